"""The optimizer blame reads the gradient step() used (the step event's `grad` row, after any
reduction across ranks), never claiming a gradient matched that was not the one used."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import duckdb
import torch

import bitguard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixtures_runs import RunSpec, write_run  # noqa: E402

PARAM = "model.layers.0.weight"
STEP_EVENTS = "SELECT seq FROM events WHERE phase = 'optimizer'"


def _sql(run_dir, *statements) -> None:
    con = duckdb.connect(os.path.join(run_dir, "rank-0.duckdb"))
    try:
        for sql in statements:
            con.execute(sql)
        con.execute("CHECKPOINT")
    finally:
        con.close()


def _pair(tmp_path, world_size: int = 1) -> tuple[str, str]:
    """Two equal runs whose optimizer events are PARAM's steps, each holding a `grad` row."""
    runs = []
    for name in ("a", "b"):
        run = write_run(str(tmp_path / name), RunSpec(layers=2, steps=3, world_size=world_size))
        _sql(run, f"UPDATE events SET boundary = '{PARAM}' WHERE phase = 'optimizer'",
             f"INSERT INTO tensors BY NAME SELECT * REPLACE ('grad' AS role) FROM tensors WHERE seq IN ({STEP_EVENTS})")
        runs.append(run)
    return runs[0], runs[1]


def _detail(a, b, blame: str = "source") -> str:
    fd = bitguard.compare(a, b, rank=0).first_divergence
    assert (fd["phase"], fd["step"], fd["fault_class"], fd["blame"]) == ("optimizer", 1, "optimizer", blame), fd
    return fd["blame_window"]["detail"]


def test_a_used_gradient_that_differs_is_said_while_the_produced_one_matched(tmp_path):
    a, b = _pair(tmp_path, world_size=2)
    _sql(b, f"UPDATE tensors SET xor = xor + 1 WHERE role IN ('grad', 'state') AND seq IN "
            f"({STEP_EVENTS} AND step = 1)")
    detail = _detail(a, b, blame="consumer")  # step()'s input already differed: the fault is upstream of it
    assert detail.startswith("the gradient step() used differs while the gradient autograd produced on this rank "
                             "matched"), detail
    assert "optimizer update computed differently" not in detail


def test_an_update_that_differs_on_a_matching_used_gradient_blames_the_optimizer(tmp_path):
    a, b = _pair(tmp_path, world_size=2)
    _sql(b, f"UPDATE tensors SET xor = xor + 1 WHERE role = 'state' AND seq IN ({STEP_EVENTS} AND step = 1)")
    detail = _detail(a, b)
    # (only the state was made to differ: helper 76, the text said the parameter did)
    assert detail.startswith("only the optimizer's state for this parameter differs, the parameter itself matched: "
                             "the state differs after step() while the gradient step() used and the previous "
                             "parameters matched"), detail
    # (helper 24: an edit of AdamW's moments between steps reads the same: the state is recorded after step())
    assert "or its state (momentum, Adam's moments) changed since its last step()" in detail, detail


def test_a_used_gradient_that_could_not_be_observed_is_not_called_matched(tmp_path):
    a, b = _pair(tmp_path)
    for run in (a, b):
        _sql(run, f"UPDATE tensors SET unobserved = 'sharded' WHERE role = 'grad' AND seq IN ({STEP_EVENTS})")
    _sql(b, f"UPDATE tensors SET xor = xor + 1 WHERE role = 'state' AND seq IN ({STEP_EVENTS} AND step = 1)")
    detail = _detail(a, b)
    assert "the gradient step() used could not be observed" in detail and "update computed differently:" not in detail


class _Private(torch.optim.Optimizer):
    """Opacus' DPOptimizer's shape: an optimizer wrapping another, its clipping threshold an attribute of its
    own (not a param group's), clipping the gradients before it steps the one it wraps."""

    def __init__(self, inner, max_grad_norm: float):
        super().__init__(inner.param_groups, {})
        self.original_optimizer, self.max_grad_norm = inner, max_grad_norm

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.max_grad_norm)
        return self.original_optimizer.step()


def test_a_wrapping_optimizer_s_own_setting_that_differs_is_among_the_api_differences(tmp_path):
    """Helper 77 (Opacus): DPOptimizer's max_grad_norm changed at a step: the pivot was right, and the API
    differences it points to were empty."""
    for name, at in (("a", None), ("b", 1)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        opt = _Private(torch.optim.SGD(model.parameters(), lr=0.1), 1.0)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                if step == at:
                    opt.max_grad_norm = 0.01
                opt.zero_grad()
                model(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"]) == (1, "optimizer"), fd
    fields = {(d["field"], d["a"], d["b"]) for d in fd["api_differences"]["differences"]}
    assert ("attributes._Private.max_grad_norm", 1.0, 0.01) in fields, fields
