"""What a Python hook and a check cost after a large operator, measured two ways: the time the
hook charges itself (its own clock, as the online sensors charge theirs) and its marginal cost
(iterations of a GEMM, the hook, the training's next modules, alternated with and without it).
No bitguard code runs here: the hook is the same few lines as the Linear hook's path when nothing
is drawn (type checks, shapes, a draw), the check a float64 column checksum of the product.

    python benchmarks/bench_hook_cost.py [--rounds 2000] [--json]

`first_call`: the hook's own time as the first Python after the GEMM, called again right after,
and in a loop with nothing between (warm). `marginal`: per call, what adding the hook (or the
check) to each block lengthened it, against what it charged itself (docs/ONLINE.md, overhead).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

clock = time.perf_counter


class Entry:
    calls = 0
    rate = 0.0
    flops = 0.0


def make_hook(entry: Entry, draw, charged: list):
    def hook(x, y) -> None:
        t0 = clock()
        if type(x) is not torch.Tensor or not x.dtype.is_floating_point or x.dim() == 0 or x.numel() == 0:
            return
        k, o = x.shape[-1], y.shape[-1]
        n = x.numel() // k
        entry.calls += 1
        entry.flops += 2.0 * n * k * o
        drawn = draw() < entry.rate
        backward = y.requires_grad and torch.is_grad_enabled()
        charged[0] += clock() - t0
        return drawn or backward
    return hook


def check(x, y, w, b, charged: list) -> None:
    t0 = clock()
    lhs = y.double().sum(0)
    rhs = x.double().sum(0) @ w.double().T + x.shape[0] * b.double()
    (lhs - rhs).abs().max().item()
    charged[0] += clock() - t0


def _quantiles(values: list[float]) -> dict:
    v = sorted(values)
    return {"p10_us": v[len(v) // 10] * 1e6, "p50_us": v[len(v) // 2] * 1e6}


def first_call(calls: int = 400) -> dict:
    x, w = torch.randn(1024, 256), torch.randn(1024, 256)
    out = {}
    for label, gemm, twice in (("after_gemm", True, False), ("second_call", True, True), ("warm_loop", False, False)):
        charged, seen = [0.0], []
        hook = make_hook(Entry(), random.Random(0).random, charged)
        for _ in range(calls):
            y = torch.nn.functional.linear(x, w) if gemm else x
            hook(x, y)
            if twice:
                charged[0] = 0.0
                hook(x, y)
            seen.append(charged[0])
            charged[0] = 0.0
        out[label] = _quantiles(seen[50:])
    return out


def marginal(rounds: int) -> dict:
    """Iterations of a GEMM, the hook (or the check) or nothing, and the training's next modules,
    alternated iteration by iteration (the order turning each round): per call, the difference of
    the two medians, and what the hook charged itself."""
    lin, norm, down = torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 256)
    x = torch.randn(1024, 256)
    out = {}
    for label in ("hook", "check"):
        charged = [0.0]
        hook = make_hook(Entry(), random.Random(0).random, charged)
        times, charges = {True: [], False: []}, []
        with torch.no_grad():
            for r in range(rounds):
                for on in ((True, False) if r % 2 else (False, True)):
                    charged[0] = 0.0
                    t = clock()
                    y = torch.nn.functional.linear(x, lin.weight, lin.bias)
                    if on:
                        if label == "hook":
                            hook(x, y)
                        else:
                            check(x, y, lin.weight, lin.bias, charged)
                    down(norm(y))  # the training's next modules
                    times[on].append(clock() - t)
                    if on:
                        charges.append(charged[0])
        with_, without = statistics.median(times[True]), statistics.median(times[False])
        out[label] = {"marginal_us": (with_ - without) * 1e6, "charged_us": statistics.median(charges) * 1e6,
                      "iteration_ms": without * 1e3}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    got = {"schema": "bitguard.bench_hook_cost/1", "threads": args.threads, "rounds": args.rounds,
           "load_average": __import__("os").getloadavg()[0], "first_call": first_call(), "marginal": marginal(args.rounds)}
    if args.json:
        print(json.dumps(got, indent=2))
        return
    for label, q in got["first_call"].items():
        print(f"hook, {label}: p10 {q['p10_us']:.1f} us, p50 {q['p50_us']:.1f} us")
    for label, m in got["marginal"].items():
        print(f"{label}: marginal {m['marginal_us']:.1f} us a call, charged {m['charged_us']:.1f} us "
              f"(an iteration without it: {m['iteration_ms']:.2f} ms)")


if __name__ == "__main__":
    main()
