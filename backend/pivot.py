"""The first divergence and its blame.

Given one rank's aligned pairs with their per-tensor digest differences, `blame` says where the
fault most likely sits:

- `data`     the model's input batch differs;
- `source`   every input of the boundary matched and an output differs: this boundary computed
             differently (`fault_class` says which part: forward, backward, accumulation for a
             parameter whose incoming gradient matched but whose .grad did not, optimizer for a
             parameter that differs after step() although its gradient matched);
- `consumer` an input already differs: the fault sits between observed boundaries, upstream.
             The blame window is the innermost enclosing module whose inputs were still
             identical, minus its observed children;
- `structure` an event is in one run only (`fault_class` missing: run B lacks it, extra: run B
             has it and A does not, signature: both have it with different tensors); the
             window is the module whose code called it.

Only what was observed and compared equal is called "matched" (an optimizer step whose
gradient was never observed says so). A difference a rule accepted, and what follows from it,
never reaches this module: compare.py labels those events `follows` first.

This module reads polars frames prepared by compare.py; it does not align or load anything.
"""

from __future__ import annotations

import polars as pl

# Which tensor roles are the inputs of an event's computation, per (phase, kind).
INPUT_ROLES = {
    ("forward", "module"): ("input", "rng"),
    ("recompute", "module"): ("input", "rng"),  # a forward run again by activation checkpointing
    ("backward", "module"): ("grad_output",),
    ("backward", "grad"): ("grad_input",),
    ("optimizer", "step"): (),
    ("optimizer", "final"): (),
    ("data", "batch"): (),
}


def _differing_roles(diffs: pl.DataFrame, a_seq: int) -> set[str]:
    rows = diffs.filter((pl.col("a_seq") == a_seq) & pl.col("differs") & ~pl.col("ignored"))
    return set(rows["role"].to_list())


def _owner(param_name: str) -> str:
    return param_name.rpartition(".")[0]


def blame(pivot: dict, events_a: pl.DataFrame, status: dict[int, str], diffs: pl.DataFrame) -> dict:
    """Blame for the pivot event (a dict of its A-side event fields plus b_seq)."""
    phase, kind = pivot["phase"], pivot["kind"]
    differing = _differing_roles(diffs, pivot["seq"])
    inputs = INPUT_ROLES.get((phase, kind), ())
    inputs_differ = bool(differing & set(inputs))
    result = {"blame": "source", "fault_class": phase, "differing_roles": sorted(differing), "blame_window": None}
    if phase == "data":
        result.update(blame="data", fault_class="rng" if differing == {"rng"} else "data")
        if differing == {"rng"}:
            result["blame_window"] = {"module": None, "detail":
                                      "the batch matched but the RNG state at the start of this step differs: "
                                      "random numbers were drawn a different number of times before it (an extra "
                                      "draw, a changed sampler or dropout)"}
    elif kind == "final":
        buffers = "state" in differing
        result.update(fault_class="final_state")
        result["blame_window"] = {"module": pivot["boundary"], "detail":
                                  "the " + ("buffers" if buffers and "param" not in differing else
                                            "parameters" + (" and buffers" if buffers else ""))
                                  + " at the end of the recording differ although every event before matched: "
                                  "something outside the observed boundaries changed them (an update outside "
                                  "torch.optim, an EMA, an edit after the last optimizer step, a buffer updated "
                                  "in code no module call covers)"}
    elif phase == "optimizer":
        result.update(fault_class="optimizer")
        result["blame_window"] = {"module": pivot["boundary"], "detail": _optimizer_detail(pivot, events_a, status)}
    elif kind == "grad":
        owner = _owner_backward(pivot, events_a, diffs)
        if owner is not None and owner["grad_output_differs"]:
            result.update(blame="consumer", fault_class="backward")
            result["blame_window"] = {"module": owner["boundary"], "detail":
                                      "the gradient reaching this module's output already differed"}
        elif "grad_input" in differing:
            result.update(fault_class="backward")
            result["blame_window"] = {"module": _owner(pivot["boundary"]) or pivot["boundary"], "detail":
                                      "the gradient computed for this parameter differs while the gradient "
                                      "reaching its module matched: the module's backward (weight gradient)"}
        else:
            result.update(fault_class="accumulation")
            result["blame_window"] = {"module": pivot["boundary"], "detail":
                                      "the incoming gradient matched but .grad after accumulation differs: "
                                      "gradient accumulation (a missed zero_grad, a wrong accumulate)"}
    elif inputs_differ:
        result["blame"] = "consumer"
        result["blame_window"] = _window(pivot, events_a, status, diffs)
    return result


def _optimizer_detail(pivot: dict, events_a: pl.DataFrame, status: dict[int, str]) -> str:
    """What is known of the update's inputs: this step's gradient and the parameter before it.
    Only what was observed and compared equal is called "matched"."""
    same_param = (pl.col("boundary") == pivot["boundary"])
    grads = events_a.filter(same_param & (pl.col("phase") == "backward") & (pl.col("kind") == "grad")
                            & (pl.col("step") == pivot["step"]))
    before = events_a.filter(same_param & (pl.col("phase") == "optimizer") & (pl.col("step") < pivot["step"]))
    grad_ok = grads.height and all(status.get(s) == "identical" for s in grads["seq"].to_list())
    prev_ok = before.height and status.get(before["seq"][-1]) == "identical"
    if grad_ok and prev_ok and (pivot.get("world_size") or 1) == 1:
        return ("the parameter differs after step() while its gradient and the previous parameters matched: "
                "the optimizer update computed differently")
    known = []
    if grad_ok and (pivot.get("world_size") or 1) > 1:
        # the hooks see each rank's own gradient; a collective that reduces it afterwards (DDP, FSDP) is not seen
        known.append("its gradient as this rank computed it matched, but the gradient the optimizer used may have "
                     "been reduced across ranks afterwards (an all-reduce the hooks do not observe)")
    elif grad_ok:
        known.append("its gradient at this step matched")
    elif not grads.height:
        known.append("its gradient at this step was not observed (no gradient event: e.g. a collective or a "
                     "sharded gradient the hooks do not see)")
    if prev_ok:
        known.append("the parameter before this step matched")
    elif not before.height:
        known.append("the parameter before this step was not recorded (the initial weights are not compared)")
    return ("the parameter differs after step(); " + "; ".join(known)
            + ": the optimizer update, or an input of it that was not observed, computed differently")


def structure_blame(event: dict, side: str, events: pl.DataFrame, twin: dict | None) -> dict:
    """Blame for an event present in one run only (`side` has it): which run lacks what, and the
    module whose code decided it (the innermost enclosing call, or the boundary's owner)."""
    have, lack = side.upper(), "B" if side == "a" else "A"
    what = f"the {event['phase']} of {event['boundary']} (call {event['call']}) at step {event['step']}"
    if twin is not None:
        fault = "signature"
        detail = (f"both runs record {what}, with different tensors (roles, shapes or dtypes): the data layout "
                  f"or the code path changed")
    else:
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have} records {what} and run {lack} does not: a module was skipped or added, a branch "
                  f"changed, it ran a different number of times, or run {lack}'s recording stopped")
    parent = None
    if event["phase"] == "forward" and event["kind"] == "module":
        same = events.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                             & (pl.col("step") == event["step"]) & (pl.col("depth") < event["depth"])
                             & (pl.col("t_start_ns") <= event["t_start_ns"]) & (pl.col("t_end_ns") >= event["t_end_ns"]))
        if same.height:
            parent = same.sort("depth", descending=True)["boundary"][0]
    elif "." in event["boundary"]:
        parent = _owner(event["boundary"])
    return {"blame": "structure", "fault_class": fault, "differing_roles": [],
            "blame_window": {"module": parent or event["boundary"], "detail": detail}}


def _owner_backward(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> dict | None:
    owner = _owner(pivot["boundary"])
    rows = events_a.filter((pl.col("phase") == "backward") & (pl.col("kind") == "module")
                           & (pl.col("boundary") == owner) & (pl.col("step") == pivot["step"]))
    if rows.is_empty():
        return None
    seqs = rows["seq"].to_list()
    d = diffs.filter(pl.col("a_seq").is_in(seqs) & (pl.col("role") == "grad_output") & pl.col("differs")
                     & ~pl.col("ignored"))
    return {"boundary": owner, "grad_output_differs": not d.is_empty()}


def _window(pivot: dict, events_a: pl.DataFrame, status: dict[int, str], diffs: pl.DataFrame) -> dict:
    """Innermost enclosing module whose inputs were identical, minus its observed children."""
    phase = pivot["phase"]
    same = events_a.filter((pl.col("phase") == phase) & (pl.col("kind") == "module") & (pl.col("step") == pivot["step"]))
    if phase in ("forward", "recompute"):  # calls nest in time
        ancestors = same.filter((pl.col("depth") < pivot["depth"]) & (pl.col("t_start_ns") <= pivot["t_start_ns"])
                                & (pl.col("t_end_ns") >= pivot["t_end_ns"])).sort("depth", descending=True)
    else:
        prefixes = _prefixes(pivot["boundary"])
        ancestors = same.filter(pl.col("boundary").is_in(prefixes)).sort("depth", descending=True)
    input_roles = INPUT_ROLES[(phase, "module")]
    for anc in ancestors.iter_rows(named=True):
        d = diffs.filter((pl.col("a_seq") == anc["seq"]) & pl.col("role").is_in(input_roles) & pl.col("differs")
                         & ~pl.col("ignored"))
        if d.is_empty():
            children = _children(anc, same, phase)
            before = [c for c in children if c["seq"] < pivot["seq"]]
            return {
                "module": anc["boundary"],
                "module_type": anc["module_type"],
                "excluding_children": [c["boundary"] for c in children],
                "after": before[-1]["boundary"] if before else None,
                "before": pivot["boundary"],
                "detail": f"inputs of {anc['boundary']} matched; the difference arose in its own code "
                          f"between its observed children"
                          + (f", after {before[-1]['boundary']}" if before else "")
                          + f" and before {pivot['boundary']}",
            }
    return {"module": None, "detail": "no enclosing module had identical inputs: the fault is upstream of every "
                                      "observed boundary (e.g. in the data pipeline or in code outside modules)"}


def _prefixes(boundary: str) -> list[str]:
    parts = boundary.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _children(anc: dict, same: pl.DataFrame, phase: str) -> list[dict]:
    if phase in ("forward", "recompute"):
        kids = same.filter((pl.col("depth") == anc["depth"] + 1) & (pl.col("t_start_ns") >= anc["t_start_ns"])
                           & (pl.col("t_end_ns") <= anc["t_end_ns"]))
    else:
        depth = anc["boundary"].count(".") + 1
        kids = same.filter(pl.col("boundary").str.starts_with(anc["boundary"] + ".")
                           & (pl.col("boundary").str.count_matches(r"\.") == depth))
    return kids.sort("seq").select("seq", "boundary").to_dicts()
