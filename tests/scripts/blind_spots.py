"""What no optimizer step or module output shows, as other people's code does it.

    python blind_spots.py bn MOMENTUM        BatchNorm1d whose running statistics use MOMENTUM
    python blind_spots.py manual LR_LAST     parameters updated by hand (no torch.optim), the last update with LR_LAST

Each trains four steps of a tiny model and prints a number that tells the runs apart.
"""

import sys

import torch
import torch.nn as nn

torch.manual_seed(0)
what, value = sys.argv[1], float(sys.argv[2])
if what == "bn":
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=value), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(4):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(m[1].running_mean.sum().item())
else:
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    for step in range(4):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        m.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= (value if step == 3 else 1e-2) * p.grad
    print(sum(p.double().sum().item() for p in m.parameters()))
