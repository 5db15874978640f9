"""`bitguard drill A B`: from the boundary-level pivot down to the operation and its source line.

A boundary pivot often lands on a consumer (the fault sits in code between observed modules)
or on a module of many operations. The runs are replayable, so the drill goes the last step:

1. compare A and B (backend/compare.py) and take the pivot: its step K, rank and the *window*
   module (a consumer pivot's blame window, a source pivot's own module, the parent of an event
   one run alone has; for a backward pivot the module, and for a parameter's gradient the module
   that owns it);
2. replay each run's recorded command for step K only (backend/replay.py: side by side where the
   cores suffice), with the
   window's call in step K traced at op level (collectors/drill.py, collectors/ops.py; a backward
   window: the autograd nodes every forward call of it made, traced in step K's backward,
   collectors/backward_ops.py) and the pivot's tensors kept whole;
3. check that each replay reproduces its record up to the window's call (a backward window: up to
   the pivot event) (else the verdict is
   `not_reproduced`: nondeterminism or a changed environment, a finding in itself);
4. align the two op streams and name the first op that differs (backend/opdiff.py), with its
   file, line and function, the chain from the boundary down to it, and a numeric diff and fault
   signature of the differing tensors (backend/signature.py).

The document is `bitguard.drill/1` (`DrillReport.to_dict()`); exit statuses: 0 an op-level
pivot named, 1 the replays' windows do not differ, 2 bad input (or what is not supported yet:
a pivot outside a module's forward or backward: an optimizer step), 3 a replay does not reproduce
its record. Drill records live beside the runs (`RUN/drill/step-K-rank-R/`, or under `out`); the
original record is never touched.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from bitguard.backend import opdiff, replay
from bitguard.backend.ingest import RunInfo, load_rank
from bitguard.backend.params_blame import made_in_call
from bitguard.backend.pivot import phase_words
from bitguard.errors import BadInput, NotSupported

DRILL_SCHEMA = "bitguard.drill/1"
SPEC_SCHEMA = "bitguard.drill-spec/1"
EXIT_STATUS = {"op_pivot": 0, "no_difference": 1, "not_reproduced": 3}
NOT_REPRODUCED = "the replay does not reproduce the record: nondeterminism or a changed environment"
TRACE_INCOMPLETE = ("both replays reproduced their records up to the window, but the op trace is incomplete: bitguard's "
                    "op tracer could not follow the window's code (a limit of the tool, not nondeterminism of the runs; "
                    "the boundary pivot stands)")
MAX_TENSOR_BYTES = 64 << 20
MAX_TOTAL_BYTES = 512 << 20
DEFAULT_TIMEOUT_S = 3600.0


@dataclass
class Window:
    """The module call a drill traces at op level."""

    rank: int
    step: int
    boundary: str
    module_type: str | None
    call: int
    why: str
    seq_a: int | None  # the window event's seq in each recorded run (the replay check's bound)
    seq_b: int | None
    phase: str = "forward"  # forward: the window's call is traced; backward: what autograd runs for its nodes

    def to_dict(self) -> dict:
        return {"boundary": self.boundary, "module_type": self.module_type, "phase": self.phase, "call": self.call,
                "step": self.step, "rank": self.rank, "why": self.why}


# What torch.jit.script and torch.jit.trace make of a module: run by TorchScript's interpreter, not traceable
SCRIPTED = frozenset({"RecursiveScriptModule", "ScriptModule", "TopLevelTracedModule", "TracedModule"})


def _parent(boundary: str, events: pl.DataFrame) -> str | None:
    """The module whose forward holds `boundary`'s call: the dotted parent, or the root; a root itself
    (helper 57: the second of two models was traced as the first, its parent)."""
    if "." in boundary:
        return boundary.rsplit(".", 1)[0]
    roots = events.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module") & (pl.col("depth") == 0))
    if boundary in roots["boundary"].to_list():
        return boundary
    return roots["boundary"][0] if roots.height else None


def _window_event(events: pl.DataFrame, step: int, boundary: str, after: int | None,
                  call: int | None = None) -> dict | None:
    """The first forward call of `boundary` in `step` that completes at or after event `after` (its
    call number `call`, when given)."""
    ev = events.filter((pl.col("step") == step) & (pl.col("phase") == "forward") & (pl.col("kind") == "module")
                       & (pl.col("boundary") == boundary))
    if after is not None:
        ev = ev.filter(pl.col("seq") >= after)
    if call is not None:
        ev = ev.filter(pl.col("call") == call)
    return ev.row(0, named=True) if ev.height else None


def plan(run_a: RunInfo, run_b: RunInfo, fd: dict) -> Window:
    """The window to trace for pivot `fd` (a `first_divergence` dict of bitguard.compare/1).

    A forward pivot's window is a module call of step K (its forward traced). A backward pivot's
    (a module's gradients, or a parameter's: its owning module, the root for a root-level one) is
    what autograd runs in step K's backward for the nodes the window module's forward calls made;
    the replay check then covers the recorded events up to the pivot itself."""
    phase, kind, boundary = fd["phase"], fd["kind"], fd["boundary"]
    where = f"step {fd['step']} {phase} {boundary}"
    if kind == "batch" and fd.get("call"):  # (helper 53: torchdiffeq's solver calls the model again with other inputs)
        raise NotSupported(f"the pivot ({where}) is the inputs of the model's call {fd['call']} in the step, which "
                           f"differ although its earlier calls matched: the training's code made them between the "
                           f"calls (a solver's next point, outputs fed back, another batch), so there is no operation "
                           f"inside the model to drill into (see 'bitguard compare')")
    if fd.get("fault_class") == "params" and fd.get("blame") == "consumer":
        # (helpers 68 and 70: a flow's weights read in its .inverse(), a temperature read in a .forward() never called:
        # the batch was refused as "the input batch", a gradient drilled into a called part that does not own it)
        raise NotSupported(f"the pivot ({where}) is made from weights that already differ as the optimizer's step() "
                           f"finds them (a model run through a method, never called: its weights are the cause, "
                           f"'bitguard compare' names them), so there is no operation inside a module call to drill into")
    if kind == "batch":
        raise NotSupported(f"the pivot ({where}) is the input batch: there is no operation to drill into; the "
                           f"batch or the RNG state differs before the model runs (see 'bitguard compare')")
    if fd["blame"] == "data" and fd.get("fault_class") == "rng":  # (helper 84: a reseeded augmentation's call)
        raise NotSupported(f"the pivot ({where}) differs by the RNG state its call began from, its tensors matching: "
                           f"random numbers were drawn differently before it (a reseed, a draw outside module calls), "
                           f"so there is no operation inside it to drill into; 'bitguard compare' says where")
    if fd["blame"] == "data":  # (helper 48: a loss given its inputs swapped was called "the input batch")
        raise NotSupported(f"the pivot ({where}) differs by its inputs, which no observed call before it made "
                           f"differently: they were made or passed by the training's code outside every module call "
                           f"(a batch, arguments swapped), so there is no operation to drill into; 'bitguard compare' "
                           f"says where they came from")
    if kind == "params" and fd["blame"] == "source":  # parameters a module call made inside it: that call
        made = _maker(run_a, run_b, fd)
        if made is not None:
            return made
    if (phase, kind) not in (("forward", "module"), ("backward", "module"), ("backward", "grad")):
        what = "optimizer step" if kind == "step" else phase_words(phase, kind)  # (as compare names it)
        raise NotSupported(f"not supported yet: drilling into a pivot that is the {what} of "
                           f"{boundary} (step {fd['step']}), no module call: the drill traces a module's forward or "
                           f"backward operations. Look at the blame window 'bitguard compare' gives")
    rank, step = fd["rank"], fd["step"]
    ea, _, _ = load_rank(run_a, rank)
    eb, _, _ = load_rank(run_b, rank)
    window = (fd.get("blame_window") or {}).get("module")
    if kind == "grad" and fd["blame"] == "consumer" and window:
        # (helper 44: LoRA's `B(A(x)) * scaling`: the gradient reaching B already differed, made by the
        # layer's own mul, which the backward of B, the parameter's owner, does not run)
        target, why = window, f"a parameter's gradient ({boundary}) that its module received already differing: " \
                              f"the backward of its blame window"
    elif kind == "grad":
        target = _parent(boundary, ea if fd.get("a_seq") is not None else eb)
        why = f"a parameter's gradient ({boundary}): the backward of the module that owns it"
    elif fd.get("cause") == "structure":
        target = window if window and window != boundary else _parent(boundary, ea if fd.get("a_seq") is not None else eb)
        why = f"an event one run alone has ({boundary}): the module that calls it"
    elif fd["blame"] == "consumer":
        target, why = window or _parent(boundary, ea), "consumer pivot: its blame window"
    else:
        target, why = boundary, "source pivot: the module itself"
    if not target:
        raise NotSupported(f"the pivot ({where}) has no module around it to trace")
    backward = phase == "backward"
    # a backward window: every forward call of the module in the step (its nodes), the check up to the pivot
    a = _window_event(ea, step, target, None if backward else fd.get("a_seq"))
    b = _window_event(eb, step, target, None if backward else fd.get("b_seq"))
    if a is None and b is None:
        if kind == "grad" and all(run.manifest.get("mode") == "full" for run in (run_a, run_b)):
            # (helper 24: TRL's fused log-prob reads lm_head.weight and never calls lm_head)
            raise NotSupported(f"not supported yet: {target}, whose parameter is the pivot ({where}), is never called "
                               f"as a module in step {step} of either run: its weights are used directly (a fused "
                               f"loss, a tied weight), so there is no module call to replay; the blame window of "
                               f"'bitguard compare' says where the gradient came from")
        full = all(run.manifest.get("mode") == "full" for run in (run_a, run_b))
        raise NotSupported(f"not supported yet: the window {target} of the pivot ({where}) is not a recorded module "
                           f"call in step {step} of either run " + (
                               "(both runs were recorded in full mode: it is called past nn.Module's call, as "
                               "gpytorch's modules are, or run through its .forward(), or compiled); the blame window "
                               "of 'bitguard compare' says where the difference came from" if full else
                               "(trusted mode or a compiled region?); record in full mode"))
    if backward and fd.get("cause") == "structure" and (fd.get("a_seq") is None) != (fd.get("b_seq") is None):
        alone, other, events = ("B", "A", ea) if fd.get("a_seq") is None else ("A", "B", eb)
        if not events.filter((pl.col("step") == step) & (pl.col("phase") == "backward")
                             & (pl.col("boundary") == target)).height:
            # (helper 72: a BYOL target network given a gradient in run B alone: the replay of A traced no
            # backward, and the drill said "not reproduced: nondeterminism")
            raise NotSupported(f"not supported yet: the pivot ({where}) is a backward run {alone} alone runs, and run "
                               f"{other} runs no backward of {target} in step {step}: there is no pass of it in run "
                               f"{other} to compare op by op. What differs is whether a gradient reaches it (an output "
                               f"detached or made under no_grad, a parameter frozen, a loss term dropped): the code "
                               f"before the backward decides it, 'bitguard compare' gives its call stack")
    scripted = (a or b)["module_type"]
    if scripted in SCRIPTED:  # (helper 79: "no difference", exit 1, where nothing inside could be traced)
        raise NotSupported(f"not supported yet: the window {target} of the pivot ({where}) is a TorchScript module "
                           f"({scripted}): its operations run in TorchScript's interpreter, where the drill cannot "
                           f"trace them; record the two runs with it not scripted (for e3nn: "
                           f"e3nn.set_optimization_defaults(jit_mode=\"eager\")) to drill into it")
    if backward:
        why = why if kind == "grad" else f"{why}, its backward"
        return Window(rank, step, target, (a or b)["module_type"], fd["call"], why,
                      fd.get("a_seq"), fd.get("b_seq"), phase="backward")
    if fd.get("cause") == "structure" and (fd.get("a_seq") is None) != (fd.get("b_seq") is None):
        # the run without the event: the call of the window that the run with it makes (helper 44: a
        # reference pass with an adapter off is the window's call 0, the one calling the extra module call 1)
        if fd.get("a_seq") is None and b is not None:
            a = _window_event(ea, step, target, None, call=b["call"])
        elif fd.get("b_seq") is None and a is not None:
            b = _window_event(eb, step, target, None, call=a["call"])
    if a is None or b is None:  # (helper 79: "not reproduced: nondeterminism", where run B's replay was faithful)
        alone, other = ("A", "B") if b is None else ("B", "A")
        raise NotSupported(f"not supported yet: the window {target} of the pivot ({where}) is called in step {step} of "
                           f"run {alone} only: run {other} does not call it there, so there are no two runs of its "
                           f"operations to compare; what differs is whether the training's code calls it ('bitguard "
                           f"compare' gives the call stack of run {alone}'s call)")
    call = (a or b)["call"]
    return Window(rank, step, target, (a or b)["module_type"], call, why,
                  a["seq"] if a else None, b["seq"] if b else None)


def _maker(run_a: RunInfo, run_b: RunInfo, fd: dict) -> Window | None:
    """The window of a params pivot whose parameters a module call made inside it (collectors/weights.py,
    `_made_params`: their event has that call's start time, helper 78's AutoNormal): the forward of that
    call, where the line that made them runs. None when they were not made so."""
    calls = []
    for run, seq in ((run_a, fd.get("a_seq")), (run_b, fd.get("b_seq"))):
        if seq is None:
            return None
        events = load_rank(run, fd["rank"])[0]
        calls.append(None if made_in_call({"seq": seq, "boundary": fd["boundary"]}, events) is None
                     else _window_event(events, fd["step"], fd["boundary"], seq))
    a, b = calls
    if a is None or b is None:
        return None
    return Window(fd["rank"], fd["step"], fd["boundary"], a["module_type"], a["call"],
                  "parameters made inside a module call: the call that made them", a["seq"], b["seq"])


def _spec(w: Window, fd: dict, out: Path, max_tensor_bytes: int = MAX_TENSOR_BYTES, windows: dict | None = None) -> dict:
    keep = [{"boundary": fd["boundary"], "phase": fd["phase"], "call": fd["call"]}]
    if fd["kind"] == "params":  # (`_maker`: the call that made the parameters)
        keep = [{"boundary": w.boundary, "phase": "forward", "call": w.call}]
    if fd["kind"] == "grad":
        keep[0]["kind"] = "grad"
    return {"schema": SPEC_SCHEMA, "step": w.step, "rank": w.rank,
            "window": {"boundary": w.boundary, "phase": w.phase, "call": w.call}, "keep": keep, "out": str(out),
            "max_tensor_bytes": max_tensor_bytes, "max_total_bytes": MAX_TOTAL_BYTES, "stop_after_step": True,
            "windows": windows or {}}


def _tensor(replay_dir: Path, t: dict | None):
    """The kept bytes of a traced tensor, as a tensor (None when they were not kept)."""
    from bitguard.backend.signature import load_bytes

    if not t or t.get("kept") != "full" or not t.get("bytes"):
        return None
    return load_bytes(replay_dir / t["bytes"], t["dtype"], t["shape"])


def _not_kept(ta: dict | None, tb: dict | None) -> dict:
    big = ta or tb or {}
    chunks_a, chunks_b = (ta or {}).get("chunks") or [], (tb or {}).get("chunks") or []
    differing = [i for i, (x, y) in enumerate(zip(chunks_a, chunks_b)) if x != y]
    where = f"{len(differing)} of {len(chunks_a)} 1-MiB chunks differ" + (
        f", the first at byte {differing[0] << 20:,}" if differing else "") if chunks_a and chunks_b else \
        "no chunk digests either"
    return {"kind": "unknown", "reading": f"the tensor ({big.get('dtype')}, shape {big.get('shape')}) is over the "
            f"drill's byte cap, so its bytes were not kept: {where}", "elements_differing": None,
            "elements_total": None, "max_abs": None, "max_ulp": None, "bits": {}}


def _signature(dirs: dict, ta: dict | None, tb: dict | None) -> dict:
    from bitguard.backend.signature import signature

    if ta and tb and ta.get("window") and tb.get("window") and ta["window"]["chunks"] == tb["window"]["chunks"]:
        return _window_signature(dirs, ta, tb)
    a, b = _tensor(dirs["a"], ta), _tensor(dirs["b"], tb)
    if (ta is not None and a is None) or (tb is not None and b is None):
        return _not_kept(ta, tb)
    return signature(a, b)


def _window_signature(dirs: dict, ta: dict, tb: dict) -> dict:
    """The signature of a tensor over the byte cap, read from the bytes of its differing 1-MiB
    chunks only (a window around the differing elements), its indices those of the whole tensor."""
    import math

    import numpy as np
    import torch

    from bitguard.backend.signature import signature

    win = ta["window"]
    item = torch.empty(0, dtype=getattr(torch, ta["dtype"])).element_size()
    parts = {}
    for side, t in (("a", ta), ("b", tb)):
        raw = b"".join((dirs[side] / f).read_bytes() for f in t["window"]["bytes"])
        parts[side] = torch.frombuffer(bytearray(raw), dtype=getattr(torch, t["dtype"]))
    n = min(parts["a"].numel(), parts["b"].numel())
    sig = signature(parts["a"][:n], parts["b"][:n])
    per_chunk = win["chunk_bytes"] // item
    starts = [c * per_chunk for c in win["chunks"]]
    total = math.prod(ta["shape"]) if ta.get("shape") else n

    def whole(flat: int) -> list[int]:  # window position -> index in the whole tensor
        k, off = divmod(flat, per_chunk)
        return [int(i) for i in np.unravel_index(starts[k] + off, ta["shape"])] if ta.get("shape") else [flat]

    sig["first_indices"] = [whole(i[0] if isinstance(i, list) and len(i) == 1 else 0) for i in sig.get("first_indices") or []]
    chunks_total = len(ta.get("chunks") or [])
    sig["window"] = {"chunks": win["chunks"], "chunks_total": chunks_total, "elements": n, "elements_total": total}
    sig["reading"] = (f"over the byte cap, read in the {len(win['chunks'])} differing 1-MiB chunk(s) of {chunks_total} "
                      f"({n:,} of {total:,} elements): {sig['reading']}")
    sig["heatmap"] = None  # a window's 1-D grid is not the tensor's 2-D picture
    return sig


def _chain(w: Window, op: dict) -> list[str]:
    chain = [f"{w.boundary} ({w.module_type})" if w.module_type else w.boundary]
    chain += [m for m in (op.get("modules") or [])[1:]]
    frames = [_short(frame) for frame in op.get("stack") or []]
    if op.get("node"):  # a backward op: its autograd node, after the forward line that made it or before its hook's
        node = op["node"].removeprefix("torch::autograd::") + (f" of {op['param']}" if op.get("param") else "")
        here = f"{node} (backward)"
        frames = [*frames, here] if op.get("source") == "created_at" else [here, *frames]
    chain += frames
    chain.append(op.get("op") or "?")
    return chain


def _short(frame: str) -> str:
    path, _, rest = frame.partition(":")
    return f"{Path(path).name}:{rest}"


def _entered(d: opdiff.OpDifference, w: Window) -> str | None:
    """Why the first differing op's inputs can already differ: no traced op before it differs."""
    if d.cause != "digest" or not d.inputs_differ:
        return None
    which = ", ".join(str(p["index"]) for p in d.inputs if p["differs"])
    node = (d.op or {}).get("node") or ""
    if w.phase == "backward" and "AccumulateGrad" in node:  # (helper 69: an EWC penalty drilled into the module)
        param = (d.op or {}).get("param") or "the parameter"
        if str((d.op or {}).get("op", "")).startswith("aten.add_") and which == "0":
            # (helper 75: fastai zeroes .grad in place, so both runs add into it: only what it held differed)
            return (f"its input 0, the .grad of {param} that autograd adds the new gradient into, differs while the new "
                    f"gradient matches: that .grad was not cleared since the last step in one run (a missed "
                    f"zero_grad(), or gradient accumulation over another number of micro-batches)")
        return (f"its input {which} differs although no traced op before it does: this is autograd summing the "
                f"gradients of {param} from each of its uses, so a use outside {w.boundary}'s call sends back another "
                f"gradient (a regulariser in the loss such as an L2 or EWC penalty, a weight tied elsewhere), or the "
                f"gradient arriving at {w.boundary}'s output differs ('bitguard compare' says whether it already did)")
    if w.phase == "backward":  # (helper 51: a loss's targets shifted, drilled into the model's backward)
        return (f"its input {which} differs although no traced op before it does: in a backward, that is first the "
                f"gradient arriving at {w.boundary}'s output from after it (the loss, its targets, code between the "
                f"output and backward(): 'bitguard compare' says whether it already differed there), or a tensor "
                f"saved in the forward and changed since, or written outside torch functions")
    return (f"its input {which} differs although no traced op before it does: that tensor was written outside torch "
            f"functions (NumPy, a C++ extension, another thread) or came into the window from outside it (a "
            f"parameter, a global)")


def _accumulation(d: opdiff.OpDifference) -> str | None:
    """An AccumulateGrad that adds into a .grad on one side and takes the gradient over on the
    other: the reading of a missed (or an extra) zero_grad()."""
    node = (d.op or {}).get("node") or ""
    if d.cause != "structure" or "AccumulateGrad" not in node:
        return None
    adds = [o for o in [d.op, *d.other_side] if o and str(o.get("op", "")).startswith("aten.add")]
    if not adds:
        return None
    side = d.side_only.upper() if str(d.op.get("op", "")).startswith("aten.add") else ("B" if d.side_only == "a" else "A")
    return (f"run {side} adds the new gradient into an existing .grad where the other run takes it over: the "
            f".grad was not cleared before this backward (a missed zero_grad(), or gradient accumulation on one side)")


def _op_pivot(w: Window, d: opdiff.OpDifference) -> dict:
    op = d.op
    at_b = {k: (d.op_b or {}).get(k) for k in ("file", "line", "function")} if d.op_b is not None else None
    return {"note": _entered(d, w) or _accumulation(d), "at_b": at_b, "op": op.get("op"), "file": op.get("file"),
            "line": op.get("line"), "function": op.get("function"), "phase": op.get("phase", "forward"),
            "node": op.get("node"), "source": op.get("source", "frame"), "boundary": w.boundary, "step": w.step, "rank": w.rank, "cause": d.cause, "side_only": d.side_only,
            "index_a": d.index_a, "index_b": d.index_b, "modules": op.get("modules") or [], "chain": _chain(w, op),
            "inputs_differ": d.inputs_differ, "args_differ": d.args_differ,
            "args_a": (d.op_a or {}).get("args"), "args_b": (d.op_b or {}).get("args"),
            "inputs": d.inputs, "outputs": d.outputs, "other_side": d.other_side, "moved": d.moved,
            "ops_equal_before": d.paired_before}


def _boundary_tensors(trace: dict | None, fd: dict) -> dict:
    """The kept tensors of the pivot's boundary call in one side's trace, by (role, idx)."""
    out = {}
    for t in (trace or {}).get("boundaries") or []:
        if t.get("boundary") == fd["boundary"] and t.get("call") == fd["call"]:
            out[(t.get("role"), t.get("idx"))] = t
    return out


def _boundary_signature(dirs: dict, traces: dict, fd: dict) -> tuple[dict | None, tuple]:
    """The signature of the boundary pivot's first differing tensor, and that tensor's two entries."""
    first = next((t for t in fd.get("tensors") or [] if t.get("differs") and not t.get("ignored")), None)
    if first is None:
        return None, (None, None)
    key = (first["role"], first["index"])
    ta = _boundary_tensors(traces["a"], fd).get(key)
    tb = _boundary_tensors(traces["b"], fd).get(key)
    if ta is None and tb is None:
        return None, (None, None)
    sig = _signature(dirs, ta, tb)
    sig["tensor"] = {"role": first["role"], "index": first["index"], "path": first.get("path")}
    return sig, (ta, tb)


@dataclass
class DrillReport:
    document: dict

    @property
    def verdict(self) -> str:
        return self.document["verdict"]

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    def to_dict(self) -> dict:
        return self.document


def _trace_problem(side: str, trace: dict | None) -> str | None:
    if trace is None:
        return f"run {side.upper()}'s replay wrote no op trace"
    if not trace.get("found"):
        return f"run {side.upper()}'s replay never called the window module in the step"
    if not trace.get("complete") or trace.get("errors"):
        return f"run {side.upper()}'s op trace is incomplete: {'; '.join(trace.get('errors') or ['the call did not return'])}"
    return None


def drill_comparison(comparison, *, rank: int | None = None, out: str | Path | None = None,
                     timeout: float = DEFAULT_TIMEOUT_S, max_tensor_bytes: int = MAX_TENSOR_BYTES) -> DrillReport:
    """Drill from `comparison`'s pivot (see the module docstring)."""
    fd = comparison.first_divergence
    if rank is not None and fd is not None and fd["rank"] != rank:
        fd = _rank_pivot(comparison, rank)
    if fd is None:
        verdict = comparison.verdict
        raise BadInput(f"the runs compare {verdict}: there is no pivot to drill into" +
                       ("; 'bitguard compare' says what could not be certified" if verdict == "inconclusive" else ""))
    run_a, run_b = comparison.run_a, comparison.run_b
    if run_b.step_shift:
        raise resumed_refusal(run_b.step_shift)
    w = plan(run_a, run_b, fd)
    name = f"step-{w.step}-rank-{w.rank}"
    # absolute: the replays run in each run's recorded working directory, not in this one
    if out is None:
        dirs = {"a": run_a.path.resolve() / "drill" / name, "b": run_b.path.resolve() / "drill" / name}
    else:
        dirs = {"a": Path(out).resolve() / "a" / name, "b": Path(out).resolve() / "b" / name}
    specs = {side: dirs[side].parent / f"{name}.spec.json" for side in dirs}
    # every replay's command first: a run that cannot be replayed is refused before anything is written
    replays = [replay.command(side, run, w.step, dirs[side], specs[side]) for side, run in (("a", run_a), ("b", run_b))]
    for side, run in (("a", run_a), ("b", run_b)):
        if out is None:
            replay.writable_beside(run.path.resolve(), name)
        dirs[side].mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    step_s = _step_seconds(run_a, w.rank, w.step)
    checks, traces, problems = _replay_pass(replays, w, fd, specs, dirs, timeout, max_tensor_bytes, {}, step_s)
    doc = {"schema": DRILL_SCHEMA, "boundary_pivot": fd, "window": w.to_dict(), "op_pivot": None,
           "signature": None, "boundary_signature": None,
           "records": {side: str(dirs[side]) for side in ("a", "b")},
           "cost": {"replay_s_a": checks["a"]["seconds"], "replay_s_b": checks["b"]["seconds"],
                    "ops_a": len((traces["a"] or {}).get("ops") or []),
                    "ops_b": len((traces["b"] or {}).get("ops") or [])}}
    if problems or not all(c["reproduced"] for c in checks.values()):
        doc.update(verdict="not_reproduced", replay=_not_reproduced(replays, checks, problems))
        doc["cost"]["wall_s"] = round(time.monotonic() - t0, 3)
        return DrillReport(doc)
    windows = _windows_wanted(doc, _analyse(doc, w, fd, dirs, traces, checks))
    if windows["a"] or windows["b"]:  # tensors over the byte cap differ: a second pass keeps their differing chunks
        again, traces2, problems2 = _replay_pass(replays, w, fd, specs, dirs, timeout, max_tensor_bytes, windows,
                                                 step_s)
        doc["cost"]["window_pass_s"] = round(max(c["seconds"] for c in again.values()), 3)
        if problems2 or not all(c["reproduced"] for c in again.values()):
            doc["replay"]["detail"] += ("; the second replay, for the bytes of the differing chunks of the tensors over "
                                        "the byte cap, did not reproduce: their signature is from chunk digests only")
        else:
            _analyse(doc, w, fd, dirs, traces2, checks)
    doc["cost"]["wall_s"] = round(time.monotonic() - t0, 3)
    return DrillReport(doc)


def _step_seconds(run: RunInfo, rank: int, step: int) -> float | None:
    """How long the recorded step took (first event's start to last event's end)."""
    events, _, _ = load_rank(run, rank)
    ev = events.filter(pl.col("step") == step)
    return (ev["t_end_ns"].max() - ev["t_start_ns"].min()) / 1e9 if ev.height else None


def _replay_pass(replays: list, w: Window, fd: dict, specs: dict, dirs: dict, timeout: float,
                 max_tensor_bytes: int, windows: dict, step_s: float | None) -> tuple[dict, dict, list]:
    """Run both replays once: (checks against the records, op traces, problems of the traces)."""
    for side in ("a", "b"):
        _clear(dirs[side])  # an earlier drill's replay there would be read as this one's
        replay.write_spec(specs[side], _spec(w, fd, dirs[side], max_tensor_bytes, windows.get(side)))
    replay.run(replays, timeout, step_s)
    checks = {}
    for r in replays:
        checks[r.side] = replay.check(r.run, r.out, w.rank, w.step, w.seq_a if r.side == "a" else w.seq_b)
        checks[r.side].update(exit_status=r.exit_status, seconds=round(r.seconds, 3), notes=list(r.notes),
                              command=r.argv)
        if r.exit_status not in (0, None) and checks[r.side]["reproduced"]:
            checks[r.side]["notes"].append(f"the replay exited {r.exit_status}: {replay.log_tail(r)}")
    traces = {side: opdiff.load(dirs[side], w.rank) for side in ("a", "b")}
    problems = [p for p in (_trace_problem(s, traces[s]) for s in ("a", "b")) if p]
    reproduced = all(c["reproduced"] for c in checks.values()) and not problems
    late = [r for r in replays if r.timed_out]
    if late and not reproduced:  # stopped before it was done: nothing is known of the runs themselves
        r = late[0]
        raise BadInput(f"the replay of run {r.side.upper()} ran past --timeout {timeout:g} s and was stopped before "
                       f"its step {w.step} was traced (its output: {r.out.parent / (r.out.name + '.' + replay.REPLAY_LOG)}"
                       f"); give a longer --timeout")
    return checks, traces, problems


REPLAY_PRODUCTS = ("manifest.json", "rank-", "ops-rank-")  # what a replay directory holds (and a drill-spec's bytes)


def _clear(directory: Path) -> None:
    """Empty a replay directory before its replay runs: what an earlier drill of the same step
    left there (its rank file, its op trace) would otherwise be read as this replay's result when
    this one is stopped early. Only a drill's own files are removed; anything else is refused."""
    if not directory.exists():
        directory.mkdir(parents=True)
        return
    entries = list(directory.iterdir())
    foreign = [e.name for e in entries if not e.name.startswith(REPLAY_PRODUCTS)]
    if foreign:
        raise BadInput(f"{directory} holds files a drill did not write ({', '.join(sorted(foreign)[:3])}); move them "
                       f"or give another --out")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _not_reproduced(replays: list, checks: dict, problems: list) -> dict:
    # a replay that failed says so first, with where its output is (helper 19: one that crashed on an
    # import was reported as a replay that "never called the window module")
    failed = [r for r in replays if r.exit_status not in (0, None) and not r.timed_out]
    details = [f"run {r.side.upper()}'s replay failed with exit status {r.exit_status}: {replay.log_tail(r)} (its "
               f"output: {r.out.parent / (r.out.name + '.' + replay.REPLAY_LOG)})" for r in failed]
    details += [f"run {s.upper()}: {checks[s]['detail']}" for s in ("a", "b") if not checks[s]["reproduced"]]
    details += problems
    for s in ("a", "b"):
        if not checks[s]["reproduced"]:
            details += [f"run {s.upper()}: {n}" for n in checks[s]["notes"]]
            tail = replay.log_tail(next(r for r in replays if r.side == s))
            if checks[s]["compared"] == 0 and tail and s not in {r.side for r in failed}:
                details.append(f"run {s.upper()}'s replay said: {tail}")
    if any(checks[s]["compared"] and not checks[s]["reproduced"] for s in ("a", "b")):
        details.append("if the script reads environment variables bitguard does not record, record them with "
                       "BITGUARD_RECORD_ENV=NAME,... (docs/DRILL.md)")
    if all(checks[s]["reproduced"] for s in ("a", "b")) and not failed:  # (helper 87: a tracer failure read as
        return {"reproduced": False, "cause": "op_trace", **checks,  # nondeterminism that was not there)
                "detail": f"{TRACE_INCOMPLETE} (" + "; ".join(details) + ")"}
    return {"reproduced": False, "cause": "replay", "detail": f"{NOT_REPRODUCED} (" + "; ".join(details) + ")",
            **checks}


def _analyse(doc: dict, w: Window, fd: dict, dirs: dict, traces: dict, checks: dict) -> tuple:
    """Fill in the op pivot and the signatures from two reproduced replays' traces; returns the
    boundary pivot's compared tensor pair (the traces' entries)."""
    upto = "the pivot" if w.phase == "backward" else "the window"
    doc["replay"] = {"reproduced": True, "detail": f"both replays reproduce their records bitwise up to {upto} "
                     f"({checks['a']['compared']} and {checks['b']['compared']} events of step {w.step})", **checks}
    doc["boundary_signature"], boundary_pair = _boundary_signature(dirs, traces, fd)
    d = opdiff.first_difference(traces["a"]["ops"], traces["b"]["ops"])
    if d is None:
        doc["verdict"] = "no_difference"
        doc["detail"] = (f"the {doc['cost']['ops_a']} operations of {w.boundary}'s call are the same in both replays: "
                         f"the difference is not made by a torch operation inside the window (a hook, a C++ "
                         f"extension calling kernels directly, or code that writes tensors in place)"
                         + ("; in a backward, also code outside the call that reads the same input and sends back "
                            "another gradient, which autograd sums into the input's gradient: a second loss term on "
                            "the same logits, a distillation term" if w.phase == "backward" else ""))
        return boundary_pair
    doc["verdict"] = "op_pivot"
    doc["op_pivot"] = _op_pivot(w, d)
    k = d.first_output
    outs = d.outputs
    if d.cause == "structure":
        only = next((o for o in outs), None)
        ta, tb = (only["a"], None) if d.side_only == "a" and only else (None, only["b"] if only else None)
        doc["signature"] = _signature(dirs, ta, tb)
        doc["op_pivot"]["then"] = _rejoin(dirs, opdiff.first_value_difference(traces["a"]["ops"], traces["b"]["ops"]))
    elif k is not None:
        doc["signature"] = _signature(dirs, outs[k]["a"], outs[k]["b"])
        doc["signature"]["tensor"] = {"role": "output", "index": k, "path": (outs[k]["a"] or outs[k]["b"]).get("path")}
        what = (doc["signature"].get("reading") or "").partition(":")[0]
        if doc["op_pivot"].get("args_differ") and not doc["op_pivot"].get("inputs_differ") and what:
            # (helper 56: a loss's constant 1e-5 against 1e-4 read "few_ulp: reduction order, a nondeterministic
            # kernel or a precision change"; the op's own arguments say why)
            doc["signature"]["reading"] = (f"{what}: the op was called with other arguments (above), its tensor "
                                           "inputs equal: a logic change (a constant, a setting, a flag), not the "
                                           "kernel or the hardware")
        elif doc["op_pivot"].get("inputs_differ") and what:
            # (helper 62: a loss coefficient, a buffer set to half by hand, read "bit_flip: a hardware SDC or memory
            # fault is likely", the op's own tensor input differing)
            doc["signature"]["reading"] = (f"{what}: the op computed on tensor inputs that differ (above), made "
                                           "outside the operations traced: the difference came into it, not from "
                                           "its kernel or the hardware")
    return boundary_pair


MAX_WINDOW_CHUNKS = 8  # differing 1-MiB chunks a second pass keeps the bytes of, per tensor


def _windows_wanted(doc: dict, boundary_pair: tuple) -> dict:
    """{side: {kept tensor name: differing chunks}} for the compared tensors that were over the
    byte cap on both sides (the op pivot's output, where the streams join again, the boundary's)."""
    pairs = []
    op = doc.get("op_pivot") or {}
    pairs += [(o["a"], o["b"]) for o in op.get("outputs") or [] if o.get("differs")][:1]
    if op.get("then"):
        pairs.append((op["then"]["a"], op["then"]["b"]))
    pairs.append(boundary_pair)
    out = {"a": {}, "b": {}}
    for ta, tb in pairs:
        if not ta or not tb or ta.get("kept") != "none" or tb.get("kept") != "none" or "window" in ta:
            continue
        ca, cb = ta.get("chunks") or [], tb.get("chunks") or []
        differing = [i for i in range(max(len(ca), len(cb))) if i >= len(ca) or i >= len(cb) or ca[i] != cb[i]]
        if differing and ta.get("name") and tb.get("name"):
            out["a"][ta["name"]] = differing[:MAX_WINDOW_CHUNKS]
            out["b"][tb["name"]] = differing[:MAX_WINDOW_CHUNKS]
    return out


def _rejoin(dirs: dict, v: opdiff.OpDifference | None) -> dict | None:
    """After a structural difference: the first op both runs call whose outputs differ (where the
    two streams join again), with the signature of its first differing output."""
    if v is None:
        return None
    k = v.first_output
    a, b = v.outputs[k]["a"], v.outputs[k]["b"]
    sig = _signature(dirs, a, b)
    return {"op": v.op.get("op"), "file": v.op.get("file"), "line": v.op.get("line"),
            "function": v.op.get("function"), "index_a": v.index_a, "index_b": v.index_b,
            "inputs_differ": v.inputs_differ, "args_differ": v.args_differ, "output": k,
            "a": a, "b": b, "signature": sig}


def _rank_pivot(comparison, rank: int) -> dict | None:
    """The first divergence of one rank (when --rank names another rank than the overall pivot's)."""
    from bitguard.backend.compare import compare

    sub = compare(comparison.run_a, comparison.run_b, rules=comparison.rules, rank=rank)
    return sub.first_divergence


def resumed_refusal(resumed_at: int) -> NotSupported:
    """Why a comparison of a resumed run (`--resumed-at`) is not drilled."""
    return NotSupported(f"drilling into a comparison of a resumed run (--resumed-at {resumed_at}) is not supported "
                        f"yet: the replay would re-run run B at A's step numbers; drill a pair recorded with the same "
                        f"step count")


def drill(a, b, *, rank: int | None = None, rules=None, out: str | Path | None = None,
          timeout: float = DEFAULT_TIMEOUT_S, max_tensor_bytes: int = MAX_TENSOR_BYTES) -> DrillReport:
    """Compare run directories `a` and `b` and drill from their pivot (see the module docstring)."""
    from bitguard.backend.compare import compare

    return drill_comparison(compare(a, b, rules=rules, rank=rank), rank=rank, out=out, timeout=timeout,
                            max_tensor_bytes=max_tensor_bytes)
