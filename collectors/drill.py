"""The drill inside a replay child: trace one module call at op level, keep bytes, stop after step K.

`bitguard drill` (backend/drill.py) replays a run with env `BITGUARD_DRILL` naming a drill spec
(`bitguard.drill-spec/1`, docs/DRILL.md). `from_env()` reads it when the recording starts (a bad
spec is bad input: the replay exits 2 before the script runs) and `Drill.install()` wraps
`nn.Module._call_impl` *under* the collector's wrapper, so that when ours runs the collector has
pushed the call's frame (its bitguard name, its recompute kind) and moved its step counter. In
step K, the window call (the `call`-th forward of the window boundary; recomputes under
activation checkpointing do not count) runs with the op tracer on (collectors/ops.py), and the
`keep` calls' inputs and outputs are digested and their bytes kept. A backward window
(`phase: "backward"`) has every forward call of its boundary in step K traced that way, noting
the autograd nodes they make, and the step's backward passes traced for those nodes
(collectors/backward_ops.py, around torch's `_engine_run_backward`): the trace's `ops` are then
the backward's, `forward_ops` the forward calls'. A backward `keep` call keeps the gradients the
collector observes there (`BackwardKeep`: a module's, or with `kind: "grad"` a parameter's).
When the step counter moves
past K (the first module call after step K's last optimizer step), or when the recording ends,
`ops-rank-R.json` (`bitguard.ops/1`) is written atomically; with `stop_after_step` the recording
is then closed as complete and the process exits 0, on every rank at the same point.

A failure of the drill never reaches the training: it is one line on stderr and one entry in the
trace's `errors` (then `complete` is false), and the tracer steps aside. Nothing here decides
what to trace (the spec says) nor reads traces back (backend/opdiff.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from bitguard.collectors.backward_ops import BackwardTrace
from bitguard.collectors.compiled import is_compiling, keep_out_of_dynamo
from bitguard.collectors.flatten import flatten
from bitguard.collectors.ops import Keeper, OpTracer, describe, transparent
from bitguard.errors import BadInput

ENV = "BITGUARD_DRILL"
SPEC_SCHEMA = "bitguard.drill-spec/1"
OPS_SCHEMA = "bitguard.ops/1"
MAX_ERRORS = 20


@dataclass(frozen=True)
class CallSpec:
    """One module call of step K: its bitguard name and which forward call of it (0: the first)."""

    boundary: str
    phase: str
    call: int
    kind: str = "module"  # module | grad (a parameter's gradient: `boundary` is its name; a keep call only)

    def to_dict(self) -> dict:
        extra = {"kind": self.kind} if self.kind != "module" else {}
        return {"boundary": self.boundary, "phase": self.phase, "call": self.call, **extra}


@dataclass(frozen=True)
class DrillSpec:
    step: int  # the training step traced (the collector's numbering)
    rank: int | None  # the rank traced; None: every rank
    window: CallSpec  # the module call traced at op level
    keep: tuple[CallSpec, ...]  # module calls whose input and output bytes are kept
    out: Path  # folder of ops-rank-R.json and ops-rank-R/
    max_tensor_bytes: int  # bytes kept of one tensor at most
    max_total_bytes: int  # bytes kept in all at most
    stop_after_step: bool  # end the process once step K is over
    windows: dict = None  # kept tensor name -> chunks to keep the bytes of (a second pass, over the caps)


def _call_spec(value, where: str) -> CallSpec:
    if not isinstance(value, dict) or not isinstance(value.get("boundary"), str) or not value["boundary"]:
        raise BadInput(f"drill spec: {where} must be an object with a boundary name")
    phase = value.get("phase", "forward")
    if phase not in ("forward", "backward"):
        raise BadInput(f"drill spec: {where} has phase {phase!r}; a call is traced in its forward or its backward")
    call = value.get("call", 0)
    if type(call) is not int or call < 0:
        raise BadInput(f"drill spec: {where}.call must be a call index >= 0")
    kind = value.get("kind", "module")
    if kind not in ("module", "grad") or (kind == "grad" and (phase != "backward" or where == "window")):
        raise BadInput(f"drill spec: {where}.kind must be module, or grad for a kept backward parameter gradient")
    return CallSpec(value["boundary"], phase, call, kind)


def _count(data: dict, key: str, default: int) -> int:
    value = data.get(key, default)
    if type(value) is not int or value < 0:
        raise BadInput(f"drill spec: {key} must be a byte count >= 0")
    return value


def read_spec(path: str, default_out: Path) -> DrillSpec:
    """The spec at `path` (BadInput, one line, when it cannot be used)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{ENV}={path}: cannot read the drill spec ({exc}); drill again") from None
    if not isinstance(data, dict) or data.get("schema") != SPEC_SCHEMA:
        raise BadInput(f"{ENV}={path} is not a {SPEC_SCHEMA} drill spec; drill again with this bitguard")
    step, rank = data.get("step"), data.get("rank")
    if type(step) is not int or step < 0:
        raise BadInput(f"drill spec {path}: step must be a step number >= 0")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise BadInput(f"drill spec {path}: rank must be a rank >= 0 or null")
    keep = data.get("keep") or []
    if not isinstance(keep, list):
        raise BadInput(f"drill spec {path}: keep must be a list of calls")
    out = data.get("out")
    return DrillSpec(step, rank, _call_spec(data.get("window"), "window"),
                     tuple(_call_spec(k, f"keep[{i}]") for i, k in enumerate(keep)),
                     Path(out) if isinstance(out, str) and out else default_out,
                     _count(data, "max_tensor_bytes", 64 << 20), _count(data, "max_total_bytes", 512 << 20),
                     bool(data.get("stop_after_step", True)), _windows(data.get("windows"), path))


def _windows(value, path) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) <= 64 and all(type(i) is int and i >= 0 for i in v)
            for k, v in value.items()):
        raise BadInput(f"drill spec {path}: windows must map kept tensor names to at most 64 chunk indices")
    return {k: tuple(v) for k, v in value.items()}


def from_env(rank: int, default_out: Path) -> Drill | None:
    """The drill the env asks for (None without BITGUARD_DRILL)."""
    path = os.environ.get(ENV, "")
    return Drill(read_spec(path, default_out), rank) if path else None


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


class Drill:
    def __init__(self, spec: DrillSpec, rank: int):
        self.spec = spec
        self.rank = rank
        self.traced = spec.rank is None or spec.rank == rank  # this rank traces (every rank stops)
        self.keeper = Keeper(spec.out / f"ops-rank-{rank}", f"ops-rank-{rank}", spec.max_tensor_bytes,
                             spec.max_total_bytes, spec.windows)
        self.keep = {(k.boundary, k.call) for k in spec.keep if k.phase == "forward"} if self.traced else set()
        backward = spec.window.phase == "backward" and self.traced
        self.backward = BackwardTrace(self.keeper, self._fail) if backward else None
        self.grads = BackwardKeep(self, [k for k in spec.keep if k.phase == "backward"]) if self.traced else None
        self.errors: list[str] = []
        self.boundaries: list[dict] = []
        self.calls: dict[str, int] = {}  # boundary -> forward calls so far in step K
        self.tracer: OpTracer | None = None
        self.found = False  # the window call began
        self.returned = False  # ... and returned
        self.module_type: str | None = None
        self.written = False
        self.off = False  # closed: every call passes straight through
        self.recording = self.collector = None
        self._inner = self._wrapper = None
        self._run_backward = self._backward_wrapper = None

    # -- installation ----------------------------------------------------------------------
    def install(self, recording) -> None:
        """Wrap `nn.Module._call_impl`; call before the collector installs (its wrapper is outer)."""
        self.recording, self.collector = recording, recording.collector
        self._inner = torch.nn.Module._call_impl
        self._wrapper = torch.nn.Module._call_impl = self._wrap(self._inner)
        keep_out_of_dynamo(self._wrapper, ())
        if self.backward is not None:  # the backward pass, where Tensor.backward and autograd.grad run it
            self._run_backward = torch.autograd._engine_run_backward
            self._backward_wrapper = torch.autograd._engine_run_backward = self._wrap_backward(self._run_backward)

    def close(self) -> None:
        """The recording ends: write the trace (if not yet) and take the wrapper out."""
        self._write()
        self.off = True
        if self._wrapper is not None and torch.nn.Module._call_impl is self._wrapper:
            torch.nn.Module._call_impl = self._inner
        if self._backward_wrapper is not None and torch.autograd._engine_run_backward is self._backward_wrapper:
            torch.autograd._engine_run_backward = self._run_backward
        # (wrapped again since by someone else: ours stays in their chain, passing calls through)
        if self.grads is not None:
            self.grads.close()

    def _wrap(self, inner):
        drill, step = self, self.spec.step

        def _call_impl(module, *args, **kwargs):
            collector = drill.collector
            if is_compiling() or drill.off or collector.step != step:
                if not drill.off and collector.step > step and not is_compiling():
                    drill._step_over()
                return inner(module, *args, **kwargs)
            return drill._in_step(inner, module, args, kwargs)

        transparent(_call_impl, Drill._in_step, Drill._traced, Drill._suspended)
        return _call_impl

    def _wrap_backward(self, run):
        drill, step = self, self.spec.step

        def _engine_run_backward(*args, **kwargs):
            if drill.off or drill.collector.step != step or is_compiling():
                return run(*args, **kwargs)
            return drill.backward.run(run, args, kwargs)

        return _engine_run_backward

    # -- step K ----------------------------------------------------------------------------
    def _in_step(self, inner, module, args, kwargs):
        frames = getattr(self.collector._local, "frames", None)
        frame = frames[-1] if frames and frames[-1].module is module else None
        if frame is None or frame.recompute is not None or not frame.record:
            return inner(module, *args, **kwargs)
        name = frame.name
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        kept = (name, call) in self.keep and self._keep_inputs(name, call, args, kwargs)
        window = self.spec.window
        if self.traced and name == window.boundary and (
                (not self.found and call == window.call) or self.backward is not None):
            output = self._traced(inner, module, args, kwargs, frame, frames)
        elif frame.region is not None and self.tracer is not None and self.tracer.active:
            output = self._suspended(inner, module, args, kwargs, frame)
        else:
            output = inner(module, *args, **kwargs)
        if kept:
            self._keep_outputs(name, call, output)
        if self.grads is not None and self.grads.wanted(name):
            self.grads.watch(name, frame, kwargs, output)
        return output

    def _traced(self, inner, module, args, kwargs, frame, frames):
        """The window call, with the op tracer on."""
        self.found = True
        self.module_type = type(frame.region or module).__name__
        if frame.region is not None:
            self._fail("window", RuntimeError(f"{frame.name} is a compiled region (torch.compile): its ops run in a "
                                              "dynamo graph and are not traced; drill a run without torch.compile"))
            return inner(module, *args, **kwargs)
        tracer = since = None
        backward = self.backward
        try:
            keeper = self.keeper if backward is None else backward.forward_keeper
            tracer = OpTracer(frames, len(frames) - 1, sys._getframe(), keeper, self._fail)
            if backward is not None:  # every forward call of the window: the autograd nodes it creates
                since = backward.nodes.begin(module, self._param_names())
                tracer.ops = backward.forward_ops
                tracer.observe = partial(backward.observe, since)
            tracer.__enter__()
            self.tracer = tracer
        except Exception as exc:  # noqa: BLE001 - untraced, and said so
            self._fail("op tracer", exc)
            return inner(module, *args, **kwargs)
        try:
            output = inner(module, *args, **kwargs)
        except BaseException as exc:
            self._fail("window", RuntimeError(f"the window call raised {type(exc).__name__}: {exc}"))
            raise
        finally:
            self._pop(tracer)
        self.returned = True
        if backward is not None:
            try:
                backward.returned(since, list(flatten(output)) if output is not None else [], frame.name)
            except Exception as exc:  # noqa: BLE001
                self._fail("backward nodes", exc)
        return output

    def _param_names(self) -> dict:
        """id(parameter) -> the collector's name of it."""
        return {pid: entry[1] for pid, entry in getattr(self.collector, "_params", {}).items()}

    def _pop(self, tracer: OpTracer) -> None:
        tracer.active = False
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is tracer:
            tracer.__exit__(None, None, None)
        else:  # someone's mode pushed inside the window and left there: ours stays, inactive
            self._fail("op tracer", RuntimeError("a torch function mode entered inside the window was not left; "
                                                 "the tracer stays on the stack, inactive"))

    def _suspended(self, inner, module, args, kwargs, frame):
        """A compiled region inside the window: called with the tracer off (dynamo must not see it),
        one op named `compiled region <its module type>` with the region's inputs and outputs."""
        tracer = self.tracer
        self._fail("op tracer", RuntimeError(f"{frame.name} inside the window is a compiled region (torch.compile): "
                                             "its ops are not traced, only its inputs and outputs"))
        depth = torch._C._len_torch_function_stack()
        if not (depth and torch._C._get_function_stack_at(depth - 1) is tracer):
            return inner(module, *args, **kwargs)
        tracer.__exit__(None, None, None)
        try:
            return tracer.region(f"compiled region {type(frame.region).__name__}", sys._getframe(),
                                 partial(inner, module), args, kwargs)
        finally:
            tracer.__enter__()

    def _keep_inputs(self, name: str, call: int, args, kwargs) -> bool:
        try:
            flat = list(flatten(args))
            if kwargs:
                flat += list(flatten(kwargs))
            self._keep_all(name, call, "input", flat)
        except Exception as exc:  # noqa: BLE001
            self._fail(f"keep {name}", exc)
            return False
        return True

    def _keep_outputs(self, name: str, call: int, output) -> None:
        try:
            self._keep_all(name, call, "output", list(flatten(output)) if output is not None else [])
        except Exception as exc:  # noqa: BLE001
            self._fail(f"keep {name}", exc)

    def _keep_all(self, name: str, call: int, role: str, flat: list) -> None:
        for idx, (path, t) in enumerate(flat):
            self.boundaries.append(self._kept(name, "forward", call, role, idx, path, t, str(call)))

    def _kept(self, name: str, phase: str, call: int | None, role: str, idx: int, path: str, t, tag: str) -> dict:
        """A boundary tensor's entry, its bytes kept as b-NAME-TAG-ROLEIDX.bin."""
        entry = {"boundary": name, "phase": phase, "call": call, "role": role, "idx": idx, **describe(t, path)}
        self.keeper.keep(t, f"b-{_file_part(name)}-{tag}-{role}{idx}", entry)
        return entry

    # -- the end of step K -----------------------------------------------------------------
    def _step_over(self) -> None:
        """The step counter moved past K: the trace is final; stop if the spec says so."""
        self._write()
        self.off = True
        if not self.spec.stop_after_step:
            return
        code = 0
        try:
            self.recording.finish("complete", 0)  # closes this drill too (recording.finish)
        except Exception as exc:  # noqa: BLE001 - the recording could not be closed: not a clean replay
            print(f"bitguard drill: could not close the recording after step {self.spec.step}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)

    def _fail(self, where: str, exc: BaseException) -> None:
        message = f"{where}: {type(exc).__name__}: {exc}"
        if message not in self.errors and len(self.errors) < MAX_ERRORS:
            self.errors.append(message)
            print(f"bitguard drill: {message} (training continues)", file=sys.stderr)

    def trace(self) -> dict:
        tracer, backward = self.tracer, self.backward
        if self.grads is not None:
            self.grads.flush()
        doc = {"schema": OPS_SCHEMA, "rank": self.rank, "step": self.spec.step,
               "window": {**self.spec.window.to_dict(), "module_type": self.module_type},
               "found": self.found, "complete": self.found and self.returned and not self.errors,
               "errors": list(self.errors), "ops": tracer.ops if tracer is not None else [],
               "boundaries": self.boundaries, "bytes_kept": self.keeper.total}
        if backward is not None:  # the window's backward: its ops; the forward calls' ops beside them
            doc.update(ops=backward.ops, forward_ops=backward.forward_ops, backward_passes=backward.passes,
                       nodes=len(backward.nodes.nodes))
            doc["complete"] = doc["complete"] and backward.passes > 0
            if self.found and not backward.passes and not self.errors:
                doc["errors"] = ["no backward pass ran in the step after the window's forward"]
        return doc

    def _write(self) -> None:
        """ops-rank-R.json, atomically (once; only on a traced rank)."""
        if self.written or not self.traced:
            return
        self.written = True
        try:
            path = self.spec.out / f"ops-rank-{self.rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.trace()))
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - the drill finds no trace and says so
            print(f"bitguard drill: could not write the op trace: {type(exc).__name__}: {exc}", file=sys.stderr)
        if self.backward is not None:
            self.backward.close()  # the step's autograd nodes are not kept past it


class BackwardKeep:
    """The gradients of the spec's backward `keep` calls in step K, kept as the collector observes
    them: a module call's `grad_output` (each output that requires grad) and `grad_input` (each
    input that does, summed over its consumers), through tensor hooks on those tensors; a
    parameter's `grad_input` (a hook after the collector's and the user's) and `grad` (its `.grad`
    after accumulation). The hooks return nothing (the gradients go on unchanged) and are removed
    when the drill closes. A module's backward calls are numbered as the collector numbers its
    events: in the order they complete (every gradient arrived), then those never completed."""

    def __init__(self, drill: Drill, specs: list[CallSpec]):
        self.drill = drill
        self.modules = {k.boundary for k in specs if k.kind == "module"}
        self.params = {k.boundary for k in specs if k.kind == "grad"}
        self.handles: list = []
        self.pending: list[dict] = []  # module calls waiting for gradients
        self.calls: dict[str, int] = {}  # boundary -> backward calls numbered so far
        self.forward_calls: dict[str, int] = {}  # boundary -> forward calls watched (file names)

    def wanted(self, name: str) -> bool:
        if self.params:  # the parameters are found (and hooked) in step K's first module call
            self._watch_params()
        return name in self.modules

    def _watch_params(self) -> None:
        names, self.params = self.params, set()
        for pid, (ref, name, *_rest) in list(getattr(self.drill.collector, "_params", {}).items()):
            p = ref()
            if name in names and p is not None and p.requires_grad:
                try:
                    self.handles.append(p.register_hook(partial(self._guard, self._param_grad, name)))
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        partial(self._guard, self._param_accumulated, name)))
                except Exception as exc:  # noqa: BLE001
                    self.drill._fail(f"keep {name}", exc)

    def watch(self, name: str, frame, kwargs, output) -> None:
        """A watched module call returned `output`: hooks on its outputs' and inputs' gradients (the
        inputs as the collector flattened them when the call began, `frame.args`)."""
        try:
            if not torch.is_grad_enabled() or output is None:
                return
            outs = [(p, t) for p, t in flatten(output) if t.requires_grad]
            if not outs:
                return
            ins = [("[0]" + p, t) for p, t in frame.args if t.requires_grad]
            if kwargs:
                ins += [(p, t) for p, t in flatten(kwargs, "[1]") if t.requires_grad]
            n = self.forward_calls.get(name, 0)
            self.forward_calls[name] = n + 1
            state = {"name": name, "tag": f"backward{n}", "expected": len(outs) + len(ins), "entries": [],
                     "done": False}
            self.pending.append(state)
            for role, tensors in (("grad_output", outs), ("grad_input", ins)):
                for idx, (path, t) in enumerate(tensors):
                    t.grad_fn  # noqa: B018 - read before the hook dict exists (hooks.py _add_grad_hook)
                    self.handles.append(t.register_hook(partial(self._guard, self._grad, state, role, idx, path)))
        except Exception as exc:  # noqa: BLE001
            self.drill._fail(f"keep {name}", exc)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the gradient goes on unchanged
            self.drill._fail("keep gradient", exc)

    def _grad(self, state: dict, role: str, idx: int, path: str, grad) -> None:
        if grad is None or state["done"]:
            return
        state["entries"].append(self.drill._kept(state["name"], "backward", None, role, idx, path, grad,
                                                 state["tag"]))
        if len(state["entries"]) >= state["expected"]:
            self._complete(state)

    def _complete(self, state: dict) -> None:
        state["done"] = True
        call = self.calls.get(state["name"], 0)
        self.calls[state["name"]] = call + 1
        for entry in sorted(state["entries"], key=lambda e: (e["role"] != "grad_output", e["idx"])):
            entry["call"] = call
            self.drill.boundaries.append(entry)

    def _param_grad(self, name: str, grad) -> None:
        if grad is not None:
            call = self.calls.get(name, 0)
            self.drill.boundaries.append(self.drill._kept(name, "backward", call, "grad_input", 0, "", grad,
                                                          f"backward{call}"))

    def _param_accumulated(self, name: str, param) -> None:
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        if param.grad is not None:
            self.drill.boundaries.append(self.drill._kept(name, "backward", call, "grad", 0, "", param.grad,
                                                          f"backward{call}"))

    def flush(self) -> None:
        """Module calls whose gradients did not all arrive: numbered after the completed ones."""
        for state in self.pending:
            if not state["done"] and state["entries"]:
                self._complete(state)
        self.pending = []

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
