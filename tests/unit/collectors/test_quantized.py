"""Quantized tensors (a QAT model converted to int8, its saved state dict, a quantized model's
outputs) are digested as their integers and quantization parameters (cuda/tensor_bytes.py
`quantized_bytes`): two identical reruns compared inconclusive (every quantized tensor unobserved)
and a changed scale could not be seen (helper 36)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import bitguard
from bitguard.cuda.tensor_bytes import quantized_bytes


class Requantize(nn.Module):
    def forward(self, x):
        return torch.quantize_per_tensor(x, 0.05, 2, torch.quint8)


def _run(path, scale: float = 0.1, channel_scale: float = 0.2) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Requantize())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch deprecates creating quantized tensors)
        with bitguard.record(path, determinism=False):
            q = model(torch.randn(3, 4))
            state = {"w": torch.quantize_per_tensor(torch.randn(4, 4), scale, 1, torch.qint8),
                     "c": torch.quantize_per_channel(torch.randn(2, 4), torch.tensor([channel_scale, 0.3]),
                                                     torch.tensor([0, 1]), 0, torch.qint8),
                     "out": q}
            torch.save(state, path / "q.pt")


def test_quantized_tensors_are_digested_and_compared(tmp_path):
    for name, kw in (("a", {}), ("b", {}), ("scale", {"scale": 0.11}), ("channel", {"channel_scale": 0.21})):
        (tmp_path / name).mkdir()
        _run(tmp_path / name, **kw)
    same = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert same.verdict == "identical", same.blocking_reasons()
    for name in ("scale", "channel"):
        c = bitguard.compare(tmp_path / "a", tmp_path / name)
        fd = c.first_divergence
        assert c.verdict == "diverged" and fd["kind"] == "saved", (name, fd)


def test_the_bytes_hold_the_integers_then_the_parameters():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.quantize_per_tensor(torch.tensor([0.0, 0.5]), 0.25, 3, torch.quint8)
    got = quantized_bytes(t)
    ints = t.int_repr().view(torch.uint8)
    assert got[:2].tolist() == ints.tolist() == [3, 5]
    assert got[2:10].clone().view(torch.float64).item() == 0.25 and got[10:18].clone().view(torch.int64).item() == 3
    assert got[18:].clone().view(torch.int64).item() == -1
