"""Recording overhead per training step and per recorded event, and collector memory, on CPU GPTs.

Steady-state step time of the same loop (6 layers, width 256, sequence 128, batch 8, vocabulary
512) run plainly, recorded in full mode and recorded in trusted mode, alternated round by round so
that machine noise hits all three alike; medians and ratios are from this one run. Two bench
models (`--model`): `gpt`, the project's tiny GPT (sample_traces/tinygpt.py, no dropout), and
`modules`, the same sizes built from more and smaller modules (attention's core, softmax, GELU and
four dropouts a block as modules, dropout 0.1), where the cost per event weighs more. The
recorded rounds run with bitguard's determinism controls at their defaults (what `bitguard
record` applies: seed, deterministic algorithms, threads pinned), the plain rounds with the
settings as the user had them (restored after every recorded round); `--no-determinism` turns the
controls off in the recorded rounds too.

Each recorded round also counts the events it recorded: the overhead per event is the round's
median step overhead over the plain steps of the same round, divided by the events per step.
`--hook-time` measures instead, in-process, the time spent inside the collector's hooks (every
entry from torch into bitguard, outermost only), per step and per event.
`--digest-bytes` counts what each recorded mode digests a step, by source, with the bytes read
twice; `--breakdown` splits a recorded step's overhead by switching one part off at a time.
`--paired N` measures the steady state of one long recording a mode instead, recorded and paused
blocks alternated (recording_steady.py); `--hook-split N` splits the hooks' Python by hook and
helper (hook_split.py). `--paired N --before DIR` runs that steady state in fresh Pythons, this
checkout's recorder and an older one's (an export, benchmarks/export_commit.py) alternated run by
run (recording_ab.py).

Start-up cost (imports, kernel compilation) is measured separately in fresh processes. Memory:
RSS growth of a long recorded run (small model, many steps) between an early and a late step, and
the peak size of the writer queue.

    python benchmarks/bench_recording.py [--model gpt|modules] [--rounds 20] [--steps 20] [--json]
                                         [--no-determinism] [--breakdown] [--team-pairs N] [--hook-time N]
                                         [--digest-bytes N] [--determinism-cost]
                                         [--paired N [--block 4] [--warmup 12] [--before DIR [--ab-runs K]]]
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
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sample_traces"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_of(pid: int | None) -> float:
    """Another process's peak RSS so far (VmHWM), MiB; 0 when there is none or it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, TypeError):
        return 0.0


MODELS = ("gpt", "modules")


def many_modules_gpt(vocab: int, seq: int, width: int, layers: int, heads: int, dropout: float):
    """A GPT of the same sizes as tinygpt's, built from more and smaller modules: per block two
    LayerNorms, the attention (its input and output projections, its core as a module of its own
    with an `nn.Softmax` and an attention dropout, a residual dropout) and the MLP (two Linears, an
    `nn.GELU`, a dropout); token and position embeddings and their dropout. 16 module calls a block
    against tinygpt's 11, and every dropout draws random numbers."""
    import math

    import torch
    import torch.nn as nn

    class AttentionCore(nn.Module):
        def __init__(self):
            super().__init__()
            self.softmax = nn.Softmax(dim=-1)
            self.drop = nn.Dropout(dropout)

        def forward(self, q, k, v):
            t = q.size(-2)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            return self.drop(self.softmax(att.masked_fill(~mask, float("-inf")))) @ v

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(width, 3 * width)
            self.core = AttentionCore()
            self.c_proj = nn.Linear(width, width)
            self.resid_drop = nn.Dropout(dropout)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
            return self.resid_drop(self.c_proj(self.core(q, k, v).transpose(1, 2).reshape(b, t, c)))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(width, 4 * width)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * width, width)
            self.drop = nn.Dropout(dropout)

        def forward(self, x):
            return self.drop(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention()
            self.ln_2, self.mlp = nn.LayerNorm(width), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def build(layers=6, width=256, seq=128, batch=8, vocab=512, model="gpt"):
    import torch

    import tinygpt

    torch.manual_seed(0)
    if model == "modules":
        net = many_modules_gpt(vocab, seq, width, layers, 4, 0.1)
    else:
        net = tinygpt.GPT(vocab, seq, width, layers, 4, torch.nn.LayerNorm, 0.0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (batch, seq + 1))
    return net, opt, data


def settings_now() -> dict:
    """The settings a recording's determinism controls change (collectors/determinism.py snapshot:
    deterministic algorithms, cuDNN and TF32 flags, matmul precision, thread count, the environment
    variables they set), as they are now: for `restore_settings`."""
    from bitguard.collectors import determinism

    return determinism.snapshot()


def restore_settings(saved: dict) -> None:
    """Put back the settings the controls change as `settings_now()` found them."""
    from bitguard.collectors import determinism

    determinism.restore(saved)


class user_settings:
    """`with user_settings():` gives back, on leaving, the settings a recording's determinism
    controls change and leave changed, so that the plain rounds after a recorded one run as the
    user's own script would (`saved`: the user's settings)."""

    def __enter__(self):
        self.saved = settings_now()
        return self

    def __exit__(self, *exc):
        restore_settings(self.saved)
        return False


def recorded(out: Path, mode: str, determinism: bool):
    """`bitguard.record(out, mode)` as a user's script gets it (determinism controls at bitguard's
    defaults unless `determinism` is False), the user's settings given back afterwards."""
    import contextlib

    import bitguard

    stack = contextlib.ExitStack()
    stack.user = stack.enter_context(user_settings())
    rec = stack.enter_context(bitguard.record(out, mode=mode, **({} if determinism else {"determinism": False})))
    stack.rec = rec
    return stack


def events_so_far(rec) -> int:
    """Events the recording has numbered (each step's are numbered at its optimizer step)."""
    return rec.collector._seq if rec.collector is not None else 0


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


def overhead(rounds: int, steps: int, model: str = "gpt", determinism: bool = True) -> dict:
    """Step times of the three modes, alternated round by round. The order of the modes turns each
    round (plain, full, trusted; then full, trusted, plain; ...) so that none always runs after
    another's close. Each round's ratio pairs a mode with the plain steps of the same round: on a
    shared machine whose speed drifts over minutes, that pairing is what the drift cancels out of,
    and the median over rounds is the headline figure (the ratio of all-steps medians is given too).
    A recorded round also counts its events (those of its timed steps, the first one's excluded):
    its overhead per event is (its median step - the round's plain median) / events per step."""
    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)  # warm the allocator and kernels
    modes = ("plain", "full", "trusted")
    times = {m: [] for m in modes}
    per_round = {"full": [], "trusted": []}  # each round's median against the same round's plain one
    per_event = {"full": [], "trusted": []}  # each round's overhead per recorded event, seconds
    events = {"full": [], "trusted": []}  # events per step, each round
    with tempfile.TemporaryDirectory() as tmp:
        # one throw-away recording pays the one-off costs (kernel compile, DuckDB load)
        with recorded(Path(tmp) / "warm", "trusted", determinism):
            timed_steps(net, opt, data, 1)
        for r in range(rounds):
            medians, counts = {}, {}
            for mode in modes[r % 3:] + modes[: r % 3]:
                if mode == "plain":
                    got = timed_steps(net, opt, data, steps)[1:]
                else:
                    with recorded(Path(tmp) / f"{mode}-{r}", mode, determinism) as rec:
                        got = timed_steps(net, opt, data, 1)
                        first = events_so_far(rec.rec)
                        got = timed_steps(net, opt, data, steps - 1)
                        counts[mode] = (events_so_far(rec.rec) - first) / (steps - 1)
                medians[mode] = statistics.median(got)
                times[mode] += got
            for mode in per_round:
                per_round[mode].append(medians[mode] / medians["plain"])
                events[mode].append(counts[mode])
                per_event[mode].append((medians[mode] - medians["plain"]) / counts[mode])
            # each round as it ends, on stderr: a run cut short still shows what it measured
            print(f"round {r + 1}/{rounds}: plain {medians['plain'] * 1000:.1f} ms, "
                  + ", ".join(f"{m} {per_round[m][-1]:.3f}x ({per_event[m][-1] * 1e6:.1f} us an event)"
                              for m in per_round), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in per_round.items()}
    return {"model": model, "determinism": determinism, "median_step_s": med,
            "samples": {k: len(v) for k, v in times.items()},
            "ratio_full": spread["full"]["median"], "ratio_trusted": spread["trusted"]["median"],
            "pooled_ratio_full": med["full"] / med["plain"], "pooled_ratio_trusted": med["trusted"] / med["plain"],
            "round_ratios": spread, "events_per_step": {k: statistics.median(v) for k, v in events.items()},
            "overhead_per_event_s": {k: statistics.median(v) for k, v in per_event.items()}}


def determinism_cost(rounds: int, steps: int, model: str = "gpt") -> dict:
    """What bitguard's determinism controls alone cost a plain step (no recording): plain steps with
    the user's settings, with the controls `bitguard record` applies by default
    (`determinism.apply`), and with those controls but torch's filling of uninitialised memory off
    (`torch.utils.deterministic.fill_uninitialized_memory`: with deterministic algorithms on,
    every tensor torch allocates uninitialised is first filled with NaN), alternated round by
    round (the order turning), medians of the round ratios against the same round's plain steps."""
    import torch

    from bitguard.collectors import determinism as det

    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)
    variants = ("plain", "controls", "controls, no fill")
    ratios = {v: [] for v in variants[1:]}
    medians_all = {v: [] for v in variants}
    fill = torch.utils.deterministic.fill_uninitialized_memory
    for r in range(rounds):
        medians = {}
        for v in variants[r % 3:] + variants[: r % 3]:
            with user_settings():
                if v != "plain":
                    det.apply(det.DeterminismConfig())
                    torch.utils.deterministic.fill_uninitialized_memory = v == "controls"
                try:
                    medians[v] = statistics.median(timed_steps(net, opt, data, steps)[1:])
                finally:
                    torch.utils.deterministic.fill_uninitialized_memory = fill
            medians_all[v].append(medians[v])
        for v in ratios:
            ratios[v].append(medians[v] / medians["plain"])
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{v} {medians[v] * 1000:.1f} ms" for v in variants),
              file=sys.stderr, flush=True)
    return {"model": model, "rounds": rounds, "steps": steps,
            "median_step_s": {v: statistics.median(x) for v, x in medians_all.items()},
            "ratio": {v: statistics.median(x) for v, x in ratios.items()},
            "round_ratios": {v: [min(x), max(x)] for v, x in ratios.items()}}


def hook_time(steps: int, model: str = "gpt", determinism: bool = True) -> dict:
    """Time spent inside the collector's hooks, in-process: every entry from torch into bitguard
    (`hooks.ENTRIES`: the module-call wrapper's enter and leave, the tensor and parameter gradient
    hooks, the guarded optimizer and other hooks; and the API recorder's guarded ones) is timed with
    `perf_counter_ns` and with the thread's CPU time (`thread_time_ns`: what another process's use of
    the cores does not add), outermost entries only (an entry made from inside another is in that
    one's time). Per step and per recorded event, medians over `steps`
    steps of one recording per mode and variant (the first step of each left out): with the
    digests, and with every digest the collectors take replaced by a constant, which leaves the
    Python (the cost per event the issue's target is about). The timer adds about 0.1 µs an entry.
    What it leaves out: the writer thread (it runs beside training, holding the GIL at times) and
    torch's own cost of calling a hook."""
    from bitguard.collectors import api_events, guarded, hooks, observation

    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    spent = [0, 0, 0]  # nanoseconds inside, nesting depth, thread CPU nanoseconds inside

    def timed(fn):
        def inside(*args, **kwargs):
            if spent[1]:
                return fn(*args, **kwargs)
            spent[1] = 1
            t, c = clock(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += clock() - t
                spent[2] += cpu() - c
                spent[1] = 0
        inside.__name__ = getattr(fn, "__name__", "hook")
        return inside

    # (code from before hooks.ENTRIES, run for a comparison, had these two entries and `_guarded` for the rest)
    entries = getattr(hooks, "ENTRIES", (hooks.Collector._enter, hooks.Collector._guarded))
    patched = {**{(hooks.Collector, f.__name__): getattr(hooks.Collector, f.__name__) for f in entries},
               (guarded.Guarded, "_guarded"): guarded.Guarded._guarded}
    digests = {(hooks, "digest_async"): hooks.digest_async, (observation, "digest_many"): observation.digest_many,
               (hooks, "digest_host_at"): hooks.digest_host_at, (api_events, "digest_many"): api_events.digest_many,
               (observation, "digest_async"): observation.digest_async}
    out = {}
    try:
        for (owner, attr), fn in patched.items():
            setattr(owner, attr, timed(fn))
        with tempfile.TemporaryDirectory() as tmp:
            for variant in ("digests", "python"):
                if variant == "python":
                    hooks.digest_async = observation.digest_async = lambda t: (0, 0)
                    hooks.digest_host_at = lambda address, nbytes: (0, 0)
                    observation.digest_many = api_events.digest_many = lambda ts: [(0, 0)] * len(ts)
                for mode in ("trusted", "full"):
                    per_step, per_event, counts, step_s, cpu_step, cpu_event = [], [], [], [], [], []
                    with recorded(Path(tmp) / f"{mode}-{variant}", mode, determinism) as rec:
                        timed_steps(net, opt, data, 1)
                        for _ in range(steps):
                            spent[0], spent[2], before = 0, 0, events_so_far(rec.rec)
                            step_s += timed_steps(net, opt, data, 1)
                            n = events_so_far(rec.rec) - before
                            per_step.append(spent[0] / 1e9)
                            per_event.append(spent[0] / 1e9 / n)
                            cpu_step.append(spent[2] / 1e9)
                            cpu_event.append(spent[2] / 1e9 / n)
                            counts.append(n)
                    out.setdefault(variant, {})[mode] = {
                        "hook_s_per_step": statistics.median(per_step), "hook_s_per_event": statistics.median(per_event),
                        "hook_cpu_s_per_step": statistics.median(cpu_step),
                        "hook_cpu_s_per_event": statistics.median(cpu_event),
                        "events_per_step": statistics.median(counts), "step_s": statistics.median(step_s)}
    finally:
        for (owner, attr), fn in {**patched, **digests}.items():
            setattr(owner, attr, fn)
    return {"model": model, "determinism": determinism, "steps": steps, **out}


def digest_bytes(steps: int, model: str = "gpt", determinism: bool = True) -> dict:
    """What a recorded step digests: every digest call the collectors make (the collector's tensor
    rows, the optimizer step's batch, the API recorder's params row) counted with its bytes and
    timed with `perf_counter_ns`, per source, and the bytes digested twice in a step (the same
    address, size and digest seen again: unchanged bytes read a second time). Medians over `steps`
    steps of one recording a mode. A row's digest served from the collector's version cache makes
    no call and is not counted."""
    from bitguard.collectors import api_events, hooks, observation

    clock = time.perf_counter_ns
    calls: list[tuple] = []  # (source, address, nbytes, digest, ns)

    def counted_at(fn):
        def at(address, nbytes):
            t = clock()
            d = fn(address, nbytes)
            calls.append(("rows", address, nbytes, d, clock() - t))
            return d
        return at

    def counted_async(fn):
        def one(t_):
            t = clock()
            d = fn(t_)
            # not a plain dense tensor at its own address: a view read in place (cuda/fingerprint.py's
            # mapped plan) or, where no plan applies, copied first (before 3b8c51b, every one was copied)
            calls.append(("rows (views, in place or copied)", 0, t_.nbytes, d, clock() - t))
            return d
        return one

    def counted_many(fn, source):
        def many(ts):
            t = clock()
            ds = fn(ts)
            share = (clock() - t) / max(1, len(ts))
            for x, d in zip(ts, ds):
                try:
                    address = x.data_ptr()
                except Exception:  # noqa: BLE001 - no storage: counted, never matched
                    address = 0
                calls.append((source, address, x.nbytes, d, share))
            return ds
        return many

    saved = {(hooks, "digest_host_at"): hooks.digest_host_at, (hooks, "digest_async"): hooks.digest_async,
             (observation, "digest_many"): observation.digest_many, (api_events, "digest_many"): api_events.digest_many}
    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)
    out = {}
    try:
        hooks.digest_host_at = counted_at(saved[(hooks, "digest_host_at")])
        hooks.digest_async = counted_async(saved[(hooks, "digest_async")])
        observation.digest_many = counted_many(saved[(observation, "digest_many")], "optimizer step")
        api_events.digest_many = counted_many(saved[(api_events, "digest_many")], "params row")
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("trusted", "full"):
                per: dict[str, list] = {}
                with recorded(Path(tmp) / mode, mode, determinism):
                    timed_steps(net, opt, data, 1)
                    for _ in range(steps):
                        calls.clear()
                        timed_steps(net, opt, data, 1)
                        step: dict[str, list] = {}
                        first: dict[tuple, str] = {}  # (address, size, digest) -> where it was read first
                        for source, address, nbytes, d, ns in calls:
                            s = step.setdefault(source, [0, 0, 0])
                            s[0], s[1], s[2] = s[0] + 1, s[1] + nbytes, s[2] + ns
                            key = (address, nbytes, d)
                            if address and key in first:  # the same bytes, unchanged, read again
                                s = step.setdefault(f"read again: {first[key]}, then {source}", [0, 0, 0])
                                s[0], s[1] = s[0] + 1, s[1] + nbytes
                            elif address:
                                first[key] = source
                        for k, v in step.items():
                            per.setdefault(k, []).append(v)
                out[mode] = {k: {"calls": statistics.median(x[0] for x in v), "bytes": statistics.median(x[1] for x in v),
                                 "s": statistics.median(x[2] for x in v) / 1e9} for k, v in per.items()}
    finally:
        for (owner, attr), fn in saved.items():
            setattr(owner, attr, fn)
    return {"model": model, "steps": steps, **out}


def breakdown(rounds: int, steps: int, model: str = "gpt", determinism: bool = True, mode: str = "trusted") -> dict:
    """Where a recorded mode's overhead goes: the same alternation as `overhead` (the order of the
    variants turning each round), with the recording also run with one part switched off at a time:
    the API recorder (collectors/api_events.py: its wrappers, step hook and per-step params row),
    the writer thread's work (every batch dropped instead of journaled), every digest the
    collectors take (replaced by a constant: what is left is Python and hooks), and rows and events
    too (what is left is the hooks firing: dispatch, frames, registering gradient hooks, RNG
    checks); and the plain step with the determinism controls alone. Each variant's cost is its
    round's median step less the same round's plain median; medians over rounds. A part's share is
    the recorded mode's cost less the variant's."""
    from bitguard.collectors import api_events, hooks, observation, store
    from bitguard.schema import TENSORS

    original = {"digest_async": hooks.digest_async, "digest_many": observation.digest_many,
                "digest_host_at": hooks.digest_host_at, "api_digest_many": api_events.digest_many,
                "obs_digest_async": observation.digest_async, "_row": hooks.Collector._row,
                "_emit": hooks.Collector._emit, "ApiRecorder": hooks.ApiRecorder, "_write": store.RankStore._write}

    class NoApi:
        """What the Collector installs in place of the API recorder: nothing."""

        def __init__(self, *args):
            pass

        def install(self):
            return self

        def remove(self):
            pass

        def root_forward(self, module, name, digested=None):
            pass

    def variant(name: str) -> None:
        hooks.digest_async, observation.digest_many = original["digest_async"], original["digest_many"]
        hooks.digest_host_at, api_events.digest_many = original["digest_host_at"], original["api_digest_many"]
        observation.digest_async = original["obs_digest_async"]
        hooks.Collector._row, hooks.Collector._emit = original["_row"], original["_emit"]
        hooks.ApiRecorder, store.RankStore._write = original["ApiRecorder"], original["_write"]
        if name in ("no digests", "hooks only"):
            hooks.digest_async = observation.digest_async = lambda t: (0, 0)
            hooks.digest_host_at = lambda address, nbytes: (0, 0)
            observation.digest_many = api_events.digest_many = lambda ts: [(0, 0)] * len(ts)
        if name == "hooks only":
            width = len(TENSORS.names)  # a row as wide as the schema's (a stub row narrower fails later reads)
            hooks.Collector._row = lambda self, t, role, idx, path, digest=None: (
                [0, role, idx, path, [], "", [], 0, 0, 0, 0, 0] + [None] * (width - 12))
            hooks.Collector._emit = lambda self, *args, **kwargs: None
        if name == "no API recorder":
            hooks.ApiRecorder = NoApi
        if name == "no writer":
            store.RankStore._write = lambda self, *args, **kwargs: None

    net, opt, data = build(model=model)
    timed_steps(net, opt, data, 2)
    names = ("plain", mode, "no API recorder", "no writer", "no digests", "hooks only", "controls only")
    cost = {name: [] for name in names[1:]}
    medians_all = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        with recorded(Path(tmp) / "warm", mode, determinism):
            timed_steps(net, opt, data, 1)
        for r in range(rounds):
            medians = {}
            for name in names[r % len(names):] + names[: r % len(names)]:
                if name in ("plain", "controls only"):
                    with user_settings():
                        if name == "controls only":
                            from bitguard.collectors import determinism as det

                            det.apply(det.DeterminismConfig())
                        medians[name] = statistics.median(timed_steps(net, opt, data, steps)[1:])
                    continue
                variant(name)
                try:
                    with recorded(Path(tmp) / f"{name}-{r}", mode, determinism):
                        medians[name] = statistics.median(timed_steps(net, opt, data, steps)[1:])
                finally:
                    variant(mode)
            for name in names:
                medians_all[name].append(medians[name])
                if name != "plain":
                    cost[name].append(medians[name] - medians["plain"])
            print(f"round {r + 1}/{rounds}: plain {medians['plain'] * 1000:.1f} ms, "
                  + ", ".join(f"{n} {cost[n][-1] * 1000:+.1f}" for n in names[1:]), file=sys.stderr, flush=True)
    return {"model": model, "mode": mode, "determinism": determinism, "rounds": rounds, "steps": steps,
            "median_step_s": {k: statistics.median(v) for k, v in medians_all.items()},
            "cost_s": {k: statistics.median(v) for k, v in cost.items()},
            "cost_range_s": {k: [min(v), max(v)] for k, v in cost.items()}}


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
    peak_queue, stores = 0, []
    original_push = store.RankStore._push

    def push(self, marker=None):
        nonlocal peak_queue
        peak_queue = max(peak_queue, self._queue.qsize())
        if not stores:
            stores.append(self)
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
        peak, peak_step, folder_peak = base, 0, 0.0
        with bitguard.record(Path(tmp) / "long", determinism=False):
            for i in range(steps):
                step(model, opt, data)
                now = rss_mib()  # every step: the writer's folds and DuckDB's checkpoints make a sawtooth
                if now > peak:
                    peak, peak_step = now, i
                if stores:  # the fold process (collectors/folder.py): its memory is the recording's too
                    folder_peak = max(folder_peak, peak_rss_of(stores[0].folder_pid))
                if i in (20, steps // 8, steps // 4, steps // 2, steps - 1):
                    samples[i] = now
        size = sum(p.stat().st_size for p in (Path(tmp) / "long").iterdir()) / 2**20
    store.RankStore._push = original_push
    first, last = samples[20], samples[steps - 1]
    return {"steps": steps, "rss_before_recording_mib": base, "rss_at_step_mib": samples,
            "growth_step20_to_end_mib": last - first, "extra_over_plain_at_end_mib": last - base,
            "max_extra_over_plain_mib": peak - base, "max_at_step": peak_step,
            "rss_plain_steady_mib": base, "libraries_mib": base - before_libraries,
            "peak_queue_batches": peak_queue, "run_dir_mib": size, "fold_process_peak_rss_mib": folder_peak,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _team_text(t: dict) -> list[str]:
    low, high = t["difference_quartiles_s"]
    return [f"trusted step, {t['pairs']} pairs: digests on torch's OpenMP team {t['median_team_s'] * 1000:.1f} ms, "
            f"on the calling thread alone {t['median_alone_s'] * 1000:.1f} ms (medians); median difference "
            f"{t['median_difference_s'] * 1000:+.2f} ms (quartiles {low * 1000:+.2f} to {high * 1000:+.2f} ms)"]


def _determinism_text(model: str, d: dict) -> list[str]:
    out = []
    for v, sec in d["median_step_s"].items():
        ratio = d["ratio"].get(v)
        out.append(f"{model} {v:18s} median step {sec * 1000:6.1f} ms"
                   + (f"   round by round: median {ratio:.3f}x ({d['round_ratios'][v][0]:.3f}-"
                      f"{d['round_ratios'][v][1]:.3f}x)" if ratio else ""))
    return out


def _hook_text(model: str, h: dict) -> list[str]:
    out = []
    for variant, what in (("digests", "with digests"), ("python", "digests stubbed")):
        for mode in ("trusted", "full"):
            m = h[variant][mode]
            out.append(f"{model} {mode:8s} {what:16s} step {m['step_s'] * 1000:6.1f} ms, inside the hooks "
                       f"{m['hook_s_per_step'] * 1000:6.2f} ms a step, {m['events_per_step']:.0f} events a step: "
                       f"{m['hook_s_per_event'] * 1e6:5.2f} us an event; thread CPU {m['hook_cpu_s_per_step'] * 1000:6.2f} ms, "
                       f"{m['hook_cpu_s_per_event'] * 1e6:5.2f} us an event (medians of {h['steps']} steps)")
    return out


def _bytes_text(b: dict) -> list[str]:
    out = []
    for mode in ("trusted", "full"):
        parts = b[mode]
        read = {k: v for k, v in parts.items() if not k.startswith("read again")}
        total, spent = sum(v["bytes"] for v in read.values()), sum(v["s"] for v in read.values())
        out.append(f"{b['model']} {mode}: {total / 1e6:.1f} MB digested a step in {spent * 1000:.2f} ms "
                   f"({total / spent / 1e9 if spent else 0:.1f} GB/s; medians of {b['steps']} steps)")
        for k, v in parts.items():
            rate = f", {v['s'] * 1000:6.2f} ms, {v['bytes'] / v['s'] / 1e9:5.1f} GB/s" if v["s"] else ""
            out.append(f"  {k:44s} {v['calls']:5.0f} tensors {v['bytes'] / 1e6:7.1f} MB{rate}")
    return out


def _breakdown_text(b: dict) -> list[str]:
    plain = b["median_step_s"]["plain"]
    out = [f"{b['model']} {b['mode']}, {b['rounds']} rounds of {b['steps']} steps; plain step {plain * 1000:.1f} ms; "
           f"each variant's cost over the plain step of its round (median, min-max over rounds):"]
    for name, sec in b["cost_s"].items():
        low, high = b["cost_range_s"][name]
        out.append(f"  {name:16s} {sec * 1000:+7.1f} ms ({low * 1000:+.1f} to {high * 1000:+.1f})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=20,
                   help="steps per round and mode (the first is dropped; 20 steps span a journal fold)")
    p.add_argument("--memory-steps", type=int, default=600)
    p.add_argument("--json", action="store_true")
    p.add_argument("--breakdown", action="store_true",
                   help="only split trusted mode's overhead by switching parts off: the API recorder, the writer, digests, "
                        "rows and events; and the determinism controls alone")
    p.add_argument("--team-pairs", type=int, default=0, metavar="N",
                   help="only compare trusted steps with digests on torch's OpenMP team and without, in N pairs")
    p.add_argument("--model", choices=MODELS, default="gpt",
                   help="gpt: the project's tiny GPT; modules: the same sizes in more and smaller modules, dropout 0.1")
    p.add_argument("--no-determinism", dest="determinism", action="store_false",
                   help="record with the determinism controls off (default: bitguard record's defaults)")
    p.add_argument("--hook-time", type=int, default=0, metavar="N",
                   help="only time the inside of the collector's hooks over N steps of each recorded mode")
    p.add_argument("--digest-bytes", type=int, default=0, metavar="N",
                   help="only count the bytes each recorded mode digests a step, by source, over N steps")
    p.add_argument("--determinism-cost", action="store_true",
                   help="only time plain steps with and without bitguard's determinism controls (no recording)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="only measure the steady state: one recording a mode, N rounds of a recorded and a paused block "
                        "(recording_steady.py)")
    p.add_argument("--hook-split", type=int, default=0, metavar="N",
                   help="only split the hooks' Python by hook and helper over N recorded steps (hook_split.py; "
                        "with --split-mode)")
    p.add_argument("--split-mode", choices=("trusted", "full"), default="trusted", help="with --hook-split and --mapped-ab: the mode")
    p.add_argument("--mapped-ab", type=int, default=0, metavar="N",
                   help="only compare, in one recording (--split-mode), views digested in place against copied first, "
                        "N rounds (recording_steady.py)")
    p.add_argument("--before", metavar="DIR",
                   help="with --paired: also run an older bitguard (an export, benchmarks/export_commit.py), each run "
                        "a fresh Python, alternated with this checkout's run by run (recording_ab.py)")
    p.add_argument("--ab-runs", type=int, default=4, metavar="K", help="with --before: pairs of runs")
    p.add_argument("--block", type=int, default=4, help="with --paired: steps a block (the first is dropped)")
    p.add_argument("--warmup", type=int, default=12, help="with --paired: recorded steps before the first round")
    p.add_argument("--no-folds", action="store_true",
                   help="the rank store folds its journal only when the recording ends (what the folds every 5 s cost: "
                        "alternate processes with and without this)")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    if args.no_folds:
        from bitguard.collectors import store

        store.FOLD_SECONDS, store.FOLD_BYTES = float("inf"), 1 << 62

    if args.hook_split:
        import hook_split

        doc = hook_split.split(args.hook_split, args.model, args.split_mode, args.determinism)
        print(json.dumps(doc, indent=2) if args.json else "\n".join(hook_split.text(doc)))
        return
    if args.mapped_ab:
        import recording_steady

        doc = recording_steady.mapped_ab(args.mapped_ab, args.block, args.warmup, args.model, args.split_mode,
                                         args.determinism)
        print(json.dumps(doc, indent=2) if args.json else "\n".join(recording_steady.ab_text(doc)))
        return
    if args.before and not args.paired:
        raise SystemExit("--before needs --paired N: the A/B runs are steady-state runs")
    if args.before:
        import recording_ab

        doc = recording_ab.ab(args.before, args.ab_runs, args.paired, args.block, args.warmup, args.model,
                              args.determinism)
        print(json.dumps(doc, indent=2) if args.json else "\n".join(recording_ab.text(doc)))
        return
    if args.paired:
        import recording_steady

        doc = recording_steady.steady(args.paired, args.block, args.warmup, args.model, args.determinism)
        print(json.dumps(doc, indent=2) if args.json else "\n".join(recording_steady.text(doc)))
        return

    if args.memory_only:
        print(json.dumps(memory(args.memory_steps)))
        return
    for wanted, run, text in ((args.team_pairs, lambda: team_pairs(args.team_pairs), _team_text),
                              (args.determinism_cost, lambda: determinism_cost(args.rounds, args.steps, args.model),
                               partial(_determinism_text, args.model)),
                              (args.hook_time, lambda: hook_time(args.hook_time, args.model, args.determinism),
                               partial(_hook_text, args.model)),
                              (args.digest_bytes, lambda: digest_bytes(args.digest_bytes, args.model, args.determinism),
                               _bytes_text),
                              (args.breakdown, lambda: breakdown(args.rounds, args.steps, args.model, args.determinism),
                               _breakdown_text)):
        if wanted:  # one of the separate measurements instead of the overhead run
            doc = run()
            print(json.dumps(doc, indent=2) if args.json else "\n".join(text(doc)))
            return
    # memory in a fresh process, so that nothing the overhead runs allocated or freed blurs it
    mem = None
    if args.memory_steps > 0:
        mem = subprocess.run([sys.executable, __file__, "--memory-only", "--memory-steps", str(args.memory_steps)],
                             capture_output=True, text=True, check=True)
    result = {"torch_threads": torch.get_num_threads(), "overhead": overhead(args.rounds, args.steps, args.model, args.determinism),
              "startup": startup(), "memory": json.loads(mem.stdout.strip().splitlines()[-1]) if mem else None}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o, s, m = result["overhead"], result["startup"], result["memory"]
    print(f"{o['model']} GPT 6x256, seq 128, batch 8, {result['torch_threads']} threads; "
          f"{o['samples']['plain']} steps a mode; determinism controls "
          f"{'at bitguard defaults' if o['determinism'] else 'off'} when recorded")
    for mode in ("plain", "full", "trusted"):
        ratio = o["median_step_s"][mode] / o["median_step_s"]["plain"]
        spread = o["round_ratios"].get(mode)
        rounds = (f"   round by round: median {spread['median']:.3f}x ({spread['min']:.3f}-{spread['max']:.3f}x); "
                  f"{o['events_per_step'][mode]:.0f} events a step, "
                  f"{o['overhead_per_event_s'][mode] * 1e6:.1f} us an event" if spread else "")
        print(f"  {mode:8s} median step {o['median_step_s'][mode] * 1000:6.1f} ms ({ratio:5.3f}x){rounds}")
    print(f"start-up: import torch {s['python_import_torch_s']:.2f} s; + bitguard and a recording "
          f"{s['import_bitguard_and_open_recording_s']:.2f} s (one-off cost {s['startup_cost_s']:.2f} s)")
    if m is None:
        return
    print(f"memory over {m['steps']} recorded steps (small GPT): RSS over the plain steady state at most "
          f"{m['max_extra_over_plain_mib']:.1f} MiB (step {m['max_at_step']}), at the end "
          f"{m['extra_over_plain_at_end_mib']:.1f} MiB; growth step 20 -> end "
          f"{m['growth_step20_to_end_mib']:.1f} MiB; peak writer queue "
          f"{m['peak_queue_batches']} batches; run dir {m['run_dir_mib']:.1f} MiB; the fold process's peak RSS "
          f"{m.get('fold_process_peak_rss_mib', 0.0):.1f} MiB (0: it did not start)")
    print("  RSS by recorded step (MiB): " + ", ".join(f"{k}: {v:.0f}" for k, v in m["rss_at_step_mib"].items())
          + f"; plain steady state with the libraries loaded {m['rss_plain_steady_mib']:.0f} "
          f"(loading DuckDB, Arrow and the compiled kernels: {m['libraries_mib']:.0f} MiB, once)")


if __name__ == "__main__":
    main()
