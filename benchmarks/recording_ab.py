"""Two recorders' steady-state overhead, alternated run by run (`bench_recording.py --paired N --before DIR`).

Each run is a fresh Python running `bench_recording.py --paired N --json`: one recording a mode,
its recorded and paused blocks alternated, so each run's ratio (median of its round ratios) is
already paired against the machine's drift within the run. Two recorders cannot share a process,
so the runs alternate between this checkout's bitguard and the export in DIR
(benchmarks/export_commit.py), the order turning each pair (now, before; before, now; ...). The
headline is, per mode, the median over pairs of `now / before` (each pair's two run ratios), with
its range; beside it each recorder's median run ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_recording.py"


def one(pythonpath: str | None, paired: int, block: int, warmup: int, model: str, determinism: bool) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, str(BENCH), "--paired", str(paired), "--block", str(block), "--warmup", str(warmup),
           "--model", model, "--json", *([] if determinism else ["--no-determinism"])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=7200)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={pythonpath}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def ab(before: str, runs: int, paired: int, block: int, warmup: int, model: str, determinism: bool) -> dict:
    got: dict[str, list[dict]] = {"now": [], "before": []}
    for i in range(runs):
        for label in ("now", "before") if i % 2 == 0 else ("before", "now"):
            doc = one(before if label == "before" else None, paired, block, warmup, model, determinism)
            got[label].append(doc)
            print(f"run {i + 1}/{runs} {label}: " + ", ".join(
                f"{mode} {m['ratio']['median']:.3f}x" for mode, m in doc["modes"].items()), file=sys.stderr, flush=True)
    modes = {}
    for mode in got["now"][0]["modes"]:
        now = [d["modes"][mode]["ratio"]["median"] for d in got["now"]]
        old = [d["modes"][mode]["ratio"]["median"] for d in got["before"]]
        pairs = [n / o for n, o in zip(now, old)]
        modes[mode] = {"now": {"median": statistics.median(now), "runs": now},
                       "before": {"median": statistics.median(old), "runs": old},
                       "now_over_before": {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs),
                                           "pairs": pairs},
                       "events_per_step": {"now": statistics.median(d["modes"][mode]["events_per_step"] for d in got["now"]),
                                           "before": statistics.median(d["modes"][mode]["events_per_step"]
                                                                       for d in got["before"])},
                       "collector_errors": [e for d in got["now"] + got["before"] for e in d["modes"][mode]["collector_errors"]]}
    return {"model": model, "determinism": determinism, "before": before, "runs": runs, "paired": paired,
            "block": block, "warmup": warmup, "modes": modes, "utc_end": time.strftime("%H:%M", time.gmtime())}


def text(doc: dict) -> list[str]:
    lines = [f"{doc['model']}: {doc['runs']} pairs of runs (this checkout, --before {doc['before']}), alternated; "
             f"each run {doc['paired']} rounds of {doc['block']}-step blocks, recorded against paused"]
    for mode, m in doc["modes"].items():
        r = m["now_over_before"]
        lines.append(f"  {mode:8s} now {m['now']['median']:.3f}x, before {m['before']['median']:.3f}x (medians of run "
                     f"ratios); now/before, median of pairs {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}); "
                     f"events a step {m['events_per_step']['now']:.0f} now, {m['events_per_step']['before']:.0f} before"
                     + (f"; {len(m['collector_errors'])} collector errors" if m["collector_errors"] else ""))
    return lines
