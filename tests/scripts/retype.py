"""tinygpt with its LayerNorm class swapped for a subclass that computes the variance in bf16 (with any argument)."""

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sample_traces"))
import tinygpt  # noqa: E402


class MyLN(nn.LayerNorm):
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).to(torch.bfloat16).pow(2).mean(-1, keepdim=True).to(x.dtype)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


if len(sys.argv) > 1:
    tinygpt.nn.LayerNorm = MyLN
tinygpt.main(["--steps", "2"])
