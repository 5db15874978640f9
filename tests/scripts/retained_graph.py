"""A second backward through a retained graph, as saliency maps and gradient penalties do it.

    python retained_graph.py saliency|params SCALE    the activation's backward scaled by SCALE in the
                                                       second pass of step 2 only (1.0: unchanged)

saliency: `torch.autograd.grad(out.sum(), x)` after `loss.backward(retain_graph=True)` (the result
kept outside the training); params: a second `.backward()` into the parameters' gradients.
"""

import sys

import torch
import torch.nn as nn

mode, scale = sys.argv[1], float(sys.argv[2])
where = {"second": False, "step": 0}


class Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y) * (scale if where["second"] and where["step"] == 2 else 1.0)


class Act(nn.Module):
    def forward(self, x):
        return Tanh.apply(x)


torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 16), Act(), nn.Linear(16, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(4):
    where["step"] = step
    x = torch.randn(4, 8, requires_grad=True)
    out = m(x)
    loss = (out - 1).pow(2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=True)
    where["second"] = True
    if mode == "saliency":
        (saliency,) = torch.autograd.grad(out.sum(), x)
        print(step, saliency.sum().item())
    else:
        (out.abs().mean() * 0.1).backward()
    where["second"] = False
    opt.step()
print(sum(p.double().sum().item() for p in m.parameters()))
