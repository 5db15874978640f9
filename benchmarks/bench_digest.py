"""Digest throughput against the memory-bound baseline on the same buffer.

CPU (default): the digest kernel (xor and pos in one pass, one thread) on a 256 MiB tensor,
against `np.sum` and `np.bitwise_xor.reduce` over the same bytes viewed as uint64; for
information also `bitguard.cuda.fingerprint.digest`, which runs a tensor that big on torch's
OpenMP team (all of torch's intra-op threads) when it finds one.
Each repetition times all three back to back, so a noisy machine hurts them alike; medians
and the digest/sum ratio are reported (the target is a ratio of at least 0.9).

--cuda: the same on the GPU: `digest` of a CUDA tensor (launch and read-back included)
against `torch.sum` of its int64 view, timed after `torch.cuda.synchronize()`.

    python benchmarks/bench_digest.py [--size-mib 256] [--reps 9] [--threads 1] [--cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np
import torch

from bitguard.cuda.cpu_kernel import digest_at, digest_buffer
from bitguard.cuda.fingerprint import TEAM_MIN_BYTES, digest, openmp_team, warmup


def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure(cases: dict[str, Callable[[], object]], reps: int, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds per case, the cases interleaved within each repetition."""
    for fn in cases.values():
        fn()  # first touch, compilation, allocator warm-up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            times[name].append(timed(fn, sync))
    return {name: statistics.median(ts) for name, ts in times.items()}


def cpu_cases(nbytes: int, threads: int) -> dict[str, Callable[[], object]]:
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    words = t.numpy().view(np.uint64)
    cases = {
        "digest (xor+pos)": lambda: digest_at(t.data_ptr(), nbytes),
        "np.sum": lambda: np.sum(words),
        "np.bitwise_xor.reduce": lambda: np.bitwise_xor.reduce(words),
    }
    if openmp_team().size and nbytes >= TEAM_MIN_BYTES:
        cases[f"digest, OpenMP team of {torch.get_num_threads()}"] = lambda: digest(t)
    if threads > 1:
        cases[f"digest_buffer, {threads} threads"] = lambda: digest_buffer(t.numpy(), threads=threads)
    return cases


def cuda_cases(nbytes: int) -> dict[str, Callable[[], object]]:
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    words = t.view(torch.int64)
    return {
        "digest (xor+pos)": lambda: digest(t),
        "torch.sum": lambda: words.sum(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="buffer size in MiB")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per case")
    parser.add_argument("--threads", type=int, default=1, help="also time digest_buffer on this many threads")
    parser.add_argument("--cuda", action="store_true", help="time the GPU kernel instead (needs CUDA)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    nbytes = args.size_mib << 20
    warmup()
    if args.cuda:
        if not torch.cuda.is_available():
            parser.error("--cuda needs a CUDA device; torch.cuda.is_available() is False")
        medians = measure(cuda_cases(nbytes), args.reps, torch.cuda.synchronize)
        baseline, device = "torch.sum", torch.cuda.get_device_name()
    else:
        medians = measure(cpu_cases(nbytes, args.threads), args.reps)
        baseline, device = "np.sum", "cpu"
    rows = {name: {"median_s": s, "gb_per_s": nbytes / s / 1e9} for name, s in medians.items()}
    ratio = rows["digest (xor+pos)"]["gb_per_s"] / rows[baseline]["gb_per_s"]

    if args.json:
        print(json.dumps({"device": device, "bytes": nbytes, "reps": args.reps, "cases": rows, "ratio_to_" + baseline: ratio}, indent=2))
        return
    print(f"{args.size_mib} MiB on {device}, median of {args.reps}")
    print(f"{'case':<30} {'median ms':>10} {'GB/s':>8}")
    for name, row in rows.items():
        print(f"{name:<30} {row['median_s'] * 1e3:>10.2f} {row['gb_per_s']:>8.1f}")
    print(f"digest / {baseline} throughput ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
