"""Where a recorded event's Python goes, hook by hook (`bench_recording.py --hook-split N`).

Every hook torch calls into (`hooks.ENTRIES`) and the collector helpers they call are wrapped with
a timer of the thread's CPU time, and each entry is charged to its caller: `_leave`'s own total,
and inside it `_watch_backward`, `_row`, `_call_key`, `_emit` and so on. The digests are replaced
by a constant (what is left is the Python and the hooks). Medians are not taken: the figures are
totals over N recorded steps (after 2 that warm up), per step and per call. Each timer costs about
1-2 µs a call (two thread-clock reads, which are system calls), so the figures are upper bounds,
the more so for the helpers called most.
"""

from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path

from bench_recording import build, recorded, timed_steps

HELPERS = ("_watch_backward", "_call_key", "_row", "_rows", "_emit", "_finish_backward", "_backward_stack",
           "_on_optimizer_step", "_drain")
MODULE_HELPERS = ("_add_grad_hook", "flatten", "_rng_drawn")


def split(steps: int, model: str = "gpt", mode: str = "trusted", determinism: bool = True) -> dict:
    from bitguard.collectors import api_events, hooks, observation

    clock = time.thread_time_ns
    spent: dict = collections.defaultdict(lambda: [0, 0])
    callers: list[str] = []

    def timed(fn, name: str):
        def inside(*args, **kwargs):
            callers.append(name)
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = spent[(callers[-2] if len(callers) > 1 else None, name)]
                entry[0] += clock() - started
                entry[1] += 1
                callers.pop()
        return inside

    saved = {}
    entries = {f.__name__ for f in hooks.ENTRIES} - {"_guarded"}
    for name in (*entries, *HELPERS):
        saved[(hooks.Collector, name)] = getattr(hooks.Collector, name)
    for name in MODULE_HELPERS:
        saved[(hooks, name)] = getattr(hooks, name)
    stubs = {(hooks, "digest_async"): lambda t: (0, 0), (observation, "digest_async"): lambda t: (0, 0),
             (hooks, "digest_host_at"): lambda address, nbytes: (0, 0),
             (observation, "digest_many"): lambda ts: [(0, 0)] * len(ts),
             (api_events, "digest_many"): lambda ts: [(0, 0)] * len(ts)}
    saved.update({key: getattr(*key) for key in stubs})
    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)
    try:
        for (owner, name), fn in saved.items():
            setattr(owner, name, stubs[(owner, name)] if (owner, name) in stubs else timed(fn, name))
        with tempfile.TemporaryDirectory() as tmp:
            with recorded(Path(tmp) / "split", mode, determinism) as stack:
                timed_steps(net, opt, data, 2)
                spent.clear()
                seq = stack.rec.collector._seq
                timed_steps(net, opt, data, steps)
                events = (stack.rec.collector._seq - seq) / steps
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
    rows = [{"caller": caller, "function": name, "ms_per_step": ns / steps / 1e6, "calls_per_step": n / steps,
             "us_per_call": ns / n / 1e3} for (caller, name), (ns, n) in spent.items()]
    rows.sort(key=lambda r: (r["caller"] or "", -r["ms_per_step"]))
    top = sum(r["ms_per_step"] for r in rows if r["caller"] is None)
    return {"model": model, "mode": mode, "steps": steps, "events_per_step": events, "hooks_ms_per_step": top,
            "us_per_event": top * 1e3 / events if events else None, "split": rows}


def text(doc: dict) -> list[str]:
    out = [f"{doc['model']} {doc['mode']}, digests stubbed, thread CPU over {doc['steps']} steps: "
           f"{doc['hooks_ms_per_step']:.2f} ms a step in the hooks, {doc['events_per_step']:.0f} events a step, "
           f"{doc['us_per_event']:.1f} us an event (timers included)"]
    for r in doc["split"]:
        who = "  " + (f"{r['caller']} > " if r["caller"] else "") + r["function"]
        out.append(f"{who:42s} {r['ms_per_step']:7.3f} ms a step {r['calls_per_step']:6.0f} calls {r['us_per_call']:7.1f} us a call")
    return out
