"""What the rank store's folds cost, by their cadence: the writer thread's CPU a step and the
memory a fold takes, fed the rows of real recorded steps.

    python benchmarks/bench_folds.py [--steps 300] [--cadence 5s,2MB,8MB,16MB,close]

One short recording of the second bench model (trusted mode, 4 steps) gives one step's events and
tensor rows; a RankStore is then fed that step `--steps` times (renumbered), 30 ms apart, for each
cadence: `Ns` folds every N seconds of this feed (5 s is about 15 of the bench model's 300 ms
steps), `NMB` once the journal holds N MB, `close` only when the store closes. Printed per
cadence: folds, steps a fold, the writer's CPU a step (journal writes and folds; time.thread_time),
the close's wall time, and the peak RSS over the RSS before the store opened (VmHWM reset first).
A single fold of a journal of `--fold-mb` MB is then profiled alone: its CPU, and its peak RSS over
the RSS before it. The machine is shared: run it under the heavy-work lock.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "sample_traces"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one_step() -> tuple[list, dict]:
    """The events and tensor rows (by seq) of step 2 of a trusted recording of the second bench model."""
    import duckdb
    import torch

    import bitguard
    from bench_recording import build

    src = Path(tempfile.mkdtemp()) / "src"
    net, opt, data = build(model="modules")
    with bitguard.record(src, mode="trusted"):
        for _ in range(4):
            loss = torch.nn.functional.cross_entropy(net(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    con = duckdb.connect(str(src / "rank-0.duckdb"), read_only=True)
    events = con.execute("SELECT * FROM events WHERE step = 2 ORDER BY seq").fetchall()
    rows = con.execute("SELECT * FROM tensors WHERE seq IN (SELECT seq FROM events WHERE step = 2) ORDER BY seq").fetchall()
    con.close()
    by: dict = {}
    for r in rows:
        by.setdefault(r[0], []).append(list(r))
    return events, by


def feed(store_module, events: list, by: dict, steps: int, pause: float):
    """A RankStore fed `steps` copies of the step; returned open, its writer stopped when pause < 0."""
    s = store_module.RankStore(str(Path(tempfile.mkdtemp()) / "rank-0.duckdb"), {"rank": 0})
    seq = 0
    for step in range(steps):
        for e in events:
            e = list(e)
            rows = [[seq, *r[1:]] for r in by.get(e[0], [])]
            e[0], e[1] = seq, step
            seq += 1
            s.add(tuple(e), rows, [])
        s.step_barrier()
        if pause > 0:
            time.sleep(pause)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--cadence", default="5s,2MB,8MB,16MB,close")
    ap.add_argument("--fold-mb", type=int, default=16, help="the journal of the fold profiled alone, MB")
    args = ap.parse_args()
    from bitguard.collectors import store

    events, by = one_step()
    print(f"{len(events)} events and {sum(map(len, by.values()))} tensor rows a step", flush=True)
    defaults = store.FOLD_SECONDS, store.FOLD_BYTES
    for cadence in args.cadence.split(","):
        if cadence.endswith("s"):
            store.FOLD_SECONDS, store.FOLD_BYTES = float(cadence[:-1]) * 0.030 / 0.300, 1 << 62  # in bench-step time
        elif cadence.endswith("MB"):
            store.FOLD_SECONDS, store.FOLD_BYTES = float("inf"), int(cadence[:-2]) << 20
        else:
            store.FOLD_SECONDS, store.FOLD_BYTES = float("inf"), 1 << 62
        reset_peak()
        before = rss_mib()
        s = feed(store, events, by, args.steps, 0.030)
        cpu = s.writer_cpu_s
        t = time.perf_counter()
        s.close("complete")
        print(f"{cadence:>6}: {s.folds} folds ({args.steps / max(s.folds, 1):.0f} steps a fold), writer CPU "
              f"{1e3 * cpu / args.steps:.2f} ms a step, close {time.perf_counter() - t:.2f} s, peak RSS "
              f"{peak_mib() - before:+.0f} MiB", flush=True)
    store.FOLD_SECONDS, store.FOLD_BYTES = float("inf"), 1 << 62
    s = feed(store, events, by, 20, 0)
    step_bytes = s._journal_bytes / 20
    s.close("complete")
    s = feed(store, events, by, int((args.fold_mb << 20) / step_bytes), 0)
    s._push()
    s._queue.put(None)
    s._thread.join()
    store.FOLD_SECONDS, store.FOLD_BYTES = defaults
    journal = s._journal_bytes
    reset_peak()
    before = rss_mib()
    t = time.thread_time()
    s._fold()
    print(f"one fold of {journal / 2**20:.0f} MB of journal "
          f"({step_bytes / 1024:.0f} KiB a step): {time.thread_time() - t:.2f} s CPU, peak RSS {peak_mib() - before:+.0f} MiB, "
          f"RSS after {rss_mib() - before:+.0f} MiB")
    s.close("complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
