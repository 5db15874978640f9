"""Two-rank FSDP1 (`FullyShardedDataParallel`) training on CPU (gloo) for 4 steps, launched by torchrun.

Every Linear is its own FSDP unit (one FlatParameter each, sharded over the two ranks; the 5-row
head makes one that does not split evenly), the root another. `--orig-params` wraps with
use_orig_params=True (the original parameters stay, as views of the flat shard: what accelerate
and the HF Trainer use); without it the FlatParameters replace them. Model, loop, result and
fault: _two_ranks.py (STACK_FAULT `module:rank=R:step=S` flips a bit of `body.0`'s output on rank
R at step S, the same plain or recorded).
"""

import argparse

import torch
import torch.nn as nn
from _two_ranks import finish, start, train
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--orig-params", action="store_true")
    args = ap.parse_args()
    rank, net, fault = start()
    # device_id: FSDP1 refuses a CPU-only machine unless told the device
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"),
                 use_orig_params=args.orig_params)
    train(model, rank, fault, args.steps)
    del model, net
    finish()


if __name__ == "__main__":
    main()
