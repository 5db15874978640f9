"""Two gloo ranks calling every observed collective once, in its c10d and functional forms,
synchronously and asynchronously: the workload of tests/record/test_comm.py. Writes what the
collectives delivered (sha256 of each result, per rank) to the path in argv[1], so that a plain
and a recorded run can be held to the same numbers.

A module reads an all-reduced tensor after the all-reduce wrote it in place: its input digest must
be the reduced bytes (a collective does not bump the version counter the digest cache keys on).
Then a DDP model trains two steps, its user registering a comm hook after the first."""

import hashlib
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(10 + rank)
    out = {}
    lin = nn.Linear(6, 2)
    x = torch.randn(4, 6, generator=g)
    lin(x)  # x digested here, as a module input, before the all-reduce writes it in place
    dist.all_reduce(x)  # sync, sum
    lin(x)  # its input digest must be the reduced x
    out["all_reduce"] = sha(x)
    y = torch.randn(5, generator=g)
    work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    out["all_reduce_async"] = sha(y)
    b = torch.randn(3, generator=g)
    dist.broadcast(b, src=1)
    out["broadcast"] = sha(b)
    parts = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank + 1)))
    out["all_gather"] = [sha(p) for p in parts]
    gathered = torch.zeros(2 * world)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank + 3)))  # calls all_gather_single inside
    out["all_gather_into_tensor"] = sha(gathered)
    shard = torch.zeros(2)
    dist.reduce_scatter_tensor(shard, torch.randn(2 * world, generator=g))
    out["reduce_scatter_tensor"] = sha(shard)
    shard2 = torch.zeros(3)
    dist.reduce_scatter(shard2, [torch.randn(3, generator=g) for _ in range(world)])
    out["reduce_scatter"] = sha(shard2)
    f = funcol.all_reduce(torch.randn(4, generator=g), "sum", dist.group.WORLD)
    out["funcol_all_reduce"] = sha(f + 0)
    fg = funcol.all_gather_tensor(torch.randn(2, generator=g), 0, dist.group.WORLD)
    out["funcol_all_gather"] = sha(fg + 0)
    names = [None] * world
    dist.all_gather_object(names, {"rank": rank})  # an object collective: not observed
    out["objects"] = names
    # DDP, with a comm hook registered after the first step (when the collector's observing hook is
    # already in place): the user's hook runs from then on, observed
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        if step == 1:
            ddp.register_comm_hook(dist.group.WORLD, allreduce_hook)
        opt.zero_grad()
        ddp(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
    out["ddp"] = [sha(p) for p in ddp.parameters()]
    del ddp, opt
    with open(f"{sys.argv[1]}.r{rank}", "w") as fh:
        json.dump(out, fh, sort_keys=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
