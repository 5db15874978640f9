"""Recording overhead per training step and collector memory, on a CPU GPT training loop.

Steady-state step time of the same loop (6 layers, width 256, sequence 128, batch 8) run plainly,
recorded in full mode and recorded in trusted mode, alternated round by round so that machine
noise hits all three alike; medians and ratios are from this one run. Start-up cost (imports,
kernel compilation) is measured separately in fresh processes. Memory: RSS growth of a long
recorded run (small model, many steps) between an early and a late step, and the peak size of the
writer queue.

    python benchmarks/bench_recording.py [--rounds 20] [--steps 20] [--json] [--breakdown] [--team-pairs N]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sample_traces"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build(layers=6, width=256, seq=128, batch=8, vocab=512):
    import torch

    import tinygpt

    torch.manual_seed(0)
    model = tinygpt.GPT(vocab, seq, width, layers, 4, torch.nn.LayerNorm, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (batch, seq + 1))
    return model, opt, data


def step(model, opt, data):
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()


def timed_steps(model, opt, data, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step(model, opt, data)
        out.append(time.perf_counter() - t)
    return out


def overhead(rounds: int, steps: int) -> dict:
    """Step times of the three modes, alternated round by round. The order of the modes turns each
    round (plain, full, trusted; then full, trusted, plain; ...) so that none always runs after
    another's close. Each round's ratio pairs a mode with the plain steps of the same round: on a
    shared machine whose speed drifts over minutes, that pairing is what the drift cancels out of,
    and the median over rounds is the headline figure (the ratio of all-steps medians is given too)."""
    import bitguard

    model, opt, data = build()
    timed_steps(model, opt, data, 2)  # warm the allocator and kernels
    modes = ("plain", "full", "trusted")
    times = {m: [] for m in modes}
    per_round = {"full": [], "trusted": []}  # each round's median against the same round's plain one
    with tempfile.TemporaryDirectory() as tmp:
        # one throw-away recording pays the one-off costs (kernel compile, DuckDB load)
        with bitguard.record(Path(tmp) / "warm", mode="trusted", determinism=False):
            timed_steps(model, opt, data, 1)
        for r in range(rounds):
            medians = {}
            for mode in modes[r % 3:] + modes[: r % 3]:
                if mode == "plain":
                    got = timed_steps(model, opt, data, steps)[1:]
                else:
                    with bitguard.record(Path(tmp) / f"{mode}-{r}", mode=mode, determinism=False):
                        got = timed_steps(model, opt, data, steps)[1:]
                medians[mode] = statistics.median(got)
                times[mode] += got
            for mode in per_round:
                per_round[mode].append(medians[mode] / medians["plain"])
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in per_round.items()}
    return {"median_step_s": med, "samples": {k: len(v) for k, v in times.items()},
            "ratio_full": spread["full"]["median"], "ratio_trusted": spread["trusted"]["median"],
            "pooled_ratio_full": med["full"] / med["plain"], "pooled_ratio_trusted": med["trusted"] / med["plain"],
            "round_ratios": spread}


def breakdown(rounds: int, steps: int) -> dict:
    """Where trusted mode's overhead goes: the same alternation as `overhead`, with trusted mode also
    run with its digest kernels replaced by a constant (what is left is Python and hooks), and with
    rows and events stubbed too (what is left is the hooks firing: dispatch, frames, registering
    gradient hooks, RNG checks). Differences of medians, one run."""
    import bitguard
    from bitguard.collectors import hooks

    original = {"digest_async": hooks.digest_async, "digest_many": hooks.digest_many,
                "_row": hooks.Collector._row, "_emit": hooks.Collector._emit}

    def variant(name: str) -> None:
        hooks.digest_async, hooks.digest_many = original["digest_async"], original["digest_many"]
        hooks.Collector._row, hooks.Collector._emit = original["_row"], original["_emit"]
        if name in ("no digests", "hooks only"):
            hooks.digest_async = lambda t: (0, 0)
            hooks.digest_many = lambda ts: [(0, 0)] * len(ts)
        if name == "hooks only":
            hooks.Collector._row = lambda self, t, role, idx, path, digest=None: [0, role, idx, path]
            hooks.Collector._emit = lambda self, *args, **kwargs: None

    model, opt, data = build()
    timed_steps(model, opt, data, 2)
    names = ("plain", "trusted", "no digests", "hooks only")
    times = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name in names:
                if name == "plain":
                    times[name] += timed_steps(model, opt, data, steps)[1:]
                    continue
                variant(name)
                try:
                    with bitguard.record(Path(tmp) / f"{name}-{r}", mode="trusted", determinism=False):
                        times[name] += timed_steps(model, opt, data, steps)[1:]
                finally:
                    variant("trusted")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": med, "digests_s": med["trusted"] - med["no digests"],
            "rows_and_events_s": med["no digests"] - med["hooks only"],
            "hooks_firing_s": med["hooks only"] - med["plain"]}


def team_pairs(pairs: int) -> dict:
    """What digesting on torch's OpenMP team saves a trusted step: one recording, its steps taken in
    pairs, one with host digests on the team and one on the calling thread alone (the order turns
    each pair), and the median of the pairs' differences (a change of a few milliseconds is lost in
    this machine's drift between rounds, not between neighbouring steps)."""
    import bitguard
    from bitguard.cuda import fingerprint

    team = fingerprint.openmp_team()
    if not team.size:
        raise SystemExit("--team-pairs: torch here does not run on an OpenMP team bitguard can use")
    model, opt, data = build()
    timed_steps(model, opt, data, 2)

    def one(on: bool) -> float:
        fingerprint._team = team if on else fingerprint.NO_TEAM
        return timed_steps(model, opt, data, 1)[0]

    on, off = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp, bitguard.record(Path(tmp) / "pairs", mode="trusted", determinism=False):
            for first in (True, False, True, False):
                one(first)
            for i in range(pairs):
                order = (True, False) if i % 2 == 0 else (False, True)
                got = {o: one(o) for o in order}
                on.append(got[True])
                off.append(got[False])
    finally:
        fingerprint._team = team
    diffs = [a - b for a, b in zip(on, off)]
    quartiles = statistics.quantiles(diffs, n=4)
    return {"pairs": pairs, "median_team_s": statistics.median(on), "median_alone_s": statistics.median(off),
            "median_difference_s": statistics.median(diffs), "difference_quartiles_s": [quartiles[0], quartiles[2]]}


def startup() -> dict:
    def run(code: str) -> float:
        best = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            best.append(time.perf_counter() - t)
        return statistics.median(best)

    base = run("import torch")
    with_bitguard = run("import torch, tempfile, bitguard\n"
                        "with bitguard.record(tempfile.mkdtemp(), determinism=False): pass")
    return {"python_import_torch_s": base, "import_bitguard_and_open_recording_s": with_bitguard,
            "startup_cost_s": with_bitguard - base}


def memory(steps: int) -> dict:
    import bitguard
    from bitguard.collectors import store

    model, opt, data = build(layers=2, width=64, seq=32, batch=4, vocab=128)
    peak_queue = 0
    original_push = store.RankStore._push

    def push(self, marker=None):
        nonlocal peak_queue
        peak_queue = max(peak_queue, self._queue.qsize())
        original_push(self, marker)

    store.RankStore._push = push
    samples = {}
    for _ in range(30):  # plain steps first: the allocator and torch reach their steady state
        step(model, opt, data)
    before_libraries = rss_mib()
    # the recorder's libraries (DuckDB, Arrow, Numba's compiled kernels): a one-off cost, counted apart
    import duckdb  # noqa: F401
    import pyarrow  # noqa: F401

    from bitguard.cuda.fingerprint import warmup

    warmup()
    with tempfile.TemporaryDirectory() as tmp:
        base = rss_mib()
        peak, peak_step = base, 0
        with bitguard.record(Path(tmp) / "long", determinism=False):
            for i in range(steps):
                step(model, opt, data)
                now = rss_mib()  # every step: the writer's folds and DuckDB's checkpoints make a sawtooth
                if now > peak:
                    peak, peak_step = now, i
                if i in (20, steps // 8, steps // 4, steps // 2, steps - 1):
                    samples[i] = now
        size = sum(p.stat().st_size for p in (Path(tmp) / "long").iterdir()) / 2**20
    store.RankStore._push = original_push
    first, last = samples[20], samples[steps - 1]
    return {"steps": steps, "rss_before_recording_mib": base, "rss_at_step_mib": samples,
            "growth_step20_to_end_mib": last - first, "extra_over_plain_at_end_mib": last - base,
            "max_extra_over_plain_mib": peak - base, "max_at_step": peak_step,
            "rss_plain_steady_mib": base, "libraries_mib": base - before_libraries,
            "peak_queue_batches": peak_queue, "run_dir_mib": size,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=20,
                   help="steps per round and mode (the first is dropped; 20 steps span a journal fold)")
    p.add_argument("--memory-steps", type=int, default=600)
    p.add_argument("--json", action="store_true")
    p.add_argument("--breakdown", action="store_true",
                   help="only split trusted mode's overhead into digests, rows and events, hooks firing")
    p.add_argument("--team-pairs", type=int, default=0, metavar="N",
                   help="only compare trusted steps with digests on torch's OpenMP team and without, in N pairs")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    if args.memory_only:
        print(json.dumps(memory(args.memory_steps)))
        return
    if args.team_pairs:
        t = team_pairs(args.team_pairs)
        if args.json:
            print(json.dumps(t, indent=2))
            return
        low, high = t["difference_quartiles_s"]
        print(f"trusted step, {t['pairs']} pairs: digests on torch's OpenMP team {t['median_team_s'] * 1000:.1f} ms, "
              f"on the calling thread alone {t['median_alone_s'] * 1000:.1f} ms (medians); median difference "
              f"{t['median_difference_s'] * 1000:+.2f} ms (quartiles {low * 1000:+.2f} to {high * 1000:+.2f} ms)")
        return
    if args.breakdown:
        b = breakdown(args.rounds, args.steps)
        if args.json:
            print(json.dumps(b, indent=2))
            return
        plain = b["median_step_s"]["plain"]
        for name, sec in b["median_step_s"].items():
            print(f"  {name:12s} {sec * 1000:8.1f} ms/step   {sec / plain:5.3f}x")
        print(f"trusted overhead: digests {b['digests_s'] * 1000:.1f} ms, rows and events "
              f"{b['rows_and_events_s'] * 1000:.1f} ms, hooks firing {b['hooks_firing_s'] * 1000:.1f} ms")
        return
    # memory in a fresh process, so that nothing the overhead runs allocated or freed blurs it
    mem = None
    if args.memory_steps > 0:
        mem = subprocess.run([sys.executable, __file__, "--memory-only", "--memory-steps", str(args.memory_steps)],
                             capture_output=True, text=True, check=True)
    result = {"torch_threads": torch.get_num_threads(), "overhead": overhead(args.rounds, args.steps),
              "startup": startup(), "memory": json.loads(mem.stdout.strip().splitlines()[-1]) if mem else None}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o, s, m = result["overhead"], result["startup"], result["memory"]
    print(f"GPT 6x256, seq 128, batch 8, {result['torch_threads']} threads; {o['samples']['plain']} steps a mode")
    for mode in ("plain", "full", "trusted"):
        ratio = o["median_step_s"][mode] / o["median_step_s"]["plain"]
        spread = o["round_ratios"].get(mode)
        rounds = (f"   round by round: median {spread['median']:.3f}x ({spread['min']:.3f}-{spread['max']:.3f}x)"
                  if spread else "")
        print(f"  {mode:8s} median step {o['median_step_s'][mode] * 1000:6.1f} ms ({ratio:5.3f}x){rounds}")
    print(f"start-up: import torch {s['python_import_torch_s']:.2f} s; + bitguard and a recording "
          f"{s['import_bitguard_and_open_recording_s']:.2f} s (one-off cost {s['startup_cost_s']:.2f} s)")
    if m is None:
        return
    print(f"memory over {m['steps']} recorded steps (small GPT): RSS over the plain steady state at most "
          f"{m['max_extra_over_plain_mib']:.1f} MiB (step {m['max_at_step']}), at the end "
          f"{m['extra_over_plain_at_end_mib']:.1f} MiB; growth step 20 -> end "
          f"{m['growth_step20_to_end_mib']:.1f} MiB; peak writer queue "
          f"{m['peak_queue_batches']} batches; run dir {m['run_dir_mib']:.1f} MiB")
    print("  RSS by recorded step (MiB): " + ", ".join(f"{k}: {v:.0f}" for k, v in m["rss_at_step_mib"].items())
          + f"; plain steady state with the libraries loaded {m['rss_plain_steady_mib']:.0f} "
          f"(loading DuckDB, Arrow and the compiled kernels: {m['libraries_mib']:.0f} MiB, once)")


if __name__ == "__main__":
    main()
