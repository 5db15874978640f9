"""Recording cost on every stack of the stacks tier: step time against plain, per event, and the
run directory's size per step (docs/STACKS.md, docs/PERFORMANCE.md).

Each stack script (tests/stacks/scripts) is run plain and recorded (`bitguard record`, under
torchrun for the distributed ones), alternated round by round, with more steps than the tests
use. Step times are taken without the script's help: `steptimer/sitecustomize.py` stamps every
optimizer step of every process; a step's time is the interval between two stamps of rank 0, the
first `--warmup` intervals left out (compilation, caches). Per stack: the median step time plain
and recorded over all rounds, their ratio, the overhead per step divided by the events recorded
per step (µs per event: the step's whole overhead, the fixed per-step part included), and the run
directory's growth per step: one more recording with `--size-steps` steps, against round 1's
(a DuckDB file grows by whole blocks, so a short run's size says little).

    python benchmarks/bench_stacks.py [--rounds 5] [--steps 12] [--size-steps 200] [--only eager,ddp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "stacks" / "scripts"
TIMER = Path(__file__).resolve().parent / "steptimer"

# name: (script, script args, processes, record args)
STACKS = {
    "eager": ("eager.py", [], 1, []),
    "autocast bf16": ("eager.py", ["--autocast"], 1, []),
    "eager, trusted mode": ("eager.py", [], 1, ["--mode", "trusted"]),
    "torch.compile (inductor)": ("compiled.py", ["--compile", "model"], 1, []),
    "DDP (2 ranks, gloo)": ("ddp.py", [], 2, []),
    "FSDP1 (2 ranks)": ("fsdp1.py", [], 2, []),
    "FSDP1 use_orig_params (2 ranks)": ("fsdp1.py", ["--orig-params"], 2, []),
    "FSDP2 (2 ranks)": ("fsdp2.py", [], 2, []),
    "checkpointing (non-reentrant)": ("checkpointing.py", [], 1, []),
    "checkpointing (reentrant)": ("checkpointing.py", ["--reentrant"], 1, []),
    "HF Trainer": ("hf_trainer.py", [], 1, []),
}


def _env(prefix: Path) -> dict:
    env = dict(os.environ)
    env.update({"BITGUARD_BENCH_STEPS": str(prefix), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONPATH": os.pathsep.join([str(TIMER), str(SCRIPTS), env.get("PYTHONPATH", "")])})
    env.pop("STACK_FAULT", None)
    env.pop("STACK_RESULT", None)
    return env


def run_once(stack: str, recorded: bool, steps: int, work: Path, tag: str) -> dict:
    script, args, nproc, record_args = STACKS[stack]
    launch = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    path = str(SCRIPTS / script)
    out = work / f"{tag}.run"
    if not recorded:
        cmd = [*launch, path, *args, "--steps", str(steps)]
    elif nproc == 1:
        cmd = [sys.executable, "-m", "bitguard", "record", "--out", str(out), *record_args, "--",
               sys.executable, path, *args, "--steps", str(steps)]
    else:
        cmd = [*launch, "-m", "bitguard", "record", "--out", str(out), *record_args, "--",
               path, *args, "--steps", str(steps)]
    prefix = work / f"{tag}.steps"
    proc = subprocess.run(cmd, env=_env(prefix), capture_output=True, text=True, cwd=str(ROOT), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{stack} ({'recorded' if recorded else 'plain'}) exited {proc.returncode}: "
                           f"{proc.stderr[-1500:]}")
    stamps = [json.loads(p.read_text()) for p in work.glob(f"{tag}.steps.*")]
    rank0 = next((s["stamps"] for s in stamps if s["rank"] == 0), None)
    if not rank0 or len(rank0) != steps:
        raise RuntimeError(f"{stack}: expected {steps} optimizer steps on rank 0, timed {len(rank0 or [])}")
    result = {"intervals": [(b - a) / 1e6 for a, b in zip(rank0, rank0[1:])]}
    if recorded:
        manifest = json.loads((out / "manifest.json").read_text())
        result["events_per_step"] = manifest["events_rank0"] / max(1, manifest["steps_completed"])
        files = [p for p in out.rglob("*") if p.is_file()]
        result["bytes_per_step"] = sum(p.stat().st_size for p in files) / max(1, manifest["steps_completed"])
        result["ranks"] = manifest.get("world_size", nproc)
    return result


def measure(stacks: list[str], rounds: int, steps: int, warmup: int, size_steps: int) -> dict:
    rows = {s: {"plain": [], "recorded": [], "events": [], "bytes": []} for s in stacks}
    with tempfile.TemporaryDirectory(prefix="bitguard-bench-stacks-") as tmp:
        for r in range(rounds):
            for s in stacks:
                order = (False, True) if r % 2 == 0 else (True, False)  # alternate which goes first
                for recorded in order:
                    tag = f"{s.replace(' ', '_').replace('/', '_')}-{r}-{int(recorded)}"
                    got = run_once(s, recorded, steps, Path(tmp), tag)
                    rows[s]["recorded" if recorded else "plain"] += got["intervals"][warmup:]
                    if recorded:
                        rows[s]["events"].append(got["events_per_step"])
                        rows[s]["bytes"].append(got["bytes_per_step"] * steps)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
        for s in stacks:
            longer = run_once(s, True, size_steps, Path(tmp), f"{s.replace(' ', '_').replace('/', '_')}-size")
            rows[s]["growth"] = (longer["bytes_per_step"] * size_steps - rows[s]["bytes"][0]) / (size_steps - steps)
    table = {}
    for s, row in rows.items():
        plain, rec = statistics.median(row["plain"]), statistics.median(row["recorded"])
        events = statistics.median(row["events"])
        table[s] = {"plain_ms": plain, "recorded_ms": rec, "ratio": rec / plain, "events_per_step": events,
                    "us_per_event": (rec - plain) * 1e3 / events if events else None,
                    "kib_per_step": row["growth"] / 1024,
                    "steps_timed": len(row["plain"])}
    return table


def markdown(table: dict) -> str:
    lines = ["| stack | plain step | recorded step | ratio | events/step | µs/event | run dir/step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s, t in table.items():
        per_event = f"{t['us_per_event']:.1f}" if t["us_per_event"] is not None else "-"
        lines.append(f"| {s} | {t['plain_ms']:.1f} ms | {t['recorded_ms']:.1f} ms | {t['ratio']:.2f}× | "
                     f"{t['events_per_step']:.0f} | {per_event} | {t['kib_per_step']:.0f} KiB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="step intervals left out at the start of each run")
    ap.add_argument("--size-steps", type=int, default=200, help="steps of the longer recording the run-dir growth is taken from")
    ap.add_argument("--only", help="comma-separated stack names (default: every stack whose script exists)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.steps <= args.warmup + 1 or args.size_steps <= args.steps:
        sys.exit("bench_stacks: --steps must exceed --warmup + 1, and --size-steps --steps")
    names = [s for s in STACKS if (SCRIPTS / STACKS[s][0]).is_file()]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        names = [s for s in names if any(w.lower() in s.lower() for w in wanted)]
    table = measure(names, args.rounds, args.steps, args.warmup, args.size_steps)
    print(json.dumps({"schema": "bitguard.bench-stacks/1", "stacks": table}, indent=1) if args.json
          else markdown(table))


if __name__ == "__main__":
    main()
