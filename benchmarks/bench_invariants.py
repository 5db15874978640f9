"""The invariants evaluation of issue 17 (docs/INVARIANTS.md): inference on five clean pipelines,
false alarms on clean programs, detection latency on buggy ones, bitwise compare on the same bugs,
and the cost of `record --check`.

Every program is sample_traces/invariant_programs.py with some flags, recorded by `bitguard
record` in a subprocess (two at a time; DDP programs under torchrun, 2 ranks on gloo):
- INFER: the clean pipelines invariants are inferred from (`bitguard invariants infer`): the tiny
  GPT, GPT-2, Llama, an MLP and a 2-rank DDP MLP, with the features the checks need (clipping,
  schedules, a frozen layer, accumulation, tying, dropout, bf16) spread over them;
- CLEAN: programs not used for inference, varying model, optimizer, schedule, batch size,
  precision and world size; each is checked offline (`bitguard invariants check --json`): one
  with any violation is a false alarm;
- BUGGY: one bug of the corpus each (`--bug NAME`, active from step 2), on the flags of a CLEAN
  program (its bitwise reference), recorded with `--check inv.json` (online) and checked offline.
  Detected within one step: the first violation at step 2 or 3; a violation before step 2 is a
  false alarm in a buggy run, counted apart. `bitguard compare REFERENCE BUGGY --json` gives the
  bitwise verdict and its first divergent step.
- Overhead: the bench-size GPT of bench_recording.py (6 layers, width 256), recorded in-process
  with and without `check=`, alternated round by round; each round's ratio pairs the two of that
  round; medians. The machine is shared by other workers: the figures are noisy, say so.

    python benchmarks/bench_invariants.py [--out DIR] [--jobs 2] [--rounds 6] [--steps 6] [--no-overhead] [--reuse] [--json]

Nothing here tunes the corpus to the engine: a miss is reported with the invariant it would have
needed (docs/INVARIANTS.md, 'What is not caught').
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "sample_traces/invariant_programs.py"
BUG_STEP = 2


@dataclass(frozen=True)
class Program:
    name: str
    args: tuple[str, ...]
    world: int = 1
    bug: str | None = None
    base: str | None = None  # the CLEAN program whose flags it shares (its bitwise reference)
    script: str = SCRIPT  # the training script (the held-out set has its own)
    start: int = BUG_STEP  # the recorder's step at which the bug first acts (0: made with the optimizer)

    def argv(self) -> list[str]:
        bug = ["--bug", self.bug, "--bug-step", str(BUG_STEP)] if self.bug else []
        return [*self.args, *bug]

    def command(self, out: Path, check: Path | None = None) -> list[str]:
        launch = [sys.executable] if self.world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.world)]
        opts = ["--check", str(check)] if check else []
        python = ["python"] if self.world == 1 else []  # under torchrun the script runs in the rank's process
        return [*launch, "-m", "bitguard", "record", "--out", str(out), "--force", *opts, "--", *python, self.script,
                *self.argv()]

    def shell(self, out: str = "runs/NAME", check: str | None = None) -> str:
        launch = "bitguard" if self.world == 1 else f"torchrun --standalone --nproc-per-node {self.world} -m bitguard"
        opts = f" --check {check}" if check else ""
        python = "python " if self.world == 1 else ""
        return f"{launch} record --out {out.replace('NAME', self.name)}{opts} -- {python}{self.script} {' '.join(self.argv())}"


def P(name, flags: str, world: int = 1) -> Program:  # noqa: N802 - a table row
    return Program(name, tuple(flags.split()), world)


INFER = [
    P("inf-tinygpt", "--model tinygpt --optimizer adamw --schedule cosine --clip 1.0 --dropout 0.1 --tie"),
    P("inf-gpt2", "--model gpt2 --optimizer adam --schedule warmup --accumulate 2 --freeze --tie"),
    P("inf-llama", "--model llama --optimizer sgd --schedule step --clip 0.5 --precision bf16"),
    P("inf-mlp", "--model mlp --optimizer momentum --freeze --dropout 0.1 --accumulate 2"),
    P("inf-ddp", "--model mlp --optimizer adamw --schedule step --clip 1.0", world=2),
]

CLEAN = [
    P("tinygpt-sgd-b2", "--model tinygpt --optimizer sgd --batch 2"),
    P("tinygpt-momentum-step-b8", "--model tinygpt --optimizer momentum --schedule step --batch 8"),
    P("tinygpt-adam-warmup-bf16", "--model tinygpt --optimizer adam --schedule warmup --precision bf16"),
    P("tinygpt-adamw-clip-accum", "--model tinygpt --optimizer adamw --clip 0.5 --accumulate 2"),
    P("tinygpt-adamw-cosine-freeze-tie", "--model tinygpt --optimizer adamw --schedule cosine --freeze --tie"),
    P("tinygpt-sgd-cosine-dropout-bf16", "--model tinygpt --optimizer sgd --schedule cosine --dropout 0.1 --precision bf16"),
    P("tinygpt-adamw-seed1", "--model tinygpt --optimizer adamw --seed 1 --steps 8"),
    P("gpt2-adamw", "--model gpt2 --optimizer adamw"),
    P("gpt2-sgd-step-b2-clip", "--model gpt2 --optimizer sgd --schedule step --batch 2 --clip 1.0"),
    P("gpt2-momentum-cosine-bf16-dropout", "--model gpt2 --optimizer momentum --schedule cosine --precision bf16 --dropout 0.1"),
    P("gpt2-adam-accum", "--model gpt2 --optimizer adam --accumulate 2"),
    P("llama-adamw-cosine-tie", "--model llama --optimizer adamw --schedule cosine --tie"),
    P("llama-adam-b8", "--model llama --optimizer adam --batch 8"),
    P("llama-momentum-warmup-freeze", "--model llama --optimizer momentum --schedule warmup --freeze"),
    P("llama-sgd-accum-clip", "--model llama --optimizer sgd --accumulate 2 --clip 1.0"),
    P("mlp-sgd", "--model mlp --optimizer sgd"),
    P("mlp-adam-cosine-b8", "--model mlp --optimizer adam --schedule cosine --batch 8"),
    P("mlp-adamw-warmup-clip-bf16", "--model mlp --optimizer adamw --schedule warmup --clip 0.5 --precision bf16"),
    P("mlp-momentum-step-dropout", "--model mlp --optimizer momentum --schedule step --dropout 0.1"),
    P("mlp-freeze-b2", "--model mlp --optimizer adamw --freeze --batch 2"),
    P("mlp-sgd-accum", "--model mlp --optimizer sgd --accumulate 2"),
    P("ddp-mlp-sgd", "--model mlp --optimizer sgd", world=2),
    P("ddp-tinygpt-adamw-cosine-clip", "--model tinygpt --optimizer adamw --schedule cosine --clip 1.0", world=2),
    P("ddp-mlp-adam-warmup-freeze", "--model mlp --optimizer adam --schedule warmup --freeze", world=2),
]

# (bug, the CLEAN program it is injected into)
BUGS = [
    ("no-zero-grad", "tinygpt-sgd-b2"), ("no-zero-grad", "gpt2-adamw"),
    ("frozen-updated", "tinygpt-adamw-cosine-freeze-tie"), ("frozen-updated", "llama-momentum-warmup-freeze"),
    ("left-frozen", "llama-adamw-cosine-tie"), ("left-frozen", "mlp-sgd"),
    ("clip-before-backward", "tinygpt-adamw-clip-accum"), ("clip-wrong-params", "gpt2-sgd-step-b2-clip"),
    ("scheduler-not-stepped", "mlp-adam-cosine-b8"), ("scheduler-not-stepped", "tinygpt-momentum-step-b8"),
    ("param-not-in-group", "tinygpt-momentum-step-b8"), ("dropout-eval", "gpt2-momentum-cosine-bf16-dropout"),
    ("dropout-eval", "mlp-momentum-step-dropout"), ("replica-diverge", "ddp-mlp-sgd"),
    ("replica-diverge", "ddp-tinygpt-adamw-cosine-clip"), ("wrong-dtype", "tinygpt-sgd-b2"),
    ("accum-wrong-scale", "gpt2-adam-accum"), ("accum-wrong-scale", "llama-sgd-accum-clip"),
    ("accum-wrong-scale", "tinygpt-adamw-clip-accum"), ("accum-wrong-scale", "mlp-sgd-accum"),
    ("repeat-batch", "mlp-sgd"), ("repeat-batch", "llama-adam-b8"), ("broken-tying", "llama-adamw-cosine-tie"),
    ("broken-tying", "tinygpt-adamw-cosine-freeze-tie"), ("inplace-leaf", "tinygpt-adam-warmup-bf16"),
    ("inplace-leaf", "mlp-adamw-warmup-clip-bf16"),
]


def buggy_programs() -> list[Program]:
    by_name = {p.name: p for p in CLEAN}
    return [Program(f"{bug}@{base}", by_name[base].args, by_name[base].world, bug, base) for bug, base in BUGS]


# -- the held-out set: sample_traces/invariant_heldout.py, never used while the engine was tuned ----
HELDOUT_SCRIPT = "sample_traces/invariant_heldout.py"


def H(name, flags: str, world: int = 1) -> Program:  # noqa: N802 - a table row
    return Program(name, tuple(flags.split()), world, script=HELDOUT_SCRIPT)


HELDOUT_CLEAN = [
    H("h-nanogpt-bf16-accum2", "--program nanogpt --precision bf16 --accumulate 2"),
    H("h-nanogpt-fp32-noclip", "--program nanogpt --clip 0"),
    H("h-nanogpt-seed1-accum4-b2", "--program nanogpt --seed 1 --accumulate 4 --batch 2"),
    H("h-trainer-bert", "--program trainer"),
    H("h-trainer-bert-accum2-cosine-freeze", "--program trainer --accumulate 2 --schedule cosine --freeze"),
    H("h-trainer-bert-accum2-lossfunc", "--program trainer --accumulate 2 --loss-func"),
    H("h-loop-cnn-onecycle", "--program loop"),
    H("h-loop-cnn-multistep-bf16-accum2", "--program loop --schedule multistep --precision bf16 --accumulate 2"),
    H("h-loop-cnn-adam-exponential-b8", "--program loop --optimizer adam --schedule exponential --batch 8"),
    H("h-ema-lstm", "--program ema"),
    H("h-ema-lstm-freeze-accum2", "--program ema --freeze --accumulate 2"),
    H("h-ddp-encoder-accum2", "--program ddp --accumulate 2", world=2),
    H("h-ddp-encoder-seed1", "--program ddp --seed 1", world=2),
]

HELDOUT_BUGS = [
    ("zero-grad-in-accum", "h-nanogpt-bf16-accum2"), ("accum-no-divide", "h-nanogpt-bf16-accum2"),
    ("lr-not-updated", "h-nanogpt-bf16-accum2"), ("clip-skipped", "h-nanogpt-bf16-accum2"),
    ("stale-batch", "h-nanogpt-bf16-accum2"),
    ("head-not-in-optimizer", "h-trainer-bert"), ("reinit-head", "h-trainer-bert"),
    ("loss-func-no-accum", "h-trainer-bert-accum2-lossfunc"), ("unfreeze-all", "h-trainer-bert-accum2-cosine-freeze"),
    ("eval-not-reset", "h-loop-cnn-onecycle"), ("group-missing", "h-loop-cnn-onecycle"),
    ("wd-on-norms", "h-loop-cnn-onecycle"), ("zero-grad-after-backward", "h-loop-cnn-onecycle"),
    ("loader-iter-recreated", "h-loop-cnn-multistep-bf16-accum2"),
    ("scheduler-not-stepped", "h-loop-cnn-adam-exponential-b8"),
    ("unfreeze-all", "h-ema-lstm-freeze-accum2"), ("ema-not-restored", "h-ema-lstm"), ("ema-before-step", "h-ema-lstm"),
    ("clip-rank0-only", "h-ddp-encoder-accum2"), ("accum-no-divide", "h-ddp-encoder-accum2"),
]


def heldout_buggy() -> list[Program]:
    sys.path.insert(0, str(ROOT))
    from sample_traces.invariant_heldout import FROM_START

    by_name = {p.name: p for p in HELDOUT_CLEAN}
    return [Program(f"{bug}@{base}", by_name[base].args, by_name[base].world, bug, base, HELDOUT_SCRIPT,
                    0 if bug in FROM_START else BUG_STEP) for bug, base in HELDOUT_BUGS]


def evaluate_heldout(out: Path, workers: int) -> dict:
    """Invariants inferred on the corpus's INFER pipelines only, checked on the held-out programs."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    inv = out / "inv.json"
    doc: dict = {"schema": "bitguard.bench-invariants/1", "bug_step": BUG_STEP, "set": "heldout"}
    recorded = record_all([(p, runs / p.name, None) for p in INFER + HELDOUT_CLEAN], workers)
    failed = [(p.name, r["tail"]) for p, r in zip(INFER + HELDOUT_CLEAN, recorded) if r["exit"] != 0]
    if failed:
        raise SystemExit("recording failed: " + "; ".join(f"{n}: {t}" for n, t in failed))
    doc["inference"] = {**infer([runs / p.name for p in INFER], inv),
                        "programs": [{"name": p.name, "command": p.shell()} for p in INFER]}
    doc["clean"] = clean_rows(HELDOUT_CLEAN, runs, inv, workers)
    doc["buggy"] = buggy_rows(heldout_buggy(), runs, inv, workers, doc["clean"])
    doc["summary"] = summary(doc)
    return doc


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "PYTHONPATH": str(ROOT)}


def record(prog: Program, out: Path, check: Path | None = None) -> dict:
    """Record one program; its exit status, wall time and the online violations it printed."""
    t = time.perf_counter()
    log, command = out.parent / f"{out.name}.log", prog.command(out, check)
    if REUSE and _finished(out, log, command):  # --reuse: the same command recorded to the end before
        text, code = log.read_text(), 0
    else:
        done = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True)
        text, code = done.stdout + done.stderr, done.returncode
        log.write_text(json.dumps(command) + "\n" + text)
    online = [(int(m[1]), int(m[2]), m[3]) for m in
              re.finditer(r"bitguard: invariant violated at step (\d+) rank (\d+): (.*)", text)]
    return {"exit": code, "seconds": time.perf_counter() - t, "online": online,
            "tail": "" if code == 0 else text[-1500:]}


REUSE = False


def _finished(out: Path, log: Path, command: list[str]) -> bool:
    try:
        status = json.loads((out / "manifest.json").read_text()).get("status")
        return status == "complete" and log.read_text().split("\n", 1)[0] == json.dumps(command)
    except (OSError, ValueError):
        return False


def record_all(jobs: list[tuple[Program, Path, Path | None]], workers: int) -> list[dict]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: record(*job), jobs))


def bitguard(*args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "bitguard", *args], cwd=ROOT, env=env(), capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def infer(runs: list[Path], out: Path) -> dict:
    code, stdout, stderr = bitguard("invariants", "infer", *map(str, runs), "-o", str(out))
    if code != 0:
        raise SystemExit(f"bitguard invariants infer failed ({code}): {stderr.strip()[-800:]}")
    doc = json.loads(out.read_text())
    return {"summary": stdout.strip(), "invariants": len(doc["invariants"]), "dropped": len(doc.get("dropped", [])),
            "by_template": _count(i["template"] for i in doc["invariants"])}


def check(run: Path, invariants: Path) -> dict:
    code, stdout, stderr = bitguard("invariants", "check", str(run), "--invariants", str(invariants), "--json")
    if code not in (0, 1, 3):
        return {"exit": code, "error": stderr.strip()[-400:], "violations": [], "applied": [], "skipped": []}
    doc = json.loads(stdout)
    doc["exit"] = code
    return doc


def compare(a: Path, b: Path) -> dict:
    code, stdout, stderr = bitguard("compare", str(a), str(b), "--json")
    if code not in (0, 1, 3):
        return {"exit": code, "verdict": "error", "step": None, "error": stderr.strip()[-300:]}
    doc = json.loads(stdout)
    first = doc.get("first_divergence") or {}
    return {"exit": code, "verdict": doc["verdict"], "step": first.get("step"), "boundary": first.get("boundary")}


def _id(message: str) -> str:
    """The invariant id a violation's stderr line names ('... [Update/gets_grad:x]: evidence')."""
    found = re.search(r"\[([A-Za-z]+/[^\]]+)\]", message)
    return found[1] if found else message


def _count(items) -> dict:
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def first_violations(violations: list[dict]) -> tuple[int | None, list[str]]:
    """The first step with a violation and the templates/invariants violated in it."""
    if not violations:
        return None, []
    step = min(v["step"] for v in violations)
    return step, sorted({f"{v['template']}:{v['invariant_id']}" for v in violations if v["step"] == step})


def latency_of(violations: list[dict], start: int = BUG_STEP) -> dict:
    """Detection in a buggy run whose bug first acts at step `start`. Only invariants not already
    violated before the bug count: a run that false-alarms from step 0 would otherwise look like an
    instant detection."""
    early = [v for v in violations if v["step"] < start]
    before = {v["invariant_id"] for v in early}
    new = [v for v in violations if v["step"] >= start and v["invariant_id"] not in before]
    step, what = first_violations(new)
    return {"early_violations": len(early), "early_invariants": sorted(before)[:8],
            "first_step": step, "latency": None if step is None else step - start, "first": what[:6]}


def evaluate(out: Path, workers: int) -> dict:
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    inv = out / "inv.json"
    doc: dict = {"schema": "bitguard.bench-invariants/1", "bug_step": BUG_STEP}

    recorded = record_all([(p, runs / p.name, None) for p in INFER + CLEAN], workers)
    failed = [(p.name, r["tail"]) for p, r in zip(INFER + CLEAN, recorded) if r["exit"] != 0]
    if failed:
        raise SystemExit("recording failed: " + "; ".join(f"{n}: {t}" for n, t in failed))
    doc["record_seconds"] = {p.name: round(r["seconds"], 1) for p, r in zip(INFER + CLEAN, recorded)}
    doc["inference"] = {**infer([runs / p.name for p in INFER], inv),
                        "programs": [{"name": p.name, "command": p.shell()} for p in INFER]}

    doc["clean"] = clean_rows(CLEAN, runs, inv, workers)
    doc["buggy"] = buggy_rows(buggy_programs(), runs, inv, workers, doc["clean"])
    doc["summary"] = summary(doc)
    return doc


def clean_rows(programs: list[Program], runs: Path, inv: Path, workers: int) -> list[dict]:
    """Each recorded clean program checked offline against `inv`: any violation is a false alarm."""
    with ThreadPoolExecutor(workers) as pool:
        checks = list(pool.map(lambda p: check(runs / p.name, inv), programs))
    return [{"name": p.name, "command": p.shell(), "exit": c["exit"], "violations": len(c["violations"]),
             "violated": sorted({v["invariant_id"] for v in c["violations"]})[:8],
             "violated_counts": {i: n for i, n in sorted(_count(v["invariant_id"] for v in c["violations"]).items())},
             "first": first_violations(c["violations"])[1][:6], "first_step": first_violations(c["violations"])[0],
             "applied": len(c["applied"]), "skipped": len(c["skipped"]), "error": c.get("error")}
            for p, c in zip(programs, checks)]


def buggy_rows(bugs: list[Program], runs: Path, inv: Path, workers: int, clean: list[dict]) -> list[dict]:
    """Each buggy program recorded with --check (online), checked offline and compared bitwise
    with its clean base program. `beyond_base`: the detection again, counting only invariants the
    base program (its `clean` row) did not violate: a false alarm of the base that happens to
    fall in the bug's step is no detection."""
    base_violated = {r["name"]: set(r.get("violated_counts", {})) for r in clean}
    recorded = record_all([(p, runs / p.name, inv) for p in bugs], workers)
    rows = []
    with ThreadPoolExecutor(workers) as pool:
        checks = list(pool.map(lambda p: check(runs / p.name, inv), bugs))
        compares = list(pool.map(lambda p: compare(runs / p.base, runs / p.name), bugs))
    for p, r, c, cmp in zip(bugs, recorded, checks, compares):
        early_ids = {_id(m) for s, _, m in r["online"] if s < p.start}
        online_steps = [s for s, _, m in r["online"] if _id(m) not in early_ids]
        rows.append({"name": p.name, "bug": p.bug, "base": p.base, "start": p.start,
                     "command": p.shell(check="inv.json"),
                     "record_exit": r["exit"], "check_exit": c["exit"], "error": c.get("error") or r["tail"][-300:],
                     "violations": len(c["violations"]), **latency_of(c["violations"], p.start),
                     "beyond_base": latency_of([v for v in c["violations"]
                                                if v["invariant_id"] not in base_violated.get(p.base, set())], p.start),
                     "online_first_step": min((s for s in online_steps if s >= p.start), default=None),
                     "online_early": sum(s < p.start for s in online_steps),
                     "applied": len(c["applied"]), "compare": cmp})
    return rows


def summary(doc: dict) -> dict:
    clean = doc["clean"]
    alarms = [r["name"] for r in clean if r["violations"]]
    buggy = doc["buggy"]
    within = [r for r in buggy if r["latency"] is not None and r["latency"] <= 1]
    beyond = [r for r in buggy if (r.get("beyond_base") or {}).get("latency") is not None
              and r["beyond_base"]["latency"] <= 1]
    by_class: dict = {}
    for r in buggy:
        by_class.setdefault(r["bug"], []).append(r["latency"] is not None and r["latency"] <= 1)
    return {"clean_runs": len(clean), "false_alarm_runs": len(alarms), "false_alarm_rate": len(alarms) / len(clean),
            "false_alarms": alarms, "inconclusive_clean": [r["name"] for r in clean if r["exit"] == 3],
            "buggy_runs": len(buggy), "detected_within_one_step": len(within),
            "detection_rate": len(within) / len(buggy),
            "detected_within_one_step_beyond_base": len(beyond),
            "classes": len(by_class), "classes_detected": sum(all(v) for v in by_class.values()),
            "buggy_with_early_violations": [r["name"] for r in buggy if r["early_violations"]],
            "compare_diverged_within_one_step": sum(
                r["compare"]["verdict"] == "diverged" and r["compare"]["step"] is not None
                and 0 <= r["compare"]["step"] - r.get("start", BUG_STEP) <= 1 for r in buggy)}


VARIANTS = ("plain", "record", "check")  # no recorder; `record` in the mode; `record --check` in the mode


def overhead(rounds: int, steps: int, modes: tuple[str, ...]) -> dict:
    """`record --check` against plain training and against the same recording mode without it, on
    bench_recording.py's GPT, in-process. Per mode, each round runs the three variants (their order
    turning round by round, so none always follows another's close) for `steps` steps each (the
    first left out); each round's ratios pair that round's medians, and the figure is the median
    of the rounds' ratios. The load average is read at each round's start. Each --check recording's
    violations are counted (a clean run: any is a false alarm, with its evidence kept). What the
    check itself costs is also timed where it runs (`ApiRecorder._check_step`, on the training
    thread: its CPU time and wall time per checked step), a figure the machine's load disturbs
    far less than a ratio of step times."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bitguard
    from bench_recording import build, timed_steps

    from bitguard.backend.invariants.recorded import read_violations
    from bitguard.collectors.api_events import ApiRecorder

    spent = {"cpu": [], "wall": []}
    original = ApiRecorder._check_step

    def timed_check(self, step):
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return original(self, step)
        finally:
            spent["cpu"].append(time.thread_time() - cpu)
            spent["wall"].append(time.perf_counter() - wall)

    ApiRecorder._check_step = timed_check
    try:
        return _overhead(rounds, steps, modes, bitguard, build, timed_steps, read_violations, spent)
    finally:
        ApiRecorder._check_step = original


def _overhead(rounds, steps, modes, bitguard, build, timed_steps, read_violations, spent) -> dict:
    model, opt, data = build()
    timed_steps(model, opt, data, 2)
    out: dict = {"model": "bench_recording.build(): GPT 6 layers, width 256, seq 128, batch 8",
                 "rounds": rounds, "steps_per_round": steps, "cpus": os.cpu_count(),
                 "omp_threads": __import__("torch").get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with bitguard.record(tmp / "reference", mode="full", determinism=False):
            timed_steps(model, opt, data, 4)
        inv = tmp / "inv.json"
        out["inference"] = infer([tmp / "reference"], inv)
        for mode in modes:
            with bitguard.record(tmp / f"warm-{mode}", mode=mode, determinism=False, check=inv):
                timed_steps(model, opt, data, 1)
            times: dict = {v: [] for v in VARIANTS}
            spent["cpu"].clear()
            spent["wall"].clear()
            ratios: dict = {"check/plain": [], "record/plain": [], "check/record": []}
            loads, false_alarms = [], []
            for r in range(rounds):
                loads.append(round(os.getloadavg()[0], 2))
                medians = {}
                for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                    if variant == "plain":
                        got = timed_steps(model, opt, data, steps)[1:]
                    else:
                        run = tmp / f"{mode}-{variant}-{r}"
                        with bitguard.record(run, mode=mode, determinism=False,
                                             check=inv if variant == "check" else None):
                            got = timed_steps(model, opt, data, steps)[1:]
                        if variant == "check":
                            found = read_violations(run)["violations"]
                            false_alarms += [{"round": r, "step": v["step"], "id": v["invariant_id"],
                                              "evidence": v["evidence"]} for v in found]
                    medians[variant] = statistics.median(got)
                    times[variant] += got
                for key in ratios:
                    a, b = key.split("/")
                    ratios[key].append(medians[a] / medians[b])
            out[mode] = {"median_step_s": {k: statistics.median(v) for k, v in times.items()},
                         "ratio": {k: statistics.median(v) for k, v in ratios.items()},
                         "round_ratios": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
                         "load_average": loads, "false_alarms": len(false_alarms),
                         "check_step_ms": {k: round(1e3 * statistics.median(v), 2) if v else None
                                           for k, v in spent.items()}, "checked_steps": len(spent["cpu"]),
                         "false_alarm_examples": false_alarms[:5]}
    return out


def tables(doc: dict) -> str:
    s = doc["summary"]
    inf = doc["inference"]
    lines = ["## Inference", "", f"`bitguard invariants infer {' '.join('runs/' + p['name'] for p in inf['programs'])}"
             f" -o inv.json`: {inf['invariants']} invariants ({', '.join(f'{t} {n}' for t, n in inf['by_template'].items())}),"
             f" {inf['dropped']} candidates dropped.", "", "| pipeline | command |", "| --- | --- |"]
    lines += [f"| {p['name']} | `{p['command']}` |" for p in inf["programs"]]
    lines += ["", f"## Clean programs: {s['false_alarm_runs']} of {s['clean_runs']} with a violation "
              f"(false-alarm rate {100 * s['false_alarm_rate']:.1f}%)", "",
              "| program | exit | violations | applied | skipped | violated (count) |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['exit']} | {r['violations']} | {r['applied']} | {r['skipped']} | "
              f"{', '.join(f'{i} x{n}' for i, n in r.get('violated_counts', {}).items()) or '-'} |" for r in doc["clean"]]
    lines += ["", f"## Buggy programs: {s['detected_within_one_step']} of {s['buggy_runs']} detected within one step "
              f"({100 * s['detection_rate']:.0f}%; {s['classes_detected']} of {s['classes']} classes in every program)", "",
              f"Counting only invariants the base program does not violate: {s['detected_within_one_step_beyond_base']} "
              f"of {s['buggy_runs']}.", "",
              "| bug | program | bug from step | first step (offline) | online | beyond the base's false alarms | invariants violated before the bug | bitwise compare | first new violation |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["buggy"]:
        cmp = r["compare"]
        lines.append(f"| {r['bug']} | {r['base']} | {r.get('start', doc['bug_step'])} | {_step(r['first_step'])} | {_step(r['online_first_step'])} | "
                     f"{_step((r.get('beyond_base') or {}).get('first_step'))} | "
                     f"{len(r['early_invariants']) or '-'} | {cmp['verdict']} at {_step(cmp['step'])} | "
                     f"{', '.join(r['first']) or '-'} |")
    if "overhead" in doc:
        lines += ["", overhead_table(doc["overhead"])]
    return "\n".join(lines)


def overhead_table(o: dict) -> str:
    lines = ["## Overhead of --check", "",
             "| mode | plain step | record | record --check | check/plain | record/plain | check/record | rounds' check/record | the check's own time per step (CPU, wall) | load average | false alarms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in ("full", "trusted"):
        if m not in o:
            continue
        t, r = o[m]["median_step_s"], o[m]["ratio"]
        spread = o[m]["round_ratios"]["check/record"]
        lines.append(f"| {m} | {t['plain'] * 1e3:.0f} ms | {t['record'] * 1e3:.0f} ms | {t['check'] * 1e3:.0f} ms | "
                     f"{r['check/plain']:.3f} | {r['record/plain']:.3f} | {r['check/record']:.3f} | "
                     f"{min(spread):.2f}-{max(spread):.2f} | {o[m]['check_step_ms']['cpu']} ms, "
                     f"{o[m]['check_step_ms']['wall']} ms | {min(o[m]['load_average']):.1f}-"
                     f"{max(o[m]['load_average']):.1f} | {o[m]['false_alarms']} |")
    return "\n".join(lines)


def _step(step) -> str:
    return "-" if step is None else str(step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "bitguard-bench-invariants"),
                    help="folder for the recordings and inv.json (kept: inspect it afterwards)")
    ap.add_argument("--jobs", type=int, default=2, help="recordings at once")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6, help="steps per round of the overhead measurement")
    ap.add_argument("--modes", default="full,trusted", help="recording modes the overhead is measured on")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--no-corpus", action="store_true", help="only the overhead")
    ap.add_argument("--reuse", action="store_true", help="keep recordings of the same command made to the end before")
    ap.add_argument("--heldout", action="store_true",
                    help="the held-out set (sample_traces/invariant_heldout.py) instead of the corpus, against "
                         "invariants inferred on the corpus's inference pipelines")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    global REUSE
    REUSE = args.reuse
    out = Path(args.out)
    if args.heldout:
        doc = evaluate_heldout(out, args.jobs)
    else:
        doc = {"schema": "bitguard.bench-invariants/1"} if args.no_corpus else evaluate(out, args.jobs)
        if not args.no_overhead:
            doc["overhead"] = overhead(args.rounds, args.steps, tuple(args.modes.split(",")))
    name = "bench-heldout.json" if args.heldout else "bench-invariants.json"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1) if args.json else tables(doc) if "summary" in doc else overhead_table(doc["overhead"]))


if __name__ == "__main__":
    main()
