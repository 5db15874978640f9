"""What a `read` row's wrapper costs a read that is not the training's: torch's own `.item()` (Adam
and AdamW read each parameter's step count with it at every step), which passes through the
API recorder's wrapper of `Tensor.item` without a row (collectors/api_events.py, `_wrap_read`).

    python benchmarks/bench_reads.py [--reads 20000] [--rounds 5]

Times a loop of `t.item()` compiled under a file name in torch's folder, plain and inside an
in-process recording, alternated round by round; prints the medians in ns a read and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import bitguard

LOOP = "def reads(t, n):\n    for _ in range(n):\n        t.item()\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reads", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    space: dict = {}
    exec(compile(LOOP, os.path.join(os.path.dirname(torch.__file__), "optim", "bench_reads.py"), "exec"), space)
    t = torch.tensor(1.5)

    def timed() -> float:
        start = time.perf_counter()
        space["reads"](t, args.reads)
        return (time.perf_counter() - start) / args.reads * 1e9

    plain, recorded = [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            plain.append(timed())
            with bitguard.record(os.path.join(out, f"run-{len(plain)}"), determinism=False):
                recorded.append(timed())
    result = {"schema": "bitguard.bench_reads/1", "reads": args.reads, "rounds": args.rounds,
              "plain_ns": statistics.median(plain), "recording_ns": statistics.median(recorded),
              "added_ns": statistics.median(r - q for r, q in zip(recorded, plain))}
    print(f"torch's own .item(): {result['plain_ns']:.0f} ns plain, {result['recording_ns']:.0f} ns recording, "
          f"+{result['added_ns']:.0f} ns a read (medians of {args.rounds} alternated rounds)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
