"""A functional collective that fails (a peer gone: gloo's "Connection reset by peer") fails the
training under the recorder as it does without it. The observer waits for the collective to digest
its result; the failure met in that wait was reported as a collector error and swallowed, and the
training's own wait later found nothing left to wait for: it went on with the tensor as it was before
the reduction (helper 63: tensor parallelism trained two steps on one rank's garbage)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import bitguard


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def peer_gone(monkeypatch):
    """The first wait raises, as a reduction whose peer died does; a later one finds no work left and
    gives the tensor back as it is."""
    waits = []
    real = funcol.wait_tensor

    def wait_tensor(t):
        waits.append(t)
        if len(waits) == 1:
            raise RuntimeError("[gloo] Connection reset by peer")
        return t

    monkeypatch.setattr(funcol, "wait_tensor", wait_tensor)
    yield waits
    monkeypatch.setattr(funcol, "wait_tensor", real)


def _reduced(group) -> torch.Tensor:
    out = funcol.all_reduce(torch.ones(4), "sum", group)
    return out * 1  # (the training's use of the result: its wait)


def test_a_failed_functional_collective_raises_without_the_recorder(group, peer_gone):
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        _reduced(group)


def test_a_failed_functional_collective_raises_under_the_recorder(group, peer_gone, tmp_path):
    with bitguard.record(tmp_path / "run", determinism=False):
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            _reduced(group)
    assert peer_gone, "the collective was not waited for"
