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


# The timelines are drawn on canvas by frontend/js/chart.js; each plot element holds its chart as
# `element.chart`: its layers (named arrays of marks, as drawn), plot area (`size`) and the maps
# between data and plot-area pixels (`x2p`, `y2p`). These read it.
PLOT_BOX = """(sel) => { const c = document.querySelector(sel).chart, b = c.canvas.getBoundingClientRect(), s = c.size;
  return {l: b.left + s.l, t: b.top + s.t, w: s.w, h: s.h, r0: c.spec.x[0], r1: c.spec.x[1]}; }"""

# the screen point of data y (a lane's centre) at the plot's middle
LANE_Y = """([sel, y]) => { const c = document.querySelector(sel).chart, b = c.canvas.getBoundingClientRect();
  return b.top + c.size.t + c.y2p(y); }"""

# a layer's hover texts made for every mark when the layer makes them on hover (a function)
LAYER = """([sel, name]) => { const L = document.querySelector(sel).chart.layers.find((l) => l.name === name);
  if (!L) return null;
  const hover = typeof L.hover === "function" ? (L.x || L.x0).map((_, i) => L.hover(i)) : L.hover;
  return JSON.parse(JSON.stringify({...L, hover})); }"""

MARK_XY = """([sel, name, i]) => {
  const c = document.querySelector(sel).chart, b = c.canvas.getBoundingClientRect();
  const L = c.layers.find((l) => l.name === name);
  const rect = L.kind === "rects";
  const x = rect ? (Math.max(L.x0[i], c.spec.x[0]) + Math.min(L.x1[i], c.spec.x[1])) / 2 : L.x[i];
  const y = rect ? (L.y0[i] + L.y1[i]) / 2 : L.y[i];
  return {x: b.left + c.size.l + c.x2p(x), y: b.top + c.size.t + c.y2p(y), custom: L.custom ? L.custom[i] : null};
}"""


def plot_box(page, plot: str = "#timeline") -> dict:
    """The plot area on screen (l, t, w, h) and its x range (r0, r1)."""
    return page.evaluate(PLOT_BOX, plot)


def lane_y(page, y: float = 0, plot: str = "#timeline") -> float:
    """The screen y of data y (lane k's centre is k: run A's lanes from the top)."""
    return page.evaluate(LANE_Y, [plot, y])


def layer(page, name: str, plot: str = "#timeline") -> dict | None:
    """A drawn layer of the chart, by name ("run A", "bins", "slices", ...), as plain data."""
    return page.evaluate(LAYER, [plot, name])


def mark_xy(page, name: str, index: int = 0, plot: str = "#timeline") -> dict:
    """The screen point of a layer's index-th mark, and its custom ([side, seq, pos] for an event)."""
    return page.evaluate(MARK_XY, [plot, name, index])


def click_point(page, layer_name: str, index: int = 0, plot: str = "#timeline"):
    """Click the index-th mark of a named layer (hover first, as a person would)."""
    p = mark_xy(page, layer_name, index, plot)
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
