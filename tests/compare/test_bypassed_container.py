"""A container called whole in one run and child by child in the other (helper 76: timm's
`checkpoint_seq` calls a Sequential's blocks one by one when gradient checkpointing is on) is not a
divergence when every number matches: it was "run B lacks the forward of blocks (Sequential)", exit
1, with every paired digest equal. A container that computed something of its own, or a child
skipped, still diverges (backend/bypassed.py)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import bitguard

from .recorded_sgd import record_sgd


class Residual(nn.Sequential):
    def forward(self, x):  # (its output is not its last child's)
        return x + super().forward(x)


class Net(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        kind = Residual if how.startswith("residual") else nn.Sequential
        self.blocks = kind(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head, self.how = nn.Linear(4, 1), how

    def forward(self, x):
        if self.how in ("whole", "residual-whole"):
            return self.head(self.blocks(x))
        h = x
        for i, child in enumerate(self.blocks):
            if self.how == "skipped" and i == 1:
                continue
            h = checkpoint(child, h, use_reentrant=False) if self.how == "checkpointed" else child(h)
        return self.head(x + h if self.how == "residual-children" else h)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bypassed")
    for how in ("whole", "children", "checkpointed", "skipped", "residual-whole", "residual-children"):
        record_sgd(tmp / how, lambda how=how: Net(how))
    return tmp


@pytest.mark.parametrize("a,b", [("whole", "children"), ("children", "whole"), ("whole", "checkpointed")])
def test_children_called_one_by_one_compare_identical_and_say_why(runs, a, b):
    r = bitguard.compare(runs / a, runs / b)
    assert r.verdict == "identical", r.first_divergence or r.blocking_reasons()
    said = [x for x in r.certification_reasons() if x["code"] == "bypassed"]
    whole = "a" if a.startswith("whole") else "b"
    assert len(said) == 1 and said[0]["side"] == whole and "blocks" in said[0]["message"], said


@pytest.mark.parametrize("a,b", [("whole", "skipped"), ("residual-whole", "residual-children")])
def test_a_child_skipped_or_a_container_computing_of_its_own_still_diverges(runs, a, b):
    r = bitguard.compare(runs / a, runs / b)
    assert r.verdict == "diverged"
    assert not [x for x in r.certification_reasons() if x["code"] == "bypassed"]
    if a == "residual-whole":  # (every number the same: the container's own sum is what is not seen in B)
        fd = r.first_divergence
        assert (fd["boundary"], fd["cause"], fd["missing_side"]) == ("blocks", "structure", "b"), fd
