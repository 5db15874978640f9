"""`bitguard drill` as a new user meets it, on training code not written for the drill: a two-rank
DDP run launched by torchrun (the stacks tier's ddp.py, its fault switched on by an environment
variable the recording is told to keep), and a run recorded by `bitguard.record()` inside
`python -c`, which has no script to replay. Through the CLI in subprocesses, as a user would.
The two that record are `slow`; a bad --timeout is refused before anything is read (fast).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from stacks import harness as h

# ddp.py's STACK_FAULT: flip bit 9 of body.0's output on rank 1 at step 2 (tests/stacks/scripts/_fault.py)
FAULT = {"STACK_FAULT": "module:rank=1:step=2", "BITGUARD_RECORD_ENV": "STACK_FAULT"}


def _drill(a, b, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bitguard", "drill", str(a), str(b), *args], capture_output=True,
                          text=True, timeout=h.TIMEOUT, env=h._env(None), cwd=str(h.ROOT))


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.slow
@pytest.mark.extended  # a two-rank replay under torch.distributed.run
def test_ddp_two_ranks_drills_the_faulty_rank_to_the_hook_line(tmp_path):
    runs = h.together({"ref": lambda: h.recorded("ddp.py", tmp_path / "ref", nproc=2),
                       "fault": lambda: h.recorded("ddp.py", tmp_path / "fault", nproc=2, env=FAULT)})
    ref, fault = runs["ref"][0], runs["fault"][0]
    assert h.manifest(fault)["env"]["STACK_FAULT"] == FAULT["STACK_FAULT"]
    got = _drill(ref, fault, "--json")
    assert got.returncode == 0, got.stderr[-3000:]
    doc = json.loads(got.stdout)
    assert doc["schema"] == "bitguard.drill/1" and doc["verdict"] == "op_pivot"
    bp = doc["boundary_pivot"]
    assert (bp["rank"], bp["step"], bp["phase"], bp["boundary"]) == (1, 2, "forward", "module.body.0"), bp
    # each side replayed under torchrun on two processes and reproduced rank 1's step 2 bitwise
    assert doc["replay"]["reproduced"] is True, doc["replay"]
    for side in ("a", "b"):
        rep = doc["replay"][side]
        assert rep["reproduced"] and rep["compared"] > 0 and rep["exit_status"] == 0, rep
        assert "torch.distributed.run" in rep["command"] and "--nproc-per-node=2" in rep["command"], rep["command"]
    # the op: the fault hook's clone inside body.0's call, on run B alone, at its line in _fault.py
    op = doc["op_pivot"]
    fault_py = h.SCRIPTS / "_fault.py"
    assert op["op"] == "torch.Tensor.clone" and op["cause"] == "structure" and op["side_only"] == "b", op
    assert op["file"] == str(fault_py) and op["line"] == _line(fault_py, "output = output.clone()"), op
    assert op["rank"] == 1 and op["boundary"] == "module.body.0"
    assert doc["boundary_signature"]["kind"] == "bit_flip", doc["boundary_signature"]
    assert (fault / "drill" / "step-2-rank-1" / "ops-rank-1.json").is_file()


SNIPPET = """
import os, torch, bitguard
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate=os.environ["APPROX"]), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
with bitguard.record(os.environ["OUT"]):
    for _ in range(2):
        loss = m(torch.randn(4, 8)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.slow
@pytest.mark.extended  # the refusal itself: tests/unit/backend/test_opdiff.py (fast)
def test_a_run_recorded_inside_python_c_is_refused_in_one_line(tmp_path):
    """A notebook-like `python -c` recording has no script file: the drill cannot replay it and says
    so in one line (exit 2), never a traceback nor a `not reproduced` finding."""
    for name, approx in (("a", "none"), ("b", "tanh")):
        subprocess.run([sys.executable, "-c", SNIPPET], check=True, capture_output=True, cwd=tmp_path,
                       env={**os.environ, "APPROX": approx, "OUT": str(tmp_path / name)}, timeout=h.TIMEOUT)
    got = _drill(tmp_path / "a", tmp_path / "b")
    assert got.returncode == 2 and got.stdout == "", (got.stdout, got.stderr)
    lines = got.stderr.strip().splitlines()  # (a pivot exists: the runs' GELUs differ, else "compare identical")
    assert len(lines) == 1 and "not supported yet" in lines[0] and "'-c'" in lines[0], lines
    assert not (tmp_path / "a" / "drill" / "step-0-rank-0.replay.log").exists()  # refused before any replay


@pytest.mark.parametrize("timeout", ["nan", "0", "-5"])
def test_a_timeout_that_is_not_a_positive_number_is_bad_input(timeout):
    """`--timeout nan` passed a `<= 0` check and stopped both replays at once: a false 'not reproduced'."""
    demo = h.ROOT / "sample_traces" / "demo"
    got = _drill(demo / "reference", demo / "reference", "--timeout", timeout)
    assert got.returncode == 2 and "is not a positive number of seconds" in got.stderr, got.stderr
