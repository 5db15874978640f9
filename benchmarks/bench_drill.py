"""What a drill costs on the bench-size model, against recording one step.

The bench model (6 layers, width 256, sequence 128, batch 8, vocabulary 512: bench_recording.py's)
trains 3 steps under `bitguard record`, plainly and with the functional fault from step 1 (a
consumer pivot at blocks.0.ln_2, window blocks.0). Then, ROUNDS times, alternated so that machine
noise hits both alike:

- `bitguard drill A B`: `drill_s`, the whole drill's wall time (compare, two replays side by side,
  checks, op diff); `replay_s`, each replay's wall time; `traced_step_s`, the pivot's step inside a
  replay (first event start to last event end) with the window traced at op level and its tensors
  kept;
- run A's replay alone, as the drill starts it (its command and spec): `solo_traced_step_s`, the
  traced step with the machine to itself;
- `bitguard record --steps 1:2` of run A's command (what the drill replays, without the drill):
  `record_s` its wall time and `recorded_step_s` its step 1.

Per round `solo_traced_step_s / recorded_step_s` is what tracing costs a step (target <= 2x);
`traced_step_s` is the same step inside the drill (higher where the drill runs both replays at
once); `startup_s` = replay_s - traced_step_s (interpreter, imports, model build, the steps
before); `drill_s / record_s` is the whole drill against recording that one step.
Medians over the rounds; `--json` prints them as bitguard.bench-drill/1.

    .venv/bin/python benchmarks/bench_drill.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

from bitguard.backend.ingest import load_rank, open_run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ("--layers", "6", "--width", "256", "--seq", "128", "--batch", "8", "--vocab", "512", "--steps", "3")
FAULT = ("--fault", "functional", "--fault-step", "1")


def _record(out: Path, args: tuple[str, ...]) -> None:
    subprocess.run([sys.executable, "-m", "bitguard", "record", "--out", str(out), "--", sys.executable,
                    "sample_traces/tinygpt.py", *args], check=True, cwd=ROOT, capture_output=True)


def _step_seconds(run: Path, step: int) -> float:
    events, _, _ = load_rank(open_run(run), 0)
    ev = events.filter(pl.col("step") == step)
    return (ev["t_end_ns"].max() - ev["t_start_ns"].min()) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp, "a"), Path(tmp, "b")
        _record(a, MODEL)
        _record(b, (*MODEL, *FAULT))
        rounds = []
        for k in range(args.rounds):
            one = Path(tmp, f"one-{k}")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "bitguard", "record", "--out", str(one), "--steps", "1:2", "--",
                            sys.executable, "sample_traces/tinygpt.py", *MODEL], check=True, cwd=ROOT,
                           capture_output=True)
            record_s = time.perf_counter() - t0
            recorded = _step_seconds(one, 1)
            t0 = time.perf_counter()
            got = subprocess.run([sys.executable, "-m", "bitguard", "drill", str(a), str(b), "--json"],
                                 capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t0
            if got.returncode != 0:
                print(got.stderr, file=sys.stderr)
                return 1
            doc = json.loads(got.stdout)
            traced = statistics.median([_step_seconds(Path(doc["records"][s]), 1) for s in ("a", "b")])
            solo = Path(tmp, f"solo-{k}")
            argv = list(doc["replay"]["a"]["command"])
            argv[argv.index("--out") + 1] = str(solo)
            spec = Path(doc["records"]["a"]).parent / f"{Path(doc['records']['a']).name}.spec.json"
            subprocess.run(argv, check=True, capture_output=True, cwd=ROOT, env={**os.environ, "BITGUARD_DRILL": str(spec)})
            solo_traced = _step_seconds(solo, 1)
            replay = statistics.median([doc["cost"]["replay_s_a"], doc["cost"]["replay_s_b"]])
            rounds.append({"drill_s": wall, "replay_s": replay, "traced_step_s": traced, "startup_s": replay - traced,
                           "record_s": record_s, "recorded_step_s": recorded, "solo_traced_step_s": solo_traced,
                           "ratio": solo_traced / recorded, "drill_over_record": wall / record_s,
                           "ops": doc["cost"]["ops_a"], "op": doc["op_pivot"]["op"]})
    keys = ("drill_s", "replay_s", "traced_step_s", "startup_s", "record_s", "recorded_step_s", "solo_traced_step_s",
            "ratio", "drill_over_record")
    med = {k: statistics.median(r[k] for r in rounds) for k in keys}
    result = {"schema": "bitguard.bench-drill/1", "model": " ".join(MODEL), "rounds": rounds, "median": med,
              "traced_over_recorded": med["ratio"], "ops_traced": rounds[0]["ops"]}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"GPT 6x256, seq 128, batch 8; {args.rounds} drills; window blocks.0, {result['ops_traced']} ops traced")
        print(f"  drill (wall)            {med['drill_s']:.2f} s   (bitguard record --steps 1:2 alone: "
              f"{med['record_s']:.2f} s)")
        print(f"  replay (each)           {med['replay_s']:.2f} s = start-up {med['startup_s']:.2f} s + traced step "
              f"{med['traced_step_s']:.3f} s")
        print(f"  recorded step           {med['recorded_step_s']:.3f} s; traced alone {med['solo_traced_step_s']:.3f} s: "
              f"traced / recorded, round by round: median {med['ratio']:.2f}x ({min(r['ratio'] for r in rounds):.2f}-"
              f"{max(r['ratio'] for r in rounds):.2f}x; target <= 2x)")
        print(f"  drill / one-step recording (both with start-up): median {med['drill_over_record']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
