"""Moving around a comparison in Debian's Chromium: zoom and "whole rank" in both axes, a click
on a bin against a double-click, drags that ask for what they cover, the selected event after a
re-run, a link to a comparison that does not exist, and the Perfetto download's progress.

The long pair (8 blocks x 120 steps, 2,280 events a side) is past the server's raw-event limit,
so its whole rank is drawn in bins and a window around the pivot event by event."""

from __future__ import annotations

import os
import time

import httpx
import pytest

import fixtures_runs as runs
from api.conftest import compare as api_compare
from browser.pages import SEL, click_point, lane_y, layer, plot_box, wait_drawn

pytestmark = pytest.mark.browser



@pytest.fixture(scope="module")
def long_comparison(explorer, tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("long-pair"))
    pair = runs.write_pair(root, "long", runs.RunSpec(layers=8, steps=120, taints=(runs.Taint(80, "model.layers.3"),),
                                                      jitter_ns=2_000))
    with httpx.Client(base_url=explorer.url, timeout=60) as client:
        return api_compare(client, pair)


def _window(page) -> tuple[float, float]:
    a, b = page.get_attribute(SEL["timeline"], "data-window").split()
    return float(a), float(b)


def _wait_window(page, predicate_js: str, timeout: float = 10_000) -> None:
    """Until the drawn window satisfies `predicate_js`, an expression of s, e (window), whole, axis, mode."""
    page.wait_for_function(f"""(sel) => {{ const n = document.querySelector(sel); if (!n || !n.dataset.window) return false;
        const [s, e] = n.dataset.window.split(" ").map(Number), whole = n.dataset.whole === "true",
              axis = n.dataset.axis, mode = n.dataset.mode; return {predicate_js}; }}""", arg=SEL["timeline"],
                           timeout=timeout)


def _x_pixel(page, box: dict, x: float) -> float:
    return box["l"] + (x - box["r0"]) / (box["r1"] - box["r0"]) * box["w"]


def _drag(page, x0: float, x1: float, box: dict | None = None, y: float | None = None) -> None:
    """Drag-zoom the detail plot from data x0 to data x1 (in the axis's units; `box` and `y`: the plot
    and the lane as the user saw them, when a zoom may redraw the plot before the drag starts)."""
    box = box or plot_box(page)
    y = lane_y(page, 0) if y is None else y  # a y between the first two lanes' centres would hit the gap between them
    page.mouse.move(_x_pixel(page, box, x0), y)
    page.mouse.down()
    page.mouse.move(_x_pixel(page, box, x1), y, steps=6)
    page.mouse.up()


def _timeline_requests(page) -> list[dict]:
    seen: list[dict] = []

    def log(request):
        if "/timeline?" in request.url:
            from urllib.parse import parse_qs, urlparse
            seen.append({k: v[0] for k, v in parse_qs(urlparse(request.url).query).items()})

    page.on("request", log)
    return seen


def test_double_click_shows_the_whole_rank_from_any_window_in_both_axes(page, explorer, long_comparison, artifacts):
    c = long_comparison
    requests = _timeline_requests(page)
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    assert page.get_attribute(SEL["timeline"], "data-mode") == "events"  # the pivot's window
    page.screenshot(path=str(artifacts / "timeline-zoomed-in.png"))
    pivot_window = _window(page)
    # drag to a window away from the pivot, then double-click: the whole rank, not the pivot window
    _drag(page, pivot_window[0] + 10, pivot_window[0] + 60)
    _wait_window(page, f"s > {pivot_window[0] + 5} && e < {pivot_window[0] + 65}")
    box = plot_box(page)
    y = lane_y(page, 0)
    page.mouse.dblclick(box["l"] + box["w"] / 2, y)
    _wait_window(page, "whole && mode === 'bins'")
    assert _window(page) == (0.0, float(c["summary"]["alignment"]["events_a"]))
    page.screenshot(path=str(artifacts / "timeline-whole-rank.png"))
    # step boundaries numbered along the top (120 steps: every 5th), each bin's tooltip with its steps
    steps = page.evaluate("""(sel) => document.querySelector(sel).chart.labels
                             .filter((a) => a.name === "step").map((a) => a.text)""", SEL["timeline"])
    assert steps[0] == "step 0" and len(steps) >= 5 and all(int(t) % 5 == 0 for t in steps[1:]), steps
    tips = [" · ".join(lines) for lines in layer(page, "bins")["hover"]]
    assert all("step" in t for t in tips) and any("steps " in t for t in tips), tips[:3]

    # a double-click on a bin: the whole rank stays, its first click zooms nowhere
    requests.clear()
    page.mouse.move(box["l"] + box["w"] / 3, y)
    page.wait_for_timeout(150)
    page.mouse.dblclick(box["l"] + box["w"] / 3, y)
    page.wait_for_timeout(900)  # past the click's wait for a second click
    assert page.get_attribute(SEL["timeline"], "data-whole") == "true"
    assert all("start" not in r for r in requests), requests

    # a single click on a bin still zooms into it
    page.mouse.move(box["l"] + box["w"] / 3, y)
    page.wait_for_timeout(150)
    page.mouse.click(box["l"] + box["w"] / 3, y)
    _wait_window(page, "!whole && e - s < 60")

    # by time: the whole rank reads in seconds, and double-click comes back to it from a zoom
    page.click(f"{SEL['axisToggle']} button[data-axis=time]")
    _wait_window(page, "axis === 'time'")
    page.click(SEL["wholeRank"])
    _wait_window(page, "axis === 'time' && whole")
    t_end = _window(page)[1]
    assert 0 < t_end < 60, t_end  # seconds, not positions read as seconds
    _drag(page, t_end * 0.2, t_end * 0.4)
    _wait_window(page, f"axis === 'time' && !whole && s > {t_end * 0.15}")
    box = plot_box(page)
    page.mouse.dblclick(box["l"] + box["w"] / 2, y)
    _wait_window(page, "axis === 'time' && whole")
    assert _window(page)[1] == pytest.approx(t_end)
    assert int(page.get_attribute(SEL["timeline"], "data-count-a")) == c["summary"]["alignment"]["events_a"]
    # no notice of plotly's own double-click over the panels beside the plot
    assert page.locator(".notifier-note").count() == 0


@pytest.mark.parametrize("axis", ["seq", "time"])
def test_a_drag_asks_for_the_events_it_covers(page, explorer, long_comparison, axis):
    c = long_comparison
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    if axis == "time":
        page.click(f"{SEL['axisToggle']} button[data-axis=time]")
        _wait_window(page, "axis === 'time'")
    page.click(SEL["wholeRank"])
    _wait_window(page, f"axis === '{axis}' && whole")
    end = _window(page)[1]
    # A click on a bin and, before its zoom (due 320 ms after the click), a drag: the drag is over the
    # whole rank, as seen. The click is where the drag starts, and the plot and lane are read before it,
    # so that nothing but the press comes between them; a press that came too late (a loaded machine:
    # the zoom fired first, and the window stayed the click's, the flaky failure) is no test of this:
    # the whole rank again and another try.
    for attempt in range(5):
        box = plot_box(page)
        y = lane_y(page, 0)
        x0 = _x_pixel(page, box, end * 0.25)
        page.mouse.move(x0, y)
        page.wait_for_timeout(150)
        page.mouse.click(x0, y)
        clicked = time.monotonic()
        page.wait_for_timeout(40)
        page.mouse.down()
        in_time = time.monotonic() - clicked < 0.25
        page.mouse.move(_x_pixel(page, box, end * 0.55), y, steps=6)  # about 680 of 2,280 events
        page.mouse.up()
        _wait_window(page, "!whole")
        if in_time:
            break
        page.wait_for_timeout(400)
        page.click(SEL["wholeRank"])
        _wait_window(page, f"axis === '{axis}' && whole")
    else:
        pytest.skip("five presses came 250 ms or more after their click: the machine is too slow to set up the race")
    s, e = _window(page)
    assert s == pytest.approx(end * 0.25, rel=0.03) and e == pytest.approx(end * 0.55, rel=0.03), (s, e, end)
    scale = 1e9 if axis == "time" else 1  # the page shows seconds, the server counts ns
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        truth = client.get(f"/api/comparisons/{c['id']}/timeline",
                           params={"rank": 0, "axis": axis, "start": s * scale, "end": e * scale}).json()
    shown = int(page.get_attribute(SEL["timeline"], "data-count-a"))
    assert shown == truth["count_a"] and shown > 500, (shown, truth["count_a"])


def test_a_click_between_squares_selects_the_nearest_event_of_that_lane(page, explorer, long_comparison):
    page.goto(f"{explorer.url}/#/c/{long_comparison['id']}")
    wait_drawn(page, 1)
    start = _window(page)[0]
    _drag(page, start + 20, start + 30)  # 10 positions: the squares far apart
    _wait_window(page, "e - s < 14")
    page.wait_for_timeout(200)
    xy = page.evaluate("""(sel) => { const c = document.querySelector(sel).chart, b = c.canvas.getBoundingClientRect();
        const t = c.layers.find((t) => t.name === "run A");
        const lane = t.y[0], i = t.y.findIndex((y, k) => k > 0 && y === lane && t.y[k - 1] === lane);
        const px = (k) => b.left + c.size.l + c.x2p(t.x[k]);
        const reach = Math.max(t.size / 2 + 3, 8);  // how far from a square the chart picks it
        return {x: px(i - 1) + 0.45 * (px(i) - px(i - 1)), y: b.top + c.size.t + c.y2p(lane),
                gap: px(i) - px(i - 1), reach, seq: t.custom[i - 1][1]}; }""", SEL["timeline"])
    assert xy["gap"] > 70 and 0.45 * xy["gap"] > 2 * xy["reach"], xy  # a click further from both squares than a pick
    page.mouse.move(xy["x"], xy["y"])
    page.wait_for_timeout(150)
    page.mouse.click(xy["x"], xy["y"])
    page.wait_for_selector(f"{SEL['detailPanel']} .digests")
    assert page.inner_text(f"{SEL['detailPanel']} .kv").count(f"{xy['seq']} ·") == 1


def test_the_selected_event_is_beside_the_timeline_and_read_again_when_the_comparison_reruns(page, explorer,
                                                                                            scenario_dirs):
    rule = {"id": "probe-debug", "action": "ignore", "match": {"boundary": "model.probe"}}
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        rs = client.post("/api/rulesets", json={"name": "probe for the stale panel", "rules": [rule]}).json()
        c = api_compare(client, scenario_dirs["probe"], rule_set_id=rs["id"])
    page.set_viewport_size({"width": 1480, "height": 800})
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    index = [c[1] for c in layer(page, "run A")["custom"]].index(1)
    click_point(page, "run A", index)
    panel = f"{SEL['detailPanel']}[data-boundary='model.probe']"
    page.wait_for_selector(f"{panel} .digests")
    # shown beside the timeline, not below the fold, and the timeline did not move away
    page.wait_for_timeout(100)
    digests = page.locator(f"{SEL['detailPanel']} .digests").bounding_box()
    timeline = page.locator(SEL["timeline"]).bounding_box()
    assert 0 <= digests["y"] and digests["y"] + digests["height"] <= 800, digests
    assert timeline["y"] >= 0 and page.evaluate("window.scrollY") == 0, timeline
    assert "benign" in page.inner_text(f"{SEL['detailPanel']} .pivot-head")
    # detach the rule set: the comparison reruns and the panel says what the event is now
    page.select_option("#ruleset-select", "")
    wait_drawn(page, 2)
    page.wait_for_selector(f"{panel}[data-revision='2'] .digests")
    head = page.inner_text(f"{SEL['detailPanel']} .pivot-head")
    assert "diverged" in head and "benign" not in head, head


def test_a_link_to_no_comparison_clears_the_view_and_offers_a_way_back(page, explorer, scenario_dirs):
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        c = api_compare(client, scenario_dirs["probe"])
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    page.evaluate("location.hash = '#/c/doesnotexist'")
    page.wait_for_selector("#cmp-unavailable")
    banner = page.inner_text(SEL["banner"])
    assert "no comparison “doesnotexist”" in banner and "/api/" not in banner, banner
    # nothing of the comparison shown before stays under the message
    assert page.inner_text(SEL["title"]).strip() == ""
    assert not page.is_visible(SEL["cmpGrid"]) and not page.is_visible(SEL["perfetto"])
    assert page.inner_text(SEL["summary"]).strip() == ""
    page.click(f"{SEL['banner']} a:has-text('Back to the comparisons')")
    page.wait_for_selector(f"{SEL['viewHome']}:not(.hidden)")
    # and a good link after the bad one shows its comparison again
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    page.wait_for_selector(f"{SEL['cmpGrid']}:not(.hidden)")
    assert page.is_visible("#pivot-boundary")


WATCH_STATES = """(sel) => { window.__states = []; const n = document.querySelector(sel);
  new MutationObserver(() => window.__states.push([n.dataset.state, n.textContent]))
    .observe(n, {attributes: true, childList: true, subtree: true, characterData: true}); }"""


def test_the_perfetto_download_shows_progress_and_errors(page, explorer, scenario_dirs):
    pytest.importorskip("bitguard.backend.perfetto_export")
    with httpx.Client(base_url=explorer.url, timeout=30) as client:
        c = api_compare(client, scenario_dirs["gap"])
    page.goto(f"{explorer.url}/#/c/{c['id']}")
    wait_drawn(page, 1)
    page.evaluate(WATCH_STATES, SEL["perfetto"])
    with page.expect_download() as info:
        page.click(SEL["perfetto"])
    download = info.value
    assert download.suggested_filename.endswith(".pftrace") and os.path.getsize(download.path()) > 100
    page.wait_for_selector(f"{SEL['perfetto']}[data-state=done]")
    states = page.evaluate("window.__states")
    kinds = [s for s, _ in states]
    assert kinds[0] == "preparing" and "receiving" in kinds, states
    received = next(text for s, text in states if s == "receiving")
    assert " of " in received and "%" in received, received  # bytes received of the size the server sent

    # a server error: said in a toast, the button ready to try again
    page.route("**/perfetto", lambda route: route.fulfill(
        status=500, json={"error": {"type": "InternalError", "message": "the disk is full"}}))
    page.click(SEL["perfetto"])
    page.wait_for_selector(f"{SEL['perfetto']}[data-state=error]")
    assert "the disk is full" in page.inner_text(SEL["toast"])
    assert page.inner_text(SEL["perfetto"]) == "Perfetto trace"
