"""How fast the explorer draws a big comparison: from "comparison ready" to the first drawn view.

Builds two synthetic run directories of about `--events` events per side straight from
`bitguard.schema` (tests/fixtures_runs.py: a 48-block network, a gap, and a divergence late in
the run), uploads them to a real `bitguard serve`, waits until the comparison is ready, then
opens it in headless Chromium and measures until the timelines, the pivot panel and the
propagation view are drawn (the page's `bitguard:first-draw` mark). Each page load is a fresh
browser context, so plotly.js is fetched and parsed every time (the cold case). It also times
a zoom (a new window asked of the server and redrawn) and the timeline endpoint alone.

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

ZOOM = """async ([start, end]) => {
  const t0 = performance.now();
  const drawn = new Promise((resolve) => document.addEventListener("bitguard:timeline-drawn", resolve, {once: true}));
  await Plotly.relayout(document.querySelector("#timeline"), {"xaxis.range": [start, end]});
  const d = (await drawn).detail;
  return {ms: performance.now() - t0, mode: d.mode};
}"""


def measure_browser(url: str, cid: str, repeat: int, extent: float) -> dict:
    """In the open app (the spec's case) and as a cold deep link in a fresh browser context."""
    from playwright.sync_api import sync_playwright

    in_app, cold, zooms = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # the page is open on the upload view (plotly.js parsed) when the comparison becomes ready
            context = browser.new_context(viewport={"width": 1480, "height": 1000})
            page = context.new_page()
            page.goto(f"{url}/#/")
            page.wait_for_function("window.Plotly !== undefined")
            for _ in range(repeat):
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#view-home:not(.hidden)")
                page.wait_for_timeout(200)
                t0 = page.evaluate(f"() => {{ performance.clearMarks(); location.hash = '#/c/{cid}'; return performance.now(); }}")
                m = page.evaluate(FIRST_DRAW)
                in_app.append({"ready_to_draw": m["first_draw"] - m["ready"], "open_to_draw": m["first_draw"] - t0,
                               "open_to_all_panels": m["all_panels"] - t0})
            # zoom out to a tenth of the rank (binned), then into 300 events (drawn one by one)
            zooms.append(page.evaluate(ZOOM, [extent * 0.45, extent * 0.55]))
            zooms.append(page.evaluate(ZOOM, [extent * 0.5, extent * 0.5 + 300]))
            context.close()
            for _ in range(repeat):
                context = browser.new_context(viewport={"width": 1480, "height": 1000})
                page = context.new_page()
                page.goto(f"{url}/#/c/{cid}")
                m = page.evaluate(FIRST_DRAW)
                cold.append({"navigation_to_draw": m["first_draw"], "ready_to_draw": m["first_draw"] - m["ready"]})
                context.close()
        finally:
            browser.close()
    return {"in_app": in_app, "cold": cold, "zooms": zooms}


def measure_api(client: httpx.Client, cid: str, pivot: int, repeat: int = 5) -> dict:
    out = {}
    for name, params in (
            ("whole rank, 800 bins", {"bins": 800}),
            ("whole rank by time, 800 bins", {"axis": "time", "bins": 800}),
            ("240 events around the pivot", {"around": pivot, "span": 240})):
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            r = client.get(f"/api/comparisons/{cid}/timeline", params=params)
            r.raise_for_status()
            times.append((time.perf_counter() - t) * 1000)
        out[name] = statistics.median(times)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events per side")
    ap.add_argument("--repeat", type=int, default=3, help="page loads to time")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bitguard-bench-explorer"),
                    help="where the synthetic runs are kept between invocations")
    ap.add_argument("--write-docs", action="store_true", help="write the figures into docs/PERFORMANCE.md")
    args = ap.parse_args(argv)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    a, b = build_pair(data, args.events)
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
                api = measure_api(client, cid, c["pivot_position"]["pos"])
                browser = measure_browser(server.url, cid, args.repeat, extent)
        finally:
            server.stop()
    med = lambda rows, k: round(statistics.median(r[k] for r in rows))  # noqa: E731
    result = {
        "events_a": al["events_a"], "events_b": al["events_b"],
        "upload_s": round(t_upload, 2), "compare_s": round(t_compare, 2),
        "ready_to_draw_ms": med(browser["in_app"], "ready_to_draw"),
        "ready_to_draw_ms_max": round(max(r["ready_to_draw"] for r in browser["in_app"])),
        "open_to_draw_ms": med(browser["in_app"], "open_to_draw"),
        "open_to_all_panels_ms": med(browser["in_app"], "open_to_all_panels"),
        "cold_navigation_to_draw_ms": med(browser["cold"], "navigation_to_draw"),
        "cold_ready_to_draw_ms": med(browser["cold"], "ready_to_draw"),
        "zoom_ms": [round(z["ms"]) for z in browser["zooms"]], "zoom_modes": [z["mode"] for z in browser["zooms"]],
        "timeline_api_ms": {k: round(v, 1) for k, v in api.items()},
        "load_average": round(os.getloadavg()[0], 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": "python benchmarks/bench_explorer.py" + (f" --events {args.events}" if args.events != 1_000_000 else ""),
    }
    print(json.dumps(result, indent=2))
    if args.write_docs:
        write_docs(result)
    return result


def write_docs(r: dict) -> None:
    """Replace (or add) the `## Explorer` section of docs/PERFORMANCE.md; other sections are kept."""
    path = ROOT / "docs" / "PERFORMANCE.md"
    text = path.read_text() if path.exists() else "# Performance\n"
    api = "; ".join(f"{k}: {v} ms" for k, v in r["timeline_api_ms"].items())
    section = f"""## Explorer

Time from "comparison ready" to the first drawn view of the explorer, in headless Chromium
(Debian's, `--disable-gpu`), for a comparison of {r['events_a']:,} events (run A) with
{r['events_b']:,} events (run B). "Ready" is the moment the page's poll sees the comparison
ready (`bitguard:ready` mark); "drawn" is when both timelines are drawn (`bitguard:first-draw`).
Budget: 2 s.

| measure (median of loads) | value |
| --- | --- |
| ready → first drawn view, page already open (the upload view, as after "Compare") | {r['ready_to_draw_ms']} ms (slowest {r['ready_to_draw_ms_max']} ms) |
| click to open → first drawn view / every panel drawn | {r['open_to_draw_ms']} ms / {r['open_to_all_panels_ms']} ms |
| cold deep link in a fresh browser (plotly.js, 4.6 MB, fetched and parsed): navigation → first drawn view | {r['cold_navigation_to_draw_ms']} ms |
| zoom to a tenth of the rank, then to 300 events (ask + redraw) | {' ms, '.join(map(str, r['zoom_ms'][:2]))} ms ({', '.join(r['zoom_modes'][:2])}) |
| timeline endpoint alone | {api} |
| upload of both runs / comparison by the engine | {r['upload_s']} s / {r['compare_s']} s (before "ready", not in the budget) |

Machine: {r['machine']}, load average {r['load_average']} while measuring. Reproduce with:

    {r['command']} --write-docs

The server never sends a million events: `GET /api/comparisons/{{id}}/timeline` bins the asked
window per lane (side × phase) into at most 4,000 bins, each with its worst status and counts,
and sends events one by one only for a window of at most 1,500 events.
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
