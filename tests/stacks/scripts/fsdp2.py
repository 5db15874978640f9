"""Two-rank FSDP2 (`fully_shard`) training on CPU (gloo) for 4 steps, launched by torchrun.

Every Linear is its own FSDP2 unit, the root another: parameters and their gradients are
DTensors sharded on dim 0 over the two ranks, the optimizer steps the local shards. Model, loop,
result and fault: _two_ranks.py (STACK_FAULT `module:rank=R:step=S` flips a bit of `body.0`'s
output on rank R at step S, the same plain or recorded). `--prefetch`: each unit gathers the next
one's weights ahead, forward and backward (explicit prefetching): the same numbers, the
all-gathers in another order.
"""

import argparse

from _two_ranks import finish, start, train
from torch.distributed.fsdp import fully_shard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prefetch", action="store_true")
    args = ap.parse_args()
    rank, net, fault = start()
    units = (net.body[0], net.body[2], net.head)
    for layer in units:
        fully_shard(layer)
    fully_shard(net)
    if args.prefetch:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(list(units[i + 1:]))
            unit.set_modules_to_backward_prefetch(list(units[:i][::-1]))
    train(net, rank, fault, args.steps)
    del net
    finish()


if __name__ == "__main__":
    main()
