"""What the browser tests know about the page: the selectors of frontend/js/dom.js, read from it."""

from __future__ import annotations

import re
from pathlib import Path

DOM_JS = Path(__file__).resolve().parents[2] / "frontend" / "js" / "dom.js"


def _selectors() -> dict[str, str]:
    block = re.search(r"export const SEL = \{(.*?)\n\};", DOM_JS.read_text(), re.S).group(1)
    return dict(re.findall(r'^\s*(\w+): "([^"]+)",', block, re.M))


SEL = _selectors()
EV = dict(re.findall(r'^\s*(\w+): "(bitguard:[\w-]+)",', DOM_JS.read_text(), re.M))


def wait_drawn(page, revision: int, timeout: float = 60_000) -> None:
    """Until the comparison's timelines are drawn for this revision (every rerun adds one)."""
    page.wait_for_selector(f"body[data-drawn-revision='{revision}']", state="attached", timeout=timeout)


def pivot_boundary(page) -> str:
    return page.inner_text("#pivot-boundary")


POINT_XY = """([sel, name, i]) => {
  const gd = document.querySelector(sel);
  const trace = gd.data.find((t) => t.name === name);
  const L = gd._fullLayout, box = gd.getBoundingClientRect();
  return {x: box.left + L._size.l + L.xaxis.l2p(trace.x[i]), y: box.top + L._size.t + L.yaxis.l2p(trace.y[i]),
          custom: trace.customdata ? trace.customdata[i] : null};
}"""


def click_point(page, trace_name: str, index: int = 0, plot: str = "#timeline"):
    """Click the index-th point of a named plotly trace (hover first: plotly picks on hover)."""
    p = page.evaluate(POINT_XY, [plot, trace_name, index])
    page.mouse.move(p["x"], p["y"])
    page.wait_for_timeout(150)
    page.mouse.click(p["x"], p["y"])
    return p["custom"]


def drill_in_the_page(page, url: str, pair: tuple[str, str], until: str, timeout: float = 30_000) -> dict:
    """Upload and compare `pair` on the explorer at `url`, open the comparison, click Drill down and wait
    until the drill panel is in state `until` (running | done | failed); the comparison."""
    import httpx

    from api.conftest import compare

    with httpx.Client(base_url=url, timeout=30) as client:
        c = compare(client, pair)
    page.goto(f"{url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    page.click(SEL["drillButton"])
    page.wait_for_selector(f"{SEL['drillPanel']}[data-state={until}]", timeout=timeout)
    return c
