"""The drill panel in Debian's Chromium: "Drill down" on the pivot panel, the running state, then the
op-level pivot, its source line and chain, the replay check, the signature and the heat map. The
server's drill is the stand-in of api/drill_fake.py, held on a gate file until the test opens it
(the routes and the worker are real; what a real replay finds is tested with backend/drill.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from api.conftest import compare as api_compare
from api.drill_fake import DOCUMENT, preamble
from api.live_server import start_server
from browser.pages import SEL, drill_in_the_page, pivot_boundary, wait_drawn

pytestmark = pytest.mark.browser


@pytest.fixture
def drill_explorer(tmp_path):
    gate = tmp_path / "open-the-drill"
    srv = start_server(str(tmp_path / "workspace"), preamble=preamble(str(gate)))
    yield srv, gate
    gate.touch()
    srv.stop()


def test_drill_down_shows_progress_then_the_op_its_line_and_the_heat_map(page, drill_explorer, scenario_dirs,
                                                                          artifacts):
    srv, gate = drill_explorer
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        c = api_compare(client, scenario_dirs["probe"])
    page.goto(f"{srv.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    assert pivot_boundary(page) == "model.probe"
    assert page.is_hidden(SEL["drillPanel"]), "never drilled: no drill panel"

    page.click(SEL["drillButton"])
    page.wait_for_selector(f"{SEL['drillPanel']}[data-state=running] #drill-progress .spinner")
    assert "Replaying both runs" in page.inner_text("#drill-progress")
    assert page.is_disabled(SEL["drillButton"]) and page.inner_text(SEL["drillButton"]) == "Drilling…"

    # away to the start page and back while it runs: the panel picks the running drill up again
    page.goto(f"{srv.url}/#/")
    page.wait_for_selector(f"{SEL['viewHome']}:not(.hidden)")
    assert page.is_hidden(SEL["drillPanel"])
    page.goto(f"{srv.url}/#/c/{c['id']}")
    page.wait_for_selector(f"{SEL['drillPanel']}[data-state=running]:not(.hidden) #drill-progress .spinner")
    page.wait_for_selector(f"{SEL['drillButton']}:disabled")

    gate.touch()
    page.wait_for_selector(f"{SEL['drillPanel']}[data-state=done]")
    op = DOCUMENT["op_pivot"]
    assert page.inner_text("#drill-op") == "torch.Tensor.add"
    assert page.inner_text("#drill-source") == f"{op['file']}:121 in residual_add"
    assert page.inner_text("#drill-chain").splitlines() == op["chain"]
    assert page.inner_text("#drill-verdict") == "op pivot"
    assert page.get_attribute("#drill-replay", "data-reproduced") == "true"
    assert page.get_attribute("#drill-signature", "data-kind") == "bit_flip"
    assert "hardware SDC" in page.inner_text("#drill-signature")
    assert page.inner_text("#drill-differing").startswith("1 of 2,048 elements")
    assert page.inner_text("#drill-bits-text") == "bit 7: 1"
    assert page.inner_text("#drill-ulp") == "1"
    digests = page.inner_text(f"{SEL['drillPanel']} table.digests")
    assert "aaaabbbbccccddde" in digests and "differs" in digests, "the op's output digests, B's differing"
    assert "[object" not in page.inner_text(SEL["drillPanel"])
    assert not page.is_disabled(SEL["drillButton"])

    page.wait_for_function("() => { const g = document.querySelector('#drill-heatmap'); return g && g.data; }")
    heat = page.evaluate("() => { const t = document.querySelector('#drill-heatmap').data[0]; "
                         "return {type: t.type, z: t.z, hover: t.text[0][1]}; }")
    assert heat["type"] == "heatmap" and heat["z"] == DOCUMENT["signature"]["heatmap"]["counts"]
    assert heat["hover"] == "rows 0–15, cols 4–7: 1 differing"
    assert page.evaluate("() => document.querySelector('#drill-bits').data[0].x") == [7]
    page.locator(SEL["drillPanel"]).screenshot(path=str(artifacts / "drill-panel.png"))

    # a reload shows the finished drill again, without drilling again
    page.reload()
    wait_drawn(page, 1)
    page.wait_for_selector(f"{SEL['drillPanel']}[data-state=done] #drill-op")
    assert errors == []


def test_a_drill_that_fails_shows_its_message_not_a_stack(page, drill_explorer, scenario_dirs):
    srv, gate = drill_explorer
    message = "the recorded script /home/u/train.py is not on this machine; drill the runs where they were recorded"
    gate.write_text(message)  # the stand-in fails as the real drill does on a run it cannot replay
    drill_in_the_page(page, srv.url, scenario_dirs["gap"], "failed")
    assert page.text_content("#drill-error") == f"NotSupported: {message}"
    assert "Traceback" not in page.inner_text(SEL["drillPanel"])
    assert not page.is_disabled(SEL["drillButton"]), "a failed drill can be asked for again"


def test_a_replay_that_does_not_reproduce_the_record_is_a_plain_warning(page, drill_explorer, scenario_dirs):
    srv, gate = drill_explorer
    why = "run B: blocks.0.ln_1's output differs from the record at step 0"
    doc = {**DOCUMENT, "verdict": "not_reproduced", "op_pivot": None, "signature": None,
           "replay": {"reproduced": False, "detail": "the replay does not reproduce the record: nondeterminism or a "
                                                     f"changed environment ({why})"}}
    gate.write_text(json.dumps(doc))
    drill_in_the_page(page, srv.url, scenario_dirs["probe"], "done")
    assert page.inner_text("#drill-verdict") == "not reproduced"
    assert page.get_attribute("#drill-replay", "data-reproduced") == "false"
    assert page.text_content("#drill-replay") == ("Warning: the replay does not reproduce the record: nondeterminism "
                                                  f"or a changed environment.{why}")
    assert page.is_hidden("#drill-op") and page.is_visible("#drill-no-op")


def test_a_one_sided_op_names_the_other_runs_ops_and_where_the_runs_join_again(page, drill_explorer, scenario_dirs,
                                                                                 artifacts):
    """SDPA against eager attention: an op on one side only, then the op where both runs meet again, whose
    output differs by a few ULPs (the shape of the engine's document for the sdpa case)."""
    srv, gate = drill_explorer
    sdpa = {"op": "torch.nn.functional.scaled_dot_product_attention", "file": "/src/tinygpt.py", "line": 95,
            "function": "forward"}
    ulp = {**DOCUMENT["signature"], "kind": "few_ulp", "reading": "a few ULPs across many elements: reduction order, "
           "a nondeterministic kernel or a precision change", "elements_differing": 900, "max_ulp": 3,
           "bits": {"0": 700, "1": 300}, "heatmap": {**DOCUMENT["signature"]["heatmap"],
                                                     "counts": [[30] * 8, [28] * 8, [29] * 8, [25] * 8]}}
    op = {**DOCUMENT["op_pivot"], "op": "torch.Tensor.__matmul__", "line": 97, "function": "forward",
          "cause": "structure", "side_only": "a", "index_b": None, "args_b": None, "other_side": [sdpa],
          "then": {**sdpa, "op": "torch.Tensor.view", "line": 99, "inputs_differ": True, "index_a": 20,
                   "index_b": 17, "a": {"dtype": "float32"}, "b": {"dtype": "float32"}, "signature": ulp}}
    gate.write_text(json.dumps({**DOCUMENT, "op_pivot": op,
                                "signature": {"kind": "structure", "reading": "only run A has this tensor"}}))
    drill_in_the_page(page, srv.url, scenario_dirs["probe"], "done")
    assert page.inner_text("#drill-side-only") == ("Run A runs this operation and run B does not; run B runs "
                                                   "torch.nn.functional.scaled_dot_product_attention (line 95) at "
                                                   "that place.")
    assert page.get_attribute("#drill-signature", "data-kind") == "structure"
    assert page.inner_text("#drill-then-op") == "torch.Tensor.view"
    assert page.inner_text("#drill-then-source") == "/src/tinygpt.py:99 in forward"
    assert page.get_attribute("#drill-then-signature", "data-kind") == "few_ulp"
    page.wait_for_function("() => { const g = document.querySelector('#drill-then-heatmap'); return g && g.data; }")
    scale = page.evaluate("() => { const t = document.querySelector('#drill-then-heatmap')._fullData[0]; "
                          "return [t.zmin, t.zmax]; }")
    assert scale == [0, 30], "the colour scale starts at 0 differing elements, not at the fewest counted"
    assert page.evaluate("() => document.querySelector('#drill-then-bits').data[0].x") == [0, 1]
    assert page.is_hidden("#drill-heatmap"), "a structure signature measures no elements"
    page.locator(SEL["drillPanel"]).screenshot(path=str(artifacts / "drill-panel-structure.png"))
