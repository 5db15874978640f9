"""Two-rank data-parallel training on CPU (gloo): the distributed recording test's workload."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        if os.environ.get("FAULT_RANK") == str(rank) and step == 1:
            x[0, 0] += 1.0
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if os.environ.get("WEIGHT_FAULT_RANK") == str(rank) and step == 1:  # a replica drifts
            with torch.no_grad():
                model.module[0].weight[0, 0] += 1e-3
    if os.environ.get("EDIT_AFTER_RANK") == str(rank):  # after the last step: only the final state shows it
        with torch.no_grad():
            model.module[2].bias[0] += 1e-3
    if os.environ.get("KEEP_MODEL"):  # torn down with the model alive, as pytorch/examples' DDP tutorial does
        dist.barrier()
        dist.destroy_process_group()
        return
    # free DDP (its reducer holds the process group) before tearing the group down: the other
    # order was seen to hang in ~ProcessGroupGloo joining its worker thread
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
