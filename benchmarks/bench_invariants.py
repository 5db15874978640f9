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

    def argv(self) -> list[str]:
        bug = ["--bug", self.bug, "--bug-step", str(BUG_STEP)] if self.bug else []
        return [*self.args, *bug]

    def command(self, out: Path, check: Path | None = None) -> list[str]:
        launch = [sys.executable] if self.world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.world)]
        opts = ["--check", str(check)] if check else []
        python = ["python"] if self.world == 1 else []  # under torchrun the script runs in the rank's process
        return [*launch, "-m", "bitguard", "record", "--out", str(out), "--force", *opts, "--", *python, SCRIPT,
                *self.argv()]

    def shell(self, out: str = "runs/NAME", check: str | None = None) -> str:
        launch = "bitguard" if self.world == 1 else f"torchrun --standalone --nproc-per-node {self.world} -m bitguard"
        opts = f" --check {check}" if check else ""
        python = "python " if self.world == 1 else ""
        return f"{launch} record --out {out.replace('NAME', self.name)}{opts} -- {python}{SCRIPT} {' '.join(self.argv())}"


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


def latency_of(violations: list[dict]) -> dict:
    """Detection in a buggy run. Only invariants not already violated before the bug count: a run
    that false-alarms from step 0 would otherwise look like an instant detection."""
    early = [v for v in violations if v["step"] < BUG_STEP]
    before = {v["invariant_id"] for v in early}
    new = [v for v in violations if v["step"] >= BUG_STEP and v["invariant_id"] not in before]
    step, what = first_violations(new)
    return {"early_violations": len(early), "early_invariants": sorted(before)[:8],
            "first_step": step, "latency": None if step is None else step - BUG_STEP, "first": what[:6]}


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

    with ThreadPoolExecutor(workers) as pool:
        checks = list(pool.map(lambda p: check(runs / p.name, inv), CLEAN))
    doc["clean"] = [{"name": p.name, "command": p.shell(), "exit": c["exit"], "violations": len(c["violations"]),
                     "violated": sorted({v["invariant_id"] for v in c["violations"]})[:8],
                     "first": first_violations(c["violations"])[1][:6],
                     "applied": len(c["applied"]), "skipped": len(c["skipped"]), "error": c.get("error")}
                    for p, c in zip(CLEAN, checks)]

    bugs = buggy_programs()
    recorded = record_all([(p, runs / p.name, inv) for p in bugs], workers)
    rows = []
    with ThreadPoolExecutor(workers) as pool:
        checks = list(pool.map(lambda p: check(runs / p.name, inv), bugs))
        compares = list(pool.map(lambda p: compare(runs / p.base, runs / p.name), bugs))
    for p, r, c, cmp in zip(bugs, recorded, checks, compares):
        early_ids = {_id(m) for s, _, m in r["online"] if s < BUG_STEP}
        online_steps = [s for s, _, m in r["online"] if _id(m) not in early_ids]
        rows.append({"name": p.name, "bug": p.bug, "base": p.base, "command": p.shell(check="inv.json"),
                     "record_exit": r["exit"], "check_exit": c["exit"], "error": c.get("error") or r["tail"][-300:],
                     "violations": len(c["violations"]), **latency_of(c["violations"]),
                     "online_first_step": min((s for s in online_steps if s >= BUG_STEP), default=None),
                     "online_early": sum(s < BUG_STEP for s in online_steps),
                     "applied": len(c["applied"]), "compare": cmp})
    doc["buggy"] = rows
    doc["summary"] = summary(doc)
    return doc


def summary(doc: dict) -> dict:
    clean = doc["clean"]
    alarms = [r["name"] for r in clean if r["violations"]]
    buggy = doc["buggy"]
    within = [r for r in buggy if r["latency"] is not None and r["latency"] <= 1]
    by_class: dict = {}
    for r in buggy:
        by_class.setdefault(r["bug"], []).append(r["latency"] is not None and r["latency"] <= 1)
    return {"clean_runs": len(clean), "false_alarm_runs": len(alarms), "false_alarm_rate": len(alarms) / len(clean),
            "false_alarms": alarms, "inconclusive_clean": [r["name"] for r in clean if r["exit"] == 3],
            "buggy_runs": len(buggy), "detected_within_one_step": len(within),
            "detection_rate": len(within) / len(buggy),
            "classes": len(by_class), "classes_detected": sum(all(v) for v in by_class.values()),
            "buggy_with_early_violations": [r["name"] for r in buggy if r["early_violations"]],
            "compare_diverged_within_one_step": sum(
                r["compare"]["verdict"] == "diverged" and r["compare"]["step"] is not None
                and 0 <= r["compare"]["step"] - BUG_STEP <= 1 for r in buggy)}


def overhead(rounds: int, steps: int, modes: tuple[str, ...]) -> dict:
    """`record --check` against the same recording mode without it, on bench_recording.py's GPT."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bitguard
    from bench_recording import build, timed_steps

    model, opt, data = build()
    timed_steps(model, opt, data, 2)
    out: dict = {"model": "bench_recording.build(): GPT 6 layers, width 256, seq 128, batch 8",
                 "rounds": rounds, "steps_per_round": steps}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with bitguard.record(tmp / "reference", mode="full", determinism=False):
            timed_steps(model, opt, data, 4)
        inv = tmp / "inv.json"
        out["inference"] = infer([tmp / "reference"], inv)
        for mode in modes:
            with bitguard.record(tmp / f"warm-{mode}", mode=mode, determinism=False, check=inv):
                timed_steps(model, opt, data, 1)
            ratios, times = [], {"plain-record": [], "check": []}
            for r in range(rounds):
                medians = {}
                for variant in (("plain-record", "check") if r % 2 == 0 else ("check", "plain-record")):
                    with bitguard.record(tmp / f"{mode}-{variant}-{r}", mode=mode, determinism=False,
                                         check=inv if variant == "check" else None):
                        got = timed_steps(model, opt, data, steps)[1:]
                    medians[variant] = statistics.median(got)
                    times[variant] += got
                ratios.append(medians["check"] / medians["plain-record"])
            out[mode] = {"median_step_s": {k: statistics.median(v) for k, v in times.items()},
                         "ratio": statistics.median(ratios), "round_ratios": [round(x, 3) for x in ratios]}
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
              "| program | exit | violations | applied | skipped | first violated |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['exit']} | {r['violations']} | {r['applied']} | {r['skipped']} | "
              f"{', '.join(r['first']) or '-'} |" for r in doc["clean"]]
    lines += ["", f"## Buggy programs: {s['detected_within_one_step']} of {s['buggy_runs']} detected within one step "
              f"({100 * s['detection_rate']:.0f}%; {s['classes_detected']} of {s['classes']} classes in every program), "
              f"bug at step {doc['bug_step']}", "",
              "| bug | program | first step (offline) | online | invariants violated before the bug | bitwise compare | first new violation |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["buggy"]:
        cmp = r["compare"]
        lines.append(f"| {r['bug']} | {r['base']} | {_step(r['first_step'])} | {_step(r['online_first_step'])} | "
                     f"{len(r['early_invariants']) or '-'} | {cmp['verdict']} at {_step(cmp['step'])} | "
                     f"{', '.join(r['first']) or '-'} |")
    if "overhead" in doc:
        o = doc["overhead"]
        lines += ["", "## Overhead of --check", "", "| mode | step without --check | with | ratio (median of rounds) |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {m} | {o[m]['median_step_s']['plain-record'] * 1e3:.0f} ms | {o[m]['median_step_s']['check'] * 1e3:.0f} ms"
                  f" | {o[m]['ratio']:.3f} |" for m in ("full", "trusted") if m in o]
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    global REUSE
    REUSE = args.reuse
    out = Path(args.out)
    doc = {"schema": "bitguard.bench-invariants/1"} if args.no_corpus else evaluate(out, args.jobs)
    if not args.no_overhead:
        doc["overhead"] = overhead(args.rounds, args.steps, tuple(args.modes.split(",")))
    (out / "bench-invariants.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "bench-invariants.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1) if args.json else tables(doc) if "summary" in doc else json.dumps(doc["overhead"], indent=1))


if __name__ == "__main__":
    main()
