"""A module whose output and buffers differ, its inputs equal, is told that a buffer it reads may have
been changed since its last call (buffers are recorded as each call leaves them): helper 35's pruning
mask flipped between steps was blamed as "computed differently" with no word of it."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.utils import prune

import bitguard


def _run(path, flip: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with bitguard.record(path, determinism=False):
        for step in range(3):
            if flip and step == 2:
                model[0].weight_mask[0, 0] = 1 - model[0].weight_mask[0, 0]
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()


def test_a_buffer_edited_between_steps_is_named_as_a_cause(tmp_path):
    _run(tmp_path / "a", False)
    _run(tmp_path / "b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (2, "forward", "0", "source"), fd
    assert "a buffer it reads" in fd["blame_window"]["detail"], fd["blame_window"]
