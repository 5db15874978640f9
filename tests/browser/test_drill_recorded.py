"""The drill end to end, with the real engine: two tiny GPT runs recorded here (the `functional`
scenario: a flipped bit in the functional residual add between blocks.0.attn and blocks.0.ln_2),
uploaded to a real `bitguard serve`, compared, and drilled from the browser. The uploads are copies,
but the recorded script is on this machine, so the server can replay them."""

from __future__ import annotations

import httpx
import pytest

from bitguard.sample_traces.recordings import run_jobs
from bitguard.sample_traces.scenarios import SCENARIOS
from browser.pages import SEL, drill_in_the_page

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.extended]  # the fake-backed tests/browser/test_drill.py is the default


@pytest.fixture(scope="module")
def functional(tmp_path_factory):
    a, b = SCENARIOS["functional"].jobs(tmp_path_factory.mktemp("drill-recorded") / "functional")
    outcomes = run_jobs([a, b], workers=2, reuse=False)
    assert not [o for o in outcomes if o.exit_status], [o.log for o in outcomes if o.exit_status]
    return a.out, b.out


def test_drill_down_from_the_browser_names_the_residual_add(page, explorer, functional, artifacts):
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    c = drill_in_the_page(page, explorer.url, functional, "running")
    page.wait_for_selector(f"{SEL['drillPanel']}[data-state=done], {SEL['drillPanel']}[data-state=failed]",
                           timeout=300_000)
    panel = page.inner_text(SEL["drillPanel"])
    assert page.get_attribute(SEL["drillPanel"], "data-state") == "done", panel
    assert page.get_attribute("#drill-replay", "data-reproduced") == "true", panel
    assert page.inner_text("#drill-verdict") == "op pivot"
    assert "in residual_add" in page.inner_text("#drill-chain")
    assert "tinygpt.py:" in page.inner_text("#drill-source")
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        doc = client.get(f"/api/comparisons/{c['id']}/drill").json()["document"]
    # a heat map for each signature that measured elements: the op's output's, the boundary tensor's
    drawn = 0
    for key, plot in (("signature", "#drill-heatmap"), ("boundary_signature", "#drill-boundary-heatmap")):
        sig = doc[key]
        if sig and sig.get("elements_differing") and sig.get("heatmap"):
            page.wait_for_function(f"() => {{ const g = document.querySelector('{plot}'); return g && g.data; }}")
            z = page.evaluate(f"() => document.querySelector('{plot}').data[0].z")
            assert z == sig["heatmap"]["counts"] and sum(map(sum, z)) == sig["elements_differing"]
            drawn += 1
    assert drawn, "the functional fault's flipped bit is measured at the boundary at least"
    page.locator(SEL["drillPanel"]).screenshot(path=str(artifacts / "drill-panel-recorded.png"))
    assert errors == []
