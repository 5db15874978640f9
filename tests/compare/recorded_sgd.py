"""A small model trained with SGD on random 3×4 batches, recorded in-process (no determinism
controls): what the compare tests that need a real recording of a model of their own make."""

from __future__ import annotations

import torch

import bitguard


def record_sgd(path, build, steps: int = 2, micro: int = 1, after_backward=None) -> None:
    """`steps` SGD steps (lr 0.1) of the model `build()` makes, seeded, each of `micro` micro-batches
    whose squared output's mean is backpropagated; `after_backward(model, step, micro)` after each."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for step in range(steps):
            opt.zero_grad()
            for m in range(micro):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                if after_backward is not None:
                    after_backward(model, step, m)
            opt.step()
