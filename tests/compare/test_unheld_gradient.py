"""A gradient that differs for a tensor no module holds (a Pyro guide made of `pyro.param`s alone, helper
78): its blame named a module `pyro` (the name's first part) and read "a regulariser in the loss, a weight
tied elsewhere" for what was a reseed before the step's draws."""

from __future__ import annotations

import torch

import bitguard


def _run(path, reseed_at: int | None) -> None:
    torch.manual_seed(0)
    loc = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([loc], lr=0.1)
    with bitguard.record(path, determinism=False):
        for step in range(3):
            if step == reseed_at:
                torch.manual_seed(7)
            opt.zero_grad()
            ((loc - torch.randn(3)) ** 2).sum().backward()  # (a sample drawn for it, as a guide's)
            opt.step()


def test_a_gradient_of_a_tensor_no_module_holds_is_not_blamed_on_a_module_or_a_tied_weight(tmp_path):
    _run(tmp_path / "a", None)
    _run(tmp_path / "b", 2)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"]) == (2, "backward"), fd
    window = fd["blame_window"]
    assert window["module"] is None and "a tensor no module holds" in window["detail"], window
    assert "random numbers drawn for it" in window["detail"] and "tied" not in window["detail"], window
