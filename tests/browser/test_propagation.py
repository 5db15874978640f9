"""The propagation view's overview in Debian's Chromium: node and edge counts, a filter per edge
type with nesting hidden at first, the counts explained in words, full names (frontend/js/propagation.js)."""

from __future__ import annotations

import httpx
import pytest

import fixtures_runs as runs
from api.conftest import compare
from browser.pages import SEL

pytestmark = pytest.mark.browser


def test_the_overview_counts_filters_edge_types_and_explains_its_numbers(page, explorer, tmp_path):
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        c = compare(client, runs.nested_propagation(str(tmp_path)))
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    page.wait_for_selector(".prop-overview .edge-kind")  # the timelines need not be drawn for this
    assert page.inner_text(SEL["propTotal"]) == "4 divergent nodes · 6 edges in all"
    overview = page.inner_text(".prop-overview")
    assert "Edges by type" in overview, overview
    assert "dataflow 3" in overview and "nesting 3" in overview, overview
    assert "“n events”: its divergent events" in overview and "“n times”: how many divergent event pairs" in overview
    assert page.is_checked(".edge-kind input[data-kind=dataflow]")
    assert not page.is_checked(".edge-kind input[data-kind=nesting]"), "nesting is hidden at first"
    assert "inside the call it belongs to" in page.get_attribute(".edge-kind:has(input[data-kind=nesting])", "title")

    # the pivot's consumers: block 3 by dataflow; the root only by nesting, so not followed yet
    fed = ".column:nth-child(2)"
    header = page.locator(f"{fed} h4")
    assert header.inner_text() == "FED BY MODEL.LAYERS.2 · FORWARD"
    assert header.evaluate("h => h.scrollWidth <= h.clientWidth"), "the header is not cut"
    assert page.locator(f"{fed} .node").evaluate_all("ns => ns.map(n => n.dataset.boundary)") == ["model.layers.3"]
    assert page.inner_text(f"{fed} .node .edge") == "via dataflow · 1 time"
    assert page.inner_text(f"{fed} .hidden-edges") == "1 more via nesting, not followed (tick it above)"

    page.check(".edge-kind input[data-kind=nesting]")
    page.wait_for_selector(f"{fed} .node[data-boundary='Net']")
    assert page.inner_text(f"{fed} .node[data-boundary='Net'] .edge") == "via nesting · 1 time"
    assert page.locator(f"{fed} .hidden-edges").count() == 0

    # full names on hover and in the drawer
    card = f"{fed} .node[data-boundary='model.layers.3']"
    assert "model.layers.3" in page.get_attribute(card, "title")
    page.click(card)
    page.wait_for_selector(f"{SEL['detailPanel']}[data-boundary='model.layers.3']")
    assert "model.layers.3" in page.inner_text(SEL["detailPanel"])
