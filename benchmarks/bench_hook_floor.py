"""The floor of a recorder built on torch's Python hooks: what the hooks cost a step when they do
nothing, on the second bench model (issue 18, part 3: the 10 µs an event target).

bitguard observes a module call through a wrapper of `nn.Module._call_impl`, a module output's
gradient through a tensor hook on it, and a parameter's gradient through a hook on the parameter:
each is an entry from torch into Python that no recorder written on these hooks can avoid. This
benchmark installs exactly those entries with nothing inside them (`bare`), and then the same entries
reading, for every tensor they meet, the properties a row needs (`reads`: shape, strides, dtype,
address, offset, element size, bytes, version; no digest, no row, no queue), alternated block by
block with the plain step in one process (the order turning each round), and divides each
variant's median cost a step by the events bitguard records a step in full mode (counted by a
recording of the same model in the same process).

    python benchmarks/bench_hook_floor.py [--rounds 20] [--block 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recording import build, events_so_far, recorded, step  # noqa: E402


def _reads(t: torch.Tensor) -> None:
    """The properties `Collector._row` reads of a plain tensor, read once each."""
    t.shape, t.stride(), t.dtype, t.data_ptr(), t.storage_offset(), t.element_size(), t.nbytes, t._version
    t.is_cpu, t.layout, t.is_nested


class Floor:
    """The three entries bitguard's collector uses, doing nothing (`reads`: reading each tensor's row
    properties); `calls` counts the entries."""

    def __init__(self, model: torch.nn.Module, reads: bool):
        self.model, self.reads, self.calls, self.enabled = model, reads, 0, False
        self.inner = torch.nn.Module._call_impl
        read = _reads if reads else None
        this = self

        def on_grad(grad):
            this.calls += 1
            if read is not None:
                read(grad)

        def call_impl(module, *args, **kwargs):
            if not this.enabled:
                return this.inner(module, *args, **kwargs)
            this.calls += 1
            if read is not None:
                for a in args:
                    if type(a) is torch.Tensor:
                        read(a)
            out = this.inner(module, *args, **kwargs)
            if type(out) is torch.Tensor:
                if read is not None:
                    read(out)
                if out.requires_grad:
                    out.register_hook(on_grad)
            return out

        self.call_impl = call_impl
        self.handles = [p.register_hook(lambda g: on_grad(g)) for p in model.parameters() if p.requires_grad]

    def __enter__(self):
        torch.nn.Module._call_impl = self.call_impl
        self.enabled = True
        return self

    def __exit__(self, *exc):
        self.enabled = False
        torch.nn.Module._call_impl = self.inner


def full_events(model, opt, data) -> float:
    """Events a step bitguard records of this model in full mode (3 steps after a warm-up step)."""
    with tempfile.TemporaryDirectory() as d:
        with recorded(Path(d) / "run", "full", True) as stack:
            step(model, opt, data)
            first = events_so_far(stack.rec)
            for _ in range(3):
                step(model, opt, data)
            return (events_so_far(stack.rec) - first) / 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=4, help="steps a block (the first is dropped)")
    args = p.parse_args()
    torch.manual_seed(0)
    model, opt, data = build(model="modules")
    events = full_events(model, opt, data)
    variants = {"plain": None, "bare": Floor(model, reads=False), "reads": Floor(model, reads=True)}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}  # the training thread's CPU time a step (other processes do not add to it)
    calls = {k: [] for k in variants}
    order = list(variants)
    for _ in range(3):
        step(model, opt, data)
    for r in range(args.rounds):
        for name in order[r % 3:] + order[:r % 3]:
            floor = variants[name]
            block, block_cpu = [], []
            for i in range(args.block):
                if floor is not None:
                    floor.calls = 0
                    floor.__enter__()
                t, c = time.perf_counter(), time.thread_time()
                step(model, opt, data)
                block.append(time.perf_counter() - t)
                block_cpu.append(time.thread_time() - c)
                if floor is not None:
                    floor.__exit__(None, None, None)
                    calls[name].append(floor.calls)
            times[name].append(statistics.median(block[1:]))
            cpu[name].append(statistics.median(block_cpu[1:]))
    print(f"modules model, {args.rounds} rounds of {args.block} steps; bitguard full mode records {events:.0f} events a step")
    for clock, series in (("wall", times), ("thread CPU", cpu)):
        plain = series["plain"]
        print(f"{clock}: plain step median {statistics.median(plain) * 1e3:.1f} ms")
        for name in ("bare", "reads"):
            extra = [v - p0 for v, p0 in zip(series[name], plain)]
            ratio = [v / p0 for v, p0 in zip(series[name], plain)]
            med = statistics.median(extra)
            entries = statistics.median(calls[name])
            print(f"  {name}: {entries:.0f} entries a step; median of round ratios {statistics.median(ratio):.3f}x "
                  f"(min {min(ratio):.3f}, max {max(ratio):.3f}); +{med * 1e3:.2f} ms a step; "
                  f"{med / entries * 1e6:.1f} us an entry; {med / events * 1e6:.1f} us an event")


if __name__ == "__main__":
    main()
