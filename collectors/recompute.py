"""Is this module call an activation recompute? (torch.utils.checkpoint, during backward)

Activation checkpointing runs a region's forward a second time during the backward pass, to
rebuild the activations it did not keep. That call starts on an empty module-call stack (the
backward pass is not inside any module), so without this test it looks like a new model root: a
batch event, a flush of the backward states still waiting for gradients, backward watches on
tensors of the original forward. hooks.py asks `recompute_kind()` when a call starts with no
module call in progress; the calls nested inside inherit the answer.

A call is a recompute when the autograd engine is running a backward pass on this thread
(`torch._C._current_graph_task_id() != -1`: never true for a forward pass, which is what makes
the test safe) and torch.utils.checkpoint's recomputation is on the Python stack:
- `REENTRANT`: `CheckpointFunction.backward` (use_reentrant=True). It then runs a backward pass
  of its own through the recomputed graph, so the recomputed calls' gradients are the real ones:
  hooks.py watches them as usual (the original forward ran under no_grad and has no watch).
- `NON_REENTRANT`: the `recompute_fn` of `_checkpoint_without_reentrant_generator`, run from a
  saved-tensor unpack hook (use_reentrant=False, Hugging Face's default). The backward goes on
  through the original forward's graph, which holds the watches; the recomputed tensors only
  replace saved activations, and its inputs are the original's tensor objects, so hooks.py adds
  no backward watch for these calls (one would give a module two backward events).

A module called during backward from anything else (a tensor hook, a custom autograd Function,
another library's checkpointing) is not called a recompute here. Nothing here records anything.
"""

from __future__ import annotations

import sys

import torch
from torch.utils import checkpoint as _checkpoint

REENTRANT = "reentrant"
NON_REENTRANT = "non-reentrant"

def _activation_wrappers() -> frozenset:
    try:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrappers
    except Exception:  # noqa: BLE001 - a torch without torch.distributed: no such wrapper to meet
        return frozenset()
    return frozenset(getattr(wrappers, n) for n in ("CheckpointWrapper", "OffloadWrapper") if hasattr(wrappers, n))


# torch's checkpoint_wrapper (apply_activation_checkpointing, torchtune's set_activation_checkpointing): a module
# that only calls the one it wraps under checkpoint, named as that module (sharded.py drops its level); hooks.py
# records the wrapped module's call alone (helper 93: the two calls shared one name and call counter, and a run
# with the wrapper against one without diverged at step 0 with every paired event equal)
PASS_THROUGH = _activation_wrappers()

# A non-reentrant recompute stops once the last saved tensor is back, by raising this through the calls it is
# inside: hooks.py records their inputs (and the RNG state they began from), with no outputs
CUT_SHORT = getattr(_checkpoint, "_StopRecomputationError", ())


def _code_named(function, name: str):
    """The code object of the function `name` defined inside `function` (a closure's code)."""
    for const in function.__code__.co_consts:
        if getattr(const, "co_name", None) == name:
            return const
    return None


_CODES = {code: kind for code, kind in (
    (_checkpoint.CheckpointFunction.backward.__code__, REENTRANT),
    (_code_named(_checkpoint._checkpoint_without_reentrant_generator, "recompute_fn"), NON_REENTRANT),
) if code is not None}
_FILE = _checkpoint.__file__
_current_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward_pass() -> bool:
    """Is this thread running a backward pass now (inside autograd's engine: a gradient hook, a
    checkpoint's recompute)?"""
    return _current_graph_task is not None and _current_graph_task() != -1


def recompute_kind() -> str | None:
    """REENTRANT or NON_REENTRANT when the module call starting now (on this thread, with no
    module call in progress) is a checkpoint recompute, None otherwise."""
    if not in_backward_pass():
        return None
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        kind = _CODES.get(code)
        if kind is not None:
            return kind
        if code.co_filename == _FILE and code.co_name == "recompute_fn":  # a torch whose code objects moved
            return NON_REENTRANT
        f = f.f_back
    return None
