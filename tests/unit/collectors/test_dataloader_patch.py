"""The determinism controls leave DataLoader workers as torch seeds them (helper 23): bitguard once
reseeded every worker's Python and NumPy generators with a seed of its own, so a script that seeds
itself drew other mixup choices and augmentations in its workers under `bitguard record` than
without it. Now a worker draws the same with the controls as without them."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bitguard.collectors import determinism


class _Draws(Dataset):  # (module level: a spawn worker unpickles it)
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64)


def _drawn(context: str) -> list:
    torch.manual_seed(1234)  # the script seeds itself
    loader = DataLoader(_Draws(), batch_size=2, num_workers=2, multiprocessing_context=context)
    return [b.tolist() for b in loader]


def test_workers_draw_the_same_with_the_controls_as_without(monkeypatch):
    plain = {c: _drawn(c) for c in ("fork",)}  # (the start method is not what the seeding depends on)
    before = determinism.snapshot()
    applied = determinism.apply(determinism.DeterminismConfig())
    try:
        assert applied["dataloader_worker_seeding"] == "torch"
        assert DataLoader.__init__ is DataLoader.__dict__["__init__"] and not getattr(DataLoader.__init__, "_bitguard",
                                                                                         False)
        for context, want in plain.items():
            assert _drawn(context) == want, context
    finally:
        determinism.give_back(before, determinism.snapshot())
