"""The corpus end to end, small: invariants inferred (`bitguard invariants infer`) from one recorded
clean program hold on the same program with another seed (other weights and data) and are
violated at the step a bug starts, offline (`bitguard invariants check`) and online (`record
--check`). The full evaluation is benchmarks/bench_invariants.py (docs/INVARIANTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# extended: the engine's end-to-end tests (test_engine_end_to_end.py) check offline against online and a
# clean run by default; these are the corpus's further variants (tests/README.md)
pytestmark = [pytest.mark.slow, pytest.mark.extended]

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "tinygpt", "--optimizer", "adamw", "--schedule", "cosine", "--clip", "1.0", "--steps", "5"]


def bitguard(*args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bitguard", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=check)


def record(out: Path, *extra, invariants: Path | None = None):
    opts = ["--check", str(invariants)] if invariants else []
    return bitguard("record", "--out", str(out), *opts, "--", "python", "sample_traces/invariant_programs.py",
                    *FLAGS, *extra)


@pytest.fixture(scope="module")
def inferred(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    record(tmp / "clean")
    bitguard("invariants", "infer", str(tmp / "clean"), "-o", str(tmp / "inv.json"))
    return tmp


def check(run: Path, invariants: Path) -> tuple[int, dict]:
    done = bitguard("invariants", "check", str(run), "--invariants", str(invariants), "--json", check=False)
    return done.returncode, json.loads(done.stdout)


def test_another_seed_of_the_clean_program_violates_nothing(inferred):
    record(inferred / "seed1", "--seed", "1")
    code, doc = check(inferred / "seed1", inferred / "inv.json")
    assert (code, doc["violations"]) == (0, []), doc["violations"][:3]
    assert doc["applied"]


# scheduler.step() follows optimizer.step(), so the recorder counts it in the next step: the call
# the bug leaves out of step 2 is missing from step 3 (docs/INVARIANTS.md)
@pytest.mark.parametrize("bug, template, step", [("no-zero-grad", "EventContain", 2),
                                                 ("scheduler-not-stepped", "EventContain", 3)])
def test_a_bug_is_caught_in_its_step_offline_and_online(inferred, bug, template, step):
    run = inferred / bug
    online = record(run, "--bug", bug, "--bug-step", "2", invariants=inferred / "inv.json")
    code, doc = check(run, inferred / "inv.json")
    assert code == 1
    assert min(v["step"] for v in doc["violations"]) == step, doc["violations"][:3]
    assert template in {v["template"] for v in doc["violations"] if v["step"] == step}
    assert f"bitguard: invariant violated at step {step} rank 0" in online.stderr
    assert not any(f"invariant violated at step {s} " in online.stderr for s in range(step))
