"""A backward blamed as a source in a step where activation checkpointing recomputed a call beside it
says that the backward read recomputed activations (helper 64: a block whose forward reads a global flag
flipped before backward; torch's non-reentrant checkpoint stopped its recompute before the call that
differed, so nothing but the weight gradient showed it, blamed on the backward with no word of the
recompute)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import bitguard


class Block(nn.Module):
    flag = False  # (read by the forward, and by its recompute in backward)

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h * 2 if Block.flag else h)


class Net(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.block, self.head, self.checkpointed = Block(), nn.Linear(8, 1), checkpointed

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x))


def _train(path, flipped: bool, checkpointed: bool = True) -> None:
    torch.manual_seed(0)
    net = Net(checkpointed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for step in range(2):
            loss = net(torch.randn(4, 8)).pow(2).mean()
            Block.flag = flipped and step == 1  # (flipped between the forward and its recompute)
            opt.zero_grad()
            loss.backward()
            opt.step()
            Block.flag = False


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_backward_source_after_a_recompute_says_so(tmp_path, checkpointed):
    _train(tmp_path / "a", False, checkpointed)
    _train(tmp_path / "b", True, checkpointed)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    if not checkpointed:  # (no recompute: the flag flipped after the forward changes nothing)
        assert fd is None
        return
    assert (fd["step"], fd["phase"], fd["blame"]) == (1, "backward", "source"), fd
    assert any(n.startswith("activation checkpointing recomputed block.") for n in fd["notes"]), fd["notes"]
