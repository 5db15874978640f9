"""What the comparison view says in words, in Debian's Chromium: the pivot named by its module in
the summary, "1 rank", events named on the timeline when there is room, "xor / pos" explained, and the bit-level hint when two digests differ in
exactly one bit."""

from __future__ import annotations

import duckdb
import httpx
import pytest

import fixtures_runs as runs
from api.conftest import compare as api_compare
from browser.pages import SEL, layer, wait_drawn

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def one_bit_pair(tmp_path_factory) -> tuple[str, str]:
    """Identical runs but for bit 7 of one xor digest: model.layers.1's output at step 1 (seq 11)."""
    a, b = runs.identical(str(tmp_path_factory.mktemp("one-bit")))
    con = duckdb.connect(f"{b}/rank-0.duckdb")
    try:
        con.execute("UPDATE tensors SET xor = xor(xor, 128::UBIGINT) WHERE seq = 11 AND role = 'output'")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return a, b


def test_the_pivot_one_rank_and_a_one_bit_difference_in_words(page, explorer, one_bit_pair):
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        c = api_compare(client, one_bit_pair)
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    assert page.inner_text("#pivot-boundary") == "model.layers.1"
    assert page.inner_text("#summary-pivot .v") == "model.layers.1 (Linear) · step 1 · forward"
    assert page.inner_text("#summary-ranks .v") == "1 rank"
    # 18 events in view: each named on the timeline, hover text apart
    trace = layer(page, "run A")
    assert trace["text"] and {"model.layers.1", "Net", "layers.2.weight"} <= set(trace["text"]), trace
    assert "seq 0" in " ".join(trace["hover"][0])
    table = f"{SEL['pivotPanel']} .digests"
    assert "xor: every 64-bit word XORed" in page.get_attribute(f"{table} th.help", "title")
    hints = page.eval_on_selector_all(f"{table} tr.bit-hint", "rs => rs.map((r) => [r.dataset.bit, r.innerText])")
    assert hints == [["7", "1-bit difference in xor (bit 7, a mantissa bit of a float32): "
                            "consistent with a single bit flip"]], hints
    # the field of the flipped bit, by dtype; two differing bits give no hint
    fields = page.evaluate("""async () => { const m = await import("/static/js/digests.js");
        return [m.bitField(31, "float32"), m.bitField(63, "float32"), m.bitField(30, "float32"),
                m.bitField(15, "bfloat16"), m.bitField(7, "bfloat16"), m.bitField(6, "torch.bfloat16"),
                m.bitField(62, "float64"), m.bitField(3, "int64"),
                m.singleBitHint("8535b43d", "8535b4bd", "float32").bit, m.singleBitHint("0f", "0c", "float32")]; }""")
    assert fields == ["sign bit of a float32", "sign bit of a float32", "exponent bit of a float32",
                      "sign bit of a bfloat16", "exponent bit of a bfloat16", "mantissa bit of a bfloat16",
                      "exponent bit of a float64", None, 7, None]
