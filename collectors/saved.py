"""What the training saves: the tensors `torch.save` and safetensors' `save_file`, `save_model` and
`save` write, each call a `saved` event (hooks.py records it). A checkpoint is what a training is
run for, and some of what it holds is computed where no module call or optimizer step meets it (an
EMA made after the last step, a model averaged or converted before it is written): without this a
different saved file could compare identical.

`tensors_in(obj)` finds the tensors of a saved object in a fixed order, each named by where it is
(`['ema']['fc1.weight']`, `[0]`, `.fc1.weight` of a module saved whole): dicts in their order, lists
and tuples, modules' parameters and buffers, and plain objects' attributes, `MAX_DEPTH` levels down;
NumPy arrays of numbers are taken as the tensors of their memory.
Python numbers and strings are left out (a checkpoint often holds a time or a path that differs
from run to run by design). `SaveWatch` wraps the save functions while a recording runs; a save
that torch's own code makes (distributed checkpointing writes each tensor with `torch.save`) or
one made inside another save is not an event of its own. Knows nothing of events or digests.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from itertools import islice

import numpy as np
import torch

from bitguard.collectors.patching import Patch

MAX_DEPTH = 8  # containers looked into below the saved object
MAX_TENSORS = 100_000  # tensors taken from one saved object
MAX_ITEMS = 1_000_000  # items of one container looked at
MAX_VISITS = 1_000_000  # values looked at in one saved object (an object holding a dataset is not walked whole)
_TORCH = torch.__name__ + "."


def tensors_in(obj) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """(path, tensor) of every tensor `obj` holds, as the module docstring says, and why some may
    be missing (None: none is): an object too big to be walked whole is marked, never taken for all
    it holds."""
    found: list[tuple[str, torch.Tensor]] = []
    budget = [MAX_VISITS]
    _walk(obj, "", MAX_DEPTH, found, set(), budget)
    if len(found) >= MAX_TENSORS or budget[0] < 0:
        return found, (f"the saved object holds more than {MAX_TENSORS:,} tensors or {MAX_VISITS:,} values: "
                       "the rest was not looked at")
    return found, None


_SCALARS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, types.FunctionType,
            types.MethodType)


def _walk(value, path: str, depth: int, found: list, open_: set, budget: list) -> None:
    if isinstance(value, _SCALARS):  # (not counted: a list of a dataset's indices is cheap to pass over)
        return
    budget[0] -= 1
    if len(found) >= MAX_TENSORS or budget[0] < 0:
        return
    if isinstance(value, torch.Tensor):
        found.append((path or "[]", value))
        return
    if isinstance(value, np.ndarray):  # saved beside the tensors (NumPy's RNG state, weights kept as arrays)
        if value.dtype.kind in "biufc":
            found.append((path or "[]", torch.from_numpy(value if value.flags.writeable else value.copy())))
        return
    if depth < 0:
        return
    if id(value) in open_:  # a container holding itself
        return
    open_.add(id(value))
    try:
        for sub, item in _items(value, path):
            _walk(item, sub, depth - 1, found, open_, budget)
    except Exception:  # noqa: BLE001 - an object that fails when looked at (a proxy) holds nothing we can name
        pass
    finally:
        open_.discard(id(value))


def _items(value, path: str):
    """(path, item) of what container `value` holds; nothing for what is not a container."""
    if isinstance(value, torch.nn.Module):
        yield from ((f"{path}.{n}", t) for n, t in value.named_parameters(remove_duplicate=False))
        yield from ((f"{path}.{n}", t) for n, t in value.named_buffers(remove_duplicate=False))
    elif isinstance(value, dict):
        yield from ((f"{path}[{k!r}]", v) for k, v in islice(value.items(), MAX_ITEMS))
    elif isinstance(value, (list, tuple)):
        yield from ((f"{path}[{i}]", v) for i, v in enumerate(islice(value, MAX_ITEMS)))
    else:
        attributes = object.__getattribute__(value, "__dict__")  # (bypassing the class's own lookups)
        if type(attributes) is dict:
            yield from ((f"{path}.{k}", v) for k, v in islice(attributes.items(), MAX_ITEMS) if isinstance(k, str))


class SaveWatch:
    """`on_save(boundary, obj)` before each save the user's code makes, while installed: `torch.save`
    as `torch.save`, safetensors' functions as `safetensors.save_file` and so on."""

    def __init__(self, on_save):
        self._on_save = on_save
        self._patches: list[Patch] = []
        self._inside = threading.local()

    def install(self) -> SaveWatch:
        self._patches.append(Patch(torch, "save", self._make("torch.save")))
        if "safetensors.torch" in sys.modules or importlib.util.find_spec("safetensors") is not None:
            try:
                import safetensors.torch as st
            except Exception:  # noqa: BLE001 - a broken install: its saves are not seen (torch.save still is)
                return self
            for name in ("save_file", "save_model", "save"):
                if callable(getattr(st, name, None)):
                    self._patches.append(Patch(st, name, self._make(f"safetensors.{name}")))
        return self

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()
        self._patches.clear()

    def _make(self, boundary: str):
        def make(original, patch):
            def save(obj, *args, **kwargs):
                if not patch.active or getattr(self._inside, "on", False) or _from_torch(sys._getframe(1)):
                    return original(obj, *args, **kwargs)
                self._inside.on = True
                try:
                    self._on_save(boundary, obj)  # (guarded by the caller: never raises)
                    return original(obj, *args, **kwargs)
                finally:
                    self._inside.on = False
            return save
        return make


def _from_torch(frame) -> bool:
    """The save is torch's own (a distributed checkpoint's items), not the user's."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(name, str) and name.startswith(_TORCH)
