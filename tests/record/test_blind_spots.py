"""What used to compare "identical" although the trained models differ: module buffers (running
statistics) and parameters updated outside torch.optim. Buffers are recorded with each call of
their module, and every root module's parameters and buffers once more when the recording ends."""

import json
import textwrap

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


def test_a_model_local_to_main_keeps_its_final_state(tmp_path):
    """The usual layout, everything inside main(): the model is gone when the recording ends, and
    with it the final-state event, so an edit after the last step() compared identical. The
    collector holds the roots it met until then (or takes their final state when the script
    drops them); a model trained and dropped before the next one is let go of at the next step."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import gc, sys, weakref, torch

        def train(scale, seed):
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                m(torch.ones(2, 4)).pow(2).mean().backward()
                opt.step()
            with torch.no_grad():
                m[1].weight.mul_(scale)  # after the last step: only the final state sees it
            return weakref.ref(m)

        def main():
            first = train(1.0, 0)  # a model trained and dropped
            second = train(float(sys.argv[1]), 1)
            gc.collect()
            assert first() is None, "the first model is still held after the second one's steps"
            assert second() is not None  # held by the recording until it ends

        main()
    """))
    record_together(dict(out=tmp_path / "a", script_args=("1.0",), script=script),
                    dict(out=tmp_path / "b", script_args=("1.0",), script=script),
                    dict(out=tmp_path / "c", script_args=("0.5",), script=script))
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["fault_class"], fd["boundary"]) == ("final", "final_state", "Sequential#2"), fd
