"""STACK_FAULT parsing and the one fault most stacks inject: a bit flip in a module's output.

`STACK_FAULT=module:step=2` (optionally `:rank=1`) flips one bit of the first element of the
module's output at that step. The script says which module, tells `Fault` the step as it trains
and the fault fires only then: the same in a plain and a recorded run.
"""

from __future__ import annotations

import os

import torch


def spec() -> tuple[str, dict[str, int]]:
    """(kind, {key: int}) of STACK_FAULT, ("", {}) when unset."""
    text = os.environ.get("STACK_FAULT", "")
    if not text:
        return "", {}
    kind, *parts = text.split(":")
    return kind, {k: int(v) for k, v in (p.split("=") for p in parts)}


def flip_bit(t: torch.Tensor, bit: int = 9) -> None:
    """Flip `bit` of the first element of `t`, in place and outside autograd."""
    with torch.no_grad():
        flat = t.view(-1)
        ints = flat[:1].view(torch.int16 if t.element_size() == 2 else torch.int32)
        ints ^= 1 << bit


class Fault:
    """A forward hook that flips a bit of `module`'s output at STACK_FAULT's step (kind `module`)."""

    def __init__(self, module: torch.nn.Module, rank: int = 0):
        kind, args = spec()
        self.step = 0
        self.armed = kind == "module" and args.get("rank", 0) == rank
        self.at = args.get("step", -1)
        module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.armed and self.step == self.at:
            output = output.clone()
            flip_bit(output)
            return output
        return None
