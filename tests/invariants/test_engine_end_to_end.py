"""The invariant engine on real recordings (slow): data-parallel replicas on 2 ranks (gloo under
torchrun) equal after each step, one replica nudged caught in the next step's forward on every
rank of the step; and what `record --check` wrote read back by the explorer's violations reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bitguard.backend.invariants.check import check_run, load_invariants
from bitguard.backend.invariants.recorded import read_violations

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "sample_traces/invariant_programs.py"
FLAGS = ["--model", "tinygpt", "--optimizer", "sgd", "--steps", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args):
    return subprocess.run(list(args), cwd=ROOT, env=ENV, capture_output=True, text=True, check=True, timeout=600)


def record_ddp(out: Path, *extra):
    run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bitguard",
        "record", "--out", str(out), "--", PROGRAM, *FLAGS, *extra)


def infer(out: Path, *runs: Path) -> Path:
    run(sys.executable, "-m", "bitguard", "invariants", "infer", *map(str, runs), "-o", str(out))
    return out


@pytest.mark.extended  # (53 s: the two-rank program; the held-out and corpus tiers check one rank in make test)
def test_one_replica_diverging_is_caught_at_the_next_forward(tmp_path):
    record_ddp(tmp_path / "clean", "--seed", "0")
    invariants = load_invariants(infer(tmp_path / "inv.json", tmp_path / "clean"))
    assert any(i.id == "Consistent/replicated:module.blocks.0.mlp.fc.weight" for i in invariants)
    record_ddp(tmp_path / "other", "--seed", "1")
    assert check_run(tmp_path / "other", invariants)["violations"] == []
    record_ddp(tmp_path / "diverged", "--seed", "2", "--bug", "replica-diverge", "--bug-step", "2")
    report = check_run(tmp_path / "diverged", invariants)
    replicated = [v for v in report["violations"] if v["template"] == "Consistent"]
    # rank 1 nudges the parameter after step 2's optimizer step: step 3's forward sees it
    assert [(v["invariant_id"], v["step"], v["rank"]) for v in replicated][0] == \
        ("Consistent/replicated:module.blocks.0.mlp.fc.weight", 3, None)
    xors = replicated[0]["evidence"]["xor_at_forward"]
    assert xors["0"] != xors["1"]
    assert min(v["step"] for v in report["violations"]) == 3


def test_what_record_check_wrote_is_what_the_violations_view_reads(tmp_path):
    run(sys.executable, "-m", "bitguard", "record", "--out", str(tmp_path / "clean"), "--", sys.executable, PROGRAM,
        *FLAGS)
    inv = infer(tmp_path / "inv.json", tmp_path / "clean")
    done = run(sys.executable, "-m", "bitguard", "record", "--check", str(inv), "--out", str(tmp_path / "buggy"), "--",
               sys.executable, PROGRAM, *FLAGS, "--seed", "3", "--bug", "inplace-leaf", "--bug-step", "2")
    lines = [line for line in done.stderr.splitlines() if line.startswith("bitguard: invariant violated")]
    doc = read_violations(tmp_path / "buggy")
    assert doc["schema"] == "bitguard.violations/1" and len(doc["violations"]) == len(lines) > 0
    assert {v["invariant_id"] for v in doc["violations"]} == {"Update/no_edit_between_steps"}
    assert {v["step"] for v in doc["violations"]} == {2}
    offline = check_run(tmp_path / "buggy", load_invariants(inv))
    assert [(v["invariant_id"], v["step"]) for v in offline["violations"]] == \
        [(v["invariant_id"], v["step"]) for v in doc["violations"]]
    json.dumps(doc)
