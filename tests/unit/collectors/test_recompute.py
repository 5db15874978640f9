"""collectors/recompute.py: a checkpoint's recompute is told apart from every forward, in both
checkpoint modes, and a module called during backward by anything else is not a recompute."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from bitguard.collectors.recompute import NON_REENTRANT, REENTRANT, recompute_kind


class _Probe(torch.nn.Module):
    """A Linear that notes what `recompute_kind()` says each time its forward runs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: list[str | None] = []

    def forward(self, x):
        self.seen.append(recompute_kind())
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("reentrant, kind", [(True, REENTRANT), (False, NON_REENTRANT)])
def test_forward_then_recompute(reentrant, kind):
    probe = _Probe()
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(probe, x, use_reentrant=reentrant)
    assert probe.seen == [None]  # the original forward, inside the checkpointed region
    y.sum().backward()
    assert probe.seen == [None, kind]


def test_forward_without_checkpoint_and_under_no_grad_is_never_a_recompute():
    probe = _Probe()
    x = torch.randn(2, 4, requires_grad=True)
    probe(x).sum().backward()
    with torch.no_grad():
        probe(x)
    assert probe.seen == [None, None]


def test_a_module_called_from_a_gradient_hook_during_backward_is_not_a_recompute():
    probe, other = _Probe(), _Probe()
    x = torch.randn(2, 4, requires_grad=True)
    y = probe(x)
    in_backward = []

    def hook(grad):
        in_backward.append(torch._C._current_graph_task_id() != -1)
        other(grad.detach())

    y.register_hook(hook)
    y.sum().backward()
    assert in_backward == [True]  # a backward pass runs,
    assert other.seen == [None]  # but no checkpoint recomputes anything


def test_nested_checkpoints_recompute_inside_a_recompute():
    inner = _Probe()

    class Outer(torch.nn.Module):
        def forward(self, x):
            return checkpoint(inner, x * 2, use_reentrant=False) + 1

    x = torch.randn(2, 4, requires_grad=True)
    checkpoint(Outer(), x, use_reentrant=False).sum().backward()
    assert inner.seen[0] is None and inner.seen[1:] and set(inner.seen[1:]) == {NON_REENTRANT}
