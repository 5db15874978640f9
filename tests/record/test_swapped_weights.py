"""Weights swapped in place between two calls of a step with no backward between them (a schedule-free
optimizer's `eval()` before an evaluation and `train()` after it, helper 77). The later call's params
event was taken only after a backward or a mode change: a run that swapped back without changing its
mode had none, so the first module the weights reached was blamed as computing differently, and a run
that forgot `model.train()` (its weights swapped back all the same) was said to be the one whose
weights had not moved."""

from __future__ import annotations

import torch

import bitguard

from .spots import tiny_mlp


def _train(path, back_at: int | None = None, train_at: int | None = None, mode: bool = True,
           skip_at: int | None = None) -> None:
    """Three steps, each an evaluation call under no_grad, then a training call; the weights are moved in
    place for the evaluation and back after it (as a schedule-free optimizer's eval()/train()), and the
    model put in eval mode for it (`mode`). `back_at`: the step whose weights are not moved back;
    `train_at`: the step whose model is not put back in training mode; `skip_at`: the step whose weights
    are not moved at all (an `eval()` forgotten)."""
    model, opt = tiny_mlp()
    with bitguard.record(path, determinism=False):
        for step in range(3):
            with torch.no_grad():
                if step != skip_at:
                    model[0].weight.mul_(0.5)
                if mode:
                    model.eval()
                model(torch.randn(2, 4))
                if step not in (back_at, skip_at):
                    model[0].weight.mul_(2.0)
                if step != train_at:
                    model.train()
            opt.zero_grad()
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            model.train()


def test_weights_not_swapped_back_are_the_params_of_the_call_after(tmp_path):
    """(No mode changed: the weights moved back in run A alone were blamed on the first module they reached.)"""
    _train(tmp_path / "a", mode=False)
    _train(tmp_path / "b", mode=False)
    _train(tmp_path / "c", back_at=1, mode=False)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert (fd["step"], fd["kind"], fd["call"], fd["blame"], fd["fault_class"]) == (1, "params", 1, "source", "params"), fd
    assert "run A's parameters of Sequential changed between two of its calls" in fd["blame_window"]["detail"], fd


def test_a_mode_left_unchanged_with_its_weights_swapped_back_is_not_said_to_leave_them_unmoved(tmp_path):
    """(Tanh has no mode: the numbers are the same, and the modes the runs called differently are said.)"""
    _train(tmp_path / "a")
    _train(tmp_path / "d", train_at=1)
    c = bitguard.compare(tmp_path / "a", tmp_path / "d")
    assert c.verdict == "identical", c.first_divergence
    assert any(d["kind"] == "modes" for d in c.to_dict()["api_differences"]["differences"]), c.to_dict()["api_differences"]


def test_weights_swapped_for_an_evaluation_in_one_run_alone_name_that_run(tmp_path):
    """Helper 77 (schedule-free's optimizer.eval() forgotten before an evaluation): the params that differ at
    the evaluation's call were said to be changed by "code outside torch.optim", without which run's: run A's
    are not what its last step() left, run B's are."""
    _train(tmp_path / "a")
    _train(tmp_path / "e", skip_at=1)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "e").first_divergence
    assert (fd["step"], fd["kind"], fd["call"], fd["fault_class"]) == (1, "params", 0, "params"), fd
    assert fd["blame_window"]["detail"].endswith("run A's are not what its last step() left, run B's are, so run "
                                                 "A's code changed them"), fd["blame_window"]
