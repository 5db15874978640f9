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

    python benchmarks/bench_folds.py --gil [--steps 300] [--rounds 3]

instead feeds the store at the default cadence with the folds on the writer thread and in the fold
process (collectors/folder.py), alternated `--rounds` times, while a probe thread asks for the
interpreter every 0.1 ms: how long it waited beyond its sleep (the longest wait, and the 99.9th
percentile) is how long the recorder's writer held the interpreter a training thread needs; with
the writer's CPU a step and the fold process's own (user + system, from /proc).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
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


def cpu_of(pid: int | None) -> float:
    """Another process's CPU time so far (user + system), s; 0 when there is none or it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, IndexError):
        return 0.0


def gil_waits(store_module, events: list, by: dict, steps: int, rounds: int) -> None:
    """Alternate folds on the writer thread and in the fold process (module docstring)."""
    store_module.FOLD_SECONDS = 5.0 * 0.030 / 0.300  # the default cadence, in bench-step time
    for r in range(rounds):
        for process in ((True, False) if r % 2 == 0 else (False, True)):
            os.environ["BITGUARD_FOLD_PROCESS"] = "1" if process else "0"
            waits, stop = [], threading.Event()

            def probe():
                while not stop.is_set():
                    t = time.perf_counter()
                    time.sleep(0.0001)
                    waits.append(time.perf_counter() - t - 0.0001)

            thread = threading.Thread(target=probe, daemon=True)
            thread.start()
            s = feed(store_module, events, by, steps, 0.030)
            stop.set()
            thread.join()
            folder_cpu = cpu_of(s.folder_pid)
            s.close("complete")
            waits.sort()
            print(f"round {r + 1}, folds {'in the fold process' if process else 'on the writer thread'}: {s.folds} "
                  f"folds; the probe's wait for the interpreter: longest {1e3 * waits[-1]:.2f} ms, 99.9th percentile "
                  f"{1e3 * waits[int(len(waits) * 0.999)]:.2f} ms, median {1e3 * statistics.median(waits):.3f} ms; "
                  f"writer CPU {1e3 * s.writer_cpu_s / steps:.2f} ms a step, fold process CPU "
                  f"{1e3 * folder_cpu / steps:.2f} ms a step", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--cadence", default="5s,2MB,8MB,16MB,close")
    ap.add_argument("--fold-mb", type=int, default=16, help="the journal of the fold profiled alone, MB")
    ap.add_argument("--gil", action="store_true", help="only measure how long the writer holds the interpreter")
    ap.add_argument("--rounds", type=int, default=3, help="with --gil: rounds of the two variants")
    args = ap.parse_args()
    from bitguard.collectors import store

    events, by = one_step()
    if args.gil:
        print(f"{len(events)} events and {sum(map(len, by.values()))} tensor rows a step", flush=True)
        gil_waits(store, events, by, args.steps, args.rounds)
        return 0
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
