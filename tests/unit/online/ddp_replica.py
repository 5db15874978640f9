"""Two-rank DistributedDataParallel training on CPU (gloo), for the cross-rank sensor's tests.

ONLINE_FAULT plants a replica divergence on one rank, right before its optimizer step (so the step
itself applies it, as a faulty device's update would):
- `param:rank=R:step=S` flips bit 20 of the first element of `body.2.weight` on rank R at step S;
- `grad:rank=R:step=S` flips bit 20 of the first element of its reduced gradient instead (what
  the all-reduce delivered differs on one rank: the parameters then diverge too).
Writes each rank's final parameters' SHA-256 to ONLINE_RESULT(.rR).
"""

import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def fault():
    spec = os.environ.get("ONLINE_FAULT")
    if not spec:
        return None, -1, -1
    kind, *args = spec.split(":")
    args = dict(a.split("=") for a in args)
    return kind, int(args["rank"]), int(args["step"])


def flip(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = int(os.environ.get("ONLINE_WIDTH", "16"))
    net = nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 2))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)
    kind, at_rank, at_step = fault()
    for step in range(int(os.environ.get("ONLINE_STEPS", "5"))):
        x, y = torch.randn(256, 8, generator=data), torch.randn(256, 2, generator=data)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if rank == at_rank and step == at_step:
            flip(net[2].weight if kind == "param" else net[2].weight.grad)
        opt.step()
    out = os.environ["ONLINE_RESULT"] + ("" if rank == 0 else f".r{rank}")
    with open(out, "w") as f:
        json.dump({n: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for n, p in net.named_parameters()}, f)
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
