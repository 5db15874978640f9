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

    def __init__(self, last: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 8) if last else None  # (a call after fc2: fc2's recompute then ends, an event)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = self.fc2(h * 2 if Block.flag else h)
        return h if self.fc3 is None else self.fc3(torch.relu(h))


class Net(nn.Module):
    def __init__(self, checkpointed: bool, last: bool = False):
        super().__init__()
        self.block, self.head, self.checkpointed = Block(last), nn.Linear(8, 1), checkpointed

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x))


def _train(path, flipped: bool, checkpointed: bool = True, last: bool = False) -> None:
    torch.manual_seed(0)
    net = Net(checkpointed, last)
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
    # (the recompute stops inside fc2, whose input is the last saved tensor: its cut call is recorded with its
    # inputs, which differ; before, nothing but the weight gradient showed it, blamed on the backward)
    assert (fd["step"], fd["phase"], fd["boundary"]) == (1, "recompute", "block.fc2"), fd
    assert fd["blame_window"]["module"] == "block", fd["blame_window"]
    assert "ran block's code again in backward" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_recompute_given_other_inputs_than_its_forward_is_blamed_on_the_module_around_it(tmp_path):
    """Helper 64: where the call that differs is recomputed (a call after it), the recompute is the pivot; its
    enclosing module's recompute never ends (the checkpoint stops it), so no window was found and the blame
    read "upstream of every observed boundary (e.g. in the data pipeline)"."""
    _train(tmp_path / "a", False, last=True)
    _train(tmp_path / "b", True, last=True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"]) == (1, "recompute", "block.fc2"), fd
    assert fd["blame_window"]["module"] == "block", fd["blame_window"]
    assert "ran block's code again in backward" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_checkpointed_module_that_updates_its_buffers_is_named_not_silent_data_corruption(tmp_path):
    """Helper 85: spectral_norm inside a checkpoint (its power iteration updates _u and _v on every call, so the
    recompute starts from the vectors the forward left): `check` found it, rightly, and called each finding
    "silent data corruption, a nondeterministic kernel, or code that behaves differently when recomputed", the
    parametrization's and the Linear's around it alike."""
    from torch.nn.utils.parametrizations import spectral_norm

    from bitguard.backend.check import run_checks

    torch.manual_seed(0)
    block = nn.Sequential(spectral_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 8))
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(2):
            opt.zero_grad()
            checkpoint(block, torch.randn(4, 8), use_reentrant=False).pow(2).mean().backward()
            opt.step()
    found = [f for f in run_checks(tmp_path / "run").findings if f.step == 0 and f.blame == "source"]
    assert found and found[0].module_type == "_SpectralNorm", [(f.boundary, f.detail) for f in found]
    assert "updates its own buffers" in found[0].detail and "state" in found[0].differing_roles, found[0].detail
    around = [f for f in found[1:] if found[0].boundary.startswith(f"{f.boundary}.")]
    assert around and all(f"{found[0].boundary}, a call inside it" in f.detail for f in around), \
        [(f.boundary, f.detail) for f in found]


def test_torchs_checkpoint_wrapper_on_or_off_changes_no_event_and_a_later_difference_is_found(tmp_path):
    """Helper 93 (torchtune's set_activation_checkpointing, torch's apply_activation_checkpointing): the wrapper and
    the module it wraps were recorded under one name and one call counter, so a run with the wrapper against one
    without diverged at step 0 ("run A lacks the forward of 0 (CheckpointWrapper, call 1)") with every paired event
    equal, and an lr changed at step 2 was never named."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    class Residual(nn.Module):  # (one child: the wrapper's call and the block's were paired across micro-batches)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    def run(path, wrap: bool, lr_at_2: float = 0.1):
        torch.manual_seed(0)
        model = nn.Sequential(Residual(), Residual(), nn.Linear(8, 1))
        if wrap:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Residual))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(path, determinism=False):
            for step in range(3):
                opt.param_groups[0]["lr"] = lr_at_2 if step == 2 else 0.1
                for _ in range(2):  # (two micro-batches: the second call of each block)
                    model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    run(tmp_path / "plain", False)
    run(tmp_path / "wrapped", True)
    run(tmp_path / "lr", True, 0.05)
    c = bitguard.compare(tmp_path / "plain", tmp_path / "wrapped")
    assert c.verdict == "identical", c.first_divergence
    fd = bitguard.compare(tmp_path / "plain", tmp_path / "lr").first_divergence
    assert (fd["step"], fd["phase"]) == (2, "optimizer"), fd
