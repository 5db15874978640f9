"""FSDP and DTensor specifics for the collectors: which part of a tensor a rank holds, and the
original parameters behind FSDP's flat and sharded ones.

- `shard_of(t)`: the `shard` column of a DTensor's row: its placements on its mesh, this rank's
  coordinate, and its local shard's shape and offset in the global tensor. The row's shape stays
  the global one; its digest is the local shard's (observation.py).
- FSDP1 (`FullyShardedDataParallel`) flattens each wrapped module's parameters into one
  FlatParameter. Autograd delivers the whole (unsharded) flat gradient on each rank; after the step
  a rank holds only its shard of the flat parameter and of its optimizer state. `flat_layouts`
  reads where each original parameter lies in both (`_fqns`, `_shapes`, `_numels_with_padding`,
  `_is_padding_mask`, `_shard_param_infos` of torch/distributed/fsdp/_flat_param.py), so the
  collector records one gradient and one step event per original parameter, under its original
  name and shape. A flat tensor whose size is not the layout's is recorded whole, its `shard`
  saying it was not attributed (never dropped).
- FSDP2 (`fully_shard`) keeps DTensor parameters (digested as local shards) but autograd reaches
  a plain unsharded parameter it makes at its first all-gather and keeps (`_unsharded_param` of
  each FSDPParam): `unsharded_params` pairs those with the sharded ones, so the gradient hooks go
  where gradients arrive.
- `clean_name`: names without FSDP1's `_fsdp_wrapped_module` and torch's
  `_checkpoint_wrapped_module` levels, so FSDP and plain runs name modules and parameters alike.

`ShardedParams` is the collector's side of it: the hooks it adds for these parameters and how
it turns their gradients and optimizer steps into events, through the collector's own `_row` and
`_emit` (hooks.py digests and queues; nothing here knows how rows are stored).

What this module reads of FSDP is private to torch (checked with torch 2.13): a layout that is
not as expected is answered with None (the flat tensor is then recorded whole and marked), never
raised.
"""

from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass
from functools import partial

import torch

from bitguard.schema import TENSORS

WRAPPER_LEVELS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")  # names FSDP1 and checkpoint_wrapper insert
NOT_ATTRIBUTED = "FSDP FlatParameter, not attributed to its original parameters"


def clean_name(name: str) -> str:
    """`name` without the wrapper levels: `_fsdp_wrapped_module.0._fsdp_wrapped_module.weight` ->
    `0.weight` (a name made only of wrapper levels gives '')."""
    if "_wrapped_module" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_LEVELS)


def shard_of(t: torch.Tensor) -> str | None:
    """What part of a DTensor this rank holds (None for any other tensor):
    `DTensor Shard(dim=0) on mesh (2,) at (1,): local [8, 8] from [8, 0]`. A Partial placement's
    local values are this rank's addend, not a part of the value."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(t, dtensor.DTensor):
        return None
    mesh = t.device_mesh
    placements = ", ".join(repr(p) for p in t.placements)
    names = f" {list(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    coordinate = mesh.get_coordinate()
    local = list(t._local_tensor.shape)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        start = f" from {list(offset)}"
    except Exception:  # noqa: BLE001 - private API: the offset is left out, the rest stays
        start = ""
    at = f" at {tuple(coordinate)}" if coordinate is not None else " (this rank is not in the mesh)"
    return f"DTensor {placements} on mesh {tuple(mesh.shape)}{names}{at}: local {local}{start}"


# -- FSDP1 flat parameters --------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One original parameter inside a FlatParameter."""

    name: str  # as a plain run names it (wrapper levels removed)
    owner: str  # class name of the module that owns it
    shape: tuple[int, ...]
    numel: int
    flat_offset: int  # where it starts in the unsharded flat parameter
    shard_offset: int  # where this rank's part starts in the sharded flat parameter
    shard_numel: int  # how many of its elements this rank holds (0: none: no step event here)
    start: int  # first element (of the parameter, flattened) this rank holds
    tid: int  # the tensor identity its post-step rows carry (stable across steps, like a parameter's)

    @property
    def shard(self) -> str | None:
        """The `shard` column of its post-step rows (None when this rank holds all of it)."""
        if self.shard_numel == self.numel:
            return None
        return (f"FSDP FlatParameter shard: elements [{self.start}, {self.start + self.shard_numel}) of the "
                f"flattened {self.numel}")


@dataclass
class FlatLayout:
    """Where the original parameters lie in one FlatParameter (unsharded and on this rank)."""

    ref: weakref.ref  # the FlatParameter
    name: str  # its own name, for rows that cannot be attributed
    owner: str
    pieces: tuple[Piece, ...]
    unsharded_numel: int
    sharded_numel: int
    originals: tuple  # weakrefs to the original parameters (use_orig_params=True), else ()


def _is_flat(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_is_flat_param", False)) and hasattr(p, "_shard_param_infos")


def flat_layouts(root: torch.nn.Module, new_tid) -> list[FlatLayout]:
    """The FlatParameters of FSDP1 modules under `root` and where their original parameters lie
    (`new_tid()` gives each piece a tensor identity). A FlatParameter whose attributes are not as
    expected gets a layout without pieces: its tensors are then recorded whole, marked."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FullyShardedDataParallel"):
        return []
    out = []
    paths = {id(m): n for n, m in root.named_modules()}
    for path, module in root.named_modules():
        handle = getattr(module, "_handle", None) if isinstance(module, fsdp.FullyShardedDataParallel) else None
        flat = getattr(handle, "flat_param", None)
        if flat is None or not _is_flat(flat):
            continue
        inner = getattr(handle, "_fully_sharded_module", module)
        prefix = clean_name(paths.get(id(inner), path))
        try:
            pieces = _pieces(flat, prefix, new_tid)
        except Exception:  # noqa: BLE001 - a layout we do not know: the flat tensors stay whole
            pieces = ()
        name = ".".join(x for x in (prefix, "_flat_param") if x)
        originals = tuple(weakref.ref(p) for p in (getattr(flat, "_params", None) or ()))
        out.append(FlatLayout(weakref.ref(flat), name, type(inner).__name__, pieces,
                              int(sum(flat._numels_with_padding)), flat.numel(), originals))
    return out


def _pieces(flat, prefix: str, new_tid) -> tuple[Piece, ...]:
    infos, shards = flat._param_infos, flat._shard_param_infos
    offsets, at = [], 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not padding:
            offsets.append(at)
        at += numel
    if not (len(offsets) == len(infos) == len(shards) == len(flat._fqns) == len(flat._shapes)):
        return ()
    out = []
    for fqn, shape, numel, offset, info, shard in zip(flat._fqns, flat._shapes, flat._numels, offsets, infos, shards):
        held = shard.numel_in_shard if shard.in_shard else 0
        out.append(Piece(clean_name(".".join(x for x in (prefix, fqn) if x)), type(info.module).__name__,
                         tuple(shape), int(numel), offset, shard.offset_in_shard if held else 0, int(held or 0),
                         shard.intra_param_start_idx if held else 0, new_tid()))
    return tuple(out)


def unsharded_parts(layout: FlatLayout, flat_grad: torch.Tensor) -> list[tuple[Piece, torch.Tensor]] | None:
    """Each original parameter's part of an unsharded flat tensor (the gradient autograd
    delivers), in its own shape; None when the tensor is not the layout's unsharded size."""
    if not layout.pieces or flat_grad.dim() != 1 or flat_grad.numel() != layout.unsharded_numel:
        return None
    return [(p, flat_grad[p.flat_offset:p.flat_offset + p.numel].view(p.shape)) for p in layout.pieces]


def sharded_parts(layout: FlatLayout, t: torch.Tensor) -> list[torch.Tensor] | None:
    """Each original parameter's part of this rank's flat shard (the parameter after the step, an
    optimizer state of its size, its reduced gradient); None when `t` is not of that size."""
    if not layout.pieces or t.dim() != 1 or t.numel() != layout.sharded_numel:
        return None
    return [t[p.shard_offset:p.shard_offset + p.shard_numel] for p in layout.pieces]


# -- FSDP2 -----------------------------------------------------------------------------------------
def fsdp2_params(module: torch.nn.Module) -> list:
    """The FSDPParams of a `fully_shard` module (its own parameter groups), [] for any other."""
    if "torch.distributed.fsdp._fully_shard._fully_shard" not in sys.modules:
        return []
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return []
    try:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in (state._fsdp_param_group,) if g is not None]
        return [fp for g in groups for fp in g.fsdp_params]
    except Exception:  # noqa: BLE001 - private API changed: no FSDP2 gradients (the step events stay)
        return []


def unsharded_params(fsdp_params: list) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(sharded, unsharded) of each FSDPParam whose unsharded parameter exists (after its module's
    first all-gather)."""
    out = []
    for fp in fsdp_params:
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            out.append((fp.sharded_param, unsharded))
    return out


# -- the collector's side ---------------------------------------------------------------------------
_SHAPE, _TID, _UNOBSERVED, _SHARD = (TENSORS.names.index(c) for c in ("shape", "tid", "unobserved", "shard"))
ACCUMULATED = ("added to a .grad already there after this hook (FSDP1 no_sync): "
               "the sum autograd leaves is not observed")


class ShardedParams:
    """The FSDP parameters of the roots a collector met: their gradient hooks, and their gradient
    and step events under the original parameters' names."""

    def __init__(self, collector):
        self.c = collector
        self.flats: dict[int, FlatLayout] = {}  # id(FlatParameter) -> its layout
        self.originals: dict[int, tuple[weakref.ref, Piece]] = {}  # use_orig_params=True: id(param) -> its piece

    def register(self, root: torch.nn.Module) -> set[int]:
        """Hook the FSDP parameters under a new root; the ids of its FlatParameters (hooked here,
        so the collector's own parameter hooks leave them out)."""
        c = self.c
        for layout in flat_layouts(root, self._new_tid):
            flat = layout.ref()
            known = self.flats.get(id(flat))
            if known is not None and known.ref() is flat:
                continue
            self.flats[id(flat)] = layout
            for ref, piece in zip(layout.originals, layout.pieces):
                if ref() is not None:
                    self.originals[id(ref())] = (ref, piece)
            if flat.requires_grad:
                c._handles.append(flat.register_hook(partial(c._guarded, self._on_flat_grad, layout)))
        for module in root.modules():
            fsdp_params = fsdp2_params(module)
            if fsdp_params:  # hooked once its first all-gather made the unsharded parameters
                handle = []
                handle.append(module.register_forward_pre_hook(
                    partial(c._guarded, self._watch_unsharded, fsdp_params, handle)))
                c._handles.append(handle[0])
        return self.flat_ids()

    def flat_ids(self) -> set[int]:
        """The ids of the live FlatParameters (hooked here: the collector's parameter hooks leave them out)."""
        return {key for key, layout in self.flats.items() if layout.ref() is not None}

    def _new_tid(self) -> int:
        self.c._next_param_tid -= 1  # parameters get negative ids, stable across steps
        return self.c._next_param_tid

    def _watch_unsharded(self, fsdp_params: list, handle: list, module, args) -> None:
        """FSDP2's pre-forward has all-gathered `module`'s parameters: gradient hooks on the
        unsharded ones (where autograd delivers), named as their sharded parameter. Removed once
        every unsharded parameter exists (FSDP2 keeps them, freeing only their storage)."""
        c = self.c
        pairs = unsharded_params(fsdp_params)
        for sharded, unsharded in pairs:
            entry = c._params.get(id(sharded))
            known = c._params.get(id(unsharded))
            if entry is None or entry[0]() is not sharded or (known is not None and known[0]() is unsharded):
                continue
            if unsharded.requires_grad:
                c._watch_param(unsharded, entry[1], entry[2])
        if len(pairs) == len(fsdp_params):
            handle[0].remove()

    def _on_flat_grad(self, layout: FlatLayout, grad) -> None:
        """The unsharded flat gradient of an FSDP1 FlatParameter arrives (before FSDP reduces and
        shards it): one gradient event per original parameter, holding its part, or one event of
        the whole flat gradient, marked, when it is not of the layout's size."""
        c = self.c
        flat = layout.ref()
        if grad is None or flat is None or not c._in_window():
            return
        t0 = time.time_ns()
        stack = c._backward_stack()
        parts = unsharded_parts(layout, grad)
        if parts is None:
            parts = [(None, grad)]
        for piece, g in parts:
            row_in = c._row(g, "grad_input", 0, "")
            row = list(row_in)
            row[1] = "grad"
            if flat.grad is not None:  # autograd adds it to .grad after this hook
                row[8], row[9], row[_UNOBSERVED] = 0, 0, ACCUMULATED
            if piece is None:
                why = f"{NOT_ATTRIBUTED}: a gradient of {grad.numel()} elements, not {layout.unsharded_numel}"
                row_in[_SHARD] = row[_SHARD] = why
                c._emit("backward", "grad", layout.name, layout.owner, 0, t0, [row_in, row], stack)
            else:
                c._emit("backward", "grad", piece.name, piece.owner, 0, t0, [row_in, row], stack)

    def step_parts(self, p: torch.Tensor, tensors: list) -> list[tuple[str | None, list, list]] | None:
        """How a parameter's optimizer-step event is recorded: None for a plain parameter (one event,
        as it is); else [(name or None, tensors, marks)], one per event, `marks` parallel to the
        tensors ((shape, shard, tid) to put in its row, or None). An FSDP1 FlatParameter gives one
        event per original parameter this rank holds a part of, holding its part of each flat
        tensor (as with use_orig_params=True, where the optimizer gets no parameter this rank holds
        nothing of); an original parameter (use_orig_params=True, a 1-D view of its part) keeps its
        event, its rows reshaped."""
        key = id(p)
        layout = self.flats.get(key)
        if layout is not None and layout.ref() is p:
            split = [sharded_parts(layout, t) for *_, t in tensors]
            if split[0] is None:  # the parameter is not its shard: one event of the flat tensors, marked
                why = f"{NOT_ATTRIBUTED}: a parameter of {p.numel()} elements, not {layout.sharded_numel}"
                return [(layout.name, tensors, [(None, why, None)] * len(tensors))]
            return [(piece.name, [(role, i, path, t if parts is None else parts[k])
                                  for (role, i, path, t), parts in zip(tensors, split)],
                     [None if parts is None else (piece.shape, piece.shard, piece.tid if role == "param" else None)
                      for (role, *_), parts in zip(tensors, split)])
                    for k, piece in enumerate(layout.pieces) if piece.shard_numel]
        entry = self.originals.get(key)
        if entry is not None and entry[0]() is p:
            piece = entry[1]
            return [(None, tensors, [(piece.shape, piece.shard, None) if t.dim() == 1 and t.numel() == p.numel()
                                     else None for *_, t in tensors])]
        return None

    def final_params(self, params: list[tuple[str, torch.Tensor]]) -> tuple[list, list]:
        """The final event's (path, tensor) pairs with FSDP1 FlatParameters split into their original
        parameters (paths `.name`), and the marks of their rows (`mark`)."""
        out, marks = [], []
        for path, p in params:
            parts = self.step_parts(p, [("param", 0, path, p)])
            if parts is None:
                out.append((path, p))
                marks.append(None)
                continue
            for name, ((*_, t),), (m,) in parts:
                out.append((path if name is None else f".{name}", t))
                marks.append(m)
        return out, marks


def mark(rows: list[list], marks: list) -> None:
    """Put `step_parts`' marks into the rows: the original shape, the shard, a stable tid."""
    for row, m in zip(rows, marks):
        if m is None:
            continue
        shape, shard, tid = m
        if shape is not None:
            row[_SHAPE] = shape
        row[_SHARD] = shard
        if tid is not None:
            row[_TID] = tid
