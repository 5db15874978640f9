"""What a stack script leaves for its test: losses and final parameters, bitwise.

`write_result(model, losses)` writes JSON to the path in env `STACK_RESULT` (rank r > 0 writes
`STACK_RESULT.r<r>`): {"losses": [float.hex], "params": {name: sha256 of the bytes}}. A plain run
and a recorded run of the same script must leave the same file: that is how the stacks tier
checks that recording did not change the training's numbers. Nothing is written when
`STACK_RESULT` is unset (the script then runs as any training script would).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0"))


def tensor_sha(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (a DTensor's local shard: each rank writes its own)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def write_result(model, losses) -> None:
    """`model`: an nn.Module (its named parameters and buffers) or a {name: tensor} mapping."""
    path = os.environ.get("STACK_RESULT")
    if not path:
        return
    rank = _rank()
    if rank:
        path = f"{path}.r{rank}"
    if isinstance(model, torch.nn.Module):
        named = list(model.named_parameters()) + list(model.named_buffers())
    else:
        named = list(model.items())
    result = {"losses": [float(x).hex() for x in losses],
              "params": {name: tensor_sha(t) for name, t in named}}
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
