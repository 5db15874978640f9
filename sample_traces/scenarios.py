"""The localisation scenarios: reference/suspect training pairs with their true root cause.

Each `Scenario` is two runs of one script in this folder (tinygpt.py or hf_train.py) that
differ by one injected fault, the place where that fault truly is (`root_cause`, in words), and
the first divergence a correct localisation reports (`expected`): the step, phase, boundary,
blame and fault class, plus the blame window where the pivot is a consumer. `located` says how
that pivot relates to the root cause: `exact` when the faulty operation is itself an observed
boundary, `first-consumer` when it is code between boundaries (a functional op, an RNG draw)
and the best any boundary-level tool can do is its first observed consumer. `consumers` lists
the first observed consumers of a boundary-level fault: an analysis that lands there (say, a
weaker fingerprint that misses the faulty output itself) located the fault's first consumer.
Benign scenarios have `expected=None`: with their rules file the pair must compare identical.

This module is the catalogue and a small command line; it records nothing itself
(recordings.py does) and compares nothing (evaluation.py does):

    python -m bitguard.sample_traces.scenarios list [--json]
    python -m bitguard.sample_traces.scenarios record NAME [NAME...] --out DIR [--dump] [--no-determinism]
    python -m bitguard.sample_traces.scenarios demo [--out sample_traces/demo]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bitguard.sample_traces.recordings import HERE, Job, run_jobs


def _rope_consumer() -> str:
    """The first module boundary the rope fault's rounded cos/sin reach. transformers 5.25 and later,
    with `kernels` installed (a dependency since 5.25), turn apply_rotary_pos_emb into an nn.Module
    (kernels' `Func`, replaceable by a hub kernel) whose call inside self_attn dispatches to the
    attention's own `Func` instance: the rounded inputs first reach that inner module
    (`self_attn.<Func>.<Func>`, unregistered modules named by their class). Before, the function
    is plain Python and the first module they reach is o_proj. Read from the installed versions
    (importing transformers here would cost every import of the catalogue seconds)."""
    from importlib import metadata, util

    try:
        major, minor = (int(part) for part in metadata.version("transformers").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return "model.layers.0.self_attn.o_proj"
    if (major, minor) >= (5, 25) and util.find_spec("kernels") is not None:
        return "model.layers.0.self_attn.<Func>.<Func>"
    return "model.layers.0.self_attn.o_proj"

TINY = ("--steps", "3")  # tinygpt defaults: 2 layers, width 32, 4 heads, 16 tokens, batch 4


@dataclass(frozen=True)
class Site:
    step: int  # training step
    phase: str  # forward | backward | optimizer | data
    boundary: str  # dotted module path, or parameter name for grad and optimizer events


@dataclass(frozen=True)
class Expected:
    step: int  # training step of the first divergence
    phase: str  # forward | backward | optimizer | data
    kind: str  # module | grad | step | batch
    boundary: str  # the pivot's boundary
    blame: str  # source | consumer | data
    fault_class: str  # forward | backward | accumulation | optimizer | data
    window: str | None = None  # blame window module (consumer blames and parameter gradients)

    @property
    def site(self) -> Site:
        return Site(self.step, self.phase, self.boundary)


@dataclass(frozen=True)
class Scenario:
    name: str  # short id, also the folder name of its recordings
    shows: str  # one line: what the scenario demonstrates
    root_cause: str  # where the fault truly is, in the code
    script: str  # tinygpt.py | hf_train.py
    reference: tuple[str, ...]  # the reference run's arguments
    suspect: tuple[str, ...]  # the suspect run's arguments
    expected: Expected | None  # the pivot a correct localisation reports; None: must compare identical
    located: str = "exact"  # exact | first-consumer: how `expected` relates to the root cause
    consumers: tuple[Site, ...] = ()  # first observed consumers of a boundary-level fault
    rules: str | None = None  # rules file in sample_traces/ that the comparison uses
    reruns_differ: bool = False  # the suspect is nondeterministic: two recordings of it differ
    probes: tuple[str, ...] = ("GPT", "lm_head.weight")  # the few-probes ablation: boundaries kept

    def jobs(self, folder: Path, **options) -> tuple[Job, Job]:
        return (Job(self.script, self.reference, str(folder / "reference"), **options),
                Job(self.script, self.suspect, str(folder / "suspect"), **options))

    @property
    def rules_path(self) -> Path | None:
        return None if self.rules is None else HERE / self.rules


def _tiny(*args: str) -> tuple[str, ...]:
    return (*TINY, *args)


def _fault(name: str, *args: str) -> tuple[str, ...]:
    return _tiny("--fault", name, "--fault-step", "1", *args)


_F, _B, _O, _D = "forward", "backward", "optimizer", "data"

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "forward-bitflip", "a one-bit corruption inside a module's forward is pinned to that module",
        "blocks.1.mlp.fc's forward output, element 3, bit 7 flipped from step 1 on",
        "tinygpt.py", _tiny(), _fault("forward-bitflip", "--fault-layer", "1"),
        Expected(1, _F, "module", "blocks.1.mlp.fc", "source", "forward"),
        consumers=(Site(1, _F, "blocks.1.mlp.act"),)),
    Scenario(
        "functional", "a fault in a functional op between modules lands on its first consumer, with a window",
        "residual_add() in Block.forward of blocks.0, between blocks.0.attn and blocks.0.ln_2",
        "tinygpt.py", _tiny(), _fault("functional"),
        Expected(1, _F, "module", "blocks.0.ln_2", "consumer", "forward", window="blocks.0"),
        located="first-consumer"),
    Scenario(
        "backward", "a wrong backward is blamed on the module whose gradient output is wrong",
        "the gradient blocks.1.attn.proj sends back to its input, one bit flipped from step 1 on",
        "tinygpt.py", _tiny(), _fault("backward", "--fault-layer", "1"),
        Expected(1, _B, "module", "blocks.1.attn.proj", "source", "backward"),
        consumers=(Site(1, _B, "blocks.1.attn.drop"), Site(1, _B, "blocks.1.attn.qkv"))),
    Scenario(
        "embedding-race", "a racy embedding backward (the paper's motivating case) is caught at its first step",
        "the token embedding's weight gradient: two rows mixed, as a racy scatter-add would, from step 1 on",
        "tinygpt.py", _tiny(), _fault("embedding-race"),
        Expected(1, _B, "grad", "wte.weight", "source", "backward", window="wte"),
        consumers=(Site(1, _O, "wte.weight"),)),
    Scenario(
        "grad-accum", "a missed zero_grad() is told apart from a wrong gradient: accumulation",
        "the training loop skips optimizer.zero_grad() from step 1 on; lm_head.weight's .grad is the first "
        "to accumulate",
        "tinygpt.py", _tiny(), _fault("grad-accum"),
        Expected(1, _B, "grad", "lm_head.weight", "source", "accumulation", window="lm_head.weight"),
        consumers=(Site(1, _O, "lm_head.weight"),)),
    Scenario(
        "optimizer", "a wrong update of one parameter is blamed on the optimizer, for that parameter",
        "optimizer.step() scales lm_head.weight by 1.0001 from step 1 on (a post-step hook)",
        "tinygpt.py", _tiny(), _fault("optimizer"),
        Expected(1, _O, "step", "lm_head.weight", "source", "optimizer", window="lm_head.weight"),
        consumers=(Site(2, _F, "lm_head"),)),
    Scenario(
        "data", "a changed batch is blamed on the data, not on the model",
        "one token of the batch of step 1 differs",
        "tinygpt.py", _tiny(), _fault("data"),
        Expected(1, _D, "batch", "GPT", "data", "data"),
        consumers=(Site(1, _F, "wte"),)),
    Scenario(
        "data-order", "a changed batch order is blamed on the data",
        "the batches from step 1 on come in another order",
        "tinygpt.py", _tiny(), _fault("data-order"),
        Expected(1, _D, "batch", "GPT", "data", "data"),
        consumers=(Site(1, _F, "wte"),)),
    Scenario(
        "rng-shift", "one extra RNG draw shifts every dropout mask: the step's RNG state is blamed",
        "the training loop draws torch.rand(1) before step 1: the RNG stream, not a tensor, is wrong; the data "
        "event records the RNG state each step starts from, so the pivot is step 1's data event (blame data, "
        "fault class rng); the first module to consume it is the embedding dropout",
        "tinygpt.py", _tiny("--dropout", "0.1"), _fault("rng-shift", "--dropout", "0.1"),
        Expected(1, _D, "batch", "GPT", "data", "rng"), consumers=(Site(1, _F, "drop"),)),
    Scenario(
        "bf16-variance", "a low-precision normalization (variance in bf16) is pinned to the first LayerNorm",
        "every LayerNorm computes its variance in bf16 from step 1 on; blocks.0.ln_1 runs first",
        "tinygpt.py", _tiny(), _fault("bf16-variance"),
        Expected(1, _F, "module", "blocks.0.ln_1", "source", "forward"),
        consumers=(Site(1, _F, "blocks.0.attn.qkv"),)),
    Scenario(
        "nondeterministic", "a nondeterministic kernel is exposed, not hidden: reruns of the suspect differ",
        "blocks.0.mlp.fc adds its split-K partial products in an order drawn on every call, from step 1 on",
        "tinygpt.py", _tiny(), _fault("nondeterministic"),
        Expected(1, _F, "module", "blocks.0.mlp.fc", "source", "forward"),
        consumers=(Site(1, _F, "blocks.0.mlp.act"),), reruns_differ=True),
    Scenario(
        "swap", "two swapped elements: invisible to XOR, seen by the order-sensitive digest",
        "blocks.0.attn.qkv's output: two query elements of token 1 swapped, from step 1 on",
        "tinygpt.py", _tiny(), _fault("swap"),
        Expected(1, _F, "module", "blocks.0.attn.qkv", "source", "forward"),
        consumers=(Site(1, _F, "blocks.0.attn.drop"), Site(1, _F, "blocks.0.attn.proj"))),
    Scenario(
        "double-flip", "two flips of the same bit in two words cancel under XOR; pos still sees them",
        "blocks.0.attn.qkv's output: bit 4 flipped in two query elements of token 1, from step 1 on",
        "tinygpt.py", _tiny(), _fault("double-flip"),
        Expected(1, _F, "module", "blocks.0.attn.qkv", "source", "forward"),
        consumers=(Site(1, _F, "blocks.0.attn.drop"), Site(1, _F, "blocks.0.attn.proj"))),
    Scenario(
        "benign-dropout", "a structural change with equal values is accepted by an allow-gap rule",
        "GELU of blocks.0.mlp wrapped in Sequential(GELU, Dropout(p=0)): extra modules, the same values",
        "tinygpt.py", _tiny(), _fault("benign-dropout"), None, rules="rules-benign-dropout.json"),
    Scenario(
        "benign-probe", "a difference in a value training never uses is accepted by an ignore rule",
        "the activation-statistics probe (model.stats, logging only) computes in bf16 from step 1 on",
        "tinygpt.py", _tiny("--probe"), _fault("benign-probe", "--probe"), None, rules="rules-benign-probe.json"),
    Scenario(
        "hf-gpt2-bitflip", "a model nobody here wrote (transformers GPT-2, random init): a bit flip in a Conv1D",
        "transformer.h.1.mlp.c_fc's forward output, element 5, bit 6 flipped from step 1 on",
        "hf_train.py", ("--model", "gpt2", "--steps", "3"),
        ("--model", "gpt2", "--steps", "3", "--fault", "mlp-bitflip", "--fault-layer", "1", "--fault-step", "1"),
        Expected(1, _F, "module", "transformer.h.1.mlp.c_fc", "source", "forward"),
        consumers=(Site(1, _F, "transformer.h.1.mlp.act"),),
        probes=("GPT2LMHeadModel", "transformer.wte.weight")),
    Scenario(
        "hf-llama-rope", "transformers Llama (random init): a low-precision function inside third-party attention",
        "apply_rotary_pos_emb() inside LlamaAttention.forward (between k_proj/v_proj and o_proj) rotates with "
        "bf16-rounded cos/sin from step 1 on",
        "hf_train.py", ("--model", "llama", "--steps", "3"),
        ("--model", "llama", "--steps", "3", "--fault", "rope-bf16", "--fault-step", "1"),
        Expected(1, _F, "module", _rope_consumer(), "consumer", "forward", window="model.layers.0.self_attn"),
        located="first-consumer", probes=("LlamaForCausalLM", "lm_head.weight")),
)}

# The pair committed under sample_traces/demo/ (small: one layer, three steps): the paper's
# motivating case, a racy embedding backward.
DEMO = Scenario(
    "demo", "the demo pair: a racy embedding backward in a one-layer GPT",
    "the token embedding's weight gradient: two rows mixed at step 1",
    "tinygpt.py", ("--steps", "3", "--layers", "1"),
    ("--steps", "3", "--layers", "1", "--fault", "embedding-race", "--fault-step", "1"),
    Expected(1, _B, "grad", "wte.weight", "source", "backward", window="wte"),
    consumers=(Site(1, _O, "wte.weight"),))


def get(names: list[str] | None) -> list[Scenario]:
    """The named scenarios in catalogue order (all when `names` is empty)."""
    if not names:
        return list(SCENARIOS.values())
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        from bitguard.errors import BadInput

        raise BadInput(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    return [SCENARIOS[n] for n in names]


def manifest() -> list[dict]:
    """The catalogue as JSON-ready dicts (what `list --json` prints)."""
    return [asdict(s) | {"rules_file": s.rules and f"sample_traces/{s.rules}"} for s in SCENARIOS.values()]


def record(names: list[str], out: Path, dump: bool = False, determinism: bool = True, workers: int = 2) -> int:
    """Record reference and suspect of each named scenario under OUT/NAME/; print how to compare them."""
    scenarios = get(names)
    jobs = [j for s in scenarios for j in s.jobs(out / s.name, dump=dump, determinism=determinism)]
    failed = 0
    for outcome in run_jobs(jobs, workers=workers, reuse=False):
        status = "ok" if outcome.exit_status == 0 else f"FAILED (exit {outcome.exit_status})"
        print(f"{outcome.job.shell()}  [{status}, {outcome.seconds:.1f} s]")
        if outcome.exit_status:
            failed += 1
            print(outcome.log, file=sys.stderr)
    for s in scenarios:
        rules = f" --rules {s.rules_path}" if s.rules else ""
        print(f"compare {s.name}: bitguard compare {out / s.name / 'reference'} {out / s.name / 'suspect'}{rules}")
    return 1 if failed else 0


def record_demo(out: Path) -> int:
    """Re-record the committed demo pair (replaces OUT/reference and OUT/suspect).

    Recorded as a user would, with `bitguard record` from the repository root (so its stacks
    name sample_traces/tinygpt.py), then each rank file is rewritten with 16 KiB DuckDB blocks
    (COPY FROM DATABASE: the same tables and rows) because a tiny run in default 256 KiB blocks
    is 1.3 MB of mostly empty space."""
    import os
    import subprocess

    root = HERE.parent
    for job in DEMO.jobs(out.resolve()):
        shutil.rmtree(job.out, ignore_errors=True)
        cmd = [sys.executable, "-m", "bitguard", "record", "--out", job.out, "--",
               f"sample_traces/{job.script}", *job.args]
        proc = subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            return proc.returncode
        compact(Path(job.out) / "rank-0.duckdb")
        print(f"recorded {job.out}: {job.shell()}")
    return 0


def compact(rank_file: Path, block_size: int = 16384) -> None:
    """Rewrite a rank file with small DuckDB blocks; tables and rows are copied unchanged."""
    import duckdb

    tmp = rank_file.with_suffix(".compact")
    tmp.unlink(missing_ok=True)
    from bitguard.db import SAFE_CONFIG

    con = duckdb.connect(config=dict(SAFE_CONFIG))
    try:  # paths as parameters, never inside the SQL text
        con.execute("ATTACH ? AS src (READ_ONLY)", [str(rank_file)])
        con.execute(f"ATTACH ? AS dst (BLOCK_SIZE {int(block_size)})", [str(tmp)])
        con.execute("COPY FROM DATABASE src TO dst")
    finally:
        con.close()
    tmp.replace(rank_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bitguard.sample_traces.scenarios",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="print the catalogue")
    p.add_argument("--json", action="store_true", help="the full manifest as JSON")
    p = sub.add_parser("record", help="record reference and suspect of scenarios under OUT/NAME/")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dump", action="store_true", help="bitguard record --dump (for the sum and tolerance ablations)")
    p.add_argument("--no-determinism", dest="determinism", action="store_false")
    p = sub.add_parser("demo", help="re-record the committed demo pair")
    p.add_argument("--out", type=Path, default=HERE / "demo")
    args = parser.parse_args(argv)
    from bitguard.errors import BitguardError

    try:
        if args.cmd == "list":
            if args.json:
                print(json.dumps(manifest(), indent=2))
            else:
                for s in SCENARIOS.values():
                    e = s.expected
                    where = "identical (benign)" if e is None else f"step {e.step} {e.phase} {e.boundary} ({e.blame})"
                    print(f"{s.name:18} {where:58} {s.shows}")
            return 0
        if args.cmd == "record":
            return record(args.names, args.out, args.dump, args.determinism)
        return record_demo(args.out)
    except BitguardError as exc:
        print(f"scenarios: error: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
