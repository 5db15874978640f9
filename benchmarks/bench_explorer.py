"""How fast the explorer answers on a big comparison, once the comparison is ready.

Builds two synthetic run directories of about `--events` events per side straight from
`bitguard.schema` (tests/fixtures_runs.py: a 48-block network, a gap, and a divergence late in
the run), uploads them to a real `bitguard serve`, waits until the comparison is ready, then, in
headless Chromium, times in alternated rounds (each round does every measure once, so a burst of
load on this shared machine spreads over all of them; medians are reported):

- the first view: from "ready" (the `bitguard:ready` mark) to the drawn timelines
  (`bitguard:first-draw`), in the open app and as a cold deep link in a fresh browser context
  (where that time goes is reported too);
- a zoom: real mouse drags (Playwright's mouse, through the page's own drag handling) from the
  whole rank to a tenth of it (bins), and from a window of 3,000 events to 300 (drawn one by
  one), timed from the drag's mouseup to the redrawn timeline and to the next frame after it;
  the zoom-out button;
- a search (a new boundary pattern each round) and next divergence: until the answer is shown and
  the timeline has redrawn at the match;
- the divergences table: a filter changed, the next page.

And, without the browser, each endpoint behind them (timeline, search, divergences).

    python benchmarks/bench_explorer.py                       # 1,000,000 events per side
    python benchmarks/bench_explorer.py --events 100000 --repeat 3
    python benchmarks/bench_explorer.py --write-docs          # update docs/PERFORMANCE.md

Needs Chromium at /usr/bin/chromium (apt-get install chromium).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

import fixtures_runs as runs  # noqa: E402
from api.live_server import start_server  # noqa: E402
from browser.conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from browser.pages import LANE_Y, PLOT_BOX  # noqa: E402

LAYERS = 48
PER_STEP = 2 * LAYERS + 3  # blocks, probe, root, one gradient per block, optimizer step


def build_pair(data: Path, events: int) -> tuple[str, str]:
    """Reference and suspect run directories of about `events` events each (reused if present)."""
    steps = max(3, -(-events // PER_STEP))
    marker = data / f"pair-{steps}.json"
    a, b = data / f"reference-{steps}", data / f"suspect-{steps}"
    if marker.exists() and (a / "rank-0.duckdb").exists() and (b / "rank-0.duckdb").exists():
        return str(a), str(b)
    t = time.perf_counter()
    runs.write_run(str(a), runs.RunSpec(layers=LAYERS, steps=steps))
    runs.write_run(str(b), runs.RunSpec(
        layers=LAYERS, steps=steps, taints=(runs.Taint(int(steps * 0.9), "model.layers.30"),),
        drop=frozenset({(steps // 3, "model.probe", "forward")}), jitter_ns=7_000))
    marker.write_text(json.dumps({"steps": steps, "events_per_side": steps * PER_STEP}))
    print(f"built two runs of {steps * PER_STEP:,} events in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return str(a), str(b)


def upload(client: httpx.Client, run_dir: str) -> dict:
    files = [("files", (f"{Path(run_dir).name}/{p.name}", p.open("rb"), "application/octet-stream"))
             for p in sorted(Path(run_dir).iterdir()) if p.is_file()]
    try:
        r = client.post("/api/runs", files=files)
    finally:
        for _, (_, fh, _) in files:
            fh.close()
    r.raise_for_status()
    return r.json()


FIRST_DRAW = """() => new Promise((resolve) => {
  const done = () => {
    const last = (name) => { const m = performance.getEntriesByName(name); return m.length ? m[m.length - 1].startTime : null; };
    const draw = last("bitguard:first-draw");
    const ready = document.querySelector("#pivot-boundary") && document.querySelector("#propagation .node");
    if (draw !== null && ready) resolve({ready: last("bitguard:ready"), first_draw: draw, all_panels: performance.now()});
    else requestAnimationFrame(done);
  };
  done();
})"""

# armed before a drag: resolves when the timeline has redrawn after the drag's mouseup, with the
# time from that mouseup (its event timestamp) to the redraw and to the frame after it
ARM_DRAG = """() => { window.__zoom = new Promise((resolve) => {
  let up = null;
  window.addEventListener("mouseup", (e) => { up = e.timeStamp; }, {capture: true, once: true});
  document.addEventListener("bitguard:timeline-drawn", (ev) => {
    const drawn = performance.now();
    requestAnimationFrame(() => setTimeout(() => {
      const asked = performance.getEntriesByType("resource").filter((r) => r.name.includes("/timeline?") && r.startTime >= up);
      resolve({ms: drawn - up, painted_ms: performance.now() - up, mode: ev.detail.mode,
               window: ev.detail.window, request_ms: asked.length ? asked[asked.length - 1].duration : null});
    }, 0));
  }, {once: true});
}); }"""


# the canvas draw alone: the detail chart drawn again from the spec it holds (median of 5)
REDRAW = """() => { const c = document.querySelector("#timeline").chart, ms = [];
  for (let i = 0; i < 5; i += 1) { const t = performance.now(); c.draw(c.spec); ms.push(performance.now() - t); }
  return ms.sort((a, b) => a - b)[2]; }"""


def _drag(page, start: float, end: float) -> dict:
    """Drag the detail timeline from data x `start` to `end` with the mouse; the timings of ARM_DRAG."""
    box = page.evaluate(PLOT_BOX, "#timeline")
    y = page.evaluate(LANE_Y, ["#timeline", 0])
    px = lambda x: box["l"] + (x - box["r0"]) / (box["r1"] - box["r0"]) * box["w"]  # noqa: E731
    page.evaluate(ARM_DRAG)
    page.mouse.move(px(start), y)
    page.mouse.down()
    page.mouse.move(px(end), y, steps=5)
    page.mouse.up()
    out = page.evaluate("window.__zoom")
    return out


# a click on a zoom button (no drag, so no wait for the drag to settle), until the timeline is redrawn
ZOOM_BUTTON = """async (sel) => {
  const t0 = performance.now();
  const drawn = new Promise((resolve) => document.addEventListener("bitguard:timeline-drawn", resolve, {once: true}));
  document.querySelector(sel).click();
  const d = (await drawn).detail;
  const ms = performance.now() - t0;
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  return {ms, painted_ms: performance.now() - t0, mode: d.mode};
}"""

# an action in the open app, timed until its answer is on screen (the watched text changes) and the
# timeline has redrawn where it took the view (any redraw within the next 1.5 s, else none)
ACT = """async ([kind, arg]) => {
  const $ = (s) => document.querySelector(s);
  const watch = {search: "#search-info", next: "#nav-info", filter: "#div-range", page: "#div-range"}[kind];
  const text = () => ($(watch) ? $(watch).textContent + "|" + ($(watch).dataset.index || "") : "");
  const before = text();
  const drawn = [];
  const onDrawn = () => drawn.push(performance.now());
  document.addEventListener("bitguard:timeline-drawn", onDrawn);
  const t0 = performance.now();
  if (kind === "search") { $("#search").value = arg; $("#search-form").requestSubmit(); }
  else if (kind === "next") $("#next-divergence").click();
  else if (kind === "filter") { const s = $("#div-phase"); s.value = arg; s.dispatchEvent(new Event("change")); }
  else if (kind === "page") $(arg).click();
  await new Promise((resolve, reject) => {
    const until = t0 + 20000;
    const tick = () => (text() !== before ? resolve() : performance.now() > until ? reject(new Error(kind + ": no answer")) : requestAnimationFrame(tick));
    tick();
  });
  const answered = performance.now() - t0;
  await new Promise((r) => setTimeout(r, 1500));
  document.removeEventListener("bitguard:timeline-drawn", onDrawn);
  const redrawn = drawn.length ? Math.max(...drawn) - t0 : null;
  return {answered, redrawn, ms: Math.max(answered, redrawn ?? 0), text: text()};
}"""

# where a cold load's time goes: marks and resource timings of the page, in ms since navigation
COLD_PARTS = """() => {
  const mark = (name) => { const m = performance.getEntriesByName(name); return m.length ? m[m.length - 1].startTime : null; };
  const res = performance.getEntriesByType("resource");
  const one = (part) => res.find((r) => r.name.includes(part));
  const plotly = one("plotly.min.js"), app = one("/static/js/app.js");
  const api = res.filter((r) => r.name.includes("/api/"));
  return {
    dom_content_loaded: performance.getEntriesByType("navigation")[0].domContentLoadedEventEnd,
    app_js_fetched: app ? app.responseEnd : null,
    plotly_fetched: plotly ? plotly.responseEnd : null, plotly_bytes: plotly ? plotly.decodedBodySize : null,
    plotly_ready: mark("bench:plotly-ready"), ready: mark("bitguard:ready"), first_draw: mark("bitguard:first-draw"),
    api_requests: api.length, api_last_end: api.length ? Math.max(...api.map((r) => r.responseEnd)) : null,
  };
}"""


def _open_in_app(page, cid: str) -> dict:
    page.evaluate("location.hash = '#/'")
    page.wait_for_selector("#view-home:not(.hidden)")
    page.wait_for_timeout(200)
    t0 = page.evaluate(f"() => {{ performance.clearMarks(); location.hash = '#/c/{cid}'; return performance.now(); }}")
    m = page.evaluate(FIRST_DRAW)
    return {"ready_to_draw": m["first_draw"] - m["ready"], "open_to_draw": m["first_draw"] - t0,
            "open_to_all_panels": m["all_panels"] - t0}


def _cold(browser, url: str, cid: str) -> dict:
    context = browser.new_context(viewport={"width": 1480, "height": 1000})
    context.add_init_script("window.addEventListener('plotly-ready', () => performance.mark('bench:plotly-ready'))")
    try:
        page = context.new_page()
        page.goto(f"{url}/#/c/{cid}")
        m = page.evaluate(FIRST_DRAW)
        parts = page.evaluate(COLD_PARTS)
    finally:
        context.close()
    return {"navigation_to_draw": m["first_draw"], "ready_to_draw": m["first_draw"] - m["ready"], "parts": parts}


def measure_browser(url: str, cid: str, repeat: int, extent: float) -> dict:
    """Alternated rounds: open in the app, then in the open app a zoom out and in, a search, next
    divergence, a table filter and a table page; last, a cold deep link in a fresh context."""
    from playwright.sync_api import sync_playwright

    rows: dict[str, list] = {}
    add = rows.setdefault
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # the page is open on the upload view when the comparison becomes ready
            context = browser.new_context(viewport={"width": 1480, "height": 1000})
            page = context.new_page()
            page.goto(f"{url}/#/")
            page.wait_for_selector("#view-home:not(.hidden)")
            for r in range(repeat):
                add("in_app", []).append(_open_in_app(page, cid))
                page.wait_for_selector("#div-range")
                page.wait_for_timeout(300)  # the panels drawn after the timelines settle
                add("whole_rank", []).append(page.evaluate(ZOOM_BUTTON, "#whole-rank"))
                page.wait_for_timeout(200)
                add("zoom_bins", []).append(_drag(page, extent * 0.45, extent * 0.55))
                add("redraw_bins", []).append({"ms": page.evaluate(REDRAW)})
                page.wait_for_timeout(200)
                _drag(page, extent * 0.5 - 1500, extent * 0.5 + 1500)  # 3,000 events: still bins
                page.wait_for_timeout(200)
                add("zoom_events", []).append(_drag(page, extent * 0.5, extent * 0.5 + 300))
                add("redraw_events", []).append({"ms": page.evaluate(REDRAW)})
                page.wait_for_timeout(200)
                add("zoom_button", []).append(page.evaluate(ZOOM_BUTTON, "#zoom-out"))
                page.evaluate(ZOOM_BUTTON, "#zoom-in")
                add("search", []).append(page.evaluate(ACT, ["search", f"model.layers.{10 + r}"]))
                add("next_divergence", []).append(page.evaluate(ACT, ["next", None]))
                add("table_filter", []).append(page.evaluate(ACT, ["filter", "backward" if r % 2 == 0 else ""]))
                add("table_page", []).append(page.evaluate(ACT, ["page", "#div-next"]))
                page.evaluate(ACT, ["page", "#div-prev"])  # back to the first page for the next round
                add("cold", []).append(_cold(browser, url, cid))  # last: its plotly.js compile loads the machine
            context.close()
        finally:
            browser.close()
    return rows


def measure_api(client: httpx.Client, cid: str, pivot: int, extent: float, repeat: int = 7) -> dict:
    """Each endpoint behind the views, in alternated rounds; a search is a new query each round (its
    first use scans the rank), then the next match of that query (a binary search)."""
    base = f"/api/comparisons/{cid}"
    times: dict[str, list] = {}
    for r in range(repeat):
        for name, path, params in (
                ("first view: the comparison", "", {}),
                ("first view: the pivot", "/pivot", {}),
                ("first view: the propagation graph", "/graph", {"limit": 5000}),
                ("first view: the loss curve", "/loss", {}),
                ("timeline: whole rank, 800 bins", "/timeline", {"bins": 800}),
                ("timeline: whole rank by time, 800 bins", "/timeline", {"axis": "time", "bins": 800}),
                ("timeline: 240 events around the pivot", "/timeline", {"around": pivot, "span": 240}),
                ("timeline: zoom to a tenth of the rank", "/timeline", {"start": extent * (0.40 + r / 100),
                                                                        "end": extent * (0.50 + r / 100), "bins": 800}),
                ("timeline: zoom to 300 events", "/timeline", {"start": extent * 0.5 + r, "end": extent * 0.5 + r + 300}),
                ("search: a new pattern, first page", "/search", {"boundary": f"layers.{20 + r}*", "limit": 50}),
                ("search: next match of that pattern", "/search", {"boundary": f"layers.{20 + r}*", "from": pivot,
                                                                   "limit": 0}),
                ("next divergence", "/search", {"status": "difference", "from": pivot + 1000 * r, "limit": 0}),
                ("divergences table: first page", "/divergences", {"limit": 25}),
                ("divergences table: filtered", "/divergences", {"phase": "backward", "limit": 25, "offset": 25 * r})):
            t = time.perf_counter()
            client.get(base + path, params=params).raise_for_status()
            times.setdefault(name, []).append((time.perf_counter() - t) * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events per side")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every measure (medians are reported)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bitguard-bench-explorer"),
                    help="where the synthetic runs are kept between invocations")
    ap.add_argument("--write-docs", action="store_true", help="write the figures into docs/PERFORMANCE.md")
    args = ap.parse_args(argv)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    a, b = build_pair(data, args.events)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(os.path.join(tmp, "workspace"), timeout=60)
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                t = time.perf_counter()
                ra, rb = upload(client, a), upload(client, b)
                t_upload = time.perf_counter() - t
                t = time.perf_counter()
                cid = client.post("/api/comparisons", json={"run_a": ra["id"], "run_b": rb["id"]}).json()["id"]
                while (c := client.get(f"/api/comparisons/{cid}").json())["status"] not in ("ready", "failed"):
                    time.sleep(0.1)
                t_compare = time.perf_counter() - t
                if c["status"] != "ready":
                    raise SystemExit(f"comparison failed: {c['error']}")
                al = c["summary"]["alignment"]
                extent = client.get(f"/api/comparisons/{cid}/timeline", params={"bins": 1}).json()["extent"][1]
                api = measure_api(client, cid, c["pivot_position"]["pos"], extent)
                browser = measure_browser(server.url, cid, args.repeat, extent)
        finally:
            server.stop()
    def med(rows: list[dict], k: str) -> int | None:
        values = [r[k] for r in rows if r[k] is not None]
        return round(statistics.median(values)) if values else None

    parts = {k: round(statistics.median(c["parts"][k] for c in browser["cold"] if c["parts"][k] is not None))
             for k in browser["cold"][0]["parts"] if any(c["parts"][k] is not None for c in browser["cold"])}
    result = {
        "events_a": al["events_a"], "events_b": al["events_b"], "rounds": args.repeat,
        "upload_s": round(t_upload, 2), "compare_s": round(t_compare, 2),
        "ready_to_draw_ms": med(browser["in_app"], "ready_to_draw"),
        "ready_to_draw_ms_max": round(max(r["ready_to_draw"] for r in browser["in_app"])),
        "open_to_draw_ms": med(browser["in_app"], "open_to_draw"),
        "open_to_all_panels_ms": med(browser["in_app"], "open_to_all_panels"),
        "cold_navigation_to_draw_ms": med(browser["cold"], "navigation_to_draw"),
        "cold_navigation_to_draw_ms_max": round(max(r["navigation_to_draw"] for r in browser["cold"])),
        "cold_ready_to_draw_ms": med(browser["cold"], "ready_to_draw"),
        "cold_parts_ms": parts,
        "zoom_ms": [med(browser["zoom_bins"], "ms"), med(browser["zoom_events"], "ms")],
        "zoom_painted_ms": [med(browser["zoom_bins"], "painted_ms"), med(browser["zoom_events"], "painted_ms")],
        "zoom_windows": [browser["zoom_bins"][0]["window"], browser["zoom_events"][0]["window"]],
        "whole_rank_ms": med(browser["whole_rank"], "ms"), "whole_rank_painted_ms": med(browser["whole_rank"], "painted_ms"),
        "canvas_draw_ms": [round(statistics.median(r["ms"] for r in browser[k]), 1) for k in ("redraw_bins", "redraw_events")], "zoom_button_painted_ms": med(browser["zoom_button"], "painted_ms"),
        "zoom_request_ms": [med(browser["zoom_bins"], "request_ms"), med(browser["zoom_events"], "request_ms")],
        "zoom_modes": [browser["zoom_bins"][0]["mode"], browser["zoom_events"][0]["mode"]],
        "zoom_button_ms": med(browser["zoom_button"], "ms"),
        "search_ms": med(browser["search"], "ms"), "search_answered_ms": med(browser["search"], "answered"),
        "next_divergence_ms": med(browser["next_divergence"], "ms"),
        "next_divergence_answered_ms": med(browser["next_divergence"], "answered"),
        "table_filter_ms": med(browser["table_filter"], "ms"), "table_page_ms": med(browser["table_page"], "ms"),
        "api_ms": {k: round(v, 1) for k, v in api.items()},
        "load_average_start": round(load_start, 1), "load_average": round(os.getloadavg()[0], 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": "python benchmarks/bench_explorer.py" + (f" --events {args.events}" if args.events != 1_000_000 else "")
                   + (f" --repeat {args.repeat}" if args.repeat != 5 else ""),
    }
    print(json.dumps(result, indent=2))
    if args.write_docs:
        write_docs(result)
    return result


def write_docs(r: dict) -> None:
    """Replace (or add) the `## Explorer` section of docs/PERFORMANCE.md; other sections are kept."""
    path = ROOT / "docs" / "PERFORMANCE.md"
    text = path.read_text() if path.exists() else "# Performance\n"
    ok = lambda ms, budget: "yes" if ms is not None and ms <= budget else "**no**"  # noqa: E731
    cold = r["cold_parts_ms"]
    api = "\n".join(f"| {k} | {v} ms |" for k, v in r["api_ms"].items())
    section = f"""## Explorer

How fast the explorer answers once a comparison is ready, in headless Chromium (Debian's,
`--disable-gpu`), for a comparison of {r['events_a']:,} events (run A) with {r['events_b']:,}
events (run B), one rank (synthetic runs: a 48-block network, a gap, a divergence at 90% of the
run). Medians of {r['rounds']} alternated rounds: each round takes every measure once, so a burst of
load from the other work on this shared machine spreads over all of them. "Ready" is the moment
the page's poll sees the comparison ready (`bitguard:ready`); "drawn", both timelines drawn
(`bitguard:first-draw`). An action is timed until its answer is on screen and the timeline has
redrawn where it took the view. Targets: 300 ms after the comparison is ready; 2 s for the first
view of a cold deep link.

| measure (median) | value | target met |
| --- | --- | --- |
| first view, page open (the upload view, as after "Compare"): ready → drawn | {r['ready_to_draw_ms']} ms (slowest {r['ready_to_draw_ms_max']} ms) | {ok(r['ready_to_draw_ms'], 300)} |
| first view, click to open → drawn / every panel drawn (includes the wait for "ready") | {r['open_to_draw_ms']} ms / {r['open_to_all_panels_ms']} ms | (no target) |
| cold deep link, fresh browser: navigation → drawn | {r['cold_navigation_to_draw_ms']} ms (slowest {r['cold_navigation_to_draw_ms_max']} ms) | {ok(r['cold_navigation_to_draw_ms'], 2000)} |
| zoom: a mouse drag from the whole rank to a tenth of it (bins): mouseup → drawn / next frame | {r['zoom_ms'][0]} ms / {r['zoom_painted_ms'][0]} ms (the request {r['zoom_request_ms'][0]} ms) | {ok(r['zoom_painted_ms'][0], 300)} |
| zoom: a mouse drag from 3,000 events to 300 (drawn one by one): mouseup → drawn / next frame | {r['zoom_ms'][1]} ms / {r['zoom_painted_ms'][1]} ms (the request {r['zoom_request_ms'][1]} ms) | {ok(r['zoom_painted_ms'][1], 300)} |
| zoom out ×2 with the button, from 300 events: drawn / next frame | {r['zoom_button_ms']} ms / {r['zoom_button_painted_ms']} ms | {ok(r['zoom_button_painted_ms'], 300)} |
| "Whole rank" from the pivot's window (the detail timeline and the strip redrawn): drawn / next frame | {r['whole_rank_ms']} ms / {r['whole_rank_painted_ms']} ms | {ok(r['whole_rank_painted_ms'], 300)} |
| search, a new pattern: answer shown / timeline redrawn at the match | {r['search_answered_ms']} ms / {r['search_ms']} ms | {ok(r['search_ms'], 300)} |
| next divergence: answer shown / timeline redrawn at it | {r['next_divergence_answered_ms']} ms / {r['next_divergence_ms']} ms | {ok(r['next_divergence_ms'], 300)} |
| divergences table: a filter changed / the next page | {r['table_filter_ms']} ms / {r['table_page_ms']} ms | {ok(max(r['table_filter_ms'], r['table_page_ms']), 300)} |
| upload of both runs / comparison by the engine | {r['upload_s']} s / {r['compare_s']} s | (before "ready") |

Where the time goes:

- **The timelines are drawn on canvas by the explorer's own code** (`frontend/js/chart.js`, with
  the marks of `lanes.js` and `slices.js`): one synchronous draw per window, ticks and labels as
  DOM text, the tooltip and the drag box as two small elements. plotly.js (the installed plotly
  package's full bundle, 4.8 MB) draws only the loss curve and the drill's figures, and
  `dom.js plotly()` loads it only after the timelines' first draw (or after 3 s). Before this,
  the timelines were plotly figures: the cold deep link took 2.35–2.7 s (plotly.js compiled and
  run by 2.2 s, then a first draw with it cold), and a zoom 318–568 ms (plotly drew each figure
  twice, and a drag waited 120 ms to settle before it asked; that zoom was timed from a
  `Plotly.relayout` call, this one from a real drag's mouseup), at load averages 5 to 16.
- **Cold deep link** (ms since navigation, medians): app.js fetched at {cold.get('app_js_fetched')};
  the page's modules fetched and run (DOM ready) at {cold.get('dom_content_loaded')}; the
  comparison seen ready at {cold.get('ready')}; the last of its {cold.get('api_requests')} API
  answers at {cold.get('api_last_end')}; drawn at {cold.get('first_draw')}. No plotly.js on that
  path. Between "ready" and "drawn": the two timeline requests (the window and the whole rank for
  the strip), answered while the other panels' requests and drawing share the one main thread.
- **Zoom**: a drag asks for its window at its mouseup (no wait for it to settle: chart.js knows
  when the drag ends) and the answer is drawn once. The request is {r['zoom_request_ms'][0]} ms /
  {r['zoom_request_ms'][1]} ms of it, and the canvas draw of the detail chart
  {r['canvas_draw_ms'][0]} ms (its 900 bins × 6 lanes) / {r['canvas_draw_ms'][1]} ms (300 events and
  their names); the rest is the response's parsing, the strip's redraw, the listeners of the
  redraw (the URL, the info line) and the frames in between.
- **First view in the open app**: the same two timeline requests and one draw; the other
  panels' answers take milliseconds (the endpoints below).
- **Search, next divergence**: the answer is on screen in tens of milliseconds; the rest is the
  timeline's redraw at the match, as for a zoom.

The endpoints alone (no browser; medians of the same rounds):

| endpoint | median |
| --- | --- |
{api}

Machine: {r['machine']}, shared with other work (load average {r['load_average_start']} at the
start of the run, {r['load_average']} at its end): timings here vary by tens of percent from run
to run, and a cold page load most (it competes with that work for two cores).
Reproduce with:

    {r['command']} --write-docs

The server never sends a million events: `GET /api/comparisons/{{id}}/timeline` bins the asked
window per lane (side × phase) into at most 4,000 bins, each with its worst status and counts,
and sends events one by one only for a window of at most 1,500 events; a search keeps each
query's matches as a sorted array (the next match is a binary search); the divergences table is
built with the result (a page is a filter and a slice).
"""
    lines = text.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "## Explorer"), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        text = "\n".join(lines[:start]) + ("\n" if start else "") + section + ("\n" + "\n".join(lines[end:])
                                                                                if end < len(lines) else "")
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    print(f"wrote the Explorer section of {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
