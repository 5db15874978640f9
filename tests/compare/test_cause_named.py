"""Pivots whose text named a cause that was not there (helper 76). A model called twice a step whose
trainable parameters one run alone changes between the calls (peft's `disable_adapter()` sets requires_grad
off on its adapters for a reference pass) is a structure difference at the second call's parameters, whose
explanation said "after a backward, or after its mode changed", neither of which happened: it names the
trainable parameters too. An optimizer whose state alone differs was said to change the parameter."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard


def _run(path, toggle_at: set[int]) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 16, 8)
    with bitguard.record(path, determinism=False):
        for step in range(3):
            out = m(x[step])
            if step in toggle_at:
                m[1].weight.requires_grad_(False)
            with torch.no_grad():
                ref = m(x[step])
            m[1].weight.requires_grad_(True)
            loss = (out - ref).pow(2).mean() + out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_a_trainable_toggled_between_two_calls_in_one_run_is_named_as_a_cause(tmp_path):
    _run(tmp_path / "a", {0, 1, 2})
    _run(tmp_path / "b", {0, 2})
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    fd = c.first_divergence
    assert (c.verdict, fd["step"], fd["kind"], fd["call"]) == ("diverged", 1, "params", 1), fd
    assert "after its trainable parameters changed (requires_grad_" in fd["blame_window"]["detail"], fd


class _Slow(torch.optim.Optimizer):
    """SGD keeping a slow copy of each parameter in its state (as a Lookahead does) that the update never reads."""

    def __init__(self, params, lr, pull, start: int = 0):
        super().__init__(params, {"lr": lr})
        self.pull, self.start, self.steps = pull, start, 0

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if self.steps >= self.start:  # (the slow copy is made at step `start`)
                    slow = self.state[p].setdefault("slow", p.detach().clone())
                    slow.add_(p - slow, alpha=self.pull)
                p.add_(p.grad, alpha=-group["lr"])
        self.steps += 1


def _slow_runs(tmp_path, *settings) -> dict:
    for name, pull, start in settings:
        torch.manual_seed(0)
        m = nn.Linear(4, 1)
        opt = _Slow(m.parameters(), 0.1, pull, start)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                m(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()
    return bitguard.compare(tmp_path / settings[0][0], tmp_path / settings[1][0]).first_divergence


def test_an_optimizer_state_alone_that_differs_is_said_to_be_the_state_not_the_parameter(tmp_path):
    """Helper 76 (timm's Lookahead, k=2 against 3): only `lookahead_slow_buff` differed, and the pivot said
    "the parameter differs after step()"."""
    fd = _slow_runs(tmp_path, ("a", 0.5, 0), ("b", 0.25, 0))
    assert (fd["phase"], fd["differing_roles"]) == ("optimizer", ["state"]), fd
    detail = fd["blame_window"]["detail"]
    assert detail.startswith("only the optimizer's state for this parameter differs") and \
        "the parameter differs" not in detail, detail


def test_an_optimizer_state_one_run_alone_keeps_is_the_pivot_where_it_is_made(tmp_path):
    """Helper 76 (timm's Lookahead, k=2 against 3: its slow weights made a step earlier in one run): the state
    kept by one run alone was passed over as "the module's signature changed", and the pivot came a step late."""
    fd = _slow_runs(tmp_path, ("a", 0.5, 0), ("b", 0.5, 1))
    assert (fd["step"], fd["phase"], fd["differing_roles"]) == (0, "optimizer", ["state"]), fd
    assert any(n.startswith("run A alone keeps 1 optimizer state tensor(s)") for n in fd["notes"]), fd["notes"]
