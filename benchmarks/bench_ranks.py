"""Many ranks compared on 1 and on N worker processes (backend/rank_pool.py), alternated in one run.

Builds a synthetic pair of `--ranks` ranks × about `--events` events per rank per side
(tests/fixtures_runs.py: a toy network of Linear blocks, a gap on every rank, digest changes
planted on three ranks at known steps), then in each round compares it once per `--jobs` value,
each in a fresh Python (so a round's time includes starting the pool's workers, as a user's
`bitguard compare --jobs N` does), and checks every time that the planted faults are the pivots
of their ranks and the earliest is the run's first divergence. Medians of the rounds, and the
ratio of each round's time to the same round's one-worker time (the alternation cancels a drift
in the machine's load; medians of those ratios are what to quote).

    python benchmarks/bench_ranks.py                          # 64 ranks x 10,000 events, jobs 1 and 2
    python benchmarks/bench_ranks.py --ranks 8 --events 2000 --rounds 2
    python benchmarks/bench_ranks.py --jobs 1 2 ray            # and on a local Ray cluster
    python benchmarks/bench_ranks.py --jobs 1 2 ray --before OLD   # and an older bitguard, alternated

`ray` compares on a Ray cluster of this machine's cores that the fresh Python starts itself
(`ray.init(num_cpus=cores)`, then `compare(..., ray="auto")`, as the Ray test does): its wall
time is the comparison's, from the first task to the merged result; the cluster's start is
reported beside it (`ray_init_s`), since a user's `--ray ADDRESS` finds a cluster running.

`--before OLD` times the bitguard package in OLD (an export of an older commit, put first on
PYTHONPATH as bench_compare.py's --before does) in the same rounds, after this one, for every
`--jobs` value. Each child also reports what a worker sends back per rank: the pickled size of
each rank's result as a worker returns it (the whole `RankComparison` before compact results,
its compact form since), measured outside the timed wall; and the parent's peak RSS apart from
the workers' (the largest finished child's, as getrusage gives it: the pool's workers; Ray's are
not the driver's children and are not seen).
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

LAYERS = 16
PER_STEP = 2 * LAYERS + 3  # blocks, probe, root, one gradient per block, the optimizer step


def planted(ranks: int, steps: int) -> dict[int, tuple[int, str]]:
    """rank -> (step, boundary) of the digest changes planted in the suspect run."""
    return {ranks // 4: (steps // 2, "model.layers.5"), ranks // 2: (steps // 3, "model.layers.2"),
            ranks - 1: (steps - 1, "model.layers.0")}


def build_pair(data: Path, ranks: int, events: int) -> tuple[str, str, dict]:
    steps = max(4, -(-events // PER_STEP))
    plant = planted(ranks, steps)
    a, b = data / f"reference-{ranks}x{steps}", data / f"suspect-{ranks}x{steps}"
    marker = data / f"pair-{ranks}x{steps}.json"
    if not marker.exists():
        t = time.perf_counter()
        gap = frozenset({(steps - 1, "model.probe", "forward")})  # a late gap on every rank
        runs.write_run(str(a), runs.RunSpec(layers=LAYERS, steps=steps, world_size=ranks))
        runs.write_run(str(b), runs.RunSpec(layers=LAYERS, steps=steps, world_size=ranks, drop=gap, taints=tuple(
            runs.Taint(step, boundary, rank=r) for r, (step, boundary) in plant.items())))
        marker.write_text(json.dumps({"ranks": ranks, "steps": steps}))
        print(f"built two runs of {ranks} ranks x {steps * PER_STEP:,} events in {time.perf_counter() - t:.0f} s",
              file=sys.stderr)
    return str(a), str(b), plant


CHILD = r"""
import json, os, pickle, resource, statistics, sys, time
t = time.perf_counter()
ray_init = None
if sys.argv[3] == "ray":
    import ray
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray_init = time.perf_counter() - t
    t = time.perf_counter()
from bitguard.backend.compare import compare
if sys.argv[3] == "ray":
    c = compare(sys.argv[1], sys.argv[2], ray="auto")
else:
    c = compare(sys.argv[1], sys.argv[2], jobs=int(sys.argv[3]))
doc = c.to_dict()
wall = time.perf_counter() - t
if ray_init is not None:
    ray.shutdown()
pivots = {r: [rc.pivot["step"], rc.pivot["boundary"]] for r, rc in c.ranks.items() if rc.pivot is not None}
first = c.first_divergence
peak_parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
# what a worker sends back of a rank: its compact form where there is one, else the whole comparison
sent = [len(pickle.dumps(rc.compact() if hasattr(rc, "compact") else rc, protocol=pickle.HIGHEST_PROTOCOL))
        for rc in c.ranks.values()] if sys.argv[4] == "1" else []
print(json.dumps({"wall_s": wall, "ray_init_s": ray_init, "verdict": doc["verdict"], "pivots": pivots,
                  "first": [first["rank"], first["step"], first["boundary"]] if first else None,
                  "sent_bytes_median": statistics.median(sent) if sent else None, "sent_bytes_max": max(sent or [0]),
                  "document": json.dumps(doc, sort_keys=True),
                  "peak_mib_parent": peak_parent,
                  "peak_mib_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def one(a: str, b: str, jobs, pythonpath: str | None = None, sizes: bool = False) -> dict:
    """One compare in a fresh Python, outside the checkout (so that `pythonpath` can put another
    bitguard first: the "before" of --before)."""
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    out = subprocess.run([sys.executable, "-c", CHILD, a, b, str(jobs), "1" if sizes else "0"], capture_output=True,
                         text=True, cwd=tempfile.gettempdir(), timeout=3600, env=env)
    if out.returncode != 0:
        raise SystemExit(f"compare --jobs {jobs} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(r: dict, plant: dict, ranks: int, steps: int) -> None:
    """The planted faults are where they were planted; every other rank's pivot is the late gap."""
    for rank in range(ranks):
        want = list(plant[rank]) if rank in plant else [steps - 1, "model.probe"]
        got = r["pivots"].get(str(rank))
        if got != want:
            raise SystemExit(f"rank {rank}: pivot {got}, planted {want}")
    earliest = min(plant.items(), key=lambda kv: (kv[1][0], kv[0]))
    if r["first"] != [earliest[0], *earliest[1]]:
        raise SystemExit(f"first divergence {r['first']}, planted earliest {earliest}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--events", type=int, default=10_000, help="events per rank per side (about)")
    p.add_argument("--jobs", type=_jobs, nargs="+", default=[1, 2], help="worker counts, or 'ray'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", metavar="PYTHONPATH", help="a folder whose bitguard package (an export of an older "
                   "commit) is timed too, alternated with this one in every round")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "bitguard-bench-ranks"),
                   help="where the synthetic runs are kept between invocations")
    args = p.parse_args(argv)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    a, b, plant = build_pair(data, args.ranks, args.events)
    steps = max(4, -(-args.events // PER_STEP))
    engines = [("now", None)] + ([("before", args.before)] if args.before else [])
    contenders = [(e, j) for e, _ in engines for j in args.jobs]
    paths = dict(engines)
    times: dict = {c: [] for c in contenders}
    ratios: dict = {c: [] for c in contenders}
    peaks: dict = {c: {"parent": [], "worker": []} for c in contenders}
    sent: dict = {c: None for c in contenders}
    inits: list[float] = []
    documents: dict = {}
    load = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        row = {}
        for c in contenders:
            r = one(a, b, c[1], paths[c[0]], sizes=rnd == 0)
            check(r, plant, args.ranks, steps)
            documents.setdefault(c[0], set()).add(r["document"])
            times[c].append(r["wall_s"])
            peaks[c]["parent"].append(r["peak_mib_parent"])
            peaks[c]["worker"].append(r["peak_mib_worker"])
            if rnd == 0:
                sent[c] = {"median": r["sent_bytes_median"], "max": r["sent_bytes_max"]}
            row[c] = r["wall_s"]
            if r.get("ray_init_s") is not None:
                inits.append(r["ray_init_s"])
        for c in contenders:
            ratios[c].append(row[c] / row[contenders[0]])
        print(f"round {rnd}: " + ", ".join(f"{_name(c)} {row[c]:.2f} s" for c in contenders), file=sys.stderr)
    load.append(os.getloadavg()[0])
    same = {e: len(docs) == 1 for e, docs in documents.items()}  # one document for every --jobs value and round
    if not all(same.values()):
        raise SystemExit(f"the compare documents differ between worker counts: {same}")
    if args.before:
        same["before = now"] = documents["before"] == documents["now"]
    events = args.ranks * steps * PER_STEP
    report = {"schema": "bitguard.bench_ranks/1", "ranks": args.ranks, "events_per_side": events,
              "cores": os.cpu_count(), "load_average": load, "rounds": args.rounds,
              "jobs": {_name(c): {"median_s": statistics.median(times[c]), "times_s": times[c],
                                  "median_ratio_to_first": statistics.median(ratios[c]),
                                  "peak_mib_parent": max(peaks[c]["parent"]),
                                  "peak_mib_worker": max(peaks[c]["worker"]),
                                  "sent_bytes_per_rank": sent[c]} for c in contenders},
              "ray_init_s": statistics.median(inits) if inits else None, "same_documents": same}
    print(f"{args.ranks} ranks, {events:,} events per side, load average {load[0]:.1f} -> {load[1]:.1f}; "
          f"one document for every worker count: {same}")
    print(f"| code | workers | median wall | ratio to {_name(contenders[0])} (median of rounds) | peak RSS parent | "
          f"peak RSS worker | sent back a rank (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in contenders:
        s = report["jobs"][_name(c)]
        bytes_ = s["sent_bytes_per_rank"]["median"]
        print(f"| {c[0]} | {c[1]} | {s['median_s']:.2f} s | {s['median_ratio_to_first']:.2f}x | "
              f"{s['peak_mib_parent']:,.0f} MiB | {s['peak_mib_worker']:,.0f} MiB | {bytes_ / 1e3:,.1f} kB |")
    if inits:
        print(f"(ray: the local cluster's start, not in the wall time: median {report['ray_init_s']:.2f} s)")
    print(json.dumps(report), file=sys.stderr)
    return report


def _name(contender) -> str:
    engine, jobs = contender
    return str(jobs) if engine == "now" else f"{engine} {jobs}"


def _jobs(text: str):
    return "ray" if text == "ray" else int(text)


if __name__ == "__main__":
    main()
