"""Optimizers' and LR schedulers' settings as JSON holds them, and what each holds when the recording ends.

The settings of a param group (`settings_of`), another library's optimizer's (`groups_of`, `numbers_of`) and one
digest of an optimizer's state (`state_digest`) go in the rows of collectors/api_events.py. `FinalSettings`
keeps, for the end of the recording, each optimizer and LR scheduler the training made or stepped: a setting
made after the last step (a learning rate set by a plateau callback, a scheduler's patience) reaches no
recorded tensor, yet a training that went on, or resumed from here, would differ (backend/compare.py,
`final_settings`). Most scripts train inside a function that returns before the recording ends, and its
optimizer and scheduler go with it (a learning rate set after the last step in `main()` compared identical):
each is read when it is freed, by a finalizer (`__del__`) set on torch.optim.Optimizer and LRScheduler while
the recording runs, and the living ones when it ends.

What it misses: a class with its own `__del__` that does not call ours; an object freed by the cyclic
collector that was never stepped (its weak references are cleared before it is finalized: its name is
not known); the state of an optimizer freed with tensors on a device (its settings are read).
"""

from __future__ import annotations

import collections.abc
import hashlib
import math
import weakref

import torch

from bitguard.cuda.fingerprint import digest_async, resolve


def num(x):
    """A float for JSON: finite as it is, otherwise 'nan', 'inf' or '-inf' (JSON has no such numbers)."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


def plain(v):
    """A hyperparameter as JSON can hold it (a one-element tensor as its float), or None to leave out."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return num(v) if isinstance(v, float) else v
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return num(v.item())
    if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float, torch.Tensor)) for x in v):
        items = [plain(x) for x in v]
        return None if any(x is None for x in items) else items
    return None


def settings_of(group: dict) -> dict:
    """A param group's hyperparameters as JSON holds them (those it can)."""
    return {k: v for k, v in ((k, plain(v)) for k, v in group.items() if k != "params") if v is not None}


def groups_of(optimizer) -> list[dict]:
    """An optimizer's param groups: torch.optim's, fastai's `hypers`, Keras' learning rate (a variable)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.param_groups
    hypers = getattr(optimizer, "hypers", None)
    if is_sequence(hypers):  # (fastai's is a fastcore `L`, not a list: helper 75, an lr set after fit compared identical)
        return [h for h in hypers if isinstance(h, dict)]
    if isinstance(getattr(optimizer, "variables", None), (list, tuple)) and hasattr(optimizer, "learning_rate"):
        lr = optimizer.learning_rate
        return [{"learning_rate": getattr(lr, "value", lr)}]
    return []


def _state_entries(optimizer):
    """(key, value) of an optimizer's state in a fixed order: torch.optim's each parameter's entries in
    its groups' order; Keras' variables (its moments and iterations; its learning rate is a setting); fastai's per
    parameter state in the order it was made."""
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p) or {}
                yield from ((key, state[key]) for key in sorted(state, key=str))
        return
    variables = getattr(optimizer, "variables", None)
    if isinstance(variables, (list, tuple)):  # (Keras: a KerasVariable's tensor is its `value`)
        rate = getattr(optimizer, "learning_rate", None)  # (`groups_of`)
        yield from ((getattr(v, "path", i), getattr(v, "value", v)) for i, v in enumerate(variables) if v is not rate)
        return
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for entry in state.values():
            if isinstance(entry, dict):
                yield from ((key, entry[key]) for key in sorted(entry, key=str))
    yield from _held_state(optimizer)


# what an optimizer of another library holds that is its parameters, its settings or its state above
_NOT_STATE = frozenset(("param_lists", "param_groups", "params", "hypers", "state", "defaults", "cbs"))


def _held_state(optimizer):
    """(name, value) of the numbers and tensors (alone, or in lists of them, two deep) an optimizer of another
    library keeps in its own attributes: fastai's Lookahead's `slow_weights` and `count` (helper 75: its slow
    weights halved after fit compared identical)."""
    attributes = getattr(optimizer, "__dict__", None)
    if type(attributes) is not dict:
        return
    for key in sorted(k for k in attributes if isinstance(k, str) and k not in _NOT_STATE and not k.startswith("_")):
        value = attributes[key]
        if isinstance(value, (bool, int, float, torch.Tensor)):
            yield key, value
        elif is_sequence(value):
            for i, inner in enumerate(value):
                for j, t in enumerate(inner if is_sequence(inner) else (inner,)):
                    if isinstance(t, torch.Tensor):
                        yield f"{key}.{i}.{j}", t


def is_sequence(value) -> bool:
    """A list, a tuple or another sequence (fastcore's `L`), not a string."""
    return isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes))


def numbers_of(obj, prefix: str = "") -> dict:
    """The public attributes of `obj` that are numbers (an optimizer wrapper's settings outside its param
    groups: Opacus' DPOptimizer's `max_grad_norm` and `noise_multiplier`, helper 77), by name."""
    attributes = getattr(obj, "__dict__", None)
    if type(attributes) is not dict:
        return {}
    return {f"{prefix}{k}": num(v) for k, v in list(attributes.items())
            if not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def state_digest(optimizer, host_only: bool = False) -> str | None:
    """One 64-bit hex digest of an optimizer's state (`_state_entries`): tensors by their digests (one
    that cannot be read by its type), other values by their repr. `host_only`: None where a tensor is
    not in host memory (a finalizer may run inside a digest, and a device's is not reentrant)."""
    parts, digests = [], []
    for key, value in _state_entries(optimizer):
        if isinstance(value, torch.Tensor):
            if host_only and value.device.type != "cpu":
                return None
            try:
                digests.append(digest_async(value.detach()))
                parts.append(None)
                continue
            except Exception as exc:  # noqa: BLE001 - a layout the digest refuses: its type stands in
                value = f"unread {type(exc).__name__}"
        parts.append(f"{key}={plain(value) if plain(value) is not None else type(value).__name__}")
    answers = iter(resolve(digests))
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(("%016x%016x" % next(answers) if part is None else part).encode() + b"\0")
    return h.hexdigest()


# a scheduler's state that says nothing of the learning rates it gives (its `optimizer` is named by the row)
_NOT_SCHEDULE = frozenset(("optimizer", "verbose", "_get_lr_called_within_step", "_is_initial"))
_DEEPEST = 4  # containers into a scheduler's state
_LONGEST = 64  # items of one container


def _jsonable(v, depth: int = 0):
    """A scheduler's state as JSON holds it: numbers, strings and their containers (a bounded walk); a
    one-element host tensor as its number; any other object as its type's name (a repr can hold an address)."""
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return num(v)
    if isinstance(v, str):
        return v[:200]
    if isinstance(v, torch.Tensor):
        return num(v.item()) if v.numel() == 1 and v.device.type == "cpu" else f"tensor {tuple(v.shape)}"
    if type(v).__module__ == "numpy" and getattr(v, "shape", None) == ():  # (a NumPy scalar)
        return _jsonable(v.item(), depth)
    if depth < _DEEPEST and isinstance(v, dict):
        return {str(k): _jsonable(x, depth + 1) for k, x in list(v.items())[:_LONGEST]}
    if depth < _DEEPEST and isinstance(v, (list, tuple)):
        return [_jsonable(x, depth + 1) for x in v[:_LONGEST]]
    return type(v).__name__


def scheduler_state(scheduler) -> dict:
    """A scheduler's class and its `state_dict()` (every attribute but its optimizer, for torch's), as JSON."""
    state = scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else vars(scheduler)
    return {"class": type(scheduler).__name__,
            "state": _jsonable({k: v for k, v in state.items() if k not in _NOT_SCHEDULE})}


def _alive_as(ref: weakref.ref, obj) -> bool:
    """Is `ref` (kept under `id(obj)`) a reference to `obj`, which is being finalized? The cyclic collector
    clears weak references before it finalizes: a dead one under a living object's id is that object's."""
    held = ref()
    return held is obj or held is None


class FinalSettings:
    """The optimizers and schedulers of a recording, for its end (`rows`). `index(obj)` names one as the
    rows of its steps do (ApiRecorder._index); `guarded(fn, obj)` runs a finalizer's reading (never raises)."""

    def __init__(self, index, guarded):
        self._index, self._guarded = index, guarded
        # id -> (ref, its settings at its last step, its name) of each optimizer that stepped
        self.stepped: dict[int, tuple[weakref.ref, list[dict], str]] = {}
        self.made: dict[int, weakref.ref] = {}  # id -> ref of each torch.optim optimizer made while recording
        self.schedulers: dict[int, tuple[weakref.ref, str]] = {}  # id -> (ref, its name)
        self.freed: list[tuple[str, str, dict]] = []  # (kind, target, value) of those freed before the end
        self._finalized: list[tuple[type, object]] = []  # (class, our __del__)

    def optimizer_made(self, optimizer) -> None:
        self.made[id(optimizer)] = weakref.ref(optimizer)

    def optimizer_stepped(self, optimizer, settings: list[dict], name: str) -> None:
        self.stepped[id(optimizer)] = (weakref.ref(optimizer), settings, name)

    def known(self, optimizer) -> bool:
        entry = self.stepped.get(id(optimizer))
        return entry is not None and entry[0]() is optimizer

    def scheduler_seen(self, scheduler) -> None:
        entry = self.schedulers.get(id(scheduler))
        if entry is None or entry[0]() is not scheduler:
            self.schedulers[id(scheduler)] = (weakref.ref(scheduler), self._index(scheduler))

    # -- finalizers ------------------------------------------------------------------------
    def install(self) -> None:
        from torch.optim import lr_scheduler
        self._finalize(torch.optim.Optimizer, self._optimizer_freed)
        for cls in dict.fromkeys((lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)):
            if not any(issubclass(cls, done) for done, _ in self._finalized):  # (older torch: not an LRScheduler)
                self._finalize(cls, self._scheduler_freed)

    def _finalize(self, cls: type, on) -> None:
        if "__del__" in vars(cls):  # (a finalizer of its own stays as it is)
            return
        guarded = self._guarded

        def __del__(obj):
            try:
                guarded(on, obj)
            except Exception:  # noqa: BLE001 - at interpreter exit even the guard's names can be gone
                pass

        cls.__del__ = __del__
        self._finalized.append((cls, __del__))

    def remove(self) -> None:
        for cls, ours in reversed(self._finalized):
            if vars(cls).get("__del__") is ours:
                del cls.__del__
        self._finalized.clear()

    def _optimizer_freed(self, optimizer) -> None:
        key = id(optimizer)
        entry = self.stepped.pop(key, None)
        if entry is not None and _alive_as(entry[0], optimizer):
            self.freed.append(("optimizer_settings", entry[2], _optimizer_value(optimizer, entry[1], host_only=True)))
        ref = self.made.pop(key, None)
        if entry is None and ref is not None and ref() is optimizer:
            self.freed.append(("optimizer_settings", self._index(optimizer),
                               _optimizer_value(optimizer, None, host_only=True)))

    def _scheduler_freed(self, scheduler) -> None:
        entry = self.schedulers.pop(id(scheduler), None)
        if entry is not None and _alive_as(entry[0], scheduler):
            self.freed.append(("scheduler_settings", entry[1], scheduler_state(scheduler)))

    # -- the end ---------------------------------------------------------------------------
    def rows(self) -> list[tuple[str, str, dict]]:
        """(kind, target, value) of each optimizer and scheduler when the recording ends: those freed
        before it, as they were then, and the living ones. The finalizers are taken out first."""
        self.remove()
        rows = list(self.freed)
        for ref, at_step, name in list(self.stepped.values()):
            optimizer = ref()
            if optimizer is not None:
                rows.append(("optimizer_settings", name, _optimizer_value(optimizer, at_step)))
        # (helper 65: an optimizer made after the last step() and never stepped, holding the state a training that
        # went on would use: its state loaded in one run and not in the other compared identical)
        for ref in list(self.made.values()):
            optimizer = ref()
            if optimizer is not None and not self.known(optimizer):
                rows.append(("optimizer_settings", self._index(optimizer), _optimizer_value(optimizer, None)))
        for ref, name in list(self.schedulers.values()):
            scheduler = ref()
            if scheduler is not None:
                rows.append(("scheduler_settings", name, scheduler_state(scheduler)))
        return rows


def _optimizer_value(optimizer, at_step: list[dict] | None, host_only: bool = False) -> dict:
    """`set_after_step`: the settings are not those of its last step (two runs that asked for other settings
    throughout, to no effect, differ at every step alike: that is no difference made after the last one)."""
    settings = [settings_of(g) for g in groups_of(optimizer)]
    return {"groups": settings, "set_after_step": settings != at_step,
            "state": state_digest(optimizer, host_only)}
