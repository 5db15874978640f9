"""Two-rank FSDP2 (`fully_shard`) training on CPU (gloo) for 4 steps, launched by torchrun.

Every Linear is its own FSDP2 unit, the root another: parameters and their gradients are
DTensors sharded on dim 0 over the two ranks, the optimizer steps the local shards. Model, loop,
result and fault: _two_ranks.py (STACK_FAULT `module:rank=R:step=S` flips a bit of `body.0`'s
output on rank R at step S, the same plain or recorded).
"""

import argparse

from _two_ranks import finish, start, train
from torch.distributed.fsdp import fully_shard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    rank, net, fault = start()
    for layer in (net.body[0], net.body[2], net.head):
        fully_shard(layer)
    fully_shard(net)
    train(net, rank, fault, args.steps)
    del net
    finish()


if __name__ == "__main__":
    main()
