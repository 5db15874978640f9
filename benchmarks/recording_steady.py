"""Recording overhead in the steady state of a long recording (`bench_recording.py --paired N`).

`bench_recording.py`'s default measurement opens a fresh recording for every round of a few
steps, so each recorded round also pays what a recording's first steps pay (its writer's start,
the first journal groups, the first fold, caches filled anew). A training recorded for thousands
of steps pays those once. Here each mode gets one recording: after `warmup` recorded steps come
`rounds` rounds of two blocks of `block` steps, one recorded and one paused, the order turning
each round; the first step of each block is dropped (it follows the switch).

Paused: the collector and its API recorder return at their first test of `enabled` (their hooks
stay installed: the module-call wrapper and the parameters' gradient hooks still run that test,
about 0.1-0.3 µs a call), nothing is queued or written, the step counter stands still, and the
determinism controls are swapped for the settings the user's script had, so that a paused step
runs as the plain script would. Resumed: bitguard's settings come back, then the hooks. A round's
ratio is its median recorded step over its median paused step; the headline is the median of the
round ratios with a bootstrap interval, beside the ratio of total step times (`mean_ratio`: the
training's own time, where a few costly steps, a journal fold's, weigh in). Each recorded block
also counts its events and the writer thread's CPU time.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_recording import build, recorded, restore_settings, settings_now, timed_steps
from roundstats import median_interval, ratio_of_means


class Paused:
    """`with Paused(stack):` inside `recorded(...)`'s stack: the recording observes nothing and the
    user's settings are in force; on leaving, bitguard's settings and the hooks come back."""

    def __init__(self, stack):
        self.stack = stack

    def __enter__(self):
        collector = self.stack.rec.collector
        self.ours = settings_now()
        collector.enabled = False
        if collector.api is not None:
            collector.api.enabled = False
        restore_settings(self.stack.user.saved)
        return self

    def __exit__(self, *exc):
        collector = self.stack.rec.collector
        restore_settings(self.ours)
        if collector.api is not None:
            collector.api.enabled = True
        collector.enabled = True
        return False


def steady(rounds: int, block: int, warmup: int, model: str = "gpt", determinism: bool = True,
           modes: tuple[str, ...] = ("full", "trusted")) -> dict:
    if block < 2:
        raise SystemExit("--block must be at least 2: the first step of each block is dropped")
    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)  # the allocator and kernels warm
    out = {"model": model, "determinism": determinism, "rounds": rounds, "block": block, "warmup": warmup,
           "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            times = {"recorded": [], "paused": []}
            ratios, per_event, events, writer, loads, kept = [], [], [], [], [], []
            with recorded(Path(tmp) / mode, mode, determinism) as stack:
                collector = stack.rec.collector
                store = collector.store
                timed_steps(net, opt, data, warmup)
                for r in range(rounds):
                    loads.append(os.getloadavg()[0])
                    got = {}
                    for arm in ("recorded", "paused") if r % 2 == 0 else ("paused", "recorded"):
                        if arm == "paused":
                            with Paused(stack):
                                got[arm] = timed_steps(net, opt, data, block)[1:]
                            continue
                        seq, cpu = collector._seq, store.writer_cpu_s
                        got[arm] = timed_steps(net, opt, data, block)[1:]
                        events.append((collector._seq - seq) / block)
                        writer.append((store.writer_cpu_s - cpu) / block)
                    for arm in times:
                        times[arm] += got[arm]
                    rec_s, plain_s = statistics.median(got["recorded"]), statistics.median(got["paused"])
                    ratios.append(rec_s / plain_s)
                    per_event.append((rec_s - plain_s) / events[-1] if events[-1] else float("nan"))
                    kept.append(got)
                    print(f"{mode} round {r + 1}/{rounds}: paused {plain_s * 1000:.1f} ms, recorded {ratios[-1]:.3f}x, "
                          f"{events[-1]:.0f} events a step, writer {writer[-1] * 1000:.1f} ms a step",
                          file=sys.stderr, flush=True)
                errors = list(collector.errors)
            out["modes"][mode] = {
                "median_step_s": {k: statistics.median(v) for k, v in times.items()},
                "ratio": median_interval(ratios), "round_ratios": ratios,
                "mean_ratio": ratio_of_means(kept, arms=("recorded", "paused")),
                "events_per_step": statistics.median(events),
                "overhead_per_event_s": statistics.median(per_event),
                "writer_cpu_s_per_step": statistics.median(writer),
                "collector_errors": errors,
                "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                "rounds_steps": kept}
    out["utc_end"] = time.strftime("%H:%M", time.gmtime())
    return out


def mapped_ab(rounds: int, block: int, warmup: int, model: str = "modules", mode: str = "trusted",
              determinism: bool = True) -> dict:
    """The in-place digest of views (cuda/fingerprint.py `mapped_plan`) against the contiguous copy
    it replaced, in one recording: rounds of two recorded blocks, one with views read in place and
    one with every view copied first, the order turning each round, the first step of each block
    dropped. Everything else (the writer's folds, the hooks) is shared by both arms."""
    from bitguard.cuda import fingerprint

    plan = fingerprint.mapped_plan
    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)
    ratios, kept = [], []
    with tempfile.TemporaryDirectory() as tmp:
        with recorded(Path(tmp) / "ab", mode, determinism):
            timed_steps(net, opt, data, warmup)
            try:
                for r in range(rounds):
                    got = {}
                    for arm in ("in place", "copied") if r % 2 == 0 else ("copied", "in place"):
                        fingerprint.mapped_plan = plan if arm == "in place" else (lambda t: None)
                        got[arm] = timed_steps(net, opt, data, block)[1:]
                    ratios.append(statistics.median(got["in place"]) / statistics.median(got["copied"]))
                    kept.append(got)
            finally:
                fingerprint.mapped_plan = plan
    return {"model": model, "mode": mode, "rounds": rounds, "block": block,
            "ratio": median_interval(ratios), "mean_ratio": ratio_of_means(kept, arms=("in place", "copied")),
            "utc_end": time.strftime("%H:%M", time.gmtime())}


def ab_text(doc: dict) -> list[str]:
    r, m = doc["ratio"], doc["mean_ratio"]
    return [f"{doc['model']} {doc['mode']}, {doc['rounds']} rounds of {doc['block']}-step blocks: views read in place "
            f"over views copied, median of round ratios {r['median']:.4f} (95% {r['bootstrap_95'][0]:.4f}-"
            f"{r['bootstrap_95'][1]:.4f}), total time {m['ratio']:.4f} ({m['bootstrap_95'][0]:.4f}-{m['bootstrap_95'][1]:.4f})"]


def text(doc: dict) -> list[str]:
    lines = [f"{doc['model']}: steady state, one recording a mode, {doc['warmup']} steps to warm up, "
             f"{doc['rounds']} rounds of {doc['block']}-step blocks (recorded, paused; first of each dropped); "
             f"determinism controls {'at bitguard defaults' if doc['determinism'] else 'off'} when recorded"]
    for mode, m in doc["modes"].items():
        r, mean = m["ratio"], m["mean_ratio"]
        lines.append(
            f"  {mode:8s} paused {m['median_step_s']['paused'] * 1000:.1f} ms, recorded "
            f"{m['median_step_s']['recorded'] * 1000:.1f} ms; median of round ratios {r['median']:.3f}x "
            f"(95% {r['bootstrap_95'][0]:.3f}-{r['bootstrap_95'][1]:.3f}); total time {mean['ratio']:.3f}x "
            f"({mean['bootstrap_95'][0]:.3f}-{mean['bootstrap_95'][1]:.3f}); {m['events_per_step']:.0f} events a step, "
            f"{m['overhead_per_event_s'] * 1e6:.1f} us an event; writer {m['writer_cpu_s_per_step'] * 1000:.1f} ms CPU "
            f"a step; load {m['load_average']['min']:.1f}-{m['load_average']['max']:.1f}"
            + (f"; collector errors: {m['collector_errors']}" if m["collector_errors"] else ""))
    return lines
