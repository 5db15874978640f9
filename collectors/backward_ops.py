"""The backward op tracer: what autograd runs for one module's nodes in step K's backward, as op records.

A backward pivot (a module's gradient, a parameter's gradient) is drilled into in two parts:

1. *Forward*: while any forward call of the window module runs in step K (collectors/drill.py
   traces it with the forward op tracer, ops.py), every autograd node the call creates is noted
   with the forward op that created it (`WindowNodes`): the nodes reachable from each traced op's
   outputs, and at the call's end from its outputs, whose sequence number is at least the one
   autograd was at when the call began (created in the call, not before); the parameters'
   `AccumulateGrad` nodes reached through `next_functions`. The nodes are kept alive for the step.
2. *Backward*: while the step's backward pass runs (`BackwardTrace.run`, around torch's
   `_engine_run_backward`, which `Tensor.backward` and `torch.autograd.grad` call), a
   `TorchFunctionMode` (the forward tracer's, `BackwardFunctions`) sees the torch functions
   Python code calls inside a node (a tensor hook such as a gradient hook on a parameter, a custom
   `autograd.Function`'s backward), with their own user frame; while a window node runs (from a
   pre-hook on the node to a post-hook: with a dispatch mode on, autograd's formulas take their
   tensor-subclass paths, `isTensorSubclassLike`, which must not change the gradients reaching the
   window), a `TorchDispatchMode` (`BackwardAten`) sees the aten ops it runs
   (`aten.embedding_dense_backward.default`, `aten.mm.default`, `AccumulateGrad`'s
   `aten.detach.default` or `aten.add_.Tensor`), placed where the forward op that created the node
   was called (`source: "created_at"`). Each op is
   attributed to `torch._C._current_autograd_node()`; only ops of the window's nodes are recorded,
   with `phase: "backward"`, `node` (its name) and `created_at` (the forward op that created it).
   An aten op below a traced torch function, or below bitguard's own code (the collector's
   gradient hooks run in the backward too), is not an op of its own.

Inputs are digested before an op, outputs after, bytes kept within the caps: the forward tracer's
code (ops.py `OpTracer._call`). Modes hand each call on with themselves popped, so dispatch is
the untraced one; a failure turns the tracer off and goes to the trace's errors.

What it cannot see: what runs inside a C++ op (a kernel, a fused backward), autograd's sums of a
gradient from several consumers (the engine adds them after the producing node's post-hooks),
tensor hooks' ops below torch functions that run with torch function off (they run before the
node's pre-hook), Python ops on threads other than the one that runs the backward pass,
collectives (not torch functions; DDP's reducer hooks run in the window's AccumulateGrad nodes,
its all-reduce elsewhere), compiled backward graphs (one opaque call), a window whose forward
runs under reentrant activation checkpointing (its nodes are made in the backward's recompute),
and nodes the window's forward did not create (a gradient arriving through a tensor made
elsewhere). The dispatch mode still makes the window's own nodes take autograd's tensor-subclass
paths: a formula that computes otherwise there changes the window's gradient, and the drill's
replay check then says the replay does not reproduce its record.

This module knows autograd nodes and modes; not which call is the window (drill.py).
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bitguard.collectors.compiled import is_compiling
from bitguard.collectors.ops import OWN, USER, Keeper, OpTracer, _kind, _kinds

NO_SEQUENCE = 2 ** 64 - 1  # an AccumulateGrad node's sequence number
MAX_NODES = 1 << 20  # nodes noted at most (a walk that finds more stops there, and says so)


class DigestsOnly(Keeper):
    """A keeper that keeps no bytes: the forward ops of a backward window are described by their
    digests only (`kept: "none"`, no chunks): the pivot is in the backward."""

    def __init__(self):
        super().__init__(None, "", 0, 0)

    def keep(self, t, name: str, entry: dict) -> None:
        entry["kept"] = "none"


def _creator(record: dict | None) -> dict | None:
    """The forward op that created a node, as a backward op's `created_at` says it."""
    if record is None:
        return None
    return {"i": record["i"], "op": record["op"], "file": record["file"], "line": record["line"],
            "function": record["function"], "stack": record["stack"]}


def _function_creator(node) -> dict | None:
    """A custom autograd.Function's node not made by a traced op: its class's forward."""
    cls = getattr(node, "_forward_cls", None)
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None:
        return None
    return {"i": None, "op": f"{cls.__module__}.{cls.__qualname__}.apply", "file": code.co_filename,
            "line": code.co_firstlineno, "function": code.co_name, "stack": []}


class WindowNodes:
    """The autograd nodes the window's forward calls created (see the module docstring)."""

    def __init__(self, fail):
        self.fail = fail
        self.nodes: dict[int, tuple] = {}  # id(node) -> (node, info)
        self.params: dict[int, str] = {}  # id(parameter) -> its name (the window's parameters)
        self.full = False
        self.noted = None  # called with each node when it is noted

    def begin(self, module: torch.nn.Module, names: dict) -> int:
        """A window call begins: its parameters (`names`: id -> name) and autograd's sequence number."""
        for p in module.parameters():
            self.params.setdefault(id(p), names.get(id(p)))
        return torch._C._autograd._get_sequence_nr()

    def info(self, node) -> dict | None:
        entry = self.nodes.get(id(node)) if node is not None else None
        return entry[1] if entry is not None and entry[0] is node else None

    def add(self, tensors, since: int, record: dict | None, modules: list, before=(), through: bool = False) -> None:
        """Note the nodes created since sequence number `since` that `tensors`' grad_fn reach, as
        created by `record` (a forward op; None: no traced op, see `_function_creator`). The walk
        stops at `before` (the op's inputs: their nodes existed before it) and, unless `through`,
        at nodes already noted (a window call's outputs walk through them, to the nodes of calls no
        op traced made, such as a custom autograd.Function's)."""
        stop = {id(t.grad_fn) for t in before if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        todo = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            key = id(node)
            if node is None or key in seen or key in stop:
                continue
            seen.add(key)
            seq = node._sequence_nr()
            if seq != NO_SEQUENCE and seq < since:  # made before the call: not the window's
                continue
            if key not in self.nodes:
                if len(self.nodes) >= MAX_NODES:
                    if not self.full:
                        self.full = True
                        self.fail("backward nodes", RuntimeError(f"over {MAX_NODES} autograd nodes in the window: "
                                                                 "the rest are not traced"))
                    return
                self.nodes[key] = (node, self._info(node, seq, record, modules))
                if self.noted is not None:
                    self.noted(node)
            elif not through:
                continue
            if seq != NO_SEQUENCE:
                todo.extend(n for n, _ in node.next_functions)

    def _info(self, node, seq: int, record: dict | None, modules: list) -> dict:
        created = _creator(record) if record is not None else _function_creator(node)
        info = {"node": node.name(), "created_at": created, "modules": list(modules)}
        if seq == NO_SEQUENCE:  # a leaf's AccumulateGrad: its parameter's name (None: not the window's)
            variable = getattr(node, "variable", None)
            info["param"] = self.params.get(id(variable)) if variable is not None else None
        return info

    def clear(self) -> None:
        self.nodes.clear()


class BackwardFunctions(OpTracer):
    """The torch functions Python code calls inside the window's nodes in the backward (tensor
    hooks, a custom Function's backward), with their own user frames: the forward tracer's code,
    attributed to the node autograd runs."""

    phase = "backward"

    def __init__(self, nodes: WindowNodes, keeper: Keeper, fail):
        super().__init__([], 0, None, keeper, fail)
        self.nodes = nodes
        self.contexts: list[tuple] = []  # (the node's info, what file/line say) of the ops being recorded

    def _attends(self) -> bool:
        return self.nodes.info(torch._C._current_autograd_node()) is not None

    def _call(self, name: str, func, args: tuple, kwargs: dict, where: tuple, pure: bool, quiet: bool,
              context: tuple | None = None):
        if context is None:  # a torch function of Python code in a node: its own frame
            context = (self.nodes.info(torch._C._current_autograd_node()) or {}, "frame")
        self.contexts.append(context)
        try:
            return super()._call(name, func, args, kwargs, where, pure, quiet)
        finally:
            self.contexts.pop()

    def _fields(self) -> dict:
        info, source = self.contexts[-1]
        fields = {"phase": self.phase, "modules": info.get("modules") or [], "node": info.get("node"),
                  "source": source, "created_at": info.get("created_at")}
        if "param" in info:
            fields["param"] = info["param"]
        return fields


class BackwardAten(TorchDispatchMode):
    """The aten ops of the window's nodes that no traced torch function holds: those a C++ node
    runs, placed where the forward op that created the node was called."""

    def __init__(self, functions: BackwardFunctions):
        super().__init__()
        self.functions = functions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.functions
        if not tracer.active:
            return func(*args, **kwargs)
        try:
            info = tracer.nodes.info(torch._C._current_autograd_node())
            where = None if info is None else self._where(sys._getframe(1), info)
        except Exception as exc:  # noqa: BLE001 - the training goes on, untraced from here
            tracer._failed(str(func), exc)
            return func(*args, **kwargs)
        if where is None:
            return func(*args, **kwargs)
        n = len(tracer.ops)
        result = tracer._call(str(func), func, args, kwargs, where[:4], False, False, (info, where[4]))
        if len(tracer.ops) > n and getattr(getattr(func, "_schema", None), "is_mutable", False):
            tracer.ops[-1]["inplace"] = True  # (the version counter moves above this mode: after the op)
        return result

    def _where(self, f, info: dict):
        """(file, line, function, stack, source) of an aten op of a window node; None when it runs
        below bitguard's code (the tracer's own call of a torch function, the collector's hooks).
        Below user Python (a hook calling torch with torch function off): that frame; from a C++
        node (no Python but torch's down to the backward pass): its creator's place."""
        stop = self.functions.stop
        while f is not None and f is not stop:
            code = f.f_code
            kind = _kinds.get(code)
            if kind is None:
                kind = _kind(code)
            if kind == OWN:
                return None
            if kind == USER:
                where = self.functions._where(f, None)
                return None if where is None else (*where, "frame")
            f = f.f_back
        created = info.get("created_at") or {}
        return created.get("file"), created.get("line"), created.get("function"), created.get("stack") or [], \
            "created_at"


class BackwardTrace:
    """The window's nodes and the two modes that trace them in the backward pass: the torch
    function mode for the whole pass (it changes nothing a C++ node computes), the dispatch mode
    only while a window node runs (from its pre-hook to its post-hook): with a dispatch mode on,
    autograd's formulas take the paths they take for tensor subclasses (`isTensorSubclassLike`),
    which must not change the gradients that reach the window."""

    def __init__(self, keeper: Keeper, fail):
        self.fail = fail
        self.nodes = WindowNodes(fail)
        self.nodes.noted = self._hook
        self.functions = BackwardFunctions(self.nodes, keeper, fail)
        self.aten = BackwardAten(self.functions)
        self.forward_ops: list[dict] = []  # the window's forward ops (their records), digests only
        self.forward_keeper = DigestsOnly()
        self.passes = 0  # backward passes traced
        self.running = False
        self.depth = 0  # window nodes running (the dispatch mode is on while > 0)
        self.handles: list = []

    @property
    def ops(self) -> list[dict]:
        return self.functions.ops

    def observe(self, since: int, record: dict, outs: list, inputs: list) -> None:
        """A forward op of the window was recorded (OpTracer.observe): the nodes it created."""
        self.nodes.add([t for _, t in outs], since, record, record["modules"], [t for _, t in inputs])

    def returned(self, since: int, outputs: list, window: str) -> None:
        """A window call returned: nodes its outputs reach that no traced op created."""
        self.nodes.add([t for _, t in outputs], since, None, [window], through=True)

    def _hook(self, node) -> None:
        """A node of the window: the dispatch mode on while it runs (hooks that pass its gradients on)."""
        try:
            self.handles.append(node.register_prehook(self._node_begins))
            self.handles.append(node.register_hook(self._node_ends))
        except Exception as exc:  # noqa: BLE001 - its C++ ops go untraced, and it is said
            self.fail(f"backward node {node.name()}", exc)

    def _node_begins(self, grad_outputs) -> None:
        if not self.running or not self.functions.active:
            return
        if self.depth == 0:
            try:
                self.aten.__enter__()
            except Exception as exc:  # noqa: BLE001
                self.fail("backward op tracer", exc)
                return
        self.depth += 1

    def _node_ends(self, grad_inputs, grad_outputs) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            _pop_dispatch_mode(self.aten, self.fail)

    def run(self, run, args: tuple, kwargs: dict):
        """torch's `_engine_run_backward(*args, **kwargs)` (`run`) with the function mode on."""
        if self.running or not self.nodes.nodes or not self.functions.active or is_compiling():
            return run(*args, **kwargs)
        functions = self.functions
        try:
            functions.stop = sys._getframe()
            functions.__enter__()
        except Exception as exc:  # noqa: BLE001 - untraced, and said so
            self.fail("backward op tracer", exc)
            return run(*args, **kwargs)
        self.running = True
        try:
            return run(*args, **kwargs)
        finally:
            self.running = False
            self.passes += 1
            if self.depth:  # a node that raised: its post-hook never ran
                self.depth = 0
                _pop_dispatch_mode(self.aten, self.fail)
            _pop_function_mode(functions, self.fail)

    def close(self) -> None:
        """The step is over: the node hooks out, the nodes let go."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.nodes.clear()


def _pop_function_mode(mode, fail) -> None:
    depth = torch._C._len_torch_function_stack()
    if depth and torch._C._get_function_stack_at(depth - 1) is mode:
        mode.__exit__(None, None, None)
    else:
        mode.active = False
        fail("backward op tracer", RuntimeError("a torch function mode entered in the backward pass was not left; "
                                                "the tracer stays on the stack, inactive"))


def _pop_dispatch_mode(mode, fail) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is mode:
        mode.__exit__(None, None, None)
    else:
        mode.functions.active = False
        fail("backward op tracer", RuntimeError("a torch dispatch mode entered in the backward pass was not left; "
                                                "the tracer stays on the stack, inactive"))
