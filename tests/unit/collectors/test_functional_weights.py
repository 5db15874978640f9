"""Tensors standing in for parameters that are no leaves (MAML's fast weights given to
functional_call) get their gradient events without the collector reading their `.grad`: torch warns
on that read, an error under `-W error` that made two identical reruns compare inconclusive
(helper 36)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.func import functional_call

import bitguard
from recorded import collector_errors


def _maml(path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with bitguard.record(path, determinism=False):
            for _ in range(2):
                x, y = torch.randn(5, 4), torch.randn(5, 1)
                fast = dict(model.named_parameters())
                loss = (functional_call(model, fast, (x,)) - y).pow(2).mean()
                grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
                fast = {n: p - 0.1 * g for (n, p), g in zip(fast.items(), grads)}
                meta = (functional_call(model, fast, (x,)) - y).pow(2).mean()
                opt.zero_grad()
                meta.backward()
                opt.step()


def test_fast_weights_record_no_collector_error_under_warnings_as_errors(tmp_path):
    _maml(tmp_path / "a")
    _maml(tmp_path / "b")
    assert collector_errors(tmp_path / "a") == []
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"


def test_fast_weights_made_anew_at_a_freed_one_s_id_are_new_trainables():
    """Helper 64: the trainable parameters of a root were told apart by the sum of their ids; functional_call's
    fast weights, made anew for each call, could take the ids of the previous call's freed ones, and that call's
    new tensors went unhooked or not as memory was reused: identical reruns recorded other gradient events. A
    weak reference gone now says they are new, whatever their ids."""
    import weakref

    from bitguard.collectors.hooks import _noted, _same_trainables, _trainables

    model = nn.Linear(2, 2)
    known = _noted(model, _trainables(model))
    assert _same_trainables(known, model, _trainables(model))
    gone = torch.zeros(1)
    dead = weakref.ref(gone)
    del gone
    assert dead() is None
    assert not _same_trainables((*known[:2], (dead,)), model, _trainables(model))  # (the same id sum, one freed)
    model.weight.requires_grad_(False)
    assert not _same_trainables(known, model, _trainables(model))


def _batched_vjp(path, scale: float) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with bitguard.record(path, determinism=False):
        for _ in range(2):
            x = torch.randn(5, 3).requires_grad_(True)
            out = model(x)
            eye = torch.eye(2).unsqueeze(1).expand(2, 5, 2) * scale
            jac, = torch.autograd.grad(out, x, eye, is_grads_batched=True, create_graph=True)
            opt.zero_grad()
            (out.pow(2).mean() + 0.1 * jac.pow(2).sum()).backward()
            opt.step()


def test_a_batched_vector_jacobian_product_records_no_collector_error(tmp_path):
    """Helper 64: `autograd.grad(..., is_grads_batched=True)` hands the hooks on a module's output a legacy
    batched tensor, with no storage: reading it was a collector error, and identical reruns were inconclusive.
    That pass is left out; what it computes is recorded where the training uses it."""
    for name, scale in (("a", 1.0), ("b", 1.0), ("c", 1.5)):
        _batched_vjp(tmp_path / name, scale)
    assert collector_errors(tmp_path / "a") == []
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    assert bitguard.compare(tmp_path / "a", tmp_path / "c").verdict == "diverged"
