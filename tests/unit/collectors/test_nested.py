"""Nested tensors are digested as their components' shapes and bytes (cuda/tensor_bytes.py
`nested_bytes`): torch's TransformerEncoder evaluated with a padding mask runs its layers on nested
tensors (its fast path), and every such pair of identical reruns compared inconclusive (helper 35)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import bitguard
from bitguard.collectors.observation import observe


def _run(path, pad_from: int = 3) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, pad_from:] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nested tensors are a prototype)
        with bitguard.record(path, determinism=False):
            for _ in range(2):
                enc.train()
                opt.zero_grad()
                enc(x).pow(2).mean().backward()
                opt.step()
                enc.eval()
                with torch.no_grad():
                    enc(x, src_key_padding_mask=mask)


def test_the_fast_path_of_an_encoder_with_a_padding_mask_compares(tmp_path):
    for name, pad in (("a", 3), ("b", 3), ("pad", 4)):
        _run(tmp_path / name, pad)
    same = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert same.verdict == "identical", same.blocking_reasons()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "pad").first_divergence
    assert fd is not None and fd["step"] == 1, fd  # the first evaluation, after step 0's update


def test_components_that_split_the_same_values_differently_differ():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = torch.arange(12.0)
        a = torch.nested.nested_tensor([values[:4].reshape(2, 2), values[4:].reshape(4, 2)])
        b = torch.nested.nested_tensor([values[:6].reshape(3, 2), values[6:].reshape(3, 2)])
    (_, _, na, da, why_a, _, _), (_, _, nb, db, why_b, _, _) = observe(a), observe(b)
    assert why_a is None and why_b is None and na == nb and da != db
