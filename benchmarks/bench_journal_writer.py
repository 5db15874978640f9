"""The rank store's writer thread in online mode on the bench-size GPT: its CPU time a step
(time.thread_time inside the writer, journal writes and folds apart) and the rows it journals.

    python benchmarks/bench_journal_writer.py --steps 60 --threads 1

One online recording (`bitguard.record(DIR, mode="online")`, default budget) after 3 plain warm-up
steps. Folds are counted apart: a recording shorter than the store's fold interval folds only when
it closes, after its last step. The machine is shared: run it under the heavy-work lock.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "sample_traces"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (a shared machine: 1)")
    args = ap.parse_args()
    import torch

    import bench_online
    import bitguard
    from bench_recording import build
    from bitguard.collectors import store

    if args.threads:
        torch.set_num_threads(args.threads)
    spent = {"write": 0.0, "fold": 0.0, "batches": 0, "folds": 0, "rows": collections.Counter()}
    write, fold = store.RankStore._write, store.RankStore._fold

    def timed_write(self, events, tensors, stacks, dumps, ends_step=False, rows=None):
        t = time.thread_time()
        try:
            return write(self, events, tensors, stacks, dumps, ends_step, rows)
        finally:
            spent["write"] += time.thread_time() - t
            spent["batches"] += 1
            for name, r in (rows or {}).items():
                spent["rows"][name] += len(r)

    def timed_fold(self):
        t = time.thread_time()
        try:
            return fold(self)
        finally:
            spent["fold"] += time.thread_time() - t
            spent["folds"] += 1

    store.RankStore._write, store.RankStore._fold = timed_write, timed_fold
    model, opt, _ = build()
    data = bench_online.batches()
    for _ in range(3):
        bench_online.one_step(model, opt, next(data))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with bitguard.record(Path(tmp) / "run", mode="online"):
            for _ in range(args.steps):
                bench_online.one_step(model, opt, next(data))
        wall = time.perf_counter() - t0
    n = args.steps
    print(f"{n} steps, {wall / n * 1e3:.1f} ms a step (the close included); writer: journal writes "
          f"{spent['write'] / n * 1e3:.2f} ms CPU a step ({spent['batches']} batches), folds "
          f"{spent['fold'] / n * 1e3:.2f} ms CPU a step amortised ({spent['folds']} folds, the close's included); "
          f"rows a step: " + ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(spent["rows"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
