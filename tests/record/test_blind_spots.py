"""What used to compare "identical" although the trained models differ: module buffers (running
statistics) and parameters updated outside torch.optim. Buffers are recorded with each call of
their module, and every root module's parameters and buffers once more when the recording ends."""

import json

import pytest

from .conftest import BITGUARD, SCRIPTS, record, record_together, run

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "blind_spots.py"


def _compare(a, b) -> tuple[int, dict]:
    proc = run([*BITGUARD, "compare", "--json", a, b])
    return proc.returncode, json.loads(proc.stdout)


def test_a_buffer_updated_differently_is_a_divergence_at_its_module(tmp_path):
    record_together(dict(out=tmp_path / "a", script_args=("bn", "0.1"), script=SCRIPT),
                    dict(out=tmp_path / "b", script_args=("bn", "0.2"), script=SCRIPT))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["module_type"]) == (0, "forward", "BatchNorm1d")
    differing = {t["path"] for t in fd["tensors"] if t["differs"]}
    assert {".running_mean", ".running_var"} <= differing and all(
        t["role"] == "state" for t in fd["tensors"] if t["differs"])


def test_parameters_updated_outside_torch_optim_differ_in_the_final_state(tmp_path):
    record_together(*(dict(out=tmp_path / name, script_args=("manual", lr), script=SCRIPT) for name, lr in
                      (("a", "0.01"), ("b", "0.5"), ("c", "0.01"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["fault_class"], fd["boundary"]) == ("final", "final_state", "Sequential")
    assert "outside torch.optim" in fd["blame_window"]["detail"]
    assert _compare(tmp_path / "a", tmp_path / "c")[0] == 0  # and a rerun is identical, final state included
