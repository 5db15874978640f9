"""Two-rank DistributedDataParallel training on CPU (gloo) for 4 steps, launched by torchrun.

DDP's bucketed all-reduce runs with DDP's own reduction, or with `--comm-hook` through this
script's comm hook (divide by the world size, all-reduce, as torch's `allreduce_hook`). Small
buckets (bucket_cap_mb) give a few of them; `--bucket-view` makes the gradients views of them. Faults (STACK_FAULT), the same plain or recorded:
- `module:rank=R:step=S` flips a bit of `body.0`'s output on rank R at step S;
- `allreduce:rank=R:step=S` (with `--comm-hook`) flips bit 9 of the first element of the reduced
  bucket 0 on rank R at step S, after the all-reduce delivered it: a corrupted all-reduce.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _fault import Fault, flip_bit, spec
from _result import write_result
from _two_ranks import finish
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


class FaultState:
    """The comm hook's state: STACK_FAULT=allreduce:... arms it on one rank for one step."""

    def __init__(self, rank: int):
        kind, args = spec()
        self.armed = kind == "allreduce" and args.get("rank", 0) == rank
        self.at = args.get("step", -1)
        self.step = 0


def flipping_allreduce_hook(state: FaultState, bucket):
    """torch's allreduce_hook (divide, all-reduce), flipping a bit of the reduced bucket 0 when armed."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    future = dist.all_reduce(buffer, async_op=True).get_future()

    def reduced(fut):
        out = fut.value()[0]
        if state.armed and state.step == state.at and bucket.index() == 0:
            flip_bit(out)
        return out

    return future.then(reduced)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--comm-hook", action="store_true")
    ap.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view=True")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    fault = Fault(net.body[0], rank)
    model = DDP(net, bucket_cap_mb=0.002, gradient_as_bucket_view=args.bucket_view)
    hook = FaultState(rank)
    if args.comm_hook:
        model.register_comm_hook(hook, flipping_allreduce_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(args.steps):
        fault.step = hook.step = step
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write_result(net, losses)
    # free DDP (its reducer holds the process group) before tearing the group down: the other
    # order was seen to hang in ~ProcessGroupGloo joining its worker thread (MACHINE.md); the comm
    # hook's state and the reducer hold each other, so finish() collects them first
    del model, opt
    finish()


if __name__ == "__main__":
    main()
