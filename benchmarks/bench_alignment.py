"""Benchmark of bitguard.backend.alignment on synthetic pairs of runs.

Each pair is a run A of N events with a transformer-like structure (steps of layers whose
events repeat their keys, a few keys unique per step) and a run B made from A by deleting 1% of
the events, inserting 1% (half copies of nearby keys, half keys never seen), and swapping 0.1%
of adjacent blocks of 1-8 events (independent branches finishing in the other order).

Every measurement runs in a fresh subprocess, so `ru_maxrss` is that size's own peak; the
inputs come from an .npz file, and Numba's compiled code is loaded (warm-up on a small pair)
before the timed runs. Cold compile time is measured separately with an empty Numba cache.

    .venv/bin/python benchmarks/bench_alignment.py            # the table in docs/PERFORMANCE.md
    .venv/bin/python benchmarks/bench_alignment.py --sizes 10000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

LAYERS = 12
# One transformer layer as module types; equal names give equal keys (q, k, v share a shape).
LAYER_MODULES = ["ln", "qkv", "qkv", "qkv", "attn", "proj", "ln", "fc1", "gelu", "fc2"]
LAYER_PARAMS = ["ln.w", "ln.b", "qkv.w", "qkv.w", "qkv.w", "proj.w", "ln.w", "ln.b", "fc1.w", "fc2.w"]
# Modules outside the layer stack: one event each per step, so their keys are unique.
OUTER_MODULES = ["embed", "pos_embed", "final_ln", "lm_head", "loss"]
OUTER_PARAMS = ["embed.w", "pos_embed.w", "final_ln.w", "final_ln.b", "lm_head.w"]


def step_slots() -> np.ndarray:
    """Slot ids of one training step in completion order; equal slots mean equal keys."""
    names: list[str] = []
    names += [f"fwd.pre.{m}" for m in OUTER_MODULES[:2]] + [f"fwd.post.{m}" for m in OUTER_MODULES[:2]]
    for _ in range(LAYERS):
        for mod in LAYER_MODULES:
            names += [f"fwd.pre.{mod}", f"fwd.post.{mod}"]
    names += [f"fwd.post.{m}" for m in OUTER_MODULES[2:]]
    names += [f"bwd.{m}" for m in reversed(OUTER_MODULES[2:])]
    for _ in range(LAYERS):
        names += [f"bwd.{mod}" for mod in reversed(LAYER_MODULES)]
        names += [f"grad.{p}" for p in reversed(LAYER_PARAMS)]
    names += [f"bwd.{m}" for m in OUTER_MODULES[:2]] + [f"grad.{p}" for p in OUTER_PARAMS]
    names += [f"optim.{p}" for p in OUTER_PARAMS] + [f"optim.{p}" for p in LAYER_PARAMS * LAYERS]
    ids = {name: k for k, name in enumerate(dict.fromkeys(names))}
    return np.array([ids[name] for name in names], dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a stand-in for the caller's key hash."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def make_pair(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys_a, keys_b, origin): origin[j] is the A position B event j was copied from, or -1."""
    rng = np.random.default_rng(seed)
    slots = step_slots()
    steps = -(-n // slots.size)
    step_of = np.repeat(np.arange(steps, dtype=np.uint64), slots.size)[:n]
    keys_a = _mix(step_of * np.uint64(1 << 20) + np.tile(slots, steps)[:n])

    # Reorders: in 0.1% * 32 of the 32-event chunks, swap two adjacent blocks of 1-8 events.
    coord = np.arange(n, dtype=np.float64)
    chunks = rng.choice(n // 32, size=max(1, n // 1000), replace=False)
    len1 = rng.integers(1, 9, chunks.size)
    len2 = rng.integers(1, 9, chunks.size)
    start = chunks * 32 + rng.integers(0, 32 - 16, chunks.size)
    for s, l1, l2 in zip(start, len1, len2):
        coord[s : s + l1] += l2
        coord[s + l1 : s + l1 + l2] -= l1

    keep = rng.random(n) >= 0.01
    n_ins = n // 100
    at = rng.integers(0, n, n_ins)
    copies = rng.random(n_ins) < 0.5
    ins_keys = np.where(copies, keys_a[np.clip(at + rng.integers(-20, 21, n_ins), 0, n - 1)],
                        rng.integers(0, 2**63, n_ins, dtype=np.uint64) | np.uint64(1 << 63))
    all_coord = np.concatenate([coord[keep], at + rng.random(n_ins)])
    all_keys = np.concatenate([keys_a[keep], ins_keys])
    all_origin = np.concatenate([np.flatnonzero(keep), np.full(n_ins, -1)])
    order = np.argsort(all_coord, kind="stable")
    return keys_a, all_keys[order], all_origin[order]


def hard_pairs(n: int) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Pairs that take align off its easy path, as (keys_a, keys_b, origin); origin is -1
    where the truth is not worth tracking."""
    rng = np.random.default_rng(1)
    keys_a, keys_b, origin = make_pair(n, seed=n)
    cut = int(n * 0.3) + 77  # partway through a step
    block = rng.integers(0, 2**63, n // 10, dtype=np.uint64) | np.uint64(1 << 63)
    mid = keys_b.size // 2
    few = rng.integers(0, 50, (2, n)).astype(np.uint64)
    unrelated = rng.integers(0, 2**63, (2, n), dtype=np.uint64)
    none = np.full(n, -1)
    return {
        "B stopped at 30% of the run": (keys_a, keys_b[:cut], origin[:cut]),
        "B with a block of 10% new events": (keys_a, np.concatenate([keys_b[:mid], block, keys_b[mid:]]),
                                             np.concatenate([origin[:mid], np.full(block.size, -1), origin[mid:]])),
        "no key unique (50 keys, random)": (few[0], few[1], none),
        "unrelated runs (all keys differ)": (unrelated[0], unrelated[1], none),
        "B is A reversed": (keys_a, keys_a[::-1].copy(), none),
    }


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _child(path: str, repeats: int, full: bool) -> dict:
    """Runs in the subprocess: load the pair, warm up, time `repeats` runs, report as JSON."""
    t0 = time.perf_counter()
    from bitguard.backend.alignment import align, full_dp_align

    warm_a, warm_b, _ = make_pair(2000, seed=99)
    align(warm_a, warm_b)
    full_dp_align(warm_a[:300], warm_b[:300])
    warm_s = time.perf_counter() - t0
    data = np.load(path)
    keys_a, keys_b, origin = data["a"], data["b"], data["origin"]
    rss_before = _peak_rss_mib()
    fn = full_dp_align if full else align
    times, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        result = fn(keys_a, keys_b)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    truth = origin >= 0
    paired = np.full(keys_a.size, -1)
    paired[result.a_idx] = result.b_idx
    exact = np.count_nonzero(paired[origin[truth]] == np.flatnonzero(truth))
    # A true pair is lost when neither of its events is matched at all (an equal key taking its
    # place is ambiguity, not loss).
    gap_b = np.zeros(keys_b.size, dtype=bool)
    gap_b[result.gaps_b] = True
    lost = np.count_nonzero((paired[origin[truth]] < 0) & gap_b[truth])
    return {
        "n": int(keys_a.size), "m": int(keys_b.size), "times": times, "cpu": cpu, "warm_s": warm_s,
        "rss_before": rss_before, "rss_peak": _peak_rss_mib(),
        "matched": result.matched, "reordered": int(result.reordered.sum()),
        "gaps_a": int(result.gaps_a.size), "gaps_b": int(result.gaps_b.size),
        "true_pairs": int(truth.sum()), "true_exact": int(exact), "true_lost": int(lost),
        "anchors": result.anchors, "windows": result.windows, "max_window": result.max_window,
        "dp_cells": result.dp_cells, "sparse_windows": result.sparse_windows,
        "narrowed_windows": result.narrowed_windows,
    }


def _run_child(pair: tuple, repeats: int, full: bool = False, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pair.npz")
        np.savez(path, a=pair[0], b=pair[1], origin=pair[2])
        args = [sys.executable, __file__, "--child", path, "--repeats", str(repeats)]
        out = subprocess.run(args + (["--full"] if full else []), check=True, env=env,
                             capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cold_compile_s() -> float:
    """Seconds to import and compile every kernel with an empty Numba cache (first-ever call)."""
    code = ("import time; t = time.perf_counter(); import numpy as np; "
            "from bitguard.backend.alignment import align, full_dp_align; "
            "a = np.arange(50, dtype=np.uint64) % 7; align(a, a[::-1].copy()); full_dp_align(a, a); "
            "print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", code], check=True, env=env,
                             capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--full-size", type=int, default=10_000, help="events per run for the full-DP comparison")
    parser.add_argument("--hard-size", type=int, default=1_000_000, help="events per run for the hard cases (0: skip)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.repeats, args.full)))
        return

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start "
          "(other work on the machine slows every figure)")
    print(f"cold compile (empty Numba cache): {_cold_compile_s():.1f} s")
    rows = []
    for n in args.sizes:
        r = _run_child(make_pair(n, seed=n), args.repeats)
        rows.append(r)
        if len(rows) == 1:
            print(f"load of cached kernels + warm-up: {r['warm_s']:.2f} s")
            print()
            print("| events A / B | median s | min-max s | CPU s | ns/event | peak RSS MiB (before) | "
                  "anchors | DP windows | max window | DP cells | matched (reordered) | gaps A / B | "
                  "true pairs: exact / lost |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        med = statistics.median(r["times"])
        print(f"| {r['n']:,} / {r['m']:,} | {med:.3f} | {min(r['times']):.3f}-{max(r['times']):.3f} | "
              f"{statistics.median(r['cpu']):.3f} | "
              f"{med / r['n'] * 1e9:.0f} | {r['rss_peak']:.0f} ({r['rss_before']:.0f}) | {r['anchors']:,} | "
              f"{r['windows']:,} | {r['max_window']:,} | {r['dp_cells']:,} | {r['matched']:,} ({r['reordered']:,}) | "
              f"{r['gaps_a']:,} / {r['gaps_b']:,} | {100 * r['true_exact'] / r['true_pairs']:.2f}% / {r['true_lost']} |",
              flush=True)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        per = [statistics.median(r["times"]) / r["n"] for r in (first, last)]
        print(f"\ntime per event {first['n']:,} -> {last['n']:,}: x{per[1] / per[0]:.2f} "
              f"(1.00 = linear)")
    if args.full_size:
        pair = make_pair(args.full_size, seed=args.full_size)
        banded = _run_child(pair, args.repeats)
        full = _run_child(pair, max(1, min(args.repeats, 3)), full=True)
        b_med, f_med = statistics.median(banded["times"]), statistics.median(full["times"])
        print(f"\nfull_dp_align on {full['n']:,} x {full['m']:,}: median {f_med:.3f} s, "
              f"peak RSS {full['rss_peak']:.0f} MiB (before {full['rss_before']:.0f}), "
              f"{full['matched']:,} matched; align: {b_med * 1e3:.1f} ms, {banded['matched']:,} matched "
              f"({banded['reordered']:,} by the reorder pass) -> speed-up x{f_med / b_med:.0f}")
    if args.hard_size:
        print(f"\nhard cases, {args.hard_size:,} events in A, median of {min(args.repeats, 3)}:\n")
        print("| case | median s | peak RSS MiB (before) | anchors | DP windows | sparse / slope windows | "
              "max window | DP cells | matched (reordered) | true pairs lost |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, pair in hard_pairs(args.hard_size).items():
            r = _run_child(pair, min(args.repeats, 3))
            lost = f"{r['true_lost']} of {r['true_pairs']:,}" if r["true_pairs"] else "-"
            print(f"| {name} | {statistics.median(r['times']):.3f} | {r['rss_peak']:.0f} ({r['rss_before']:.0f}) | "
                  f"{r['anchors']:,} | {r['windows']:,} | {r['sparse_windows']} / {r['narrowed_windows']} | "
                  f"{r['max_window']:,} | {r['dp_cells']:,} | {r['matched']:,} ({r['reordered']:,}) | {lost} |",
                  flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
