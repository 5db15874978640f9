"""The whole comparison, from two run directories to the verdict, pivot and propagation.

Builds synthetic pairs of one rank at about `--events` events per side each (tests/fixtures_runs.py:
a 48-block network; the suspect's block 30 diverges at half the run, so everything after it
differs and the propagation follows half the events, and the suspect lacks one probe call at
three quarters of the run), then runs `bitguard compare A B --json` in a fresh Python per size,
alternating the sizes in each round. Each run reports the time from the start of the command to
the JSON written (imports included), the time of `compare()` and of building the document, the
peak RSS, the user and system CPU and the minor page faults of `compare()` and the document, and
is checked: verdict `diverged`, the pivot the planted digest change. `--touch` also times, after
each compare, a fresh Python that does nothing but first-touch as much memory as that compare's
peak: what this machine charges for the memory alone, apart from what bitguard computes.

    python benchmarks/bench_compare.py                           # 10k, 100k, 1M per side, 3 rounds
    python benchmarks/bench_compare.py --events 10000000 --rounds 1
    python benchmarks/bench_compare.py --events 1000000 --profile  # cProfile of one compare, top 40
    python benchmarks/bench_compare.py --before /tmp/old          # also time an older bitguard, alternated
    python benchmarks/bench_compare.py --touch                    # and the machine's cost of the same memory alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fixtures_runs as runs  # noqa: E402

LAYERS = 48
PER_STEP = 2 * LAYERS + 3  # blocks, probe, root, one gradient per block, optimizer step
TAINTED = "model.layers.30"


def plan(events: int) -> tuple[int, int, int]:
    """(steps, step of the digest change, step of the gap) for about `events` events per side."""
    steps = max(4, -(-events // PER_STEP))
    return steps, steps // 2, (3 * steps) // 4


def build_pair(data: Path, events: int) -> tuple[str, str]:
    """Reference and suspect run directories of about `events` events each (reused if present)."""
    steps, taint, gap = plan(events)
    a, b = data / f"reference-{steps}", data / f"suspect-{steps}"
    marker = data / f"pair-{steps}.json"
    if not marker.exists():
        t = time.perf_counter()
        runs.write_run(str(a), runs.RunSpec(layers=LAYERS, steps=steps))
        runs.write_run(str(b), runs.RunSpec(layers=LAYERS, steps=steps, taints=(runs.Taint(taint, TAINTED),),
                                            drop=frozenset({(gap, "model.probe", "forward")}), jitter_ns=7_000))
        marker.write_text(json.dumps({"steps": steps, "events_per_side": steps * PER_STEP}))
        print(f"built two runs of {steps * PER_STEP:,} events in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return str(a), str(b)


CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import bitguard.cli
from bitguard.backend.compare import compare
t1 = time.perf_counter()
r1 = resource.getrusage(resource.RUSAGE_SELF)
c = compare(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
doc = c.to_dict()
text = json.dumps(doc, indent=2)
t3 = time.perf_counter()
r3 = resource.getrusage(resource.RUSAGE_SELF)
fd = doc["first_divergence"]
print(json.dumps({"import_s": t1 - t0, "compare_s": t2 - t1, "document_s": t3 - t2, "wall_s": t3 - t0,
                  "verdict": doc["verdict"], "pivot": [fd["step"], fd["boundary"], fd["cause"]] if fd else None,
                  "nodes": len(doc["propagation"]["nodes"]), "json_bytes": len(text),
                  "peak_mib": r3.ru_maxrss / 1024, "user_s": r3.ru_utime - r1.ru_utime,
                  "system_s": r3.ru_stime - r1.ru_stime, "minor_faults": r3.ru_minflt - r1.ru_minflt,
                  "bitguard": bitguard.cli.__file__}))
"""

# The machine's own cost of memory: first touches of `MiB` of fresh 4 KiB pages (numpy's huge-page
# advice off, as most of a comparison's allocations have none), nothing else; wall and system time.
TOUCH = r"""
import resource, sys, time, numpy as np
from numpy._core.multiarray import _set_madvise_hugepage
_set_madvise_hugepage(False)
size, kept = int(float(sys.argv[1]) * 2**20), []
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for at in range(0, size, 64 << 20):
    a = np.empty(min(64 << 20, size - at), dtype=np.uint8)
    a[::4096] = 1
    kept.append(a)
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
print(t1 - t0, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt)
"""

PROFILE = r"""
import cProfile, pstats, sys
from bitguard.backend.compare import compare
pr = cProfile.Profile()
pr.enable()
compare(sys.argv[1], sys.argv[2]).to_dict()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
"""


def one(a: str, b: str, pythonpath: str | None = None) -> dict:
    """One compare in a fresh Python, outside the checkout (so that `pythonpath` can put another
    bitguard first: the "before" of --before)."""
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    out = subprocess.run([sys.executable, "-c", CHILD, a, b], capture_output=True, text=True,
                         cwd=tempfile.gettempdir(), timeout=3600, env=env)
    if out.returncode != 0:
        raise SystemExit(f"compare failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def touch(mib: float) -> dict:
    """The machine's cost of first-touching `mib` MiB of fresh pages, in a fresh Python (TOUCH)."""
    out = subprocess.run([sys.executable, "-c", TOUCH, str(mib)], capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir(), timeout=3600)
    wall, system, faults = out.stdout.split()
    return {"mib": mib, "wall_s": float(wall), "system_s": float(system), "minor_faults": int(faults)}


def check(r: dict, events: int) -> None:
    _, taint, _ = plan(events)
    if r["verdict"] != "diverged" or r["pivot"] != [taint, TAINTED, "digest"]:
        raise SystemExit(f"verdict {r['verdict']}, pivot {r['pivot']}; planted step {taint} {TAINTED}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", metavar="PYTHONPATH", help="a folder whose bitguard package (an export of an older "
                   "commit) is timed too, alternated with this one in every round")
    p.add_argument("--profile", action="store_true", help="print a cProfile of one compare per size, no timing")
    p.add_argument("--touch", action="store_true", help="after each compare, time a fresh Python that only "
                   "first-touches as much memory as that compare's peak: the machine's cost of the memory alone")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bitguard-bench-compare"),
                   help="where the synthetic runs are kept between invocations")
    args = p.parse_args(argv)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    pairs = {n: build_pair(data, n) for n in args.events}
    if args.profile:
        for n, (a, b) in pairs.items():
            subprocess.run([sys.executable, "-c", PROFILE, a, b], cwd=tempfile.gettempdir(), check=True)
        return {}
    results: dict[int, list[dict]] = {n: [] for n in args.events}
    before: dict[int, list[dict]] = {n: [] for n in args.events}
    if args.rounds < 1:
        return {}
    load = [os.getloadavg()]
    for rnd in range(args.rounds):
        for n, (a, b) in pairs.items():
            for label, path, into in (("now", None, results), ("before", args.before, before)):
                if label == "before" and not path:
                    continue
                r = one(a, b, path)
                check(r, n)
                if args.touch:
                    r["touch"] = touch(r["peak_mib"])
                into[n].append(r)
                print(f"round {rnd}: {n:,} events ({label}, {r['bitguard']}): {r['wall_s']:.2f} s "
                      f"(compare {r['compare_s']:.2f} s), {r['peak_mib']:.0f} MiB", file=sys.stderr)
    load.append(os.getloadavg())
    report = {"schema": "bitguard.bench_compare/1", "cores": os.cpu_count(), "load_average": load,
              "rounds": args.rounds, "sizes": {}}
    print(f"load average {load[0][0]:.1f} -> {load[1][0]:.1f}, {args.rounds} round(s)")
    print("| events per side | whole command (median) | compare() | document | peak RSS | ns per event (compare + document) "
          "| user CPU per event | system CPU per event | minor faults |" + (" touch of the peak alone |" if args.touch else ""))
    print("| --- " * (9 + args.touch) + "|")
    for n, rs in results.items():
        steps, _, _ = plan(n)
        per_side = steps * PER_STEP
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("wall_s", "compare_s", "document_s", "peak_mib", "user_s", "system_s", "minor_faults")}
        report["sizes"][str(per_side)] = {**med, "runs": rs, "before": before[n]}
        line = (f"| {per_side:,} | {med['wall_s']:.2f} s | {med['compare_s']:.2f} s | {med['document_s']:.2f} s | "
                f"{med['peak_mib']:,.0f} MiB | {(med['compare_s'] + med['document_s']) / per_side * 1e9:,.0f} | "
                f"{med['user_s'] / per_side * 1e9:,.0f} ns | {med['system_s'] / per_side * 1e9:,.0f} ns | "
                f"{med['minor_faults'] / 1e6:.2f} M |")
        if args.touch:
            wall = statistics.median(r["touch"]["wall_s"] for r in rs)
            system = statistics.median(r["touch"]["system_s"] for r in rs)
            line += f" {wall:.2f} s ({system:.2f} s system), {wall / (med['peak_mib'] / 1024):.2f} s a GiB |"
        print(line)
    if args.before:
        print("\nbefore (--before), same rounds: compare() + document, peak RSS, ratio now/before (median of rounds)")
        for n, rs in results.items():
            ratios = [(r["compare_s"] + r["document_s"]) / (q["compare_s"] + q["document_s"])
                      for r, q in zip(rs, before[n])]
            old = statistics.median(q["compare_s"] + q["document_s"] for q in before[n])
            print(f"{n:,}: before {old:.2f} s, {statistics.median(q['peak_mib'] for q in before[n]):,.0f} MiB; "
                  f"ratio {statistics.median(ratios):.2f}x")
    print(json.dumps(report), file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
