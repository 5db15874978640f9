"""A model that writes tensors in place between and inside modules (ReLU(inplace), add_ on a
module's output before the next module reads it): digest reuse must never hide such a write."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.add_(1.0)  # in place, between modules: act's input is a's output, written since
        return self.b(self.act(h))


torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
