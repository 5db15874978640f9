"""A model whose modules take keyword arguments and return nested containers and dataclasses, and
a Python number (the first argument, default 1.5) that the code after the module multiplies by."""

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

GAIN = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5


@dataclass
class Output:
    logits: torch.Tensor
    extras: dict


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, scale=None):
        y = self.lin(x)
        return {"y": y * scale, "pair": (y, y.sum()), "gain": GAIN, "tag": "inner"}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        out = self.inner(x, scale=torch.full((8,), 2.0))
        logits = self.head(out["y"]) * out["gain"]
        return Output(logits, {"aux": out["pair"][1]})


torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    out = model(torch.randn(4, 8))
    (out.logits.sum() + out.extras["aux"]).backward()
    opt.step()
