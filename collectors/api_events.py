"""API-level events: the training calls that invariants are about, as rows of `api_events`.

`ApiRecorder(store, naming)` wraps, while a recording runs, the calls a training loop makes
around the model: `Optimizer.zero_grad` and `Module.zero_grad`, `torch.autograd.backward` and
`Tensor.backward`, gradient clipping, learning-rate scheduler steps and `GradScaler.update`, and
takes a global optimizer step post hook for the optimizer's param groups. At each root module
forward (the Collector tells it: `root_forward`) it also writes, once per step and root, the
`params` row (every parameter's requires_grad, dtype, device, xor digest and storage) and at
every root forward the `modes` row (which mode-sensitive modules are in training mode), and a
`read` row for each value the training reads out of a tensor (collectors/reads.py). Row
formats, one JSON `value` per kind, are in docs/INVARIANTS_CONTRACT (section 1) and below.

Scalars (a loss, a clipping norm, the loss scale) are kept as tensors and read when the step
ends (the optimizer step post hook), so a CUDA step is never synchronised inside; the rows of a
step are handed to the store there. Every wrapper calls the original with the caller's own
arguments and only reads what goes in and out: the training's numbers are a plain run's. A
failure inside a wrapper is a collector error (reported once), never the training's.

With a checker (`bitguard record --check inv.json`) the recorder keeps the step's rows (its own
and the Collector's events and tensors, teed from the store) and, when the next step begins or
the recording ends, builds the step's facts and checks them (backend/invariants): each violation
is a `violations` row and one line on stderr.

What it misses, by design: `clip_grad_norm_` is seen wherever it is imported from (its inner
`_clip_grads_with_norm_` is wrapped in torch.nn.utils.clip_grad, which it looks up at call time),
but `clip_grad_value_` and the public `clip_grads_with_norm_` only through their module
attributes (a `from torch.nn.utils import clip_grad_value_` made before the recording started
is not seen); an optimizer or scheduler subclass whose own `zero_grad`/`step` does not call
torch's is not seen; FSDP's `clip_grad_norm_` method is its own code (not seen); modules added
to a model after its first forward are not in its `modes` rows. It knows nothing of how rows are
stored or of what an invariant is.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import sys
import threading
import time
import weakref

import torch

from bitguard.collectors.compiled import eager_name, is_compiling, original as uncompiled
from bitguard.collectors.guarded import Guarded
from bitguard.collectors.reads import Reads
from bitguard.collectors.settings import FinalSettings, groups_of, num, numbers_of, plain, settings_of
from bitguard.collectors.sharded import clean_name
from bitguard.collectors.weights import initialising_step, library_name
from bitguard.cuda.fingerprint import digest_many, resolve
from bitguard.schema import API_EVENTS, EVENTS, TENSORS, VIOLATIONS

_MODE_CLASSES = re.compile(r"Dropout|BatchNorm")  # modules whose mode matters even if forward hides it
MAX_PRINTED_VIOLATIONS = 200  # stderr lines; every violation is in the table whatever the count
MAX_PENDING_ROWS = 4096  # rows held for their step's end before they are written regardless
MAX_KEPT_EVENTS = 200_000  # with --check: events kept for the steps not checked yet (a loop that never steps)
_FACT_KINDS = ("grad", "step", "batch")  # event kinds step facts read (and root module forwards)


class CollectorNaming:
    """Names and steps as the Collector (collectors/hooks.py) gives them: parameters and modules
    by the collector's own maps, steps by its counter (a call after an optimizer.step() ended
    belongs to the next step, as events do)."""

    def __init__(self, collector):
        self.collector = collector

    def step(self) -> int:
        c = self.collector
        return c.step + (1 if c._advance else 0)

    def ending_step(self) -> int:
        """The step an optimizer step post hook ends (the Collector has not advanced yet)."""
        return self.collector.step

    def param_name(self, p) -> str | None:
        entry = self.collector._params.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def module_name(self, m) -> str | None:
        entry = self.collector._names.get(id(m))
        return entry[1] if entry is not None and entry[0]() is m else None

    def adopt_root(self, m) -> None:
        """A model the training updates but may never call (an AveragedModel): a root of its own,
        held until the recording ends, so that its final state is recorded."""
        if self.module_name(m) is None:
            self.collector._register_root(m)


class OnlineNaming:
    """Names and steps as online mode's monitor (collectors/online/monitor.py) gives them: modules by
    its ModuleNames (the roots a sensor met), parameters by those roots' named_parameters(), steps
    by its counter. Online mode wraps no module call: its recordings hold no params or modes rows."""

    def __init__(self, monitor):
        self.monitor = monitor
        self._params: dict[int, tuple[weakref.ref, str]] = {}
        self._roots_seen = 0

    def step(self) -> int:
        return self.monitor.steps_seen()

    def ending_step(self) -> int:
        """The step an optimizer step post hook ends (the monitor's own hook, before ours, advanced it)."""
        return self.monitor._step

    def param_name(self, p) -> str | None:
        entry = self._params.get(id(p))
        if entry is None or entry[0]() is not p:
            self._learn()
            entry = self._params.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def module_name(self, m) -> str | None:
        entry = self.monitor.module_name._names.get(id(m))
        return entry[1] if entry is not None and entry[0]() is m else None

    def adopt_root(self, m) -> None:
        """(Online mode records no final state.)"""

    def _learn(self) -> None:
        """Name the parameters of every root the monitor has met since the last look."""
        names = self.monitor.module_name
        if len(names._roots) == self._roots_seen:
            return
        self._roots_seen = len(names._roots)
        for ref, name in list(names._names.values()):
            root = ref()
            if root is not None and name in names._roots:
                for n, p in torch.nn.Module.named_parameters(root, remove_duplicate=False):  # (not an override's)
                    self._params.setdefault(id(p), (weakref.ref(p), clean_name(eager_name(n))))


def _digests(params: list) -> list:
    """The parameters' digests (`digest_many`); in the place of one that cannot be digested (the
    meta device before a model is materialised, a subclass without values), why, as a string."""
    try:
        return digest_many([p.detach() for p in params])
    except Exception:  # noqa: BLE001 - one parameter spoils the batch: digest each alone
        out = []
        for p in params:
            try:
                out.append(digest_many([p.detach()])[0])
            except Exception as exc:  # noqa: BLE001
                out.append(f"{type(exc).__name__}: {exc}")
        return out


class _Pending:
    """A row whose value still holds tensors (scalars to read when the step ends)."""

    __slots__ = ("step", "ord", "kind", "target", "value", "t_ns", "later")

    def __init__(self, step, ord_, kind, target, value, t_ns, later):
        self.step, self.ord, self.kind, self.target, self.value, self.t_ns = step, ord_, kind, target, value, t_ns
        self.later = later  # [(key, tensor or pending digest, how to read it)], filled into value at the step's end


class _Params(list):
    """Parameters whose names go in a row when its step ends."""

    __slots__ = ()


def _wrapper_stepping(optimizer, frame, depth: int = 6, foreign: bool = False):
    """The optimizer whose step() called `optimizer`'s (a frame among the `depth` that called the step hook,
    whose `self` is another optimizer holding this one as an attribute), None without one: torch_optimizer's
    Lookahead keeps its slow weights in its own state and never calls Optimizer.__init__, so no step hook runs
    for it (helper 54: its slow weights halved after the last step compared identical). `foreign`: of another
    library's optimizer, whose wrapper is no torch.optim one either (fastai's Lookahead): any object whose
    `step` it is."""
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if owner is not None and owner is not optimizer and (
                isinstance(owner, torch.optim.Optimizer) or (foreign and frame.f_code.co_name == "step")):
            attributes = getattr(owner, "__dict__", None)
            if type(attributes) is dict and any(v is optimizer for v in attributes.values()):
                return owner
        frame = frame.f_back
    return None


def _readable(params) -> list:
    """The parameters a clipping call was given, when reading them leaves them to the call: a
    tensor, a list or a tuple (a generator is the call's to consume: its names are not recorded)."""
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params) if isinstance(params, (list, tuple)) else []


def _mode_matters(module: torch.nn.Module) -> bool:
    """Is a module's training/eval mode part of what it computes (Dropout*, BatchNorm*, a forward that reads
    self.training, or a forward pre-hook that does: torch.nn.utils.spectral_norm's power iteration, helper 85)?"""
    cls = type(module)
    if any(_MODE_CLASSES.search(k.__name__) for k in cls.__mro__ if k is not torch.nn.Module):
        return True
    return any(_reads_training(fn) for fn in (getattr(cls, "forward", None), *module._forward_pre_hooks.values()))


def _reads_training(fn) -> bool:
    """Does a function, or a callable object's __call__, name `training`?"""
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return code is not None and "training" in code.co_names


class ApiRecorder(Guarded):
    def __init__(self, store, naming, fail, rank: int = 0, out=sys.stderr):
        self.store = store
        self.naming = naming
        self._fail = fail  # fail(where, exc): the owner's collector-error report (recorded once, on stderr)
        self.rank = rank
        self.enabled = True
        self.checker = None  # backend/invariants Checker, with --check
        self.violations = 0
        self._out = out
        self._ord = 0
        self._pending: list[_Pending] = []  # rows of the step in progress
        self._backwards: dict[int, int] = {}  # step -> backward calls
        self._indices: dict[str, weakref.WeakKeyDictionary] = {}  # class name -> object -> index
        self._param_names: dict[int, tuple[weakref.ref, str]] = {}  # names of parameters the collector skips
        self._params_step: dict[int, int] = {}  # id(root) -> step of its last params row
        self._mode_modules: dict[int, tuple[weakref.ref, list]] = {}  # id(root) -> [(name, ref)]
        self._scaled: dict[int, tuple[weakref.ref, object]] = {}  # GradScaler.scale outputs -> their scaler
        self._local = threading.local()
        self._restore: list[tuple[object, str, object, object]] = []  # (owner, attr, original, wrapper)
        self._handles: list = []
        self._norm_type = threading.local()
        # with a checker: the rows of steps not yet checked
        self._kept_api: list[dict] = []
        self._kept_events: list[tuple] = []
        self._kept_tensors: list[list] = []
        self._checked = -1
        self._reads: Reads | None = None  # what the training reads out of its tensors (collectors/reads.py)
        self._store_add = None
        self._overflow = False
        # the optimizers and schedulers made or stepped, for the end of the recording (collectors/settings.py)
        self._final = FinalSettings(self._index, self._guarded)
        # id of an optimizer -> (it, the optimizer whose step() called its step, or None), found at its first step
        self._wrappers: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}

    # -- installation ----------------------------------------------------------------------
    def install(self) -> ApiRecorder:
        """Wrap the calls and take the step hook; a failure here is a collector error, and what was
        installed until then stays (remove() takes it out)."""
        self._guarded(self._install)
        return self

    def _install(self) -> None:
        from torch.nn.utils import clip_grad
        from torch.optim import lr_scheduler
        from torch.optim import optimizer as optim
        from torch.optim import swa_utils

        self._wrap(torch.optim.Optimizer, "zero_grad", self._zero_grad_of(True), outermost="zero_grad")
        self._wrap(torch.nn.Module, "zero_grad", self._zero_grad_of(False), outermost="zero_grad")
        # Tensor.backward calls torch.autograd.backward: one row, the outermost call's
        self._wrap(torch.autograd, "backward", self._on_backward, outermost="backward")
        self._wrap(torch.Tensor, "backward", self._on_tensor_backward, outermost="backward")
        # clip_grad_norm_ however it was imported: it looks these two up in its module when it runs
        self._wrap(clip_grad, "_get_total_norm", self._on_total_norm, before=True)
        self._wrap(clip_grad, "_clip_grads_with_norm_", self._on_clip_norm, before=True)
        if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is not None:  # (the same function, by name)
            self._wrap(torch.nn.utils, "clip_grads_with_norm_", self._on_clip_norm, before=True)
        for owner in (clip_grad, torch.nn.utils):
            self._wrap(owner, "clip_grad_value_", self._on_clip_value, before=True)
        schedulers = [c for c in vars(lr_scheduler).values() if isinstance(c, type) and issubclass(c, lr_scheduler.LRScheduler)]
        for cls in dict.fromkeys([lr_scheduler.LRScheduler, *schedulers]):
            if "step" in vars(cls):
                self._wrap(cls, "step", self._on_scheduler_step, outermost="scheduler")
            if "__init__" in vars(cls):  # (ReduceLROnPlateau's constructor takes no step: seen when made)
                self._wrap(cls, "__init__", self._on_scheduler_made, outermost="scheduler_made")
        # an averaged copy (SWA, EMA) is updated and often never called: its final state is the model saved
        self._wrap(swa_utils.AveragedModel, "update_parameters", self._on_averaged_update)
        self._wrap(torch.optim.Optimizer, "__init__", self._on_optimizer_made, outermost="optimizer_made")
        self._wrap(torch.amp.GradScaler, "scale", self._on_scale)
        self._wrap(torch.amp.GradScaler, "update", self._on_scaler_update)
        self._handles.append(optim.register_optimizer_step_post_hook(self.guard(self._on_optimizer_step)))
        # the numbers the training reads out of tensors (an evaluation's loss or accuracy, a logged metric,
        # a prediction's score): what it makes of the model's outputs outside every module (helper 33)
        self._reads = Reads(self, num).install()
        self._final.install()

    def remove(self) -> None:
        """Write what the last step left, check it, and put every wrapped function back."""
        self.guard(self._settings_at_end)()
        self._final.remove()  # (the finalizers out even where a failure disabled the recorder)
        self.guard(self._end_step)(None)
        self.guard(self._check_through)(None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._reads is not None:
            self._reads.remove()
        for owner, attr, original, wrapper in reversed(self._restore):
            if owner.__dict__.get(attr) is wrapper:  # (wrapped again since by someone else: ours passes through)
                setattr(owner, attr, original)
        self._restore.clear()
        if self._store_add is not None and self.store.__dict__.get("add") is not None:
            del self.store.add
        self.enabled = False

    def check_with(self, checker) -> None:
        """Check each step against `checker` (backend/invariants Checker) when it ends; the
        Collector's rows of the step are teed from the store for its facts."""
        self.checker = checker
        add = self._store_add = self.store.add

        def teed(event, tensors, stacks, dumps=()):
            # only what step facts read: gradients, optimizer steps, batches and root forwards
            if self.enabled and (event[7] in _FACT_KINDS or (event[7] == "module" and event[4] == "forward"
                                                             and event[9] == 0)):
                if len(self._kept_events) < MAX_KEPT_EVENTS:
                    self._kept_events.append(event)
                    self._kept_tensors.extend(list(r) for r in tensors)
                elif not self._overflow:
                    self._overflow = True
                    self._fail("invariant check", OverflowError(
                        f"more than {MAX_KEPT_EVENTS} events without a step's end: the steps from {event[3]} on "
                        f"are checked without them"))
            return add(event, tensors, stacks, dumps)

        self.store.add = teed

    def _wrap(self, owner, attr: str, on, before: bool = False, outermost: str | None = None) -> None:
        """Replace owner.attr by a wrapper calling the original with the caller's arguments. `on` is
        called (guarded) with (args, kwargs, output) after it returns, or with (args, kwargs) before
        it runs when `before`; `outermost`: only the outermost of nested calls of that name is seen.
        The original runs with exactly the caller's arguments, and its exceptions go to the caller."""
        original = owner.__dict__[attr] if attr in owner.__dict__ else getattr(owner, attr)
        guarded = self._guarded
        local = self._local

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not self.enabled or is_compiling():
                return original(*args, **kwargs)
            if outermost is not None:
                if getattr(local, outermost, False):
                    return original(*args, **kwargs)
                setattr(local, outermost, True)
            try:
                if before:
                    guarded(on, args, kwargs)
                out = original(*args, **kwargs)
                if not before:
                    guarded(on, args, kwargs, out)
                return out
            finally:
                if outermost is not None:
                    setattr(local, outermost, False)

        setattr(owner, attr, wrapper)
        self._restore.append((owner, attr, original, wrapper))

    # -- failure containment (collectors/guarded.py) ---------------------------------------
    def _where(self, fn) -> str:
        return f"api events {getattr(fn, '__name__', 'hook')}"

    # -- rows ------------------------------------------------------------------------------
    def _add(self, kind: str, target: str, value: dict, later=(), step: int | None = None) -> None:
        step = self.naming.step() if step is None else step
        if self.checker is not None and step > self._checked + 1:
            self._check_through(step)
        self._pending.append(_Pending(step, self._ord, kind, target, value, time.time_ns(), list(later)))
        self._ord += 1
        if len(self._pending) >= MAX_PENDING_ROWS:  # a loop that never steps (evaluation): rows go out anyway
            self._end_step(None)

    def _index(self, obj) -> str:
        """`Class#i`: i counts the objects of that class in the order they were first seen; an optimizer
        of tensors a library names (Pyro's, one a parameter, made in an order that changes from run to
        run: weights.library_name) is `Class(names)`."""
        name = type(obj).__name__
        if isinstance(obj, torch.optim.Optimizer):
            named = []
            for p in (p for group in obj.param_groups for p in group.get("params", ())):
                named.append(library_name(p))
                if named[-1] is None:  # (the common case: at the first parameter)
                    break
            if named and named[-1] is not None:
                return f"{name}({', '.join(named)})"
        seen = self._indices.setdefault(name, weakref.WeakKeyDictionary())
        i = seen.get(obj)
        if i is None:
            i = seen[obj] = len(seen)
        return f"{name}#{i}"

    def _name(self, p, i: int) -> str:
        name = self.naming.param_name(p)
        if name is None:
            entry = self._param_names.get(id(p))
            name = entry[1] if entry is not None and entry[0]() is p else f"<unnamed {i}>"
        return name

    def _names(self, params) -> _Params:
        """The parameters, named when the step ends (a zero_grad before the model's first forward
        comes before the collector has met, and named, its parameters)."""
        return _Params(params)

    def _named(self, obj):
        """`obj` with each `_Params` in it replaced by the parameters' names."""
        if type(obj) is _Params:
            return [self._name(p, i) for i, p in enumerate(obj)]
        if isinstance(obj, dict):
            return {k: self._named(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._named(v) for v in obj]
        return obj

    # -- the wrapped calls -----------------------------------------------------------------
    def _zero_grad_of(self, optimizer: bool):
        default = True  # torch's default set_to_none, read from the function it wraps below

        owner = torch.optim.Optimizer if optimizer else torch.nn.Module
        try:
            default = inspect.signature(owner.zero_grad).parameters["set_to_none"].default
        except (KeyError, ValueError, TypeError):
            pass

        def on_zero_grad(args, kwargs, out):
            this = args[0]
            set_to_none = kwargs.get("set_to_none", args[1] if len(args) > 1 else default)
            if optimizer:
                params = [p for g in this.param_groups for p in g["params"]]
                target = self._index(this)
            else:  # (a compiled model's zero_grad is its model's: helper 90, "called in B" beside "not called in B")
                params, this = list(this.parameters()), uncompiled(this)
                target = self.naming.module_name(this) or type(this).__name__
            self._add("zero_grad", target, {"set_to_none": bool(set_to_none), "params": self._names(params)})

        on_zero_grad.__name__ = "zero_grad"
        return on_zero_grad

    def _on_tensor_backward(self, args, kwargs, out):
        self._backward_row(args[0])

    def _on_backward(self, args, kwargs, out):
        roots = args[0] if args else kwargs.get("tensors")
        self._backward_row(roots[0] if isinstance(roots, (list, tuple)) and roots else roots, roots)

    def _backward_row(self, root, roots=None) -> None:
        step = self.naming.step()
        call = self._backwards.get(step, 0)
        self._backwards[step] = call + 1
        value = {"value": None, "shape": list(getattr(root, "shape", ())), "dtype": str(getattr(root, "dtype", "")).removeprefix("torch."),
                 "call": call, "roots": len(roots) if isinstance(roots, (list, tuple)) else 1}
        later = []
        if isinstance(root, torch.Tensor) and root.numel() == 1:
            later.append(("value", root.detach(), None))
            scaled = self._scaled.get(id(root))
            if scaled is not None and scaled[0]() is root and getattr(scaled[1], "_scale", None) is not None:
                later.append(("scaled_by", scaled[1]._scale.detach().clone(), None))
        self._add("backward", "loss", value, later, step)

    def _on_total_norm(self, args, kwargs):
        self._norm_type.value = kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0)

    def _on_clip_norm(self, args, kwargs):
        params = _readable(args[0] if args else kwargs.get("parameters"))
        max_norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
        total = kwargs.get("total_norm", args[2] if len(args) > 2 else None)
        norm_type = getattr(self._norm_type, "value", None)
        self._norm_type.value = None
        value = {"max_norm": plain(max_norm), "norm_type": plain(norm_type), "total_norm": None,
                 "params": self._names(params)}
        later = [("total_norm", total.detach(), None)] if isinstance(total, torch.Tensor) else []
        self._add("clip_grad_norm", "clip", value, later)

    def _on_clip_value(self, args, kwargs):
        params = _readable(args[0] if args else kwargs.get("parameters"))
        clip = kwargs.get("clip_value", args[1] if len(args) > 1 else None)
        self._add("clip_grad_value", "clip", {"clip_value": plain(clip), "params": self._names(params)})

    def _on_scheduler_step(self, args, kwargs, out):
        sched = args[0]
        # (nothing is set on the scheduler: its state_dict() holds every attribute it has)
        initial = getattr(sched, "_step_count", None) == 1  # 0 before the step its constructor takes
        last = sched.get_last_lr() if hasattr(sched, "get_last_lr") else []
        value = {"last_lr": [plain(x) for x in last], "class": type(sched).__name__,
                 "optimizer": self._index(sched.optimizer) if hasattr(sched, "optimizer") else None}
        epoch = getattr(sched, "last_epoch", None)  # (its count: a scheduler a resume did not restore differs here
        if type(epoch) is int:  # first, steps before its learning rate does: helper 38)
            value["last_epoch"] = epoch
        # the scheduler's constructor steps it once: a scheduler exists, it was not stepped by the loop
        self._add("scheduler_init" if initial else "scheduler_step", self._index(sched), value)
        self._final.scheduler_seen(sched)

    def _on_scheduler_made(self, args, kwargs, out):
        if args:
            self._final.scheduler_seen(args[0])

    def _on_averaged_update(self, args, kwargs, out):
        if args and isinstance(args[0], torch.nn.Module):
            self.naming.adopt_root(args[0])

    def _on_optimizer_made(self, args, kwargs, out):
        if args and isinstance(args[0], torch.optim.Optimizer):
            self._final.optimizer_made(args[0])

    def _on_scale(self, args, kwargs, out):
        if isinstance(out, torch.Tensor):
            self._scaled = {k: v for k, v in self._scaled.items() if v[0]() is not None}
            self._scaled[id(out)] = (weakref.ref(out), args[0])

    def _on_scaler_update(self, args, kwargs, out):
        scaler = args[0]
        enabled = bool(getattr(scaler, "_enabled", True))
        scale = getattr(scaler, "_scale", None)
        later = [("scale", scale.detach().clone(), None)] if enabled and isinstance(scale, torch.Tensor) else []
        # (its schedule too: growth_factor 2 against 3, never reached in the window, compared identical: helper 92)
        schedule = {k: plain(getattr(scaler, f"_{k}", None)) for k in ("growth_factor", "backoff_factor",
                                                                        "growth_interval")}
        self._add("loss_scale", self._index(scaler), {"scale": None if later else 1.0, "enabled": enabled,
                                                      **{k: v for k, v in schedule.items() if v is not None}}, later)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if initialising_step():  # (torch.distributed.checkpoint filling the state in: no training step)
            return
        step = self.naming.ending_step()
        settings = [settings_of(g) for g in optimizer.param_groups]
        target = self._index(optimizer)
        if not self._final.known(optimizer):  # its first step: who stepped it (not every step's cost)
            wrapper = _wrapper_stepping(optimizer, sys._getframe(1))
            if wrapper is not None and id(wrapper) not in self._final.stepped:
                self._final.optimizer_stepped(wrapper, [settings_of(g) for g in groups_of(wrapper)], self._index(wrapper))
            self._wrappers[id(optimizer)] = (weakref.ref(optimizer), weakref.ref(wrapper) if wrapper is not None else None)
        self._final.optimizer_stepped(optimizer, settings, target)
        groups = [{**s, "params": self._names(g["params"])} for s, g in zip(settings, optimizer.param_groups)]
        value = {"groups": groups}
        entry = self._wrappers.get(id(optimizer))
        wrapper = entry[1]() if entry is not None and entry[0]() is optimizer and entry[1] is not None else None
        numbers = {**numbers_of(optimizer), **(numbers_of(wrapper, f"{type(wrapper).__name__}.") if wrapper else {})}
        if numbers:  # (none for torch.optim's own: its rows stay as they were)
            value["attributes"] = numbers
        self._add("optimizer_step", target, value, step=step)
        self._end_step(step)

    def _settings_at_end(self) -> None:
        """When the recording ends, each optimizer's and scheduler's settings and state as the training left
        them (`optimizer_settings`, `scheduler_settings`: collectors/settings.py): a learning rate set by hand
        after the last step() (a plateau callback's, helper 50), a momentum buffer edited, a scheduler's
        patience, reach no recorded tensor, yet a training that went on or resumed from here would differ
        (backend/compare.py, `final_settings`)."""
        for kind, target, value in self._final.rows():
            self._add(kind, target, value)

    def foreign_stepped(self, optimizer) -> None:
        """Another library's optimizer updated the weights (Keras', fastai's: collectors/foreign_steps.py):
        its settings at each step, as torch.optim's (helper 75: fastai's lr raised from a step showed no
        setting that differs), and its settings and state when the recording ends (helper 50)."""
        settings = [settings_of(g) for g in groups_of(optimizer)]
        try:
            if id(optimizer) not in self._final.stepped:  # (its first step: a wrapper that stepped it, fastai's Lookahead)
                wrapper = _wrapper_stepping(optimizer, sys._getframe(1), foreign=True)
                if wrapper is not None:
                    self._final.optimizer_stepped(wrapper, [settings_of(g) for g in groups_of(wrapper)],
                                                  self._index(wrapper))
            self._final.optimizer_stepped(optimizer, settings, self._index(optimizer))
        except TypeError:  # (not weakly referable: left out)
            pass
        if settings:
            self._add("optimizer_step", self._index(optimizer), {"groups": settings}, step=self.naming.ending_step())

    # -- root modules ----------------------------------------------------------------------
    def root_forward(self, module: torch.nn.Module, name: str, digested: dict | None = None) -> None:
        """A root module's forward begins (the Collector calls this): its `modes` row, and once per
        step its `params` row (`digested`: id of a parameter -> its digest, taken already by the
        Collector's params event)."""
        self._guarded(self._root_forward, module, name, digested)

    def _root_forward(self, module: torch.nn.Module, name: str, digested: dict | None) -> None:
        if next(module.parameters(), None) is None:  # a loss or a functional module called on its own: no model
            return
        step = self.naming.step()
        if self._params_step.get(id(module)) != step:
            self._params_step[id(module)] = step
            self._params_row(module, name, step, digested or {})
        self._add("modes", name, self._modes(module, name), step=step)

    def _params_row(self, module: torch.nn.Module, name: str, step: int, digested: dict) -> None:
        # (torch's walk, not an override's: torchrl's LossModule has the signature before remove_duplicate, helper 47)
        named = [(clean_name(eager_name(n)), p) for n, p in torch.nn.Module.named_parameters(module, remove_duplicate=False)]
        unique, seen = [], {}
        for n, p in named:
            if id(p) not in seen:
                seen[id(p)] = len(unique)
                unique.append(p)
            if self.naming.param_name(p) is None:
                self._param_names[id(p)] = (weakref.ref(p), n)
        missing = [p for p in unique if id(p) not in digested]
        taken = iter(_digests(missing) if missing else ())
        digests = [digested[id(p)] if id(p) in digested else next(taken) for p in unique]
        storages: dict[int, int] = {}
        value, later = {}, []
        for n, p in named:
            try:
                key = p.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - a parameter without storage (meta, a subclass)
                key = -id(p)
            value[n] = {"requires_grad": p.requires_grad, "dtype": str(p.dtype).removeprefix("torch."),
                        "device": str(p.device), "xor": None, "storage": storages.setdefault(key, len(storages)),
                        "model_param": True}
            got = digests[seen[id(p)]]
            if isinstance(got, str):  # not digested: xor stays None (unknown, never a value)
                value[n]["unobserved"] = got
            else:
                later.append((n, got, "xor"))
        self._add("params", name, value, later, step)

    def _modes(self, module: torch.nn.Module, name: str) -> dict:
        entry = self._mode_modules.get(id(module))
        if entry is None or entry[0]() is not module:
            subs = [(self.naming.module_name(m) or clean_name(eager_name(n)) or name, weakref.ref(m))
                    for n, m in module.named_modules() if m is not module and _mode_matters(m)]
            entry = self._mode_modules[id(module)] = (weakref.ref(module), [(name, weakref.ref(module))] + subs)
        modes = {"training": [], "eval": []}
        for n, ref in entry[1]:
            m = ref()
            if m is not None:
                modes["training" if m.training else "eval"].append(n)
        return modes

    # -- the end of a step -----------------------------------------------------------------
    def _end_step(self, step: int | None) -> None:
        """Read the step's scalars and digests, and hand its rows to the store (all pending rows
        when `step` is None: the recording ends)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        tensors = [(r, i) for r in pending for i, item in enumerate(r.later) if isinstance(item[1], torch.Tensor)]
        values = [t.item() for t in (r.later[i][1] for r, i in tensors)]  # at the step's end: no sync inside it
        for (r, i), v in zip(tensors, values):
            key, _, how = r.later[i]
            r.later[i] = (key, v, how)
        digests = [item for r in pending for item in r.later if item[2] == "xor"]
        answers = iter(resolve([item[1] for item in digests]))
        rows = []
        for r in pending:
            value = r.value
            for key, v, how in r.later:
                if how == "xor":
                    value[key]["xor"] = f"{next(answers)[0]:016x}"
                else:
                    value[key] = num(v)
            if r.kind == "backward":
                value["calls_in_step"] = self._backwards.get(r.step, 0)
            elif r.kind != "params":
                value = self._named(value)
            row = {"step": r.step, "rank": self.rank, "ord": r.ord, "kind": r.kind, "target": r.target,
                   "value": json.dumps(value), "t_ns": r.t_ns}
            rows.append(row)
        self._backwards = {s: n for s, n in self._backwards.items() if step is not None and s > step}
        self.store.add_rows(API_EVENTS.name, rows)
        if self.checker is not None:
            self._kept_api.extend(rows)

    def _check_through(self, upto: int | None) -> None:
        """Check every kept step before `upto` that is not checked yet (when None, at the end: every
        kept step that an optimizer step ended; what follows the last one is no training step)."""
        if self.checker is None:
            return
        steps = {r["step"] for r in self._kept_api} | {e[3] for e in self._kept_events}
        if upto is None:
            steps = {r["step"] for r in self._kept_api if r["kind"] == "optimizer_step"}
        for step in sorted(s for s in steps if s > self._checked and (upto is None or s < upto)):
            self._check_step(step)
            self._checked = step

    def _check_step(self, step: int) -> None:
        from bitguard.backend.invariants.facts import step_facts

        api = [r for r in self._kept_api if r["step"] == step]
        events = [e for e in self._kept_events if e[3] == step]
        seqs = {e[0] for e in events}
        tensors = [r for r in self._kept_tensors if r[0] in seqs]
        self._kept_api = [r for r in self._kept_api if r["step"] > step]
        self._kept_events = [e for e in self._kept_events if e[3] > step]
        self._kept_tensors = [r for r in self._kept_tensors if r[0] not in seqs]
        self._overflow = False
        event_names, tensor_names = EVENTS.names, TENSORS.names  # (a property: a new list each read)
        event_rows = [dict(zip(event_names, e)) for e in events]
        tensor_rows = [dict(zip(tensor_names, r)) for r in tensors]
        pending = [row for row in tensor_rows if not isinstance(row["xor"], int)]
        if pending:  # GPU digests: read back now (the writer thread reads the same batches: either is first)
            for row, (x, p) in zip(pending, resolve([row["xor"] for row in pending])):
                row["xor"], row["pos"] = x, p
        facts = step_facts(api, event_rows, tensor_rows)
        found = self.checker.check_step(facts)
        rows = []
        for v in found:
            rows.append({"step": v.step, "rank": v.rank, "invariant_id": v.invariant_id, "template": v.template,
                         "message": v.message, "evidence": json.dumps(v.evidence, default=str), "t_ns": time.time_ns()})
            if self.violations < MAX_PRINTED_VIOLATIONS:
                print(f"bitguard: invariant violated at step {v.step} rank {v.rank}: {v.message}", file=self._out)
            self.violations += 1
        if rows:
            self.store.add_rows(VIOLATIONS.name, rows)
