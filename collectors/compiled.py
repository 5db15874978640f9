"""torch.compile: what the collectors observe of a compiled model, and under which names.

A compiled region is a module whose calls run compiled code: an `OptimizedModule`
(`torch.compile(module)`, also as a submodule: `model.block = torch.compile(block)`) or a module
compiled in place (`module.compile()`, whose `_compiled_call_impl` `Module.__call__` runs instead
of `_call_impl`). The collectors observe a region where it is called eagerly: its inputs, its
outputs, the gradients of both, and, as for every model, parameter gradients and optimizer steps.
Nothing of bitguard runs while dynamo traces (the module-call wrapper passes calls straight
through when `torch.compiler.is_compiling()`, which dynamo folds to a constant), so the graphs
that run are those a plain run compiles, and the module boundaries inside a region are not
observed. The region's forward event says so: it carries one `state` row at `REGION_PATH`,
marked unobserved with `REGION_REASON` (backend/granularity.py reads it; a reader that does not
know it sees an unobserved tensor, so it never certifies more than was seen).

Names are eager's: the region is named and typed as the module it wraps, `_orig_mod.` is
stripped from module and parameter names, so an eager run and a compiled run of the same model
align. Module code that dynamo does not trace (a graph break into code it skips) runs eagerly
inside the region and is observed as usual.

This module knows torch.compile's wrappers, not how events are stored or compared. It never
imports torch._dynamo: where it is not loaded, nothing is compiled.
"""

from __future__ import annotations

import functools
import re
import sys
import weakref

import torch

from bitguard.collectors.patching import Patch
from bitguard.schema import COMPILED_REGION_PATH as REGION_PATH

REGION_REASON = ("compiled region (torch.compile): observed at its inputs and outputs; the module boundaries "
                 "inside it were not observed")
_ORIG_MOD = re.compile(r"(?:^|\.)_orig_mod(?=\.|$)")
is_compiling = torch.compiler.is_compiling  # dynamo folds this call to True while it traces
# torch.jit.trace (and torch.onnx.export, which traces) in progress: the calls it runs are its graph's, and every
# op of ours it would record into that graph (helper 66: "Graphs differed across invocations", the trace failed)
jit_tracing = torch._C._get_tracing_state


def aside_while_tracing(recorder) -> list[Patch]:
    """torch.jit.trace and torch.jit.trace_module patched to run with `recorder.enabled` off (a Collector, an
    online Monitor): what a trace runs (the module traced, then again eagerly as it checks the trace) is no call
    of the training's (helper 66: the trace failed its check with the recorder's ops in its graph, an online
    sensor's sums were traced values, and the eager module of the check, dropped after, took a final state or
    not as the garbage collector ran)."""
    def make(original, patch):
        def aside(*args, **kwargs):
            was = recorder.enabled
            if patch.active:
                recorder.enabled = False
            try:
                return original(*args, **kwargs)
            finally:
                if patch.active:
                    recorder.enabled = was
        return aside
    return [Patch(torch.jit, name, make) for name in ("trace", "trace_module")]


_optimized: type | None = None  # torch._dynamo's OptimizedModule, once torch._dynamo is loaded


def _optimized_module() -> type | None:
    """torch._dynamo's OptimizedModule class, None while torch._dynamo is not loaded."""
    global _optimized
    if _optimized is None:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        _optimized = None if eval_frame is None else eval_frame.OptimizedModule
    return _optimized


def original(module: torch.nn.Module) -> torch.nn.Module:
    """The module an OptimizedModule wraps (itself for any other module)."""
    optimized = _optimized or _optimized_module()
    while optimized is not None and isinstance(module, optimized):
        module = module._orig_mod
    return module


def region_of(module: torch.nn.Module) -> torch.nn.Module | None:
    """When a call of `module` runs compiled code, the module whose code it compiles (an
    OptimizedModule's `_orig_mod`, or `module` itself when compiled in place); None otherwise.
    This runs for every module call: a class attribute read and, once torch._dynamo is loaded, an
    isinstance."""
    if module._compiled_call_impl is not None:
        return module
    optimized = _optimized or _optimized_module()
    return original(module) if optimized is not None and isinstance(module, optimized) else None


def inner_call(parent: torch.nn.Module, module: torch.nn.Module) -> bool:
    """Is this call of `module` the compiled call that the region `parent`'s own call makes (an
    OptimizedModule calling its `_orig_mod`, a module compiled in place calling itself)? The
    region's event is that call's; it is not observed a second time."""
    if parent is module:
        return module._compiled_call_impl is not None
    return parent._modules.get("_orig_mod") is module  # (OptimizedModule registers it as a submodule)


def keep_out_of_dynamo(wrapper, own) -> None:
    """Tell dynamo's frame evaluation (torch's C part: torch._dynamo need not be loaded) how to
    treat our frames when a compiled region calls into them: the module-call `wrapper`'s frame is
    never compiled as a top frame, but what it calls is (the module's forward, the frame a plain
    run compiles); the collector's `own` functions run as plain Python, with everything they call.
    Without this, a graph break inside a region made dynamo compile the wrapper (one code object
    for every module: the recompile limit) and our bookkeeping. Set again at each region call:
    `torch._dynamo.reset()` may forget it."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    if eval_frame is None or not hasattr(eval_frame, "set_code_exec_strategy"):
        return
    action, strategy = eval_frame._FrameAction, eval_frame._FrameExecStrategy
    eval_frame.set_code_exec_strategy(wrapper.__code__, strategy(action.SKIP, action.DEFAULT))
    for fn in own:
        eval_frame.set_code_exec_strategy(fn.__code__, strategy(action.SKIP, action.SKIP))


def eager_name(name: str) -> str:
    """A module or parameter name as in the eager model: `_orig_mod` parts taken out."""
    return _ORIG_MOD.sub("", name).lstrip(".") if "_orig_mod" in name else name


def compiled_function(fn) -> str | None:
    """Why compiling `fn` hides module calls from the collectors (None when it does not): a function
    of the user's, not a module (whose calls are observed at the region's boundary) nor torch's own
    (flex attention compiles itself), traced whole by dynamo with every module call inside it."""
    if fn is None or isinstance(fn, torch.nn.Module) or isinstance(getattr(fn, "__self__", None), torch.nn.Module):
        return None
    if str(getattr(fn, "__module__", "") or "").split(".")[0] == "torch":
        return None
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return (f"torch.compile({name}) compiles a function: the module calls, gradients and optimizer steps dynamo "
            f"traces inside it are not observed (compile the model, torch.compile(model), to observe it at its "
            f"boundary)")


class CompileWatch:
    """While installed, `Module.compile()` leaves a module whose compiled calls are observed at
    their boundary: its `_compiled_call_impl` goes through `observe(inner)` (the collector's
    module-call wrapper around the compiled function); and `torch.compile` of a function (a
    training step) is reported through `report(message)` when it runs outside every module call
    (`inside()` False): what it traces is not observed. Run inside a module's call (a library's
    compiled helper, torchvision's roi_align under deterministic algorithms: helper 45), what it
    computes is that call's, observed at its boundary. `remove()` restores both."""

    def __init__(self, observe, report, inside=lambda: False):
        self._observe = observe
        self._report = report
        self._inside = inside
        self._patches: list[Patch] = []
        self._wrapped: list = []  # (weakref to the module, the compiled callable torch set)
        self._noted = False

    def install(self) -> None:
        watch = self

        def make_compile(original, patch):
            def compile(module, *args, **kwargs):
                out = original(module, *args, **kwargs)
                if patch.active:
                    watch.wrap(module)
                    watch.note_determinism(kwargs)
                return out
            return compile

        def make_torch_compile(original, patch):
            def torch_compile(model=None, **kwargs):
                if model is None:  # @torch.compile(mode=...): the decorator
                    return lambda fn: torch_compile(fn, **kwargs)
                if patch.active:
                    watch.note_determinism(kwargs)
                # (disable=True, as `@torch.compile(disable=not args.compile)` leaves it: nothing is traced, helper 92)
                why = compiled_function(model) if patch.active and not kwargs.get("disable") else None
                compiled = original(model, **kwargs)
                return compiled if why is None or not callable(compiled) else watch.reporting(compiled, why, patch)
            return torch_compile

        self._patches = [Patch(torch.nn.Module, "compile", make_compile), Patch(torch, "compile", make_torch_compile)]

    def note_determinism(self, kwargs: dict) -> None:
        """Say once, on stderr, that deterministic algorithms (the determinism controls) change what inductor
        generates: a compiled run's numbers recorded so can differ from a plain run's (helper 90: equal losses,
        final weights a few ULPs apart; docs/STACKS.md)."""
        if self._noted or kwargs.get("disable") or not torch.are_deterministic_algorithms_enabled():
            return
        self._noted = True
        print("bitguard: note: deterministic algorithms are on while recording (the determinism controls), and "
              "torch.compile then generates deterministic kernels: the recorded numbers can differ from a plain "
              "run's by a few ULPs (a plain run with torch.use_deterministic_algorithms(True) and "
              "TORCHINDUCTOR_DETERMINISTIC=1 computes the recorded ones; --no-determinism records the plain run's "
              "kernels)", file=sys.stderr)

    def reporting(self, compiled, why: str, patch):
        """`compiled` (a function torch.compile made), saying `why` at its first call outside every
        module call while the recording runs."""
        watch = self

        @functools.wraps(compiled)
        def run(*args, **kwargs):
            if patch.active and not is_compiling() and not watch._inside():
                watch._report(why)
            return compiled(*args, **kwargs)
        return run

    def wrap(self, module: torch.nn.Module) -> None:
        compiled = module._compiled_call_impl
        if compiled is None or getattr(compiled, "_bitguard_observed", False):
            return
        call = self._observe(lambda _module, *args, **kwargs: compiled(*args, **kwargs))
        ref = weakref.ref(module)

        def observed(*args, **kwargs):
            return call(ref(), *args, **kwargs)

        observed._bitguard_observed = True
        module._compiled_call_impl = observed
        self._wrapped.append((ref, compiled))

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()
        for ref, compiled in self._wrapped:
            module = ref()
            if module is not None and getattr(module._compiled_call_impl, "_bitguard_observed", False):
                module._compiled_call_impl = compiled
        self._wrapped.clear()
