"""A tiny training loop whose fault writes memory outside every torch function, through a NumPy
view made before training (as a C++ extension or a racy kernel might), which no op trace sees.
From step 1 on: --fault weight bumps an element of the block's weight just before its linear op
reads it; --fault output bumps an element of the block's output buffer after its last op. The
block's scale comes from the environment (TOY_SCALE), as many scripts take their settings, and
TOY_SLEEP makes each step that many seconds slower (numbers unchanged)."""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, fault: str | None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("out", torch.zeros(4, 8))
        self.fault, self.active = fault, False
        self.weight_view = self.lin.weight.detach().numpy()  # made once, before training
        self.out_view = self.out.numpy()

    def forward(self, x):
        if self.active and self.fault == "weight":
            self.weight_view[0, 0] += 1e-3
        y = F.linear(x, self.lin.weight, self.lin.bias) * float(os.environ.get("TOY_SCALE", "2"))
        with torch.no_grad():
            self.out.copy_(y)  # the block hands on a buffer (no gradient flows back through it)
        if self.active and self.fault == "output":
            self.out_view[0, 0] += 1.0
        return self.out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", choices=("weight", "output"), default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    block, head = Block(args.fault), nn.Linear(8, 1)
    model = nn.Sequential(block, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(3, 4, 8)
    for step in range(3):
        block.active = step >= 1
        opt.zero_grad()
        model(data[step]).pow(2).mean().backward()
        opt.step()
        time.sleep(float(os.environ.get("TOY_SLEEP", "0")))


if __name__ == "__main__":
    main()
