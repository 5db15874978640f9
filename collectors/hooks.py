"""Collectors: the hooks that observe every model boundary of a training process.

`Collector.install()` wraps what every module call runs (`nn.Module._call_impl`: every
`nn.Module`, whenever it was created), attaches a global optimizer step hook, and per-parameter
gradient hooks for every root module it meets. Each observation becomes one event row plus one
row per tensor with its digests.

Gradients are observed without touching the autograd graph's arithmetic: no module backward
hooks (those insert identity nodes, which was seen to reorder gradient sums), only tensor hooks
on tensors that already exist and, on a parameter whose `.grad` is accumulated into, a
post-accumulate hook. Consequences:
- a module's backward event holds `grad_output` (the gradient of each output tensor) and
  `grad_input` (the full gradient of each input tensor that requires grad, i.e. summed over all
  of that tensor's consumers); it completes when all of them have arrived, or at the next
  flush point (next root forward, optimizer step, end) with what did arrive.
- a parameter's gradient event holds `grad_input` (what autograd delivered) and `grad` (the
  `.grad` after accumulation; the same digest when `.grad` was empty), so an accumulation fault
  is told apart from a wrong gradient.
- FSDP parameters (collectors/sharded.py): FSDP2's gradients are taken on the unsharded
  parameters autograd reaches, FSDP1's flat gradient and flat shards are split into the original
  parameters, and a sharded tensor's row says which part this rank holds (`shard`). The step
  event ends the step (the counter advances) even when observing it failed.

A tensor that cannot be digested exactly (nested, compressed sparse, a subclass that does not
hold its values, meta, a digest that raises) and a container that cannot be flattened still get
their row, marked `unobserved` with the reason (observation.py): an event is never dropped.

Nothing here knows how rows are stored (see store.py) or compared (backend/).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections import OrderedDict
from ctypes import string_at as _string_at
from functools import partial
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.nn.parameter import is_lazy

from bitguard.collectors import kept
from bitguard.collectors.api_events import ApiRecorder, CollectorNaming
from bitguard.collectors.beside import JsonWrites
from bitguard.collectors.callstack import StackTable, _is_user
from bitguard.collectors.comm import CommObserver
from bitguard.collectors.compiled import (REGION_PATH, REGION_REASON, CompileWatch, aside_while_tracing, eager_name,
                                          inner_call, is_compiling, jit_tracing,
                                          keep_out_of_dynamo, original, region_of)
from bitguard.collectors.flatten import NotFlattened, flatten
from bitguard.collectors.observation import NO_DIGEST, PLAIN, dims, observe, transformed, unwrapped
from bitguard.collectors.patching import Patch
from bitguard.collectors.processes import ProcessWatch
from bitguard.collectors.recompute import CUT_SHORT, NON_REENTRANT, PASS_THROUGH, recompute_kind
from bitguard.collectors.saved import SaveWatch
from bitguard.collectors.foreign_steps import ForeignStepWatch
from bitguard.collectors.scaler import ScalerWatch
from bitguard.collectors.sharded import ShardedParams, clean_name
from bitguard.collectors.store import MAX_REPORTED_ERRORS
from bitguard.collectors.threads import OtherThreads
from bitguard.collectors.weights import WeightEvents, buffered_below, is_distributed, module_versions
from bitguard.cuda.fingerprint import digest_async, digest_host_at, in_place_on_host
from bitguard.cuda.tensor_bytes import tensor_bytes
from bitguard.errors import NotSupported
from bitguard.modes import HEAVY_MODULES  # what trusted mode observes of module calls

QUEUED_EVENTS = 256  # events queued before they are numbered and handed to the store
MAX_WAITING_CALLS = 65536  # module calls waiting for a backward that may never come (_flush_backward)
_ELSEWHERE = object()  # `_enter`: a call on another thread than the recording's, run by `OtherThreads.call`


class _Frame:
    """A module call in progress (a plain class with slots: one is made for every module call)."""

    __slots__ = ("module", "name", "depth", "t0", "record", "calls", "args", "inputs", "kwinputs", "rng", "stack_key",
                 "recompute", "region", "made", "parts")

    def __init__(self, module: torch.nn.Module, name: str, depth: int, t0: int, record: bool, calls: list):
        self.module = module
        self.name = name
        self.depth = depth
        self.t0 = t0
        self.record = record
        self.calls = calls  # the thread's module calls in progress, this one's parent last
        self.args: list = []  # flatten(args), when recorded
        self.inputs: list = []  # their rows
        self.kwinputs: list | None = None  # its keyword arguments' rows, taken as the call began
        self.rng: torch.Tensor | None = None  # the CPU RNG state when the call began
        self.stack_key: tuple | None = None  # user frames above the call (computed when a child needs it)
        self.recompute: str | None = None  # a checkpoint recompute: its kind (collectors/recompute.py)
        self.region: torch.nn.Module | None = None  # a compiled region: the module it compiles (compiled.py)
        self.made: tuple | None = None  # parameters made during the call: (when, [(module, name, tensor)]) (weights.py)
        self.parts: set[int] | None = None  # a root's call in the window: the ids of its parts (weights.py, `_parts_of`)


class _Backward:
    """A module call waiting for the gradients of its outputs and inputs."""

    __slots__ = ("name", "module_type", "depth", "t0", "expected", "rows", "arrived", "outputs", "done", "step")

    def __init__(self, name: str, module_type: str, depth: int, t0: int, expected: int, step: int):
        self.name = name
        self.module_type = module_type
        self.depth = depth
        self.t0 = t0
        self.expected = expected
        self.rows: list = []
        self.arrived = 0
        self.outputs = 0  # of the gradients arrived, those of its outputs
        self.done = False
        self.step = step  # of its forward


def _legacy_batched(t: torch.Tensor) -> bool:
    """A gradient of `torch.autograd.grad(..., is_grads_batched=True)` (and of `autograd.functional.jacobian`
    with `vectorize=True`): a batch of vector-Jacobian products under torch's legacy vmap, with no storage of
    its own and no way to read the batch it is a slice of. Its pass is not a backward of the training's (what it
    computes reaches the training as the result the call returns, recorded where it is used)."""
    try:
        return bool(torch._C._functorch.is_legacy_batchedtensor(t))
    except Exception:  # noqa: BLE001 - a torch without the check
        return False


def outside_transforms():
    """A context in which torch ops run as outside every torch.func transform (vmap, grad): what
    reads an unwrapped tensor's values (a contiguous copy) must not be wrapped again (helper 17: in
    Opacus' functorch per-sample gradients an expanded gradient of ones was unobserved, every run
    inconclusive)."""
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    except ImportError:  # a torch without it: the copy may fail, and the tensor is marked unobserved
        return contextlib.nullcontext()
    return temporarily_clear_interpreter_stack()


def _owner(root: torch.nn.Module, p_name: str) -> torch.nn.Module:
    """The module of `root` that holds the parameter at path `p_name` (walked by attribute, as a
    TorchScript module, which refuses `get_submodule`, allows)."""
    module = root
    for part in p_name.split(".")[:-1]:
        module = getattr(module, part)
    return module


# torch modules whose forward never draws random numbers (dropout-like modules are not here).
_RNG_FREE_FORWARDS = {getattr(torch.nn, name).forward for name in (
    "Linear", "Bilinear", "Embedding", "EmbeddingBag", "LayerNorm", "RMSNorm", "GroupNorm",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Identity", "Flatten",
    "LeakyReLU", "ELU", "Mish", "Hardswish", "Softplus") if hasattr(torch.nn, name)}
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_HOOK_KEY = ("bitguard", "gradient")  # our entry in a tensor's hook dict (torch's own keys are ints)
_STRIDED = torch.strided


def _grad_order(row: list) -> tuple:
    """A module backward event's rows in order: outputs' gradients first, then by index."""
    return row[1] != "grad_output", row[2]


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class _Hook(partial):
    """A partial torch.save knows as one of the recorder's hooks: it warned of it otherwise ("backward hook
    ... will not be serialized"), a line the training's own run does not print (helper 72). A class
    attribute, as `unserializable_hook` sets on each object, at a partial's cost (this runs for every
    watched tensor of every step)."""
    __slots__ = ()
    __torch_unserializable__ = True


def _add_grad_hook(t: torch.Tensor, hook) -> None:
    """`t.register_hook(hook)`, without the handle (these hooks are never removed: the tensor goes
    first). For a plain tensor, what register_hook does is done here directly: its hook dict, and
    that dict registered with the node that produced the tensor. That is a third of its cost, and
    this runs for every watched tensor of every step. Other tensor types take the public way.

    `t.grad_fn` is read first, before the hook dict exists, in both ways. A view written in place
    outside autograd (`out[0, 0, 0] += 1` under no_grad on F.linear's 3-D output, a view) has a
    stale node that torch regenerates (AsStridedBackward0) the first time `grad_fn` is read, and
    the regenerated node takes over the tensor's hook dict. Read after the dict was set (as
    `Tensor.register_hook` itself does), the node then holds the dict twice, once from the
    regeneration and once from `_register_hook_dict`, and the backward pass dies in
    PyFunctionTensorPreHook (SIGSEGV, issue 12). Read first, the regeneration is over before there
    is a dict to carry. tests/record/test_patterns.py holds both ways to the pattern corpus.

    `hook` is a partial given one more argument here: whether `t` is a leaf (no grad_fn), read now
    (a hook must not read grad_fn: the same regeneration)."""
    grad_fn = t.grad_fn  # first: see above
    hook = _Hook(hook, grad_fn is None)
    if type(t) is not torch.Tensor:
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        if grad_fn is not None:
            grad_fn._register_hook_dict(t)
    hooks[_HOOK_KEY] = hook


def _trainables(module: torch.nn.Module) -> tuple[int, list[torch.Tensor]]:
    """The sum of the ids of `module`'s parameters that require a gradient and hold values, and those: the
    sum moves when one is unfrozen, added, replaced, or a lazy module's is made (`LazyLinear`, PyG's `-1`
    sizes: materialized in place at the first call)."""
    params = [p for p in module.parameters() if p.requires_grad and not is_lazy(p)]
    return sum(map(id, params)), params


def _noted(module: torch.nn.Module, now: tuple) -> tuple:
    """A `_trainable` entry for `module`, `now` its `_trainables`: weak references to the parameters."""
    return weakref.ref(module), now[0], tuple(map(weakref.ref, now[1]))


def _same_trainables(known: tuple | None, module: torch.nn.Module, now: tuple) -> bool:
    """Whether `known` (a `_noted` entry) still holds for `module`, `now` its `_trainables`: the same sum of
    ids, and none of those it noted freed (a new tensor at a freed one's id leaves the sum unmoved:
    functional_call's fast weights, made anew for each call, helper 64)."""
    return known is not None and known[0]() is module and known[1] == now[0] and all(r() is not None for r in known[2])


def _rng_drawn(before: torch.Tensor) -> bool:
    """Has the CPU generator moved since `before` was taken (did the call draw random numbers)?
    A byte comparison of the two states (both uint8 CPU tensors in their own memory, alive for the
    call), read at their addresses: `.numpy()` alone cost 0.6 µs a state. This runs for every
    recorded call of a module that may draw."""
    now = torch.get_rng_state()
    return _string_at(now.data_ptr(), now.nbytes) != _string_at(before.data_ptr(), before.nbytes)


def _owner_called_from(module: torch.nn.Module, frame) -> torch.nn.Module | None:
    """The module whose method called `module` outside any module call, when it holds `module`:
    the first frame above the call outside torch and bitguard, if its `self` is such a module
    (a LightningModule's training_step calling `self.net`, a GAN's `self.G` and `self.D`). The
    root is then that module, so that its parts are named by their paths in it (`net.0`, `G.0`,
    `D.0`) from their first call, where they were named by their own class (`Sequential`, and a
    GAN's two models' parts alike: `0`, `0`) until a later look found the owner."""
    while frame is not None and not _is_user(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None or "self" not in frame.f_code.co_varnames or frame.f_code.co_name == "__init__":
        return None  # (a part called while its model is built, to size a layer: the model is not whole yet)
    owner = frame.f_locals.get("self")
    if owner is module or type(owner) in weakref.ProxyTypes or not isinstance(owner, torch.nn.Module) \
            or is_distributed(owner):
        return None
    return owner if any(m is module for m in owner.modules()) else None


class Collector(WeightEvents):
    # Slots, not an instance dict: every hook reads a dozen of these, between kernels that left the
    # caches cold.
    __slots__ = ("api", "digest_cache", "dump", "enabled", "errors", "mode", "rank", "step", "steps", "store",
                 "world_size", "_accumulating", "_advance", "_call_impl", "_calls", "_calls_step", "_forward_codes",
                 "_generation", "_grad_watch", "_handles", "_heavy", "_held", "_local", "_lock", "_names",
                 "_next_param_tid", "_next_tid", "_grads", "_optimizers", "_optimizers_seen", "_steps_taken", "_param_in", "_params", "_params_at", "_pass_stack", "_pending", "_queued",
                 "_foreign", "_kept_lists", "_rng_free", "_root_names", "_roots", "_seq", "_sharded", "_stacks", "_thread_names",
                 "_tids", "_tids_limit", "_wrapper", "_depths", "_in_child", "_walked", "_finaled", "_unheld", "_held_optimizers",
                 "_trainable", "_hooked_params", "_backwards", "_json", "_orphans", "_orphans_step", "_orphans_versions", "_known_at_step", "_given", "_kept_marks", "_stepped_roots", "_met", "_met_step",
                 "_kept_places", "_kept_holders", "began", "script_globals", "thread", "_elsewhere", "_buffers_seen", "_buffered",
                 "_foreign_call", "_slots_of", "_step_after_pass", "_parts")

    def __init__(self, store, mode: str = "full", steps: tuple[int, int | None] | None = None,
                 rank: int = 0, world_size: int = 1, dump: bool = False, digest_cache: bool = True):
        self.store = store
        self.mode = mode
        self.steps = steps
        self.rank = rank
        self.world_size = world_size
        self.dump = dump  # also store every tensor's bytes (small models only)
        self.digest_cache = digest_cache  # reuse a tensor's digest while its version is unchanged
        # bumped at every call of a module outside any other (the model's forward, the loss): a cached
        # digest serves only within one, never across the user's code between two (`_row`)
        self._generation = 0
        self.step = 0
        self.enabled = True
        self.errors: list[str] = store.errors
        self._advance = False
        self._step_after_pass = False  # an optimizer stepped inside a backward pass: the step ends with the pass
        self._seq = 0
        self._queued: list[tuple] = []  # events waiting for `_drain`
        self._calls: dict[tuple, int] = {}  # (name, phase, kind) -> calls so far in step `_calls_step`
        self._calls_step = 0
        self._thread_names: dict[int, str] = {}  # ident -> name, for threads threading does not list
        self.thread = threading.get_ident()  # the recording's thread: module calls made on another are not recorded
        self._elsewhere = OtherThreads()  # module calls made there, not recorded (`_enter`, collectors/threads.py)
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        self._root_names: set[str] = set()
        self._roots: list[tuple[weakref.ref, str]] = []  # root modules met, for the final-state event
        # id(root) -> (ref, step, `_grads`, `module_versions`, its mode) at its last params event; parameter gradients
        self._params_at: dict[int, tuple[weakref.ref, int, int, int, bool]] = {}  # seen so far: `_grads`
        self._optimizers: dict[int, tuple[weakref.ref, str]] = {}  # id -> (ref, `_optimizer_label`)
        self._optimizers_seen: dict[str, int] = {}  # class name -> the last `#i` given
        self._steps_taken = 0  # optimizer steps seen (collectors/scaler.py: a step skipped has none)
        self._grads = 0
        self._backwards = 0  # module backward events emitted: gradients that reached no parameter say so at the end
        # Roots with parameters, held: a model local to the script's main() is gone when the
        # recording ends, and its final state with it. Let go of (its final state taken then) once
        # nothing else holds it (`_let_go`), and when the recording ends. Not held: a model inside
        # a torch.distributed wrapper (`is_distributed`).
        self._held: list[tuple[torch.nn.Module, str]] = []
        self._foreign: str | None = None  # a root called with tensors in place of its parameters (functional_call)
        self._foreign_call = -1  # `_generation` of the last such call of a root (weights.py, `_swapped_params`)
        # id of a part named holding parameters -> (ref, ((name, ref of the parameter), ...) then): a call finding
        # another tensor in a slot is given other weights (weights.py, `_swapped_params`)
        self._slots_of: dict[int, tuple[weakref.ref, tuple[tuple[str, weakref.ref], ...]]] = {}
        self._parts: dict[int, tuple[weakref.ref, set[int], int]] = {}  # a root called -> its parts' ids, at a step
        self._in_child = False  # a forked child's copy of this collector (`_forked`): it only reports saves
        self._kept_lists: dict[int, kept.KeptTensors] = {}  # id of a list or dict of shadow weights -> its root, held
        self._kept_marks: tuple | None = None  # what the user's frames held at the last look (kept.marks)
        self.began = None  # the frame that began the recording (Recording.__enter__'s caller; kept.user_frames)
        self.script_globals: dict | None = None  # `bitguard record`'s script's, once it has run (`_finals`)
        # (id of an object, attribute), or the path of a variable of the user's code -> its root
        self._kept_places: dict[tuple[int, str] | str, kept.KeptTensors] = {}
        self._kept_holders: frozenset = frozenset()  # the variables and attributes the last look found kept models in
        self._params: dict[int, tuple[weakref.ref, str, str, int]] = {}  # id -> (ref, name, owner type, tid)
        self._param_in: dict[int, tuple] = {}  # pid -> (t0, grad_input row) while .grad accumulates
        self._accumulating: set[int] = set()  # parameters with a hook after accumulation
        self._hooked_params: dict[int, weakref.ref] = {}  # id -> ref of a parameter whose gradient is hooked
        self._orphans: dict[int, tuple[weakref.ref, str, str | None]] = {}  # id -> (ref, place, held name) of one only an optimizer holds
        self._orphans_step = -1  # the step of their last params event (weights.py, _orphan_params)
        self._orphans_versions = -1  # the sum of their version counters as it took them (tensor_versions)
        self._known_at_step: dict[int, tuple[weakref.ref, int]] = {}  # id -> (ref, how many tensors) of an optimizer
        # whose tensors were all known before a step (weights.py, _on_optimizer_pre)
        self._stepped_roots: dict[int, tuple] = {}  # id of an optimizer -> (ref, tensors, the roots list and its
        # length looked at, [(ref, name) of each root module holding a tensor it steps]): weights.py, _uncalled_roots
        self._met: set[int] = set()  # ids of the parameters a params event of step `_met_step` took (_start_params)
        self._met_step = -1
        self._given: dict[int, dict[int, tuple]] = {}  # id of an optimizer in its step() -> id of a gradient it was
        # given -> (the gradient, its digest before the step: weights.py, _take_given)
        # id(root) -> `_noted` when last looked (ref, sum of ids, refs): its parameters hooked again when they move
        self._trainable: dict[int, tuple[weakref.ref, int, tuple]] = {}
        self._tids: dict[int, list] = {}  # id -> [weakref, tid, (version, address, shape, strides) digested, digest]
        self._tids_limit = 4096
        self._finaled: set[int] = set()  # ids of the parameters a final event holds
        self._unheld: dict[str, set[int]] = {}  # a distributed root (not held) -> ids of its parameters
        self._held_optimizers: list = []  # those stepping an unheld root's parameters: held for `_final_stepped`
        self._walked: dict[int, object] = {}  # objects among calls' arguments walked this step (flatten.held_by)
        self._grad_watch: dict[int, tuple] = {}  # id -> (weakref, listeners of its gradient)
        self._next_tid = 1
        self._next_param_tid = 0  # the last parameter's tid (they count down from -1)
        self._local = threading.local()
        self._pending: list[_Backward] = []
        self._handles: list = []
        self._call_impl = self._wrapper = None  # nn.Module._call_impl as found, and our wrapper of it
        self._stacks = StackTable()
        self._lock = threading.RLock()
        self._pass_stack: int | None = None  # user stack of the backward pass in progress
        self._heavy: dict[type, bool] = {}  # module class -> observed in trusted mode
        self._forward_codes: dict[type, object] = {}  # module class -> code object of its forward
        self._rng_free: dict[type, bool] = {}  # module class -> its forward never draws
        # id of a module holding buffers -> t0 of its last call begun, or of the call of an enclosing module that
        # reported its buffers (`_unobserved_buffers`); id of a module -> (ref, `buffered_below` it)
        self._buffers_seen: dict[int, int] = {}
        self._buffered: dict[int, tuple[weakref.ref, list]] = {}
        self._depths: dict[str, int] = {}  # module name -> call depth of its last recorded forward (for a recompute)
        self._sharded = ShardedParams(self)  # FSDP parameters: flat parameters split, shards marked (sharded.py)
        self.api: ApiRecorder | None = None  # API-level events (collectors/api_events.py), once installed
        self._json: JsonWrites | None = None  # the JSON files the training writes (beside.py), once installed

    # -- installation ----------------------------------------------------------------------
    def install(self) -> None:
        from torch.optim import optimizer as optim

        self._wrap_module_calls()
        # module.compile() in place: observed at its boundary; torch.compile of a function: reported
        watch = CompileWatch(self._observing, self._guard(self._compiled_function), self._inside_a_call)
        watch.install()
        self._handles.append(watch)
        self._keep_out_of_dynamo()
        self._handles.append(CommObserver(self).install())  # collectives as `comm` events (collectors/comm.py)
        # processes the training starts: reported (not observed); in a forked one, this collector stops
        self._handles.append(ProcessWatch(self._guard(self._child_process), self._forked).install())
        # a step the loss scaler skipped (an inf gradient) still ends the step
        self._handles.append(ScalerWatch(lambda: self._steps_taken, self._guard(self._skipped_step)).install())
        self._handles.append(SaveWatch(self._saved).install())  # what torch.save and the like write: `saved`
        # the JSON files the training writes with open(): `saved` too, read once closed (beside.py)
        self._json = JsonWrites(lambda: self.enabled and not self._in_child, str(Path(self.store.path).parent),
                                lambda frame: self._stacks.key_until(frame)[0], self._json_in_child).install()
        self._handles.append(self._json)
        # a Keras or fastai optimizer's update (no torch.optim) ends the step too
        self._handles.append(ForeignStepWatch(lambda: self._steps_taken, self._guard(self._foreign_step)).install())
        if torch.distributed.is_available():  # the process group's end: the distributed models' final state
            self._handles.append(Patch(torch.distributed, "destroy_process_group", self._before_destroy))
        self._handles += aside_while_tracing(self)  # torch.jit's tracing, and the eager run its check makes
        self._handles.append(optim.register_optimizer_step_pre_hook(self._guard(self._on_optimizer_pre)))
        # a parameter made inside a module call (a guide's in its first forward): a params event as the call ends
        self._handles.append(register_module_parameter_registration_hook(self._guard(self._param_made)))
        self._handles.append(optim.register_optimizer_step_post_hook(self._guard(self._on_optimizer_step)))
        # last: its step hook runs after ours, with the step's events drained (removed after the final drain)
        self.api = ApiRecorder(self.store, CollectorNaming(self), self._fail, self.rank).install()
        self._handles.append(self.api)

    def remove(self, final_state: bool = True) -> None:
        """Flush what is pending, record the final state (of a recording that ended normally), and
        remove every hook this collector installed."""
        self._guard(self._flush_backward)()
        self._guard(self._child_saves)()
        if self._elsewhere.calls and not self._root_names:  # (before the end's look names the models the script keeps)
            threads = ", ".join(sorted(self._elsewhere.calls))
            self._fail("module calls", NotSupported(
                f"the model was called only on thread(s) {threads}, not on the thread that began the recording, and "
                f"module calls on other threads are not recorded: begin the recording on the training's thread "
                f"(`with bitguard.record(...):` inside the function that thread runs)"))
        if final_state:
            self._guard(self._json_written)(True)
            self._guard(self._emit_final)()
        self._held.clear()
        self._held_optimizers.clear()
        self._guard(self._drain)()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if torch.nn.Module._call_impl is self._wrapper:
            torch.nn.Module._call_impl = self._call_impl
        # (wrapped again since by someone else: ours stays in their chain, passing calls through)
        # A removed hook leaves its tensor an empty hook dict, which autograd still calls into for
        # every gradient: give the parameters back as they were when nothing else hooks them.
        for ref, *_ in self._params.values():
            p = ref()
            for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                if p is not None and getattr(p, attr, None) == {}:
                    setattr(p, attr, None)
        self.enabled = False

    def _child_process(self, message: str) -> None:
        self._fail("child process", NotSupported(message))

    def _forked(self) -> None:
        """In a forked child: stop (its writer thread is the parent's; the run is the parent's)."""
        self.enabled = False
        self._in_child = True
        if self.api is not None:
            self.api.enabled = False

    # -- failure containment ---------------------------------------------------------------
    def _guard(self, fn):
        """`fn` as a hook that never raises into training: `_guarded` bound to it."""
        return partial(self._guarded, fn)

    def _guarded(self, fn, *args, **kwargs) -> None:
        if not self.enabled or is_compiling():  # a hook dynamo traces (a compiled step()): ours stay out
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail(getattr(fn, "__name__", "hook"), exc)

    def _fail(self, where: str, exc: BaseException) -> None:
        message = f"{where}: {type(exc).__name__}: {exc}"
        if message not in self.errors and len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)
            print(f"bitguard: collector error (training continues): {message}", file=sys.stderr)

    # -- helpers ---------------------------------------------------------------------------
    def _in_window(self) -> bool:
        if self.steps is None:
            return True
        start, end = self.steps
        return self.step >= start and (end is None or self.step < end)

    def _maybe_advance(self) -> None:
        if self._advance:
            self._advance = False
            steps = self.steps
            if steps is not None and steps[1] == self.step + 1:  # the window's last step is over
                self._guard(self._window_ends)()
            self.step += 1

    def _purge_dead(self) -> None:
        """Forget tensors that died, in both id maps (at each step's end, or when a loop without
        steps piles them up)."""
        self._tids = {k: e for k, e in self._tids.items() if e[0]() is not None}
        self._grad_watch = {k: e for k, e in self._grad_watch.items() if e[0]() is not None}
        self._tids_limit = max(4096, 2 * len(self._tids))
        if len(self._walked) > 4096:  # (a loop without steps: objects are walked again, never piled up)
            self._walked.clear()

    def _row(self, t: torch.Tensor, role: str, idx: int, path: str, digest=None) -> list:
        """One tensor row (`digest`: already taken, by `digest_many`, of a plain dense tensor). This
        runs for every tensor of every event, so it is written for speed: each of the tensor's
        properties is read once (a torch property read is about 0.1 µs, more with cold caches)."""
        key = id(t)
        entry = self._tids.get(key)  # [ref, tid, (version, ...) digested, digest] of a non-parameter tensor
        if entry is None or entry[0]() is not t:
            param = self._params.get(key) if type(t) is not torch.Tensor else None
            if param is not None and param[0]() is t:
                entry = None  # a parameter: its tid is in `_params`
                tid = param[3]
            else:  # a tensor seen for the first time (or a dead one's id, reused)
                if len(self._tids) >= self._tids_limit:
                    self._purge_dead()
                tid = self._next_tid
                entry = [weakref.ref(t), tid, None, None]  # dead entries go at the step's end
                self._next_tid = tid + 1
                self._tids[key] = entry
        else:
            tid = entry[1]
        # A digest is reused while the version counter is unchanged only on the CPU, where ops run to
        # completion on the calling thread, so the same version means the same bytes (but for writes
        # through `.data`); on a GPU an asynchronous kernel could still write the tensor, so every
        # observation of a CUDA tensor is digested. digest_cache=False digests all. Never reused:
        # parameters (their tid is in `_params`) and a module's buffers (role "state": kernels update
        # them in place without bumping the counter, as batch norm does its running statistics); nor
        # across top-level module calls (`_generation`): between two, the user's code may refill a
        # tensor's memory through NumPy (`torch.from_numpy` of a reused batch buffer) or `.data`.
        version = None
        if entry is not None and self.digest_cache and role != "state" and t.is_cpu:
            try:
                version = t._version
            except Exception:  # noqa: BLE001 - inference tensors have no version counter
                pass
        try:
            address = t.data_ptr()
            offset = t.storage_offset()  # the storage's address: the tensor's own less its offset
            storage = address - offset * t.element_size() if offset else address
        except Exception:  # noqa: BLE001 - tensors without storage (meta, some subclasses)
            address = storage = 0
        if version is not None:
            # The cache key is the version with the memory and layout read: `t.data = other` gives a
            # tensor new memory without bumping its version, and the digest of the old memory would
            # be a stale one (a false "identical"). Shape and strides as torch gives them (tuples:
            # no copies, fewer objects for the cyclic GC), also the row's.
            try:
                shape, strides = t.shape, t.stride()
            except Exception:  # noqa: BLE001 - no strides (sparse, nested): not cached, observed apart
                version = None
            else:
                version = (version, address, shape, strides, self._generation)
                if digest is None and entry[2] == version:
                    digest = entry[3]  # the same tensor, not written since it was digested
        dtype = _DTYPE_NAMES.get(t.dtype) or _dtype_name(t.dtype)
        unobserved = None  # the row's last column: why the tensor could not be digested
        if digest is None:  # (a digest taken already, or kept, is a plain dense tensor's: no checks)
            if type(t) not in PLAIN or t.layout is not _STRIDED or t.is_nested:
                return self._other_row(t, role, idx, path, dtype, tid, storage)
            nbytes = t.nbytes
            try:
                # a host tensor in its own memory (the common case): digested at the address read above
                digest = digest_host_at(address, nbytes) if address and in_place_on_host(t) else digest_async(t)
            except Exception as exc:  # noqa: BLE001 - a tensor that cannot be read is marked, never dropped
                if t.is_quantized:  # (checked here, not before every digest: rare, and refused by the plain path)
                    return self._other_row(t, role, idx, path, dtype, tid, storage)
                inner = None if address or t.is_meta else unwrapped(t)
                if t.is_meta:  # no values to read, nor to differ: the digest of no bytes (shape and dtype say the rest)
                    digest = (0, 0)
                elif inner is None:
                    digest, unobserved = NO_DIGEST, self._unreadable(exc, t)
                else:  # inside vmap or grad: the values of the whole batch it is a slice of, as they are
                    t, version = inner, None
                    try:  # (with the transforms' interpreters active, the ops of a copy would wrap it again)
                        with outside_transforms():
                            nbytes, digest = t.nbytes, digest_async(t)
                    except Exception as inner_exc:  # noqa: BLE001
                        digest, unobserved = NO_DIGEST, self._unreadable(inner_exc, t)
        else:
            nbytes = t.nbytes
        if version is not None and entry[2] != version and unobserved is None:
            entry[2], entry[3] = version, digest
        if version is None:
            shape, strides = t.shape, t.stride()
        xor, pos = digest if type(digest) is tuple else (digest, digest)
        row = [0, role, idx, path, shape, dtype, strides, nbytes, xor, pos, tid, storage, unobserved, None]
        if self.dump:  # the bytes ride along as a last item until _drain moves them to the dumps table
            row.append(tensor_bytes(t).cpu().numpy().tobytes() if t.numel() and unobserved is None else b"")
        return row

    def _other_row(self, t: torch.Tensor, role: str, idx: int, path: str, dtype: str, tid: int, storage: int) -> list:
        """The row of a tensor that is not plain dense (sparse, nested, a subclass: observation.py),
        digested when it can be read exactly, otherwise marked unobserved with the reason."""
        try:
            shape, strides, nbytes, digest, unobserved, values, shard = observe(t)
        except Exception as exc:  # noqa: BLE001 - marked, never dropped
            why = self._unreadable(exc, t)
            why = why if type(t) in PLAIN else f"{type(t).__name__}: {why}"
            shape, strides, nbytes, digest, unobserved, values, shard = dims(t), [], 0, NO_DIGEST, why, None, None
        xor, pos = digest if type(digest) is tuple else (digest, digest)
        row = [0, role, idx, path, shape, dtype, strides, nbytes, xor, pos, tid, storage, unobserved, shard]
        if self.dump:
            row.append(tensor_bytes(values).cpu().numpy().tobytes() if values is not None and values.numel() else b"")
        return row

    def _unreadable(self, exc: BaseException, t: torch.Tensor | None = None) -> str:
        """The `unobserved` reason for a tensor whose digest raised. A tensor the digest refuses by
        design (NotSupported: meta, quantized) is only marked, as is one inside a torch.func
        transform (vmap, grad: a wrapper without storage of its own); any other failure is also a
        collector error (reported in the manifest), since it may be one of ours."""
        if t is not None and transformed(t):
            return ("a tensor inside a torch.func transform (vmap, grad, jacrev: per-sample gradients): a wrapper "
                    "whose values are not in memory of its own (not digested)")
        if not isinstance(exc, NotSupported):
            self._fail("digest", exc)
        return f"{type(exc).__name__}: {exc}"

    def _rows(self, flat: list[tuple[str, torch.Tensor]], role: str, start: int = 0) -> list[list]:
        """Rows of `flatten`'s (path, tensor) pairs; one unobserved row for a container that could
        not be flattened."""
        rows = [self._row(t, role, start + i, path) for i, (path, t) in enumerate(flat)]
        if type(flat) is NotFlattened:
            rows.append([0, role, start + len(rows), flat.path, [], "", [], 0, *NO_DIGEST, 0, 0, flat.reason]
                        + ([b""] if self.dump else []))
        return rows

    def _emit(self, phase: str, kind: str, name: str, module_type: str, depth: int, t0: int,
              rows: list[list], stack: int | tuple | None = None) -> None:
        """Queue one event with what must be taken now: its step, end time, thread, stack (an id, a
        key for `_drain` to intern, or None for the caller's, captured here) and, for a GPU event, its
        stream. Numbering and building the event wait for `_drain`, which takes many events at once:
        run between a step's kernels, this code finds the caches cold and runs several times slower
        than in a batch."""
        where = None
        if rows and type(rows[0][8]) is not int:  # a pending digest: a CUDA tensor
            device = str(getattr(rows[0][8], "device", "cuda"))
            where = (device, torch.cuda.current_stream(torch.device(device)).cuda_stream)
        event = (self.step, phase, kind, name, module_type, depth, t0, time.time_ns(),
                 threading.get_ident(), rows, self._stacks.capture() if stack is None else stack, where)
        with self._lock:  # autograd's device threads emit too
            self._queued.append(event)
            if len(self._queued) >= QUEUED_EVENTS:
                self._drain()

    def _drain(self) -> None:
        """Number the queued events in completion order and hand them to the store."""
        with self._lock:
            queued, self._queued = self._queued, []
            intern = self._stacks.intern
            queued = [e if type(e[10]) is int else e[:10] + (intern(e[10]),) + e[11:] for e in queued]
            stacks = self._stacks.take_new() if self._stacks.new else ()  # with the first event: never later
            calls, add = self._calls, self.store.add
            threads = {t.ident: t.name for t in threading.enumerate()}
            for step, phase, kind, name, module_type, depth, t0, t1, ident, rows, stack, where in queued:
                thread = threads.get(ident) or self._other_thread(ident)
                if step != self._calls_step:  # call indices count within a step
                    calls.clear()
                    self._calls_step = step
                key = (name, phase, kind)
                call = calls.get(key, 0)
                calls[key] = call + 1
                seq = self._seq
                self._seq = seq + 1
                for row in rows:
                    row[0] = seq
                dumps = [(seq, r[1], r[2], r.pop()) for r in rows] if self.dump else ()
                device, stream = where or ("cpu", None)
                add((seq, self.rank, self.world_size, step, phase, name, module_type, kind, call, depth, thread,
                     device, stream, t0, t1, stack), rows, stacks, dumps)
                stacks = ()

    def _other_thread(self, ident: int) -> str:
        """A name for a thread Python does not know (autograd's device threads) or that has ended:
        `native-N`, numbered in order of appearance (thread idents differ between runs)."""
        name = self._thread_names.get(ident)
        if name is None:
            name = self._thread_names[ident] = f"native-{len(self._thread_names) + 1}"
        return name

    def _rng_row(self, state: torch.Tensor, digest, path: str, idx: int) -> list:
        """A row for an RNG state: role `rng`, no tensor identity (the model never sees it)."""
        row = [0, "rng", idx, path, [state.numel()], "uint8", [1], state.numel(), digest[0], digest[1], 0, 0, None]
        if self.dump:
            row.append(state.numpy().tobytes())
        return row

    def _rng_rows(self, cpu: torch.Tensor) -> list[list]:
        """The data event's RNG states: the CPU generator, and each CUDA one once CUDA is in use."""
        rows = [self._rng_row(cpu, digest_async(cpu), "cpu", 0)]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                rows.append(self._rng_row(state, digest_async(state), f"cuda:{i}", i + 1))
        return rows

    # -- module naming ---------------------------------------------------------------------
    def _register_root(self, module: torch.nn.Module, base: str | None = None) -> str:
        """Name a module called outside any other, and everything in it. An earlier root inside
        it (a part called alone while the model was built, to size a layer; a parametrization
        run once when registered) is named anew as a part of this one. (Two models alive at once
        whose parts have the same paths, a GAN's generator and discriminator, still share those
        names: telling them apart by which was alive first would make names depend on when Python
        frees an earlier model, which may differ from run to run.)"""
        if self._held:
            self._let_go()  # the final state of a model the script dropped comes before this one's events
        kept_name = base is not None
        base = base or type(module).__name__  # (a kept model found by its variable: that name)
        name, n = base, 1
        while name in self._root_names:
            n += 1
            name = f"{base}#{n}"
        root_ref = weakref.ref(module)  # first: what cannot be referenced weakly changes nothing here
        self._root_names.add(name)
        parts = {id(m) for m in module.modules()}
        inside = [other for other in (ref() for ref, _ in self._roots) if other is not None and id(other) in parts]
        renamed = {id(m) for other in inside for m in other.modules()}
        if inside:
            self._roots = [(ref, n) for ref, n in self._roots if id(ref()) not in renamed]
            self._held = [(m, n) for m, n in self._held if id(m) not in renamed]
        self._roots.append((root_ref, name))
        if any(True for _ in module.parameters()):
            if not any(map(is_distributed, module.modules())):
                self._held.append((module, name))
            else:  # not held: its final state must be taken while it lives, or said missing (`_emit_final`)
                self._unheld[name] = {id(p) for p in module.parameters()}
        # An id already known may be a dead module's or parameter's, reused by a new one (a model
        # built after an earlier one was freed): that entry is replaced, or the new parameter would
        # go without a name and without gradient hooks.
        # a kept model's parts are named under its name (`ema.module`: timm's ModelEmaV2 called for an
        # evaluation read as `module`, helper 34); a called root's, by their paths in it, as ever
        self._name_parts(module, name, renamed, prefix=name if kept_name else None)
        flats = self._sharded.register(module)
        for p_name, p in module.named_parameters() if renamed else ():
            entry = self._params.get(id(p))
            if entry is not None and entry[0]() is p and id(_owner(module, p_name)) in renamed:
                # named by an earlier root inside this one
                self._params[id(p)] = (entry[0], clean_name(eager_name(p_name)), entry[2], entry[3])
        self._hook_trainable(module, flats)
        self._trainable[id(module)] = _noted(module, _trainables(module))
        return name

    def _hook_trainable(self, root: torch.nn.Module, flats: set[int]) -> None:
        """Name and hook each parameter of `root` that requires a gradient and is not hooked yet (FSDP's
        flat parameters, `flats`, are sharded.py's); one named already (as an optimizer stepped it) is
        only hooked."""
        for p_name, p in root.named_parameters():
            if not p.requires_grad or id(p) in flats or self._hooked(p) or is_lazy(p):  # (a lazy one: once made)
                continue
            entry = self._params.get(id(p))
            if entry is not None and entry[0]() is p:
                self._hook_grad(p)
            else:
                self._watch_at(root, p_name, p)

    def _name_parts(self, module: torch.nn.Module, name: str, renamed: set[int] = frozenset(),
                    prefix: str | None = None) -> None:
        """Name each part of root `module` (called `name`) not named yet (or in `renamed`) by its path
        (after `prefix.` when one is given)."""
        for sub_name, sub in module.named_modules():
            entry = self._names.get(id(sub))
            # (a compiled submodule known already: named as its eager module)
            if entry is None or entry[0]() is not sub or id(sub) in renamed:
                path = clean_name(eager_name(sub_name))
                self._names[id(sub)] = (weakref.ref(sub), (f"{prefix}.{path}" if prefix else path) if path else name)
            self._note_slots(sub)

    def _note_slots(self, module: torch.nn.Module) -> None:
        """Which parameter is in each of `module`'s slots now (`_slots_of`); not those of DTensors
        (FSDP2 puts an unsharded parameter in the slot for each call: the model's own, gathered)."""
        dtensor = sys.modules.get("torch.distributed.tensor")
        sharded = dtensor.DTensor if dtensor is not None else ()
        slots = tuple((n, weakref.ref(p)) for n, p in module._parameters.items()
                      if p is not None and not isinstance(p, sharded))
        if slots:
            self._slots_of[id(module)] = (weakref.ref(module), slots)
        else:
            self._slots_of.pop(id(module), None)

    def _watch_changed(self, root: torch.nn.Module) -> bool:
        """At each call of a root: when its trainable parameters are not those it had (a backbone
        unfrozen after a warm-up, a layer added, a parameter replaced: `load_state_dict(assign=True)`,
        `resize_token_embeddings`, Keras making its variables anew once a model is built), the new
        ones are named and their gradients hooked, and True is returned (the call is due a params
        event). Their gradient events were missing until then, and a difference in them was blamed
        on the optimizer as "not observed", or on the first module that read them."""
        now = _trainables(root)
        known = self._trainable.get(id(root))
        if _same_trainables(known, root, now):
            return False
        self._trainable[id(root)] = _noted(root, now)
        entry = self._names.get(id(root))
        if entry is not None and entry[0]() is root:  # (a layer added: named by its path, as the others)
            self._name_parts(root, entry[1])
        self._hook_trainable(root, self._sharded.flat_ids())
        return known is not None

    def _watch_at(self, root: torch.nn.Module, p_name: str, p: torch.nn.Parameter) -> str:
        """Name parameter `p` by its path `p_name` in `root`, hook its gradient; its name."""
        name = clean_name(eager_name(p_name))
        self._watch_param(p, name, type(_owner(root, p_name)).__name__)
        return name

    def _watch_param(self, p: torch.nn.Parameter, name: str, owner: str) -> None:
        """Name a parameter (`owner`: its module's class name) and hook its gradient."""
        self._next_param_tid -= 1  # parameters get negative ids, stable across steps
        self._params[id(p)] = (weakref.ref(p), name, owner, self._next_param_tid)
        self._accumulating.discard(id(p))
        self._param_in.pop(id(p), None)
        if p.requires_grad and not self._hooked(p):  # (a frozen one, named as it steps: nothing to hook)
            self._hook_grad(p)

    def _hooked(self, p: torch.nn.Parameter) -> bool:
        ref = self._hooked_params.get(id(p))
        return ref is not None and ref() is p

    def _hook_grad(self, p: torch.nn.Parameter) -> None:
        ref = self._hooked_params[id(p)] = weakref.ref(p)  # (the hook's tensor: its id may be another's when it runs)
        self._handles.append(p.register_hook(_Hook(self._on_param_grad, id(p), ref)))

    def _name_of(self, module: torch.nn.Module, parent: _Frame | None) -> str:
        entry = self._names.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        inner = original(module)
        if inner is not module:  # torch.compile's wrapper is named as the module it compiles
            name = self._name_of(inner, parent)
            known = self._names.get(id(inner))
            if known is not None and known[0]() is inner:  # (an unregistered module's name is its call's: not kept)
                self._names[id(module)] = (weakref.ref(module), name)
            return name
        if parent is None:
            caller = sys._getframe(1)
            owner = _owner_called_from(module, caller)
            # (a part with no parameters of its own is not looked for: a loss or an activation made anew each step
            # would cost a look at every step)
            held = (owner is not None or next(module.parameters(), None) is not None) \
                and self._register_holder(owner if owner is not None else module, caller)
            if owner is not None and not held:  # (its `self` holds it: Lightning's training_step calling self.net)
                self._register_root(owner)
            if held or owner is not None:
                entry = self._names.get(id(module))
                if entry is not None and entry[0]() is module:
                    return entry[1]
            return self._register_root(module)
        # A module no root registers is named by the call it is made in, each time, not once for good: one
        # such module can be called from every layer (transformers >= 5.25 with `kernels` makes
        # apply_rotary_pos_emb one module object that every attention layer calls), and a name kept from
        # its first call put every later layer's call under the first layer's name.
        return f"{parent.name}.<{type(module).__name__}>"

    def _wanted(self, module: torch.nn.Module) -> bool:
        if self.mode == "full":
            return True
        kind = type(module)
        wanted = self._heavy.get(kind)
        if wanted is None:
            wanted = self._heavy[kind] = bool(HEAVY_MODULES.search(kind.__name__))
        return wanted

    # -- forward ---------------------------------------------------------------------------
    def _wrap_module_calls(self) -> None:
        """Observe every module call by wrapping `nn.Module._call_impl`, what `Module.__call__` runs,
        rather than with global module hooks: their presence sends every module call down torch's
        slow path (a closure, a set, hook-dict walks), which cost more a step than this wrapper and
        torch's fast path together. The wrapper sees what the caller passed and what it gets back
        (the module's own hooks, if any, run inside). `remove()` puts the original back."""
        self._call_impl = torch.nn.Module._call_impl
        self._wrapper = torch.nn.Module._call_impl = self._observing(self._call_impl)

    def _observing(self, inner):
        """`inner(module, *args, **kwargs)` observed. While dynamo traces (a compiled region's
        inside), calls pass straight through: `is_compiling()` is a constant to dynamo, so nothing
        of ours enters its graphs (collectors/compiled.py)."""
        enter, leave = self._enter, self._leave  # (each contains its own failures: one call less a module call)

        def _call_impl(module, *args, **kwargs):
            if is_compiling() or not self.enabled or jit_tracing() is not None:
                return inner(module, *args, **kwargs)
            frame = enter(module, args, kwargs)
            if frame is _ELSEWHERE:
                return self._elsewhere.call(inner, module, args, kwargs)
            try:
                output = inner(module, *args, **kwargs)
            except CUT_SHORT:  # a non-reentrant checkpoint's recompute stopped inside this call: its inputs
                if frame is not None:  # (and the RNG state it began from) are recorded, with no outputs
                    frame.calls.pop()
                    if frame.record and frame.recompute is not None:
                        leave(frame, kwargs, None)
                    frame = None
                raise
            finally:
                if frame is not None:
                    frame.calls.pop()
            if frame is not None:
                if frame.made is not None:  # (its parameters made inside, Pyro's AutoNormal: before its event)
                    self._made_params(frame)
                if frame.record:
                    leave(frame, kwargs, output)
            return output

        return _call_impl

    def calls_elsewhere(self) -> tuple[dict[str, int], dict[str, int]]:
        """Module calls made on other threads than the recording's, outside any other, by thread name; and
        those of them that moved a generator's state (collectors/threads.py)."""
        return dict(self._elsewhere.calls), dict(self._elsewhere.drew)

    def _inside_a_call(self) -> bool:
        """Whether this thread is inside a module call (the module-call wrapper's frames)."""
        return bool(getattr(self._local, "frames", None))

    def _compiled_function(self, why: str) -> None:
        """A function is compiled (collectors/compiled.py): what it traces goes unobserved, and the
        recording says so (a collector error: compare cannot certify such a run)."""
        self._fail("torch.compile", NotSupported(why))

    def _keep_out_of_dynamo(self) -> None:
        keep_out_of_dynamo(self._wrapper, ENTRIES)  # see collectors/compiled.py

    def _enter(self, module, args, kwargs=None) -> _Frame | object | None:
        """A module call begins: its frame, pushed last (None, and nothing pushed, on failure: the
        wrapper needs the frame back, so this contains its failures itself instead of `_guarded`).
        This runs for every module call, between kernels that left the caches cold: the common
        case (a call inside a model, recorded or not) reads what it needs once and calls few helpers."""
        try:
            try:
                frames = self._local.frames
            except AttributeError:
                frames = self._local.frames = []
            if not frames and threading.get_ident() != self.thread and recompute_kind() is None:
                return _ELSEWHERE  # (the wrapper runs it, counted: collectors/threads.py)
            if type(module) in PASS_THROUGH:
                return None  # (torch's checkpoint_wrapper: the module it wraps is recorded, under the same name)
            if self._advance:
                self._maybe_advance()
            if frames:
                parent = frames[-1]
                if parent.region is not None and inner_call(parent.module, module):
                    return None  # torch.compile's own call of the module it compiles: the region's event is its
                recompute = parent.recompute
            else:
                parent = None
                self._generation += 1  # a top-level call: no digest cached before it serves inside it
                recompute = recompute_kind()  # a checkpoint's recompute during backward is no new root: no flush,
                if recompute is None:  # no batch event; calls still waiting for their backward go on
                    self._flush_backward(ended=False)  # waiting (a loss module is called before it)
            entry = self._names.get(id(module))
            name = entry[1] if entry is not None and entry[0]() is module else self._name_of(module, parent)
            t0 = time.time_ns()
            if module._buffers:  # (_unobserved_buffers)
                self._buffers_seen[id(module)] = t0
            steps = self.steps  # (_in_window)
            in_window = steps is None or (self.step >= steps[0] and (steps[1] is None or self.step < steps[1]))
            region = region_of(module)  # a compiled region: its only observable boundary, in every mode
            if region is not None:
                self._keep_out_of_dynamo()
            if recompute is None:
                depth = len(frames)
            else:  # a recompute: at its original forward's depth
                depth = parent.depth + 1 if parent is not None else self._depths.get(name, 0)
            record = in_window and (region is not None or self.mode == "full" or self._wanted(module))
            frame = _Frame(module, name, depth, t0, record, frames)
            frame.recompute = recompute
            frame.region = region
            if record and recompute is None:
                self._depths[name] = depth
            if parent is not None:  # the common case: a call inside a model
                if in_window and recompute is None:
                    if module._parameters or id(module) in self._slots_of:
                        self._swapped_params(module, name, t0)
                    parts = frames[0].parts  # (not one of the root's parts: `_called_inside`)
                    if parts is not None and id(module) not in parts:
                        self._called_inside(module, name, t0, parts)
                if record:
                    if len(args) == 1 and isinstance(args[0], torch.Tensor):  # (what flatten and _rows give)
                        frame.args = [("[0]", args[0])]
                        frame.inputs = [self._row(args[0], "input", 0, "[0]")]
                    else:
                        flat = frame.args = flatten(args, numbers=True, walked=self._walked)
                        frame.inputs = self._rows(flat, "input")
                    if kwargs:  # (as the call begins: what it reads, before it can change it)
                        frame.kwinputs = self._rows(flatten(kwargs, numbers=True, walked=self._walked), "input",
                                                    len(frame.inputs))
                    free = self._rng_free.get(type(module))  # (_may_draw, once the class is known)
                    if (self._may_draw(module) if free is None else
                            not free or module._forward_pre_hooks or module._forward_hooks):
                        frame.rng = torch.get_rng_state()
                frames.append(frame)
                return frame
            if recompute is None and in_window:
                frame.parts = self._parts_of(module)
            is_model_root = recompute is None and in_window and any(True for _ in module.parameters())
            if record or is_model_root:
                frame.args = flatten(args, numbers=True, walked=self._walked)
                frame.inputs = self._rows(frame.args, "input")
                if kwargs:  # (`model(input_ids=..., labels=...)`: the batch, before the forward can change it)
                    frame.kwinputs = self._rows(flatten(kwargs, numbers=True, walked=self._walked), "input",
                                                len(frame.inputs))
                if is_model_root or self._may_draw(module):
                    frame.rng = torch.get_rng_state()
            digested = None
            if is_model_root:
                try:
                    changed = self._watch_changed(module)
                except Exception as exc:  # noqa: BLE001 - the call is recorded all the same
                    changed = False
                    self._fail("_watch_changed", exc)
                versions = self._params_due(module)
                if versions is None and changed:
                    versions = module_versions(module)
                if self._orphans_due():
                    self._orphan_params(t0)
                if versions is not None:
                    digested = self._start_params(module, name, type(region or module).__name__, t0, versions)
            elif in_window and recompute is None and self._orphans_due():
                # a step whose first call outside any other holds no parameters: the model is one whose
                # `__call__` skips torch's (gpytorch's modules: its shared Softplus is what is called), or
                # hand-written; what only an optimizer holds is taken here (helper 46)
                self._orphan_params(t0)
            if recompute is None and self.api is not None:  # its params and modes rows
                self.api.root_forward(module, name, digested)
            if is_model_root:
                rows = [list(r) for r in frame.inputs + (frame.kwinputs or [])] + self._rng_rows(frame.rng)
                self._emit("data", "batch", name, type(region or module).__name__, 0, t0, rows)
            frames.append(frame)
            return frame
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("forward", exc)
            return None

    def _leave(self, frame: _Frame, kwargs, output) -> None:
        """A recorded module call returned `output` (its frame already popped): its forward event.
        Called by the module-call wrapper directly; a failure is recorded, never raised."""
        try:
            inputs = frame.inputs
            rows = inputs + frame.kwinputs if frame.kwinputs else inputs  # (taken as the call began)
            rng = frame.rng
            if rng is not None and _rng_drawn(rng):
                # the call drew random numbers: the RNG state it started from is one of its inputs
                rows = rows + [self._rng_row(rng, digest_async(rng), "cpu", 0)]
            if output is None:
                outputs, out_rows = [], []
            elif isinstance(output, torch.Tensor):  # the common case (what `flatten` and `_rows` give)
                outputs = [("", output)]
                out_rows = [self._row(output, "output", 0, "")]
            else:
                outputs = flatten(output, numbers=True, walked=self._walked)
                out_rows = self._rows(outputs, "output")
            region = frame.region
            module = region or frame.module
            buffers = module._buffers
            if buffers:  # a module's own buffers as the call left them (running statistics, caches)
                out_rows += self._rows([(f".{n}", b) for n, b in buffers.items() if b is not None], "state")
            if region is None:
                below = self._buffered.get(id(module))
                if below is None or below[0]() is not module:
                    below = self._buffered[id(module)] = (weakref.ref(module), buffered_below(module))
                if below[1]:
                    out_rows += self._unobserved_buffers(frame.t0, below[1], sum(r[1] == "state" for r in out_rows))
            else:  # an unobserved row saying that the boundaries inside were not observed
                marker = NotFlattened([], REGION_PATH, REGION_REASON)
                out_rows += self._rows(marker, "state", sum(r[1] == "state" for r in out_rows))
            mtype = type(module).__name__
            frames = frame.calls
            stack = self._call_key(sys._getframe(1), frames, len(frames) - 1)  # interned by _drain
            self._emit("forward" if frame.recompute is None else "recompute", "module", frame.name, mtype, frame.depth,
                       frame.t0, rows + out_rows, stack)
            if torch.is_grad_enabled() and frame.recompute is not NON_REENTRANT:  # see collectors/recompute.py
                self._watch_backward(frame, mtype, kwargs, outputs)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_leave", exc)

    def _unobserved_buffers(self, t0: int, below: list, start: int) -> list[list]:
        """The "state" rows of the buffers of modules below a call begun at `t0` (`below`: from
        `buffered_below`) that were not called since it began: a part run through its `.forward()`
        (lightly's memory bank, updated by its loss's call, helper 48) or not called at all has no event
        of its own, and its buffers were seen only at the end. Paths name the part: `.bank.queue`.
        Reported by the innermost recorded call around it: those around that one do not again. `below`
        is found at the module's first recorded call: a part added to it later is not among them."""
        seen, rows = self._buffers_seen, []
        for path, ref in below:
            sub = ref()
            if sub is not None and seen.get(id(sub), -1) < t0:
                seen[id(sub)] = t0
                rows += self._rows([(f".{path}.{n}", b) for n, b in sub._buffers.items() if b is not None], "state",
                                   start + len(rows))
        return rows

    def _call_key(self, f, frames: list[_Frame], level: int) -> tuple:
        """The user-stack key of code running at frame `f` inside the module call frames[level]
        (level -1: outside every module). Walking stops at that module's forward frame and reuses
        the module call's own key, computed once per call: a deep model's events each walk a few
        frames instead of the whole stack."""
        if level < 0:
            return self._stacks.key_until(f)[0]
        parent = frames[level]
        code = self._forward_code(parent.module)
        head, stop = self._stacks.key_until(f, code)
        if stop is None:  # the walk reached the top: `head` is the whole stack
            return head
        if parent.stack_key is None:
            parent.stack_key = self._call_key(stop.f_back, frames, level - 1)
        return head + parent.stack_key

    def _may_draw(self, module: torch.nn.Module) -> bool:
        """Could this call draw random numbers? Not when its forward is one of torch's own that never
        do (Linear, norms, Embedding, ...) and nothing of the user's hooks into the call: then the
        RNG state is neither taken before nor compared after (two copies of 5 KB a call)."""
        kind = type(module)
        known = self._rng_free.get(kind)
        if known is None:
            known = self._rng_free[kind] = getattr(kind, "forward", None) in _RNG_FREE_FORWARDS
        return not known or bool(module._forward_pre_hooks or module._forward_hooks)

    def _forward_code(self, module: torch.nn.Module):
        """The code object a module's forward frame runs (None when forward is not a function)."""
        kind = type(module)
        code = self._forward_codes.get(kind, False)
        if code is False:
            code = self._forward_codes[kind] = getattr(getattr(kind, "forward", None), "__code__", None)
        return code

    # -- backward --------------------------------------------------------------------------
    def _watch_backward(self, frame: _Frame, mtype: str, kwargs, outputs: list) -> None:
        """Watch the gradients of a recorded call's outputs and inputs: its backward event. One
        tensor hook per tensor, however many calls watch it: a module's output is usually the next
        one's input (this runs for every recorded call with gradients on: written for speed)."""
        outs = [(p, t) for p, t in outputs if t.requires_grad]
        if not outs:
            return
        # the paths are those of the pair (args, kwargs): [0][i] for positional, [1]['name'] for keywords
        ins = [("[0]" + p, t) for p, t in frame.args if t.requires_grad]
        if kwargs:
            ins += [(p, t) for p, t in flatten(kwargs, "[1]", walked=self._walked) if t.requires_grad]
        state = _Backward(frame.name, mtype, frame.depth, time.time_ns(), len(outs) + len(ins), self.step)
        watched, on_grad = self._grad_watch, self._on_grad
        for role, pairs in (("grad_output", outs), ("grad_input", ins)):
            for i, (path, t) in enumerate(pairs):
                listener = (state, role, i, path)
                entry = watched.get(id(t))
                if entry is not None and entry[0]() is t:
                    listeners = entry[1]
                    if listeners[0][0].done:  # a tensor watched again in a later step: forget the finished calls
                        listeners[:] = [x for x in listeners if not x[0].done]
                    if role == "grad_input":  # before the calls it is a grad_output of (see _on_grad)
                        listeners.insert(sum(1 for x in listeners if x[1] == "grad_input"), listener)
                    else:
                        listeners.append(listener)
                    continue
                listeners = [listener]
                _add_grad_hook(t, partial(on_grad, listeners))  # (which adds whether t is a leaf)
                watched[id(t)] = (weakref.ref(t), listeners)
        with self._lock:
            self._pending.append(state)

    def _on_grad(self, listeners: list, leaf: bool, grad) -> None:
        """A watched tensor's gradient arrives: a row for each module call waiting for it. A tensor
        hook torch calls directly (it contains its own failures, as `_guarded` would). The calls
        that read the tensor (it is their grad_input: their backward made this gradient) come
        before the call that wrote it (its grad_output: its backward starts from it), so that a
        call's backward event comes before the events of the calls its gradient flows into."""
        if grad is None or not self.enabled or is_compiling():  # a hook dynamo traces: ours stay out
            return
        try:
            if _legacy_batched(grad):  # (helper 64: a collector error, identical reruns inconclusive)
                return
            for state, role, idx, path in listeners:
                if role == "grad_input" and leaf and (state.done or not state.outputs) and not any(
                        x[0] is state and x[1] == "grad_output" for x in listeners):
                    # No gradient of the call's outputs came first, and this input is a leaf (a parameter
                    # the call was given): its gradient came from a later graph, not through the call
                    # (a parametrization's check as it is registered, a call whose output was dropped).
                    # (A non-leaf input's gradient is the call's own even then: an output edited in
                    # place outside autograd loses its hook, not its gradient.)
                    continue
                if state.done:
                    if state.step != self.step or not self.enabled:
                        continue
                    # a second backward through a retained graph (`retain_graph=True`, a gradient
                    # penalty, a saliency map): the call's gradients again, a new backward event
                    state.done, state.rows, state.arrived, state.outputs = False, [], 0, 0
                    with self._lock:
                        self._pending.append(state)
                if state.arrived == 0:
                    state.t0 = time.time_ns()
                state.rows.append(self._row(grad, role, idx, path))
                state.arrived += 1
                if role == "grad_output":
                    state.outputs += 1
                if state.arrived >= state.expected:
                    self._finish_backward(state)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_on_grad", exc)

    def _finish_backward(self, state: _Backward) -> None:
        state.done = True
        self._backwards += 1
        rows = state.rows
        if len(rows) > 1:
            rows = sorted(rows, key=_grad_order)  # outputs' gradients first
        self._emit("backward", "module", state.name, state.module_type, state.depth, state.t0, rows,
                   self._backward_stack())

    def _backward_stack(self) -> int:
        """The user stack of the backward pass running now, captured once per pass: every hook of a
        pass runs under the same Python frames (those that called backward()), so the first one's
        stack is every one's. The engine's end-of-pass callback forgets it."""
        sid = self._pass_stack
        if sid is None:
            sid = self._pass_stack = self._stacks.capture()
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
            except RuntimeError:  # not inside a backward pass after all: nothing to cache
                self._pass_stack = None
        return sid

    def _end_of_pass(self) -> None:
        self._pass_stack = None

    def _flush_backward(self, ended: bool = True) -> None:
        """Emit the backward events of the calls whose gradients have begun to arrive (an output or
        input that gets none is not waited for past a new top-level call or a step's end). A call
        nothing has arrived for yet is still waiting for its backward unless the recording `ended`:
        a loss module, or another model (a GAN's discriminator, and its optimizer's step), is
        called between a model's forward and its backward. (Ending those at every top-level call
        lost every module backward event of a training whose loss is an `nn.Module`.) The calls
        that never get one (a forward under grad without a backward) are let go of beyond
        MAX_WAITING_CALLS, the oldest first."""
        with self._lock:
            pending, self._pending = self._pending, []
        waiting = []
        for state in pending:
            if state.done:
                continue
            if state.arrived:
                self._finish_backward(state)
            elif ended:
                state.done = True
            else:
                waiting.append(state)
        if len(waiting) > MAX_WAITING_CALLS:
            for state in waiting[:-MAX_WAITING_CALLS]:
                state.done = True
            waiting = waiting[-MAX_WAITING_CALLS:]
        if waiting:
            with self._lock:
                self._pending[:0] = waiting

    # -- parameter gradients ---------------------------------------------------------------
    def _on_param_grad(self, pid: int, ref: weakref.ref, grad) -> None:
        """A parameter's gradient arrives (before autograd accumulates it into `.grad`). When `.grad`
        is empty, autograd makes this gradient its value as it is (taken over or copied), so the
        event is complete now; otherwise `.grad` is known only after the accumulation, and a hook
        for that is added to the parameter the first time it is needed. Training loops that empty
        `.grad` every step (zero_grad's default) so cost one hook call a parameter, not two. A tensor
        hook torch calls directly (it contains its own failures, as `_guarded` would)."""
        if grad is None or not self.enabled or is_compiling():  # a hook dynamo traces: ours stay out
            return
        try:
            if _legacy_batched(grad):
                return
            if self._advance:  # no module call since the last optimizer step: tensors trained by hand
                self._loose_step()
            steps = self.steps  # (_in_window)
            if steps is not None and not (self.step >= steps[0] and (steps[1] is None or self.step < steps[1])):
                return
            entry = self._params[pid]
            param = entry[0]()
            if param is None or param is not ref():
                # (the hooked tensor is gone and its id is another's: the hook stays in the graph that made it, a
                # stand-in for a parameter (torch.func's MAML) freed before its backward; helper 64: that gradient
                # was an event of whichever tensor had the id by then, as the memory was reused or not)
                return
            self._grads += 1
            t0 = time.time_ns()
            row_in = self._row(grad, "grad_input", 0, "")
            # (a tensor standing in for a parameter, functional_call's fast weights, is no leaf: its .grad
            # stays empty, and reading it makes torch warn, an error under -W error: helper 36, MAML)
            if not (param.is_leaf or param.retains_grad) or param.grad is None:
                row = list(row_in)
                row[1] = "grad"
                self._emit("backward", "grad", entry[1], entry[2], 0, t0, [row_in, row], self._backward_stack())
                return
            self._param_in[pid] = (t0, row_in)
            if pid not in self._accumulating:
                self._accumulating.add(pid)
                self._handles.append(param.register_post_accumulate_grad_hook(
                    partial(self._guarded, self._on_param_accumulated, pid)))
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_on_param_grad", exc)

    def _loose_step(self) -> None:
        """A gradient arrives with no module call since the last optimizer step: a loop that trains
        tensors held by no module (`w = torch.zeros(3, requires_grad=True)` stepped by torch.optim). Its
        step begins here, with the params event of those tensors, as a root's first call begins one:
        its events were all numbered step 0, and an edit of a tensor between two steps was blamed on
        another tensor's gradient (helper 42)."""
        self._maybe_advance()
        if self._orphans_due():
            self._orphan_params(time.time_ns())

    def _on_param_accumulated(self, pid: int, param) -> None:
        pending = self._param_in.pop(pid, None)
        if pending is None or param.grad is None:
            return
        t0, row_in = pending
        self._emit_grad(pid, t0, row_in, self._row(param.grad, "grad", 0, ""))

    def _emit_grad(self, pid: int, t0: int, row_in: list, row: list) -> None:
        _, name, owner, _ = self._params[pid]
        self._emit("backward", "grad", name, owner, 0, t0, [row_in, row], self._backward_stack())

# What torch calls into directly (each contains its own failures): dynamo runs them as plain Python
# (collectors/compiled.py, keep_out_of_dynamo), and benchmarks/bench_recording.py --hook-time times them.
ENTRIES = (Collector._enter, Collector._leave, Collector._guarded, Collector._on_grad, Collector._on_param_grad)

