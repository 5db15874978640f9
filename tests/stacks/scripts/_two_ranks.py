"""The model and loop the two-rank sharded stacks (fsdp1.py, fsdp2.py) share: a small MLP whose
5-row head does not split evenly over two ranks, trained 4 steps with AdamW on each rank's own
batches, and the STACK_FAULT `module:rank=R:step=S` hook on `body.0` (_fault.py)."""

import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _fault import Fault
from _result import write_result


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 5)  # 5 rows: shards of 3 and 2

    def forward(self, x):
        return self.head(self.body(x))


def start() -> tuple[int, Net, Fault]:
    """The process group (gloo), this rank, the model (seed 0 on every rank) and its fault hook."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    return rank, net, Fault(net.body[0], rank)


def train(model: nn.Module, rank: int, fault: Fault, steps: int) -> None:
    """Train the wrapped `model` and write the result (each rank's local shards)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(steps):
        fault.step = step
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 5, generator=data)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write_result(model, losses)


def finish() -> None:
    """End the process group, once the caller dropped the model: what holds the group goes before
    it (MACHINE.md: gloo teardown). FSDP's modules and states hold each other, so only a collection
    frees them: without it a rank was seen to abort at exit ("terminate called without an active
    exception") in about one run of ten."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
