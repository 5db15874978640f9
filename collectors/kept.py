"""What the training keeps but never calls: a hand-written EMA copy of the model (deepcopy, updated
in place under no_grad, saved at the end), timm's ModelEmaV2, diffusers' EMAModel (a plain object
whose `shadow_params` list of tensors is updated in place). No module call meets them, so without
this their final state, the weights a user saves, was never compared.

`found_in(frame)` looks through a frame's variables, its `self`'s attributes, and one level into
the dicts, lists, tuples and plain objects they hold, for modules, and for lists of tensors an
object keeps that need no gradient (an EMA's shadow weights); each named by where it was found
(`state.ema`, `self.ema.m` as `ema.m`, `ema_unet.shadow_params`). The collector (hooks.py) makes
each a root held to the end of the recording. Knows nothing of events.
"""

from __future__ import annotations

import types
from itertools import islice

import torch

MAX_ITEMS = 64  # items of one container looked at (a list of a dataset's batches is not walked)


class KeptTensors(torch.nn.Module):
    """A list of tensors an object keeps (`ema.shadow_params`), as the buffers of a module, so that
    its final state is recorded as a root's; the tensors are the list's own, not copies."""

    def __init__(self, tensors: list):
        super().__init__()
        self.kept = tensors  # (the list itself, held: a later look finds it again by identity)
        for i, t in enumerate(tensors):
            self.register_buffer(str(i), t)


def found_in(frame) -> list[tuple[str, object]]:
    """(name, module or list of tensors) of what `frame`'s variables keep, as the module docstring
    says; an object that fails when looked at (a proxy, a lazy import) is passed over."""
    try:
        variables = list(frame.f_locals.items())
    except Exception:  # noqa: BLE001 - nothing found is the safe answer
        return []
    found = []
    for key, value in variables:
        if isinstance(key, str) and key.isidentifier():
            found += _kept(key, value, 2, owner=key == "self")
    return found


def _kept(name: str, value, depth: int, owner: bool = False) -> list[tuple[str, object]]:
    """What `value` (found as `name`) keeps, `depth` containers down; `owner`: the frame's `self`,
    whose attributes are named by themselves (a method's `self.ema` is `ema`)."""
    try:
        if _is_module(value):
            return [] if owner else [(name, value)]
        if depth <= 0 or isinstance(value, (torch.Tensor, type, types.ModuleType, types.FunctionType)):
            return []
        if type(value) is dict:
            items = [(f"{name}.{k}", v) for k, v in islice(value.items(), MAX_ITEMS) if isinstance(k, str)]
        elif type(value) in (list, tuple):
            items = [(f"{name}.{i}", v) for i, v in enumerate(islice(value, MAX_ITEMS))]
        else:
            attributes = object.__getattribute__(value, "__dict__")  # (bypassing the class's own lookups)
            if type(attributes) is not dict:
                return []
            found = []
            for key, v in islice(attributes.items(), MAX_ITEMS):
                if isinstance(key, str):
                    n = key if owner else f"{name}.{key}"
                    found += [(n, v)] if _shadow(v) else _kept(n, v, depth - 1)
            return found
        return [found for n, v in items for found in _kept(n, v, depth - 1)]
    except Exception:  # noqa: BLE001 - __slots__ only, a proxy: nothing kept there
        return []


def _shadow(value) -> bool:
    """A list of tensors that need no gradient, of floating point (an EMA's shadow weights)."""
    if type(value) is not list or not value or len(value) > 100_000:
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() and not t.requires_grad
               for t in value)


def _is_module(value) -> bool:
    try:
        return isinstance(value, torch.nn.Module)
    except Exception:  # noqa: BLE001 - a proxy whose __class__ raises
        return False
