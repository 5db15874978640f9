"""What the API-level events (collectors/api_events.py) cost a recorded step, on bench_recording's GPT.

Full-mode recordings of the same loop with the ApiRecorder installed and with it left out (its
install and root_forward made no-ops), alternated round by round so machine noise hits both
alike; medians and the ratio are from this one run. Besides, the recorder's own time per step,
measured inside it: the params row (every parameter digested once per step), the modes row, the
wrappers and the step's end (rows encoded and handed to the store).

    python benchmarks/bench_api_events.py [--rounds 8] [--steps 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recording import build, timed_steps  # noqa: E402


def recorded_steps(out: Path, steps: int, with_api: bool, timers: dict | None = None) -> list[float]:
    import bitguard
    from bitguard.collectors.api_events import ApiRecorder

    saved = {name: getattr(ApiRecorder, name) for name in ("install", "root_forward", "_end_step", "_params_row",
                                                           "_modes", "_add")}
    if not with_api:
        ApiRecorder.install = lambda self: self
        ApiRecorder.root_forward = lambda self, module, name, digested=None: None
    elif timers is not None:
        for name in ("_end_step", "_params_row", "_modes", "_add"):
            setattr(ApiRecorder, name, _timed(saved[name], timers, name))
    try:
        model, opt, data = build()
        with bitguard.record(out, force=True):
            timed_steps(model, opt, data, 2)  # warm-up
            return timed_steps(model, opt, data, steps)
    finally:
        for name, fn in saved.items():
            setattr(ApiRecorder, name, fn)


def _timed(fn, timers: dict, name: str):
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[name] = timers.get(name, 0.0) + time.perf_counter() - t

    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    times = {"with": [], "without": []}
    timers: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label in (("with", "without") if r % 2 == 0 else ("without", "with")):
                times[label] += recorded_steps(Path(tmp) / label, args.steps, label == "with",
                                               timers if label == "with" else None)
    recorded_with = args.rounds * args.steps
    med = {k: statistics.median(v) for k, v in times.items()}
    inside = {k: 1e3 * v / (recorded_with + 2 * args.rounds) for k, v in timers.items()}  # ms per step (with warm-ups)
    doc = {"schema": "bitguard.bench_api_events/1", "rounds": args.rounds, "steps": args.steps,
           "step_ms_with": 1e3 * med["with"], "step_ms_without": 1e3 * med["without"],
           "ratio": med["with"] / med["without"], "inside_ms_per_step": inside}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"full-mode step, median of {len(times['with'])}: with API events {doc['step_ms_with']:.1f} ms, "
          f"without {doc['step_ms_without']:.1f} ms, ratio {doc['ratio']:.3f}")
    print("inside the recorder, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(inside.items()))
          + " (_add includes the wrappers' own work; _params_row and _modes run inside root_forward's _add calls)")


if __name__ == "__main__":
    main()
