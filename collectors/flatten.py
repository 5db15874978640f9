"""A module call's arguments and outputs as (path, tensor) pairs: pytree's key paths, dataclasses,
containers pytree does not know, the tensors other objects hold (a cache object: `held_by`), and what
cannot be flattened said so (`NotFlattened`).

Nothing here knows about events, digests or how rows are stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import fields, is_dataclass

import torch
from torch.utils import _pytree as pytree

from bitguard.collectors.saved import SCALARS, number_tensor, tensors_in
from bitguard.schema import NUMBER_MARK

CALL_DEPTH, CALL_TENSORS, CALL_VISITS = 8, 10_000, 100_000  # the limits of an object's walk (`held_by`)
# what holds no tensor, and modules given as arguments (their weights are their own events')
_NOT_WALKED = (*SCALARS, torch.nn.Module, torch.layout, torch.memory_format)


class NotFlattened(list):
    """What `flatten` gives for a container with a part it could not flatten: the (path, tensor)
    pairs it could read, and the path of the first part it could not and why (`_rows` adds one
    unobserved row for that part, so the event is still recorded, and says what it lacks)."""

    __slots__ = ("path", "reason")

    def __init__(self, pairs: list, path: str, reason: str):
        super().__init__(pairs)
        self.path = path
        self.reason = reason


def joined(parts: list[list]) -> list[tuple[str, torch.Tensor]]:
    """The pairs of several `flatten` results, a `NotFlattened` if one of them was."""
    out = [pair for part in parts for pair in part]
    failed = next((part for part in parts if type(part) is NotFlattened), None)
    return out if failed is None else NotFlattened(out, failed.path, failed.reason)


def flatten(obj, prefix: str = "", numbers: bool = False, walked: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nested container, dataclasses included (a
    `NotFlattened` when a part of it cannot be flattened); `numbers`: also each Python int, float
    or bool, as a 0-d tensor whose path ends in NUMBER_MARK (a module's outputs: a number it returns
    feeds the code after it as a tensor would)."""
    if isinstance(obj, torch.Tensor):  # the common cases, without pytree's cost
        return [(prefix, obj)]
    if type(obj) is tuple:
        out = []
        for i, x in enumerate(obj):
            if not isinstance(x, torch.Tensor):
                break
            out.append((f"{prefix}[{i}]", x))
        else:
            return out
    try:
        leaves, _ = pytree.tree_flatten_with_path(obj)
        parts = []
        for path, leaf in leaves:
            key = prefix + pytree.keystr(path)
            if isinstance(leaf, torch.Tensor):
                parts.append([(key, leaf)])
            elif numbers and type(leaf) in (int, float, bool):
                parts.append([((key + NUMBER_MARK.format(type(leaf).__name__)).lstrip(), number_tensor(leaf))])
            elif is_dataclass(leaf) and not isinstance(leaf, type):
                parts += [flatten(getattr(leaf, f.name), f"{key}.{f.name}", numbers, walked) for f in fields(leaf)]
            elif isinstance(leaf, (Mapping, list, tuple)):  # a subclass pytree does not know (class D(dict))
                parts.append(flatten_without_keys(leaf, key, numbers, walked))
            elif not isinstance(leaf, _NOT_WALKED):  # an object (transformers' DynamicCache): what it holds
                parts.append(held_by(leaf, key, walked))
    except Exception:  # noqa: BLE001 - a node registered without key paths, or any part that fails
        return flatten_without_keys(obj, prefix, numbers, walked)
    return joined(parts)


def flatten_without_keys(obj, prefix: str, numbers: bool = False, walked: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """`flatten` of a tree holding a node registered with pytree without key paths (transformers'
    ModelOutput: `register_pytree_node` without `flatten_with_keys_fn`), on which
    `tree_flatten_with_path` raises. Mappings, lists and tuples are walked by their own keys and
    positions, down to the subtrees that have key paths; a node that is none of those is
    flattened by position, its tensors named `<leaf i>`. A part that cannot be flattened at all
    makes the result a `NotFlattened`."""
    try:
        if isinstance(obj, Mapping):
            items = _mapping_items(obj)
        elif isinstance(obj, (list, tuple)):
            items = [(f"[{i}]", v) for i, v in enumerate(obj)]
        else:
            leaves = pytree.tree_flatten(obj)[0]  # (a dataclass among them is walked by its fields)
            items = [(f"<leaf {i}>", x) for i, x in enumerate(leaves)
                     if not isinstance(x, _NOT_WALKED) or (numbers and type(x) in (int, float, bool))]
        return joined([flatten(value, prefix + path, numbers, walked) for path, value in items])
    except Exception as exc:  # noqa: BLE001 - the event is recorded without these tensors, and says so
        return NotFlattened([], prefix, f"could not flatten {type(obj).__name__}: {type(exc).__name__}: {exc}")


def _mapping_items(obj: Mapping) -> list[tuple[str, object]]:
    """(path, value) of a mapping's items; of a lazy stack of mappings (tensordict's LazyStackedTensorDict)
    whose items hold different keys, or whose items' values cannot be stacked (ragged), each item apart,
    `[i]`: its `items()` give only the keys every item holds, and raise on ragged ones (helper 62: an entry of
    one item that the model read went unrecorded, unsaid; ragged batches were never certified)."""
    parts = getattr(obj, "tensordicts", None) if type(obj).__name__.startswith("LazyStacked") else None
    if not isinstance(parts, (list, tuple)) or not parts:
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    try:
        if len({frozenset(p.keys(True, True)) for p in parts}) == 1:
            return [(f"[{k!r}]", v) for k, v in obj.items()]
    except Exception:  # noqa: BLE001 - not stackable: each item apart
        pass
    return [(f"[{i}]", p) for i, p in enumerate(parts)]


def held_by(obj, prefix: str, walked: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tensors an object among a call's arguments or outputs holds, walked as a save's
    (saved.tensors_in: its attributes, slots, `__getstate__`), named below `prefix`
    (`['past_key_values'].layers[0].keys`); a `NotFlattened` saying why when it cannot be walked
    whole. Not dropped: what the call reads or returns there is observed as any tensor.

    `walked` (id -> the object, weakly where it can be): objects walked already, passed over. The
    collector walks an object where it first meets it in a step: transformers hands one cache to
    every layer, and a training that leaves `use_cache` on fills it from the keys and values the
    layers compute, so walking it at every layer would cost rows quadratic in the layers for
    what their own events already hold."""
    if walked is not None:
        entry = walked.get(id(obj))
        if entry is not None and (entry() if type(entry) is weakref.ref else entry) is obj:
            return []
        try:
            walked[id(obj)] = weakref.ref(obj)
        except TypeError:  # (no weak reference to it: held until the collector forgets the step's objects)
            walked[id(obj)] = obj
    pairs, why = tensors_in(obj, f"{type(obj).__name__} {prefix}".rstrip(), CALL_DEPTH, CALL_TENSORS, CALL_VISITS,
                            save=False)
    pairs = [(prefix + path if path != "[]" else prefix, t) for path, t in pairs]
    return pairs if why is None else NotFlattened(pairs, prefix, why)
