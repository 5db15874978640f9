"""What a tensor row holds for a tensor that is not a plain dense one.

`Collector._row` digests dense strided tensors (torch.Tensor, nn.Parameter) itself; every other
tensor comes here and gets a row either way, never dropped and never raised into the training:
- sparse COO: the digest of its coalesced form, the bytes of its indices (int64, row-major) then
  of its values; no strides. Coalescing works on a detached copy (none when it is coalesced
  already): duplicate entries are summed there, as `to_dense()` would, and the tensor the
  training holds is not touched.
- a DTensor: its local shard (`cuda/fingerprint.local_values`); the shape stays the global one,
  `nbytes` is the shard's, and the row's `shard` says which part it is (placements, mesh, local
  shape and offset: `sharded.shard_of`).
- a subclass that keeps its values in its own storage (one with `__torch_function__` only): its
  bytes, as for a plain tensor.
- a subclass with a `__torch_dispatch__` of its own (its storage need not hold its values) that says
  what it is made of (`__tensor_flatten__`, the protocol torch.compile's traceable wrappers keep:
  torchao's quantized weights, TwoTensor): a header naming its inner tensors (name, shape, dtype)
  and its flatten context, then each inner tensor's bytes in order (docs/DIGESTS.md).
- what cannot be read exactly gets digest (0, 0) and the reason, for the row's `unobserved`
  column: nested tensors (strided or jagged), compressed sparse layouts (CSR, CSC, BSR, BSC),
  other subclasses with a `__torch_dispatch__` of their own, and whatever raises on the way (the
  caller marks the row with the exception).
Dimensions without one size (a nested tensor's ragged one) are recorded as -1.

Nothing here knows about events, tensor identity or how rows are stored.
"""

from __future__ import annotations

import re
import sys

import torch

from bitguard.collectors.sharded import shard_of
from bitguard.cuda.fingerprint import digest_async, digest_many, local_values
from bitguard.cuda.tensor_bytes import nested_bytes, quantized_bytes, tensor_bytes

NO_DIGEST = (0, 0)  # the digest an unobserved row carries (it means nothing)
PLAIN = (torch.Tensor, torch.nn.Parameter)  # the tensor types `Collector._row` digests itself (if dense strided)
_PLAIN_DISPATCH = getattr(torch.Tensor.__torch_dispatch__, "__func__", torch.Tensor.__torch_dispatch__)


def dims(t: torch.Tensor) -> list[int]:
    """`t`'s shape as plain ints, -1 for a dimension without one size."""
    try:
        return [d if type(d) is int else -1 for d in t.shape]
    except Exception:  # noqa: BLE001 - strided nested tensors have no sizes at all
        return [-1] * t.dim()


def observe(t: torch.Tensor) -> tuple[list[int], list[int], int, object, str | None, torch.Tensor | None,
                                      str | None]:
    """(shape, strides, nbytes, digest, unobserved, values, shard) of a tensor that is not plain
    dense: `values` is the tensor whose bytes the digest read (for --dump), None when unobserved;
    `shard` which part of the tensor they are (None: all of it)."""
    if t.is_nested:  # (TransformerEncoder's fast path with a padding mask, jagged batches)
        values = nested_bytes(t)
        return dims(t), [], values.numel(), digest_async(values), None, values, None
    if t.is_quantized:  # (QAT converted to int8, a quantized model's weights): its integers and parameters
        values = quantized_bytes(t)
        return dims(t), list(t.stride()), values.numel(), digest_async(values), None, values, None
    layout = t.layout
    if layout is torch.sparse_coo:
        with torch.no_grad():
            c = t.detach().coalesce()
            values = torch.cat([tensor_bytes(c.indices()), tensor_bytes(c.values())])
        return dims(t), [], values.numel(), digest_async(values), None, values, None
    if layout is not torch.strided:
        why = f"{layout} layout: only strided and sparse COO tensors are digested"
        return dims(t), [], 0, NO_DIGEST, why, None, None
    local = local_values(t)  # a DTensor's shard (itself maybe a subclass), `t` itself otherwise
    funcol = sys.modules.get("torch.distributed._functional_collectives")  # loaded wherever one exists
    if funcol is not None and isinstance(local, funcol.AsyncCollectiveTensor):
        # a collective's result still in flight (tensor parallelism's outputs): completed now, as
        # its first use would (collectors/comm.py does the same), its values are the collective's
        local = local.trigger_wait()
    if _own_dispatch(local):
        values = flattened_bytes(local)
        if values is not None:
            return dims(t), [], values.numel(), digest_async(values), None, values, shard_of(t)
        what = type(t).__name__ if local is t else f"{type(t).__name__}'s local shard, a {type(local).__name__},"
        what += " is"
        return (dims(t), [], 0, NO_DIGEST, f"{what} a tensor subclass with its own __torch_dispatch__: "
                "its storage need not hold its values (not digested)", None, None)
    return dims(t), list(local.stride()), local.nbytes, digest_async(local), None, local, shard_of(t)


def _own_dispatch(t: torch.Tensor) -> bool:
    dispatch = type(t).__torch_dispatch__
    return getattr(dispatch, "__func__", dispatch) is not _PLAIN_DISPATCH


def flattened_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """The bytes a traceable wrapper subclass is digested by: a header, `repr` of its inner tensors'
    (name, shape, dtype) and of its flatten context (memory addresses left out), as UTF-8, then each
    inner tensor's bytes in order (an inner one of the same kind, recursively); None when `t` does not
    say what it is made of (no `__tensor_flatten__`) or an inner tensor cannot be read."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, context = flatten()
        inner = [getattr(t, name) for name in names]
        parts = []
        for part in inner:
            if part.is_quantized:
                parts.append(quantized_bytes(part))
            elif _own_dispatch(part):
                nested = flattened_bytes(part)
                if nested is None:
                    return None
                parts.append(nested)
            else:
                parts.append(tensor_bytes(part))
        header = repr([(name, list(part.shape), str(part.dtype)) for name, part in zip(names, inner)]) \
            + re.sub(r"0x[0-9a-fA-F]+", "0x", repr(context))
        head = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        device = parts[0].device if parts else head.device
        return torch.cat([head.to(device), *parts])
    except Exception:  # noqa: BLE001 - what cannot be read stays unobserved, with the subclass's reason
        return None


def transformed(t: torch.Tensor) -> bool:
    """A functorch wrapper (a tensor inside vmap or grad)."""
    try:
        return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))
    except Exception:  # noqa: BLE001 - a torch without the check
        return False


def unwrapped(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under a functorch wrapper (a tensor inside vmap or grad: under vmap, the
    whole batch of which the wrapper is one slice, its batch dimension in place), None for any
    other tensor. Its values are what the wrapper's computation reads, all members at once."""
    if not transformed(t):
        return None
    try:
        while torch._C._functorch.is_functorch_wrapped_tensor(t):
            t = torch._C._functorch.get_unwrapped(t)
    except Exception:  # noqa: BLE001 - a torch without it: the wrapper stays unobserved
        return None
    return t


def plain_digests(tensors: list) -> list:
    """The digests of the plain tensors among `tensors` (one kernel call for the host ones), None in
    the place of the others (a subclass, a DTensor: `_row` observes those itself) and of every one
    when one cannot be read (each row then digests its own, or says why not)."""
    plain = [type(t) in PLAIN for t in tensors]
    try:
        taken = iter(digest_many([t for t, p in zip(tensors, plain) if p]))
    except Exception:  # noqa: BLE001 - one tensor it cannot read
        return [None] * len(tensors)
    return [next(taken) if p else None for p in plain]
