"""The first divergence and its blame.

Given one rank's aligned pairs with their per-tensor digest differences, `blame` says where the
fault most likely sits:

- `data`     the model's input batch differs (where one run feeds it what another observed model
             returned, a GAN's steps swapped, the window's detail names that model: `fed_by_model`);
- `source`   every input of the boundary matched and an output differs: this boundary computed
             differently (`fault_class` says which part: forward, backward, accumulation for a
             parameter whose incoming gradient matched but whose .grad did not, optimizer for a
             parameter that differs after step() although the gradient step() used matched, comm
             for a collective whose inputs matched on this rank and whose output differs:
             `confirm_comm` then asks the other ranks of its group, and an input that differed
             there makes this rank its `consumer`);
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

import re

import polars as pl

from bitguard.backend import collectives
from bitguard.backend.params_blame import params_detail
from bitguard.backend.retype import ONLY_A, ONLY_B
from bitguard.schema import FIRST_STEP, JSON_FILE, KEYS_MARK

# Which tensor roles are the inputs of an event's computation, per (phase, kind).
INPUT_ROLES = {
    ("forward", "module"): ("input", "rng"),
    ("recompute", "module"): ("input", "rng"),  # a forward run again by activation checkpointing
    ("backward", "module"): ("grad_output",),
    ("backward", "grad"): ("grad_input",),
    ("optimizer", "step"): ("grad",),  # the gradient step() used (older runs have no such row)
    ("optimizer", "final"): (),
    ("optimizer", "params"): (),  # a root's parameters as a step's first call meets them
    ("optimizer", "saved"): (),  # the tensors a save call of the training wrote
    ("data", "batch"): (),
    ("comm", "collective"): ("input",),  # a collective: this rank's part of its inputs
}


def phase_words(phase: str, kind: str) -> str:
    """What an event is, in a sentence: its phase, or for the root-level state events what they hold."""
    return {"final": "final state", "params": "parameters at the start", "saved": "saved tensors"}.get(kind, phase)


_RESEEDED = ("random numbers were drawn a different number of times before it (an extra draw, a changed sampler or "
             "dropout), or the generator was seeded or its state set differently (manual_seed, set_rng_state)")


def _differing_roles(diffs: pl.DataFrame, a_seq: int) -> set[str]:
    rows = diffs.filter((pl.col("a_seq") == a_seq) & pl.col("differs") & ~pl.col("ignored"))
    return set(rows["role"].to_list())


def _drew_alone(diffs: pl.DataFrame, a_seq: int) -> str | None:
    """"A" or "B" where the RNG state a call began from is recorded in that run alone (the call drew random
    numbers there only: retype.py pairs such a row with nothing), else None."""
    rows = diffs.filter((pl.col("a_seq") == a_seq) & (pl.col("role") == "rng"))
    if "xor_b" not in rows.columns or not rows.height:
        return None
    if rows.filter(pl.col("xor").is_null() & pl.col("xor_b").is_not_null()).height:
        return "B"
    return "A" if rows.filter(pl.col("xor_b").is_null() & pl.col("xor").is_not_null()).height else None


def _parts_run_uncalled(diffs: pl.DataFrame, a_seq: int) -> list[str]:
    """The parts of a module whose differing buffers its forward event holds (`state.bank.queue`: the
    recorder reports there the buffers of a part the call ran without calling it), by their paths."""
    if "path" not in diffs.columns:
        return []
    rows = diffs.filter((pl.col("a_seq") == a_seq) & pl.col("differs") & ~pl.col("ignored") & (pl.col("role") == "state"))
    paths = (re.match(r"^(?:state)?(?:\[\d+\])?\.(.+)\.[^.]+$", p) for p in rows["path"].to_list())
    return sorted({m.group(1) for m in paths if m})


def _owner(param_name: str) -> str:
    """The module a parameter's name says holds it ("" for none: a tensor no module holds is named by its
    place, `SGD.param_groups[0][1]`, or by a library, `pyro.param['s_loc']`: not a module `pyro`'s, helper 78)."""
    return "" if param_name.endswith("]") else param_name.rpartition(".")[0]


def blame(pivot: dict, events_a: pl.DataFrame, status: dict[int, str], diffs: pl.DataFrame,
          tensors_a: pl.DataFrame | None = None, shift: int = 0, events_b: pl.DataFrame | None = None,
          tensors_b: pl.DataFrame | None = None) -> dict:
    """Blame for the pivot event (a dict of its A-side event fields plus b_seq; `tensors_a`: A's
    tensor rows, to tell the parameters an optimizer steps from the others; `shift`: compare's
    --resumed-at, added to B's steps; B's events and tensors: to find a resume given the other way
    round)."""
    phase, kind = pivot["phase"], pivot["kind"]
    differing = _differing_roles(diffs, pivot["seq"])
    inputs = INPUT_ROLES.get((phase, kind), ())
    drew = _drew_alone(diffs, pivot["seq"]) if phase in ("forward", "recompute") and "rng" in differing else None
    inputs_differ = bool((differing - ({"rng"} if drew else set())) & set(inputs))  # (its own draw: no input)
    result = {"blame": "source", "fault_class": phase, "differing_roles": sorted(differing), "blame_window": None}
    if phase == "data":
        result.update(blame="data", fault_class="rng" if differing == {"rng"} else "data")
        if differing == {"rng"}:
            result["blame_window"] = {"module": None, "detail":
                                      "the batch matched but the RNG state at the start of this step differs: "
                                      + _RESEEDED}
        elif (unheld := _unheld_weights(pivot, events_a, diffs)) is not None:
            # (helper 68: a flow trained through its .inverse(), never called, its own parameter used before its first
            # part's call: that part's batch was blamed on the data, though the flow was initialised differently)
            result.update(blame="consumer", fault_class="params")
            result["blame_window"] = {"module": None, "detail": unheld}
        elif (again := _called_before(pivot, events_a)) is not None:
            result["blame_window"] = {"module": None, "detail": again}
    elif kind == "final":
        buffers = "state" in differing
        result.update(fault_class="final_state")
        # (helper 60: an EMA's shadow weights, kept as a module's buffers by the recorder, read "the buffers")
        held = "kept tensors (an EMA's or an average's shadow weights, which the training keeps but never calls)" \
            if pivot.get("module_type") == "KeptTensors" else None
        result["blame_window"] = {"module": pivot["boundary"], "detail":
                                  "the " + (held or "buffers" if buffers and "param" not in differing else
                                            "parameters" + (" and buffers" if buffers else ""))
                                  + " at the end of the recording (of its step window, with --steps) differ although "
                                  "every event before matched: something outside the observed boundaries changed "
                                  "them (an update outside torch.optim, an EMA, an edit after the last optimizer "
                                  "step, a buffer updated in code no module call covers)"}
        seen = events_a.filter((pl.col("boundary") == pivot["boundary"]) & (pl.col("kind") != "final"))
        if not seen.height:  # (helper 74: an EMA reset at step 2 of 5 was said to differ "at step 5")
            result["blame_window"]["detail"] += (
                f"; {pivot['boundary']} is compared only here: the training keeps it but no call or step of it was "
                f"recorded, so the change may have been made at any step before (a save of it each step would "
                f"place it: saves are compared where they are written)")
    elif kind == "saved":
        result.update(fault_class="saved")
        result["blame_window"] = {"module": pivot["boundary"], "detail": (
            "the values of a JSON file the training wrote (its rows' paths begin with its name) differ although every "
            "event before matched: a configuration or state written outside the save functions (peft's "
            "adapter_config.json, the Hugging Face Trainer's trainer_state.json, a save_pretrained config.json or "
            "scheduler_config.json) holds other numbers or strings" if pivot["module_type"] == JSON_FILE else
            f"what this {pivot['boundary']} call wrote (a {pivot['module_type']}) differs although every event before "
            "matched: the saved tensors were computed or changed outside the observed boundaries (an EMA or averaged "
            "copy, a conversion, an edit after the last optimizer step), or a different object was saved")}
    elif kind == "params":
        result.update(fault_class="params")
        detail = params_detail(pivot, events_a, diffs, tensors_a, shift, events_b, tensors_b)
        result["blame_window"] = {"module": pivot["boundary"], "detail": detail}
    elif phase == "comm":
        result.update(fault_class="comm")
        if inputs_differ:
            result["blame"] = "consumer"
        result["blame_window"] = {"module": pivot["boundary"], "detail": _comm_detail(pivot, inputs_differ)}
    elif phase == "optimizer":
        used = diffs.filter((pl.col("a_seq") == pivot["seq"]) & (pl.col("role") == "grad"))
        # the gradient step() used is the update's input: when it already differed, the fault is upstream of step()
        result.update(fault_class="optimizer", blame="consumer" if inputs_differ else "source")
        # (helper 76: Lookahead's k changed: only its slow buffer differed, and the text said "the parameter differs")
        state_only = differing == {"state"}
        detail = _optimizer_detail(pivot, events_a, status, used, "the state" if state_only else "the parameter")
        if state_only:
            detail = "only the optimizer's state for this parameter differs, the parameter itself matched: " + detail
        result["blame_window"] = {"module": pivot["boundary"], "detail": detail}
        state = diffs.filter((pl.col("a_seq") == pivot["seq"]) & (pl.col("role") == "state") & pl.col("differs"))
        # (its step count: not a hyperparameter's doing)
        counted = state.filter(pl.col("path").cast(pl.String).str.contains("step"))
        if shift and pivot["step"] == shift and counted.height and not inputs_differ:
            # (helper 55: a resume that did not load the optimizer's state was said to be the update computing
            # differently, or "an input of it that was not observed")
            result["blame_window"]["detail"] = (
                f"the optimizer's state, its step count too, differs at run B's first step (it resumed at step "
                f"{shift}: "
                f"{', '.join(p.lstrip('.') for p in state['path'].to_list()[:3])}): B's optimizer did not resume "
                "with the state A's had there (its state_dict not loaded, or loaded from another step's checkpoint); "
                + result["blame_window"]["detail"])
    elif kind == "grad":
        owner = _owner_backward(pivot, events_a, diffs)
        root = _root_backward_differing(pivot, events_a, diffs) if owner is None else None
        unheld = None if owner is not None else \
            _unheld_weights(pivot, events_a, diffs, f"the gradient of {pivot['boundary']} differs")
        if unheld is not None:
            # (helper 68: a flow's learned base scale, read in its .nll() after its net's call, initialised differently:
            # its gradient was said to come from the loss, though its value already differed)
            result.update(blame="consumer", fault_class="params")
            result["blame_window"] = {"module": None, "detail": unheld}
        elif owner is None and root is not None:  # (the parameter is read outside any call of its module)
            result.update(blame="consumer", fault_class="backward")
            window = _window(root, events_a, status, diffs)
            window["detail"] = (f"no backward of {_owner(pivot['boundary']) or 'its module'} was recorded in this step: "
                                f"the parameter is used outside a call of its module (a fused loss reading "
                                f"{pivot['boundary']} directly); " + window["detail"])
            result["blame_window"] = window
        elif owner is not None and owner["grad_output_differs"]:
            result.update(blame="consumer", fault_class="backward")
            # the window: up from its module, the innermost module whose incoming gradient matched
            window = _window(owner["event"], events_a, status, diffs)
            if window["module"] is None:  # no module around it had a matching incoming gradient: where did it come from?
                root = _root_backward_differing(pivot, events_a, diffs)
                if root is not None and root["seq"] != owner["event"]["seq"]:
                    window = _window(root, events_a, status, diffs)
                    window["detail"] = f"the gradient reaching {owner['boundary']}'s output already differed; " \
                                       + window["detail"]
                else:  # (trusted mode: the root and the modules after it may not be observed)
                    window = {"module": None, "detail": f"the gradient reaching {owner['boundary']}'s output already "
                              "differed, and no observed module after it says where it arose: the loss, or code or "
                              "modules the recording did not observe (trusted mode observes heavy modules only)"}
            else:
                window["detail"] = f"the gradient reaching {owner['boundary']}'s output already differed; " \
                                   + window["detail"]
            result["blame_window"] = window
        elif "grad_input" in differing and owner is None and not _owner(pivot["boundary"]) \
                and not pivot.get("module_type"):  # (a root's own parameter has its module's type: `bias` of a Linear)
            # (helper 78: a Pyro guide made of `pyro.param`s alone, reseeded: "a regulariser, a weight tied elsewhere")
            result.update(fault_class="backward")
            result["blame_window"] = {"module": None, "detail": (
                f"the gradient computed for {pivot['boundary']}, a tensor no module holds, differs: what the training's "
                f"code computed from it outside every recorded module differs (the loss, the random numbers drawn for "
                f"it after a reseed or an extra draw, its inputs or its code); no recorded event before says which")}
        elif "grad_input" in differing:
            result.update(fault_class="backward")
            reaching = "while the gradient reaching its module matched" if owner is not None else (
                f"(a parameter of a root {pivot.get('module_type')}: several roots of that type ran in this step, so "
                f"which one's backward it came through is not told)" if not _owner(pivot["boundary"]) else
                "and no backward of its module was recorded in this step (it is used outside a call of the module)")
            result["blame_window"] = {"module": owner["boundary"] if owner is not None else
                                      _owner(pivot["boundary"]) or pivot["boundary"], "detail":
                                      f"the gradient computed for this parameter differs {reaching}: the module's "
                                      "backward (weight gradient), or a use of the parameter outside the module "
                                      "whose gradient autograd sums into it (a regulariser in the loss such as an "
                                      "L2 term, a weight tied elsewhere), or a hook the training put on the module's "
                                      "output after its call returned (Tensor.register_hook: it changes the gradient "
                                      "after bitguard read it; `bitguard drill` names it)"}
        else:
            result.update(fault_class="accumulation")
            result["blame_window"] = {"module": pivot["boundary"], "detail":
                                      "the incoming gradient matched but .grad after accumulation differs: "
                                      "gradient accumulation (a missed zero_grad, a wrong accumulate), or a hook on "
                                      "the parameter (param.register_hook, register_post_accumulate_grad_hook) that "
                                      "changes its gradient (`bitguard drill` names it)"}
    elif inputs_differ:
        result["blame"] = "consumer"
        result["blame_window"] = _window(pivot, events_a, status, diffs)
        if phase == "forward" and result["blame_window"]["module"] is None:
            # no enclosing call had identical inputs and none produced them (every event before matched): they come
            # from outside every observed boundary (helper 28: SB3 calls a parameterless extractor first, on the
            # observations, so no batch event was taken, and a module that was not even its parent was blamed)
            result.update(blame="data", fault_class="data")
            rewired = None if events_b is None or tensors_b is None else \
                _rewired_around(pivot, events_a, diffs, ((events_a, tensors_a), (events_b, tensors_b)))
            if rewired is not None and (EDITED_AFTER in rewired or MADE_BETWEEN in rewired):  # (code between two calls:
                # not the data)
                result.update(blame="consumer", fault_class="forward")
            unheld = None if rewired is not None else _unheld_weights(pivot, events_a, diffs)
            if unheld is not None:  # (weights no call holds, made differently: conclusive, the data may differ too)
                result.update(blame="consumer", fault_class="params")
            reseeded = None
            if rewired is None and unheld is None and (differing - {"rng"}).isdisjoint(inputs):
                # (helper 68: a parameter-free noise module or augmentation, given the same tensors, drew from a generator
                # reseeded in one run: "the inputs differ ... the training's own code or data")
                result.update(fault_class="rng")
                reseeded = (f"the tensors {pivot['boundary']} was given matched, but the RNG state it began from "
                            f"differs, and every event before matched: " + _RESEEDED)
            result["blame_window"] = {"module": None, "detail": rewired or unheld or reseeded or (
                f"the inputs of {pivot['boundary']} differ, and no call around it had identical inputs nor did any "
                "recorded module produce them (every event before matched): they come from the training's own code "
                "or data (a batch, an observation, a replay buffer's sample, code between module calls)")}
    elif phase == "backward" and kind == "module" and "grad_input" in differing \
            and (sharing := _sharing(pivot, events_a, tensors_a)):
        # (helper 45: torchvision's RPN head and box heads read one feature map; a loss term of the box
        # regression dropped was blamed on the classification head's backward as computed differently)
        shown = ", ".join(sharing[:3]) + (f" and {len(sharing) - 3} more" if len(sharing) > 3 else "")
        result.update(blame="consumer")
        result["blame_window"] = {"module": None, "detail":
                                  f"the gradient this call's backward returned (grad_input) differs while the gradient "
                                  f"it started from (grad_output) matched, but that is the gradient of its input, "
                                  f"which {shown} also read in this step: autograd sums what each of them sends back "
                                  f"before it is read here, so a difference in their backward shows here first (an "
                                  f"output that gets a gradient in one run alone: a loss term dropped, weighted "
                                  f"differently or detached), unless this call's own backward computed differently"}
    elif phase == "backward" and kind == "module" and "grad_input" in differing:
        # (helper 35: a clamp in a Tensor.register_hook on the module's input, blamed on the module with no word;
        # no window module: a source's place is the pivot itself)
        result["blame_window"] = {"module": None, "detail":
                                  "the gradient this call's backward returned (grad_input) differs while the gradient "
                                  "it started from (grad_output) matched: its backward computed differently (a kernel, "
                                  "a custom autograd Function), or the training changed that gradient before it was "
                                  "read here: a hook on the input tensor, or on the module's output put after its "
                                  "call returned (Tensor.register_hook, a gradient clamp or scale: it changes the "
                                  "gradient after bitguard read it), or the module's own backward hook "
                                  "(register_full_backward_hook); or code "
                                  "outside any module call that reads the same input sent back another gradient "
                                  "(what is recorded is the input's gradient, summed over everything that read it)"}
    elif drew and not inputs_differ:
        # (helper 60: composer's StochasticDepth drew in one run alone, its output unchanged: said to be a signature
        # change, the pivot a step later, then "consumer" of an RNG state no other call made)
        result["blame_window"] = {"module": pivot["boundary"], "detail":
                                  f"this call drew random numbers in run {drew} alone (its other inputs matched): its "
                                  f"code, or a module it ran without calling it, draws in one run only (a dropout, a "
                                  f"stochastic depth or a sampling added or removed, or run in one mode only), and every "
                                  f"later draw of the training gives other numbers, even where this call's output is "
                                  f"the same"}
    elif phase == "forward" and differing == {"state"}:
        parts = _parts_run_uncalled(diffs, pivot["seq"])
        result["blame_window"] = {"module": pivot["boundary"], "detail": (
            f"only buffers of {' and '.join(parts)} differ after this module's call, its inputs and outputs "
            f"matched: {'these parts were' if len(parts) > 1 else 'that part was'} not called during it (run through "
            f"its .forward(), as a memory bank or queue often is, or not run at all), so no event of their own saw "
            f"them: this call's code updated them differently, or they were changed outside any module call since "
            f"its last call" if parts else
            "only this module's buffers differ after its call, its inputs and outputs matched: they were changed "
            "outside any module call since its last call (a buffer edited between steps, set by hand), or its own "
            "code updated them differently in this call (running statistics)")}
    elif phase == "forward" and "state" in differing:
        # (helper 35: a pruning mask flipped between steps, a spectral norm's weight_u edited: "computed differently")
        before = events_a.filter((pl.col("boundary") == pivot["boundary"]) & (pl.col("phase") == "forward")
                                 & (pl.col("seq") < pivot["seq"]))
        result["blame_window"] = {"module": pivot["boundary"], "detail": (
            "this module's output and buffers differ, its inputs matched: its computation, or a buffer it reads "
            "(recorded as each call leaves it, not as the call found it) changed since its last call outside any "
            "module call: a pruning mask, a spectral norm's vectors or running statistics edited or set by hand"
            if before.height else
            # (helper 74: a codebook's k-means init, a rotary embedding's inv_freq: "changed since its last call")
            "this module's output and buffers differ at its first call, its inputs matched: a buffer it reads was "
            "made differently (its initialisation, or one this first call makes from the data: a k-means codebook, "
            "a data-dependent norm), or its computation differs")}
    if result["blame_window"] is None and phase == "forward" and kind == "module" and result["blame"] == "source":
        # (helper 92: a global forward pre-hook scaling one Linear's input read as that Linear computing differently)
        result["blame_window"] = {"module": None, "detail": (
            "its inputs matched and its output differs: its forward computed differently (its code, a kernel, a "
            "setting or state it reads), or a forward hook changed its input or output inside the call (its own, "
            "register_forward_pre_hook or register_forward_hook, or a global one, register_module_forward_pre_hook or "
            "register_module_forward_hook: the inputs are read before the hooks run, the output after); `bitguard "
            "drill` names the operation")}
    unseen = _unseen_inputs(diffs, pivot["seq"], inputs) if result["blame"] == "source" and kind == "module" else []
    if unseen:  # (helper 49: PyG's Index, a CSR adjacency: "inputs matched")
        window = result["blame_window"] or {"module": None, "detail": "they matched, and what it computed differs"}
        result["blame_window"] = {**window, "detail": _unseen_words(unseen) + window["detail"]}
    return result


def _unseen_inputs(diffs: pl.DataFrame, seq: int, roles) -> list[str]:
    """The paths of event `seq`'s inputs (`roles`) that either run could not observe: "its inputs matched"
    is then said of the others only."""
    if "unobserved_b" not in diffs.columns:
        return []
    rows = diffs.filter((pl.col("a_seq") == seq) & pl.col("role").is_in(list(roles))
                        & (pl.col("unobserved").is_not_null() | pl.col("unobserved_b").is_not_null()))
    return [(f"{r}{p}", (a or b) in (ONLY_A, ONLY_B))
            for r, p, a, b in rows.select("role", "path", "unobserved", "unobserved_b").iter_rows()]


def _unseen_words(unseen: list[tuple[str, bool]]) -> str:
    """Those inputs in words: unreadable ones may be what differs; one run alone records the others (helper 58)."""
    said = []
    for alone, words in ((False, "could not be observed (a tensor the digest cannot read: see the tensors' "
                                 "'unobserved'), and may be what differs"),
                         (True, "recorded by one run alone (an input the other run's call does not take), so "
                                "not compared")):
        paths = [p for p, one in unseen if one == alone]
        if paths:
            said.append(", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
                        + f" {words}")
    return f"of its inputs, {'; '.join(said)}; of the others: "


def fed_by_model(pivot: dict, sides: tuple[tuple, tuple], diffs: pl.DataFrame) -> str | None:
    """For a batch pivot (`data` blame): where a differing input holds what an observed module
    returned earlier in the same run (a GAN's discriminator given the generator's output after the
    order of its steps changed, helper 33), the sentence that says so, else None: the batch is then
    what the training loaded. `sides`: A's and B's (events, tensors). A module's output is known by
    its digests, so a detached or copied output is found too."""
    made = _producers(pivot, diffs, sides, 1)
    if not made or made[0][1] == [None, None]:
        return None
    row, said = made[0]
    where = "; ".join(f"in run {run} it holds " + (f"what {made} returned" if made else "no recorded module's output")
                      for run, made in zip("AB", said))
    return (f"input {row['path'] or row['idx']} of {pivot['boundary']} differs, and it is not a batch the training "
            f"loaded: {where}. The training feeds {pivot['boundary']} another model's output here in one run: the "
            "order of the models' calls, or what the code between them passes on, differs (a GAN's steps swapped), not "
            "the data pipeline")


def _producers(pivot: dict, diffs: pl.DataFrame, sides: tuple[tuple, tuple], rows: int) -> list[tuple[dict, list]]:
    """The pivot's first `rows` differing inputs, each with what recorded module returned it in run
    A and in run B (`_returned`: None for none)."""
    if pivot.get("b_seq") is None:
        return []
    differing = diffs.filter((pl.col("a_seq") == pivot["seq"]) & pl.col("differs") & ~pl.col("ignored")
                             & (pl.col("role") == "input"))
    return [(row, [_returned(events, tensors, seq, xor, pos, row["idx"], pivot["step"])
                   for (events, tensors), seq, xor, pos in ((sides[0], pivot["seq"], row["xor"], row["pos"]),
                                                            (sides[1], pivot["b_seq"], row["xor_b"], row["pos_b"]))])
            for row in differing.head(rows).iter_rows(named=True)]


def _rewired_around(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame, sides: tuple[tuple, tuple]) -> str | None:
    """`_rewired` for the pivot, else for the calls around it, outermost first (helper 48: a loss module
    given its inputs swapped, whose CrossEntropyLoss child is the first event to differ)."""
    said = _rewired(pivot, diffs, sides)
    if said is not None or "t_start_ns" not in events_a.columns:
        return said
    around = events_a.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                             & (pl.col("step") == pivot["step"]) & (pl.col("depth") < pivot["depth"])
                             & (pl.col("t_start_ns") <= pivot["t_start_ns"]) & (pl.col("t_end_ns") >= pivot["t_end_ns"]))
    for event in around.sort("depth").iter_rows(named=True):
        paired = diffs.filter(pl.col("a_seq") == event["seq"])
        if paired.is_empty():
            continue
        said = _rewired({**event, "b_seq": paired["b_seq"][0]}, diffs, sides)
        if said is not None:
            return f"the inputs of {pivot['boundary']} differ, computed inside {event['boundary']}'s call, where " + said
    return None


def _unheld_weights(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame, head: str | None = None) -> str | None:
    """Where weights that no module call met in the pivot's step differ as an optimizer's step() finds them,
    later in that step (a model run through its `.forward()`, whose output the pivot's module is given; helper
    56): the tensors only an optimizer holds before its first step, or a root's parameters taken at step()
    (collectors/weights.py, `_uncalled_roots`), the sentence that says the inputs come from them; else None."""
    step = events_a.filter(pl.col("step") == pivot["step"])
    called = set(step.filter(pl.col("phase") == "forward")["boundary"].to_list())
    later = step.filter((pl.col("kind") == "params") & (pl.col("phase") == "optimizer") & (pl.col("seq") > pivot["seq"])
                        & (pl.col("boundary").cast(pl.String).str.ends_with(FIRST_STEP)
                           | ~pl.col("boundary").is_in(list(called))))
    for seq, boundary, module_type in later.sort("seq").select("seq", "boundary", "module_type").iter_rows():
        if module_type == "optimizer" and not boundary.endswith(FIRST_STEP):
            continue  # (the tensors only an optimizer holds at a step after its first: taken at the step's start)
        differing = diffs.filter((pl.col("a_seq") == seq) & pl.col("differs") & (pl.col("role") == "param"))
        if not differing.height:
            continue
        names = ", ".join(p.lstrip(".") for p in differing["path"].to_list()[:3])
        held = (f"weights no recorded module call holds, which {boundary.removesuffix(FIRST_STEP)} steps ({names}), "
                "already differ as its first step() finds them" if module_type == "optimizer" else
                f"the weights of {boundary} ({names}), which an optimizer steps and no module call met in this step, "
                "already differ as its step() finds them")
        head = head or f"the inputs of {pivot['boundary']} differ, and no recorded module produced them"
        return (f"{head}; {held}, "
                "later in this step: a model run through its .forward() or another method, never called "
                "(as gpytorch's modules and normalizing flows' .inverse() are), made differently (its initialisation, "
                "its seed, a loaded checkpoint) or changed before this step computes these inputs (the data it is "
                "given may differ too)")
    return None


def _called_before(pivot: dict, events_a: pl.DataFrame) -> str | None:
    """For a data pivot at a root's second or later call in its step: the sentence that says the calls before
    it matched, so that its input may be made from what they returned, not read from the data (helper 74:
    generate() sampling at another temperature was blamed on the data with nothing more said); else None."""
    if not pivot.get("call"):
        return None
    before = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("phase") == "forward")
                             & (pl.col("boundary") == pivot["boundary"]) & (pl.col("seq") < pivot["seq"])).height
    if not before:
        return None
    return (f"{pivot['boundary']} was called {before} time{'s' if before > 1 else ''} before in step {pivot['step']} "
            f"and every event before matched: this input is either another batch of the data (several batches a "
            "step) or made by the training's own code from what those calls returned (generation, sampling at "
            "another temperature, outputs fed back in): look at the code between these calls, at the call stack below")


EDITED_AFTER = "changed in place after it returned"
MADE_BETWEEN = "made it from what was returned, or passed something else"  # (`_rewired`: not any module's output)  # (`_rewired`: an output edited before the next call read it)


def _rewired(pivot: dict, diffs: pl.DataFrame, sides: tuple[tuple, tuple]) -> str | None:
    """For a forward pivot whose differing inputs no observed call explains: those that are, in either
    run, what a recorded module returned, and which, in words (helper 48: a contrastive loss given
    its two encoders' outputs swapped was said to get them from "the training's own code or data")."""
    if sides[0][1] is None:
        return None
    said, edited, remade = [], [], []
    for row, made in _producers(pivot, diffs, sides, 3):
        if made != [None, None] and made[0] != made[1]:
            for run, side, seq, other in (("A", sides[0], pivot["seq"], made[1]),
                                          ("B", sides[1], pivot["b_seq"], made[0])):
                if made["AB".index(run)] is None and _returned(*side, seq, None, None, row["idx"], pivot["step"],
                                                               same_tensor=True) == other:
                    edited.append(f"input {row['path'] or row['idx']} is the tensor {other} returned in both runs, "
                                  f"and in run {run} it was {EDITED_AFTER} (what {pivot['boundary']} "
                                  "was given is no longer what was returned)")
                    break
            else:
                if None in made:  # (one run's code made it from the module's output, or put another in its place)
                    run, module = ("A", made[1]) if made[0] is None else ("B", made[0])
                    remade.append(f"input {row['path'] or row['idx']} is what {module} returned in run "
                                  f"{'AB'.replace(run, '')} and what no recorded module returned in run {run}")
                said.append(f"input {row['path'] or row['idx']} is what {made[0] or 'no recorded module'} returned in "
                            f"run A and what {made[1] or 'no recorded module'} returned in run B")
    if edited:  # (helper 56: `out[:, 1].mul_(1.01)` between a model and its loss was said to be arguments swapped)
        return (f"the inputs of {pivot['boundary']} differ, and no call around it had identical inputs: "
                + "; ".join(edited) + ": code between them edits it (an in-place op on the output: `out[:, i].mul_()`, "
                "`+=`, `clamp_()`, an assignment into it)")
    if not said:
        return None
    if len(remade) == len(said):  # (helper 75: `out = out * 1.1` between a model and its loss was said to be swapped)
        return (f"the inputs of {pivot['boundary']} differ, and no call around it had identical inputs: "
                + "; ".join(remade) + f": that run's code between the calls {MADE_BETWEEN} (an out-of-place op on "
                "the output, `out = out * s`, or another tensor given in its place)")
    return (f"the inputs of {pivot['boundary']} differ, and no call around it had identical inputs: " + "; ".join(said)
            + f": {pivot['boundary']} is given other modules' outputs (arguments swapped or passed from elsewhere), "
            "not other data")


# the fewest bytes of a floating-point output whose equal digests say "the same tensor": small tensors and
# integers repeat by value (helper 45: a batch's two labels equal to what a module returned a step before)
_SAME_BY_VALUE = 16


def _returned(events: pl.DataFrame, tensors: pl.DataFrame, seq: int, xor, pos, idx: int, step: int,
              same_tensor: bool = False) -> str | None:
    """The latest event before `seq` whose output holds input `idx` of event `seq` (these digests):
    the same tensor object, or, in the same step, its memory (a detached copy shares it), a
    floating-point one of `_SAME_BY_VALUE` bytes or more; in words. (By values alone, a dataset's
    targets, the same each epoch, were what a transform had returned an epoch before: helper 45.)
    `same_tensor`: the latest of the step whose output is the same tensor object, whatever its digests."""
    if (xor is None or pos is None) and not same_tensor:
        return None
    mine = tensors.filter((pl.col("seq") == seq) & (pl.col("role") == "input") & (pl.col("idx") == idx))
    if not mine.height:
        return None
    tid, storage = mine["tid"][0], mine["storage"][0]
    in_step = events.filter(pl.col("step") == step)["seq"]
    if same_tensor:
        hit = tensors.filter((pl.col("seq") < seq) & (pl.col("role") == "output") & (pl.col("tid") == tid)
                             & (tid is not None) & (tid != 0) & pl.col("seq").is_in(in_step.implode()))
    else:
        hit = tensors.filter((pl.col("seq") < seq) & (pl.col("role") == "output") & (pl.col("xor") == xor)
                             & (pl.col("pos") == pos) & pl.col("dtype").str.contains("float")
                             & (pl.col("nbytes") >= _SAME_BY_VALUE)
                             & ((pl.col("tid") == tid) | ((pl.col("storage") == storage) & (storage != 0)
                                                          & pl.col("seq").is_in(in_step.implode()))))
    # (not one its call was given and returned as it is: a TensorDictModule returns its input batch, helper 47)
    passed = tensors.filter(pl.col("seq").is_in(hit["seq"].implode()) & (pl.col("role") == "input"))
    hit = hit.join(passed.select("seq", "tid"), on=["seq", "tid"], how="anti")
    if not hit.height:
        return None
    event = events.filter(pl.col("seq") == hit["seq"].max())
    if not event.height:
        return None
    e = event.row(0, named=True)
    return f"{e['boundary']} ({e['phase']} at step {e['step']}, call {e['call']})"


def _sharing(pivot: dict, events_a: pl.DataFrame, tensors_a: pl.DataFrame | None) -> list[str]:
    """The other calls whose backward in the pivot's step records the pivot's grad_input tensor (by
    identity): calls that read the same input, whose gradients autograd sums into it."""
    if tensors_a is None:
        return []
    mine = tensors_a.filter((pl.col("seq") == pivot["seq"]) & (pl.col("role") == "grad_input") & (pl.col("tid") > 0))
    if not mine.height:
        return []
    others = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("phase") == "backward")
                             & (pl.col("kind") == "module") & (pl.col("seq") != pivot["seq"]))
    hits = tensors_a.filter(pl.col("seq").is_in(others["seq"].implode()) & (pl.col("role") == "grad_input")
                            & pl.col("tid").is_in(mine["tid"].implode()))
    return others.filter(pl.col("seq").is_in(hits["seq"].implode()))["boundary"].unique(maintain_order=True).to_list()


def _comm_detail(pivot: dict, inputs_differ: bool) -> str:
    """A collective at the pivot, as far as this rank's events tell (`confirm_comm` adds what the
    other ranks of its group say)."""
    if inputs_differ:
        return ("this rank's input to the collective already differed: it was produced upstream, in code between "
                "the observed boundaries before it")
    return ("this rank's inputs to the collective matched and its output differs: the collective (or the DDP comm "
            "hook around it) delivered different bytes on this rank, unless another rank's input differed")


def collective_rows(events_a: pl.DataFrame, tensors_a: pl.DataFrame, pairs: pl.DataFrame,
                    diffs: pl.DataFrame) -> pl.DataFrame:
    """Run A's collectives as `confirm_comm` reads them, in A's order: seq, step, boundary, issue
    (the `@N` their rows end in, their issue order on the group; None without), paired, and
    whether a paired one's inputs differ (no rule accepting it) or could not be observed. A few
    rows a step: what a rank's pool worker sends back of its collectives (rank_summary.py)."""
    comm = events_a.filter(pl.col("phase") == "comm").select("seq", "step", "boundary")
    seqs = comm["seq"].implode()
    issues: dict[int, str] = {}
    for seq, path in tensors_a.filter(pl.col("seq").is_in(seqs)).select("seq", "path").iter_rows():
        if seq not in issues and collectives.issue_of(path) is not None:
            issues[seq] = collectives.issue_of(path)
    inputs = diffs.filter(pl.col("a_seq").is_in(seqs) & (pl.col("role") == "input")).group_by("a_seq").agg(
        (pl.col("differs") & ~pl.col("ignored")).any().alias("input_differs"),
        pl.col("unknown").any().alias("input_unknown")).rename({"a_seq": "seq"})
    return comm.with_columns(
        pl.Series("issue", [issues.get(s) for s in comm["seq"].to_list()], pl.String),
        pl.col("seq").is_in(pairs["a_seq"].implode()).alias("paired"),
    ).join(inputs, on="seq", how="left", maintain_order="left").with_columns(
        pl.col("input_differs").fill_null(False), pl.col("input_unknown").fill_null(False))


def confirm_comm(ranks: dict, rank_selected: bool) -> None:
    """A collective blamed on one rank (`fault_class` comm, inputs matched there) checked against
    the same collective on the other compared ranks of its group (same step, boundary and issue
    order `@N`): an input that differed on another rank makes this rank a consumer of it; inputs
    that matched on every rank of the group confirm the blame; ranks not compared are named.
    Reads each rank's collectives (`collective_rows`, in its summary), never its frames."""
    for rc in ranks.values():
        b = rc.blame
        if rc.pivot is None or b is None or b["fault_class"] != "comm" or b["blame"] != "source":
            continue
        members = collectives.group_of(rc.pivot["boundary"])
        if members is None:
            continue
        own = rc.summary.comm.filter(pl.col("seq") == rc.pivot["seq"])["issue"]
        issue = own[0] if own.len() else None
        differ, matched, absent = [], [], []
        for r in members:
            if r == rc.rank:
                continue
            other = ranks.get(r)
            same = None if other is None else _same_collective(other.summary.comm, rc.pivot, issue)
            if same is None:
                absent.append(r)
            elif same["input_differs"]:
                differ.append(r)
            elif same["input_unknown"]:
                absent.append(r)
            else:
                matched.append(r)
        w = b["blame_window"]
        if differ:
            rc.fed_by = differ
            b["blame"] = "consumer"
            w["detail"] = (f"this rank's inputs to the collective matched, but rank(s) {_ranks(differ)} of its group "
                           f"fed it a different input: its output differs here because of theirs")
        elif absent:
            why = "were not compared (--rank)" if rank_selected else "have no observed counterpart of it"
            w["detail"] += f"; rank(s) {_ranks(absent)} of the group {why}, so their inputs are not known to match"
        else:
            w["detail"] = (f"the inputs to the collective matched on every rank of its group ({_ranks(members)}) and "
                           f"its output differs on this rank: the collective (or the DDP comm hook around it) "
                           f"computed differently")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _same_collective(comm: pl.DataFrame, pivot: dict, issue: str | None) -> dict | None:
    """The row of another rank's collectives (`collective_rows`) that is `pivot`'s collective, if paired."""
    same = comm.filter((pl.col("step") == pivot["step"]) & (pl.col("boundary") == pivot["boundary"]))
    for row in same.iter_rows(named=True):
        if issue is None or row["issue"] == issue:
            return row if row["paired"] else None
    return None


def _optimizer_detail(pivot: dict, events_a: pl.DataFrame, status: dict[int, str], used: pl.DataFrame,
                      what: str = "the parameter") -> str:
    """What is known of the update's inputs: the gradient step() used (the step event's `grad`
    row, after any reduction across ranks), this step's gradient as autograd produced it, and the
    parameter before it. Only what was observed and compared equal is called "matched"."""
    same_param = (pl.col("boundary") == pivot["boundary"])
    grads = events_a.filter(same_param & (pl.col("phase") == "backward") & (pl.col("kind") == "grad")
                            & (pl.col("step") == pivot["step"]))
    before = events_a.filter(same_param & (pl.col("phase") == "optimizer") & (pl.col("step") < pivot["step"]))
    grad_ok = grads.height and all(status.get(s) == "identical" for s in grads["seq"].to_list())
    prev_ok = before.height and status.get(before["seq"][-1]) == "identical"
    used_seen = used.height and not used["unknown"].any()
    used_differs = bool(used.height and (used["differs"] & ~used["ignored"]).any())
    if used_differs:
        between = ("a reduction across ranks or an edit of .grad; a collective observed there would have been the "
                   "first divergence" if (pivot.get("world_size") or 1) > 1 else
                   "an edit of .grad: clipping, noise or scaling added to it, by the training's code or by an "
                   "optimizer wrapping this one, as Opacus' DPOptimizer does")
        produced = (f"while the gradient autograd produced on this rank matched: it changed between backward and "
                    f"step() ({between})" if grad_ok else
                    "and the gradient autograd produced on this rank was not observed or differs too")
        return f"the gradient step() used differs {produced}"
    # (an optimizer's state is recorded as step() leaves it: an edit of it since is seen only here)
    state = ("the optimizer update computed differently (its hyperparameters, its code), or its state "
             "(momentum, Adam's moments) changed since its last step(): edited, or loaded from a checkpoint; or the "
             "parameter itself was changed after this step's forward began and before step() (a clamp or an edit "
             "under no_grad or through .data between backward() and step(): the parameter is recorded as the step's "
             "first call meets it and as step() leaves it, not as step() finds it)")
    if used_seen and prev_ok:
        return (f"{what} differs after step() while the gradient step() used and the previous parameters "
                f"matched: {state}")
    if grad_ok and prev_ok and (pivot.get("world_size") or 1) == 1 and not used.height:
        return f"{what} differs after step() while its gradient and the previous parameters matched: {state}"
    known = []
    if used_seen:
        known.append("the gradient step() used matched")
    elif used.height:
        known.append("the gradient step() used could not be observed")
    elif grad_ok and (pivot.get("world_size") or 1) > 1:
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
        known.append("no optimizer step before this one recorded the parameter (a model's parameters are compared "
                     "as each step begins, in its params event)")
    return (f"{what} differs after step(); " + "; ".join(known)
            + ": the optimizer update, or an input of it that was not observed, computed differently")


def signature_change(rows_a: pl.DataFrame, rows_b: pl.DataFrame, shown: int = 3) -> str:
    """What differs between the tensors of an event and of its twin in the other run, by role and
    path: those one run alone records, and those of another shape or dtype (a dict's keys: how many)."""
    def layout(rows):
        return {(r["role"], r["path"]): (r["dtype"], list(r["shape"] or []))
                for r in rows.select("role", "path", "dtype", "shape").iter_rows(named=True)}

    a, b = layout(rows_a), layout(rows_b)
    parts = []
    for label, mine, theirs in (("only in A", a, b), ("only in B", b, a)):
        alone = [path or role for role, path in mine if (role, path) not in theirs]
        if alone:
            parts.append(f"{label}: {', '.join(alone[:shown])}" + (f" and {len(alone) - shown} more" if len(alone) > shown else ""))
    changed = [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]]
    for (role, path), (dtype_a, shape_a), (dtype_b, shape_b) in changed[:shown]:
        if path.endswith(KEYS_MARK) and shape_a and shape_b:
            parts.append(f"the dict {path[:-len(KEYS_MARK)] or 'saved'} holds {shape_a[0]} keys in A and {shape_b[0]} in B")
        else:
            parts.append(f"{path or role}: {dtype_a}{shape_a} in A, {dtype_b}{shape_b} in B")
    if len(changed) > shown:
        parts.append(f"and {len(changed) - shown} more of another shape or dtype")
    return "; ".join(parts)


def structure_blame(event: dict, side: str, events: pl.DataFrame, twin: dict | None, change: str = "",
                    tensors: pl.DataFrame | None = None) -> dict:
    """Blame for an event present in one run only (`side` has it, `events` and `tensors` are its):
    which run lacks what, and the module whose code decided it (the innermost enclosing call, or the
    boundary's owner). `change`: what differs from its twin (`signature_change`), where the other
    run records the event too."""
    have, lack = side.upper(), "B" if side == "a" else "A"
    what = f"the {phase_words(event['phase'], event['kind'])} of {event['boundary']} (call {event['call']}) at step {event['step']}"
    if twin is not None:
        fault = "signature"
        detail = (f"both runs record {what}, with different tensors ({change or 'roles, shapes or dtypes'}): the "
                  f"data layout or the code path changed")
    elif event["kind"] == "saved":
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have} records {what} and run {lack} does not: the training saved at another point, "
                  f"a different number of times or not at all, or the save failed in run {lack}")
    elif event["kind"] == "final" and _goes_on_after(event, events):
        # (helper 52: a model rebuilt and loaded in the same process, an in-process resume: "run B ends here")
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have} took {what} mid-run, when the training let go of that model (it dropped or replaced it: "
                  f"a model rebuilt and loaded in the same process, as an in-process resume does, or a sweep's next "
                  f"model), while run {lack} kept its model: the events after it name run {have}'s new model anew "
                  f"(`#2`), so they pair with nothing of run {lack}'s; compare runs that keep their models alike")
    elif event["kind"] == "final":  # (the first gap: the other run records more of this step, or ends later)
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have}'s recording ends here, with {what}, while run {lack} goes on: the runs trained a "
                  f"different number of steps (an early stop, another max_steps or epoch count, a loop that ended on "
                  f"another condition, an exception the training caught), or run {lack}'s recording ended without "
                  f"its final state")
    elif event["kind"] == "params" and event["call"] > 0 and _as_at_first_call(event, events, tensors):
        # (helper 48: a model.eval() forgotten in run B, its model without dropout or norms: run A's params event
        # at the evaluation's call was said to show weights "changed between two of its calls")
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have} took the parameters of {event['boundary']} again at call {event['call']} of step "
                  f"{event['step']}, equal to those at its first call: the weights did not move, but run {have} "
                  f"called the model again in this step after a backward, or after its mode changed (train()/eval()), "
                  f"or after its trainable parameters changed (requires_grad_ set on or off between the calls: a "
                  f"freeze or an unfreeze, peft's disable_adapter()), where run {lack} did not: its step ended sooner "
                  f"(an optimizer step() after fewer micro-batches of a gradient accumulation), it called the model "
                  f"fewer times, or its mode or trainable parameters did not change; see the training API calls that "
                  f"differ (`modes`, `backward`, `requires_grad`)")
    elif event["kind"] == "params" and event["call"] > 0:  # (taken at a later call only when the weights moved)
        return {"blame": "source", "fault_class": "params", "differing_roles": ["param"],
                "blame_window": {"module": event["boundary"], "detail": (
                    f"run {have}'s parameters of {event['boundary']} changed between two of its calls in step "
                    f"{event['step']} (a params event at a later call of a step is taken only when they moved since "
                    f"the step's first call), and run {lack}'s did not: an edit between micro-batches or between a "
                    f"forward and the next (through .data, under no_grad, by a callback), or a step() inside the "
                    f"accumulation")}}
    elif event["kind"] == "params" and (first := _earlier_of_its_class(event, events)):
        # (helper 52: a model rebuilt and loaded in the same process: its new root is `Linear#2`)
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have} meets a new model here, {event['boundary']}, of the class of its {first} (a model "
                  f"rebuilt and loaded in the same process, as an in-process resume does, or a sweep's next model), "
                  f"where run {lack} does not: the events after it name the new model anew, so they pair with nothing "
                  f"of run {lack}'s; compare runs that keep their models alike")
    else:
        fault = "missing" if side == "a" else "extra"
        detail = (f"run {have} records {what} and run {lack} does not: a module was skipped or added, a branch "
                  f"changed, it ran a different number of times, or run {lack}'s recording stopped")
    parent = None
    if event["phase"] == "forward" and event["kind"] == "module":
        same = _calls_around(events, event).filter(pl.col("depth") < event["depth"])
        if same.height:
            parent = same.sort("depth", descending=True)["boundary"][0]
    elif "." in event["boundary"] and event["kind"] not in ("saved", "final", "params"):  # (torch.save, SGD#1)
        parent = _owner(event["boundary"])
    return {"blame": "structure", "fault_class": fault, "differing_roles": [],
            "blame_window": {"module": parent or event["boundary"], "detail": detail}}


def drawn_apart(blame: dict, event: dict, side: str, events: pl.DataFrame, pairs: pl.DataFrame,
                diffs: pl.DataFrame) -> dict:
    """A structure pivot's `blame` (its `event` of run `side`, whose `events` these are), or, where the forward call
    of its window's module around it began from an RNG state that differs between the runs (`pairs`, `diffs`:
    the rank's), `data`/`rng` there (helper 84: a container picking a child at random, kornia's random_apply,
    torchvision's RandomChoice, reseeded, was "a module skipped or added", the RNG never named)."""
    parent = blame["blame_window"]["module"]
    if parent is None or event["phase"] != "forward" or event["kind"] != "module":
        return blame
    seqs = _calls_around(events, event).filter(pl.col("boundary") == parent)["seq"].head(1)
    if side == "b":
        seqs = pairs.filter(pl.col("b_seq").is_in(seqs.implode()))["a_seq"]
    if not seqs.len() or not diffs.filter((pl.col("a_seq") == seqs[0]) & (pl.col("role") == "rng") & pl.col("differs")
                                          & ~pl.col("ignored")).height:
        return blame
    return {"blame": "data", "fault_class": "rng", "differing_roles": ["rng"], "blame_window": {"module": parent, "detail": (
        f"{blame['blame_window']['detail']}; the RNG state the call of {parent} around it began from differs between the "
        f"runs, while every event before matched: its draws chose another branch (a reseed, an extra draw before it, a "
        f"changed sampler)")}}


def _calls_around(events: pl.DataFrame, event: dict) -> pl.DataFrame:
    """The forward module calls of `events` in `event`'s step whose time spans its own (it, and those it ran inside)."""
    return events.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module") & (pl.col("step") == event["step"])
                         & (pl.col("t_start_ns") <= event["t_start_ns"]) & (pl.col("t_end_ns") >= event["t_end_ns"]))


def _earlier_of_its_class(event: dict, events: pl.DataFrame) -> str | None:
    """The root a run met before this one of the same class (`Linear` for `Linear#2`), if it met one."""
    match = re.fullmatch(r"(.+)#\d+", event["boundary"])
    if match is None or events.filter((pl.col("seq") < event["seq"]) & (pl.col("boundary") == match.group(1))).is_empty():
        return None
    return match.group(1)


def _goes_on_after(event: dict, events: pl.DataFrame) -> bool:
    """Does the run record events other than final states after this final event (it let go of a model
    mid-run) rather than ending there?"""
    return not events.filter((pl.col("seq") > event["seq"]) & (pl.col("kind") != "final")).is_empty()


def _as_at_first_call(event: dict, events: pl.DataFrame, tensors: pl.DataFrame | None) -> bool:
    """Does a params event at a later call of a step hold the same digests as the step's first one of
    its boundary?"""
    if tensors is None:
        return False
    first = events.filter((pl.col("step") == event["step"]) & (pl.col("kind") == "params")
                          & (pl.col("boundary") == event["boundary"]) & (pl.col("call") == 0))
    if first.is_empty():
        return False

    def rows(seq):
        return tensors.filter(pl.col("seq") == seq).select("role", "idx", "path", "xor", "pos").sort("role", "idx").rows()

    mine = rows(event["seq"])
    return bool(mine) and mine == rows(first["seq"][0])


def _owner_backward(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> dict | None:
    owner = _owner(pivot["boundary"])
    if not owner:  # (a root's own parameter, `bias` of a bare Linear: its module is the root, by its own name; helper 69)
        roots = events_a.filter((pl.col("phase") == "backward") & (pl.col("kind") == "module") & (pl.col("depth") == 0)
                                & (pl.col("step") == pivot["step"]) & (pl.col("module_type") == pivot["module_type"]))
        names = roots["boundary"].unique().to_list()
        if len(names) != 1:
            return None
        owner = names[0]
    rows = events_a.filter((pl.col("phase") == "backward") & (pl.col("kind") == "module")
                           & (pl.col("boundary") == owner) & (pl.col("step") == pivot["step"]))
    if rows.is_empty():
        return None
    seqs = rows["seq"].to_list()
    d = diffs.filter(pl.col("a_seq").is_in(seqs) & (pl.col("role") == "grad_output") & pl.col("differs")
                     & ~pl.col("ignored"))
    event = rows.filter(pl.col("seq") == d["a_seq"].min()).row(0, named=True) if d.height else None
    return {"boundary": owner, "grad_output_differs": not d.is_empty(), "event": event}


def _root_backward_differing(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> dict | None:
    """A root's backward event of the pivot's step whose incoming gradient differs (the first), or None."""
    roots = events_a.filter((pl.col("phase") == "backward") & (pl.col("kind") == "module") & (pl.col("depth") == 0)
                            & (pl.col("step") == pivot["step"]))
    if roots.is_empty():
        return None
    d = diffs.filter(pl.col("a_seq").is_in(roots["seq"].implode()) & (pl.col("role") == "grad_output")
                     & pl.col("differs") & ~pl.col("ignored"))
    if d.is_empty():
        return None
    differing = roots.filter(pl.col("seq").is_in(d["a_seq"].implode()))
    owner = _forward_root(pivot, events_a)  # (helper 79: of two roots, the other one's was named)
    mine = differing.filter(pl.col("boundary") == owner) if owner is not None else differing.clear()
    return (mine if mine.height else differing).sort("seq").row(0, named=True)


def _forward_root(pivot: dict, events_a: pl.DataFrame) -> str | None:
    """The root whose forward calls hold every forward call of the pivot's module (its boundary and type) in
    the pivot's step, when one does (two roots' parts may share paths: `1` in each, told apart by their type)."""
    forwards = events_a.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                               & (pl.col("step") == pivot["step"]))
    mine = forwards.filter((pl.col("boundary") == pivot["boundary"]) & (pl.col("depth") > 0)
                           & (pl.col("module_type") == pivot.get("module_type")))
    roots = forwards.filter(pl.col("depth") == 0).select("boundary", "t_start_ns", "t_end_ns")
    if mine.is_empty() or roots.is_empty():
        return None
    held = mine.select("t_start_ns", "t_end_ns").join(roots, how="cross", suffix="_root").filter(
        (pl.col("t_start_ns_root") <= pl.col("t_start_ns")) & (pl.col("t_end_ns_root") >= pl.col("t_end_ns")))
    owners = held["boundary"].unique()
    return owners[0] if owners.len() == 1 and held.height == mine.height else None


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
            unseen = _unseen_inputs(diffs, anc["seq"], input_roles)
            changed = _own_buffers_changed(anc, events_a, diffs) if phase == "forward" else []
            return _between_children(anc, _children(anc, same, phase), pivot,
                                     (_unseen_words(unseen) if unseen else "")
                                     + f"inputs of {anc['boundary']} matched; " + (
                                         f"its buffers {', '.join(changed[:3])} differ as this call left them and "
                                         f"matched as its last call left them: changed outside any module call "
                                         f"since then (an edit by hand or through .data between steps, a load), and "
                                         f"read here, or computed differently by its own code" if changed else
                                         _RAN_AGAIN.format(m=anc["boundary"]) if phase == "recompute" else
                                         "the difference arose in its own code"))
    if phase == "forward":
        root = _root_window(pivot, events_a, diffs)
        if root is not None:
            return root
    if phase == "backward" and pivot.get("depth") != 0:
        root = _root_backward_window(pivot, events_a, diffs, same)
        if root is not None:
            return root
    # a root's backward whose incoming gradient differs: the pivot's own, or the step's first (helper 28: DQN's
    # root returns its Sequential's output, so the child's backward comes first, and no prefix names the root)
    root = (pivot if pivot.get("depth") == 0 else _root_backward_differing(pivot, events_a, diffs)) \
        if phase == "backward" else None
    if root is not None:
        return {"module": None, "detail": f"the gradient reaching {root['boundary']}'s output already differs: it "
                                          "was computed outside every observed module, by the loss (its code, or its "
                                          "targets: labels are not among a model's inputs) or by code between the "
                                          "output and backward(), such as a custom autograd function's backward "
                                          "(a loss wrapper that weights or clips the gradient)"}
    if phase == "backward":  # (helper 53: trusted mode, whose root's backward is not observed, said "the data pipeline")
        return {"module": None, "detail": "the gradient reaching it already differs, and no observed module after it "
                                          "received a matching one: it was computed by the loss (its code, or its "
                                          "targets), by code between the model's output and backward(), or by modules "
                                          "the recording did not observe (trusted mode observes heavy modules only)"}
    if phase == "recompute":  # (helper 64: a non-reentrant recompute stops once backward has what it needs: the
        return _recompute_window(pivot, events_a)  # enclosing call's own recompute never ends, no event)
    return {"module": None, "detail": "no enclosing module had identical inputs: the fault is upstream of every "
                                      "observed boundary (e.g. in the data pipeline or in code outside modules)"}


# a recompute's window: the pivot's forward in the step came first and matched (it would be the pivot otherwise)
_RAN_AGAIN = ("activation checkpointing ran {m}'s code again in backward (code that reads a flag or a state changed "
              "between forward and backward, or an RNG state not preserved with preserve_rng_state=False, computes "
              "otherwise then), and the difference arose in its own code")


def _recompute_window(pivot: dict, events_a: pl.DataFrame) -> dict:
    """A recompute with no enclosing recompute event whose inputs matched: its forward in the step came first
    and matched (it is no pivot), so the code that ran again in backward gave it other inputs than the forward
    did; the window is the innermost module around it that the forward recorded."""
    forwards = events_a.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                               & (pl.col("step") == pivot["step"]))["boundary"]
    around = next((p for p in reversed(_prefixes(pivot["boundary"])) if (forwards == p).any()), None)
    where = f"{around}'s code" if around else "the code around it"
    return {"module": around, "detail": f"the forward of {pivot['boundary']} in this step matched; activation "
                                        f"checkpointing ran {where} again in backward to recompute it, and it gave it "
                                        "other inputs than the forward did: code that reads a flag or a state changed "
                                        "between forward and backward, or an RNG state not preserved "
                                        "(preserve_rng_state=False)"}


def _root_backward_window(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame, same: pl.DataFrame) -> dict | None:
    """For a backward pivot no named ancestor explains: the root call whose forward held the pivot's call,
    when that root's own backward began from a matching gradient: the difference arose in the root's own
    code between its children (its parts are not named under it, so no prefix finds it; helper 68: a root
    that detached half of its child's output, its loss the same, was said to get its gradient from the loss
    or code outside the model). Only where the step calls the pivot's module and the root once each: which
    backward is which call's is not known otherwise."""
    forwards = events_a.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                               & (pl.col("step") == pivot["step"]))
    mine = forwards.filter(pl.col("boundary") == pivot["boundary"])
    if mine.height != 1 or (same["boundary"] == pivot["boundary"]).sum() != 1:
        return None
    f = mine.row(0, named=True)
    roots = forwards.filter((pl.col("depth") == 0) & (pl.col("t_start_ns") <= f["t_start_ns"])
                            & (pl.col("t_end_ns") >= f["t_end_ns"]) & (pl.col("seq") != f["seq"]))
    if roots.height != 1:
        return None
    r = roots.row(0, named=True)
    back = same.filter((pl.col("boundary") == r["boundary"]) & (pl.col("depth") == 0))
    if back.height != 1 or (forwards["boundary"] == r["boundary"]).sum() != 1:
        return None
    anc = back.row(0, named=True)
    if not diffs.filter((pl.col("a_seq") == anc["seq"]) & (pl.col("role") == "grad_output") & pl.col("differs")
                        & ~pl.col("ignored")).is_empty():
        return None  # (its incoming gradient differs: the loss or code after the model, said below)
    parts = forwards.filter((pl.col("depth") == 1) & (pl.col("t_start_ns") >= r["t_start_ns"])
                            & (pl.col("t_end_ns") <= r["t_end_ns"]))["boundary"]
    kids = same.filter((pl.col("depth") == 1) & pl.col("boundary").is_in(parts.implode())).sort("seq")
    return _between_children(anc, kids.select("seq", "boundary").to_dicts(), pivot,
                             f"the gradient reaching {anc['boundary']}'s output matched; the difference arose in its own "
                             "code (a detach, a different op or branch that computes the same values)")


def _root_window(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> dict | None:
    """The model's root call as the window when no enclosing module event says so: a mode that
    observes some modules only (trusted) records no event for a root of another type, but its
    inputs are the step's data event (the batch and RNG state as the root call began), and when
    those matched, the difference arose in the root's own code between its observed children."""
    data = events_a.filter((pl.col("phase") == "data") & (pl.col("step") == pivot["step"])
                           & (pl.col("seq") < pivot["seq"]) & (pl.col("depth") < pivot["depth"]))
    if data.is_empty():
        return None
    anc = data.sort("seq").row(-1, named=True)  # the forward pass the pivot is in, if its call is not over
    over = events_a.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module") & (pl.col("depth") == 0)
                           & (pl.col("t_start_ns") >= anc["t_start_ns"]) & (pl.col("t_end_ns") <= pivot["t_start_ns"]))
    if not over.is_empty():  # (a top-level call began and ended since: the root's call had ended; calls nest)
        return None
    if not diffs.filter((pl.col("a_seq") == anc["seq"]) & pl.col("differs") & ~pl.col("ignored")).is_empty():
        return None
    later = events_a.filter((pl.col("phase") == "data") & (pl.col("seq") > anc["seq"]))
    end = later.get_column("seq").min() if not later.is_empty() else None
    kids = events_a.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")
                           & (pl.col("depth") == anc["depth"] + 1) & (pl.col("seq") > anc["seq"])
                           & (pl.col("seq") < end if end is not None else pl.lit(True)))
    return _between_children(anc, kids.sort("seq").select("seq", "boundary").to_dicts(), pivot,
                             f"the inputs of {anc['boundary']} (this step's data) matched; the difference arose in "
                             f"its own code, which this mode does not observe module by module,")


def _own_buffers_changed(anc: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> list[str]:
    """The paths of window `anc`'s buffers that differ as this call left them, where its last call left them
    all equal (a memory bank a container gives its child, edited between steps: helper 79, "the difference
    arose in its own code"); none otherwise."""
    state = diffs.filter((pl.col("a_seq") == anc["seq"]) & (pl.col("role") == "state") & pl.col("differs"))
    if state.is_empty():
        return []
    last = events_a.filter((pl.col("boundary") == anc["boundary"]) & (pl.col("phase") == "forward")
                           & (pl.col("kind") == "module") & (pl.col("seq") < anc["seq"]))
    if last.is_empty():
        return []
    before = diffs.filter((pl.col("a_seq") == last["seq"].max()) & (pl.col("role") == "state"))
    if before.is_empty() or before["differs"].any():
        return []
    return state["path"].unique(maintain_order=True).to_list()


def _between_children(anc: dict, children: list[dict], pivot: dict, head: str) -> dict:
    """The window: module `anc`'s own code between its observed `children`, up to the pivot."""
    before = [c for c in children if c["seq"] < pivot["seq"]]
    return {
        "module": anc["boundary"],
        "module_type": anc["module_type"],
        # each child once (a child called in a loop would be listed at every call)
        "excluding_children": list(dict.fromkeys(c["boundary"] for c in children)),
        "after": before[-1]["boundary"] if before else None,
        "before": pivot["boundary"],
        # (helper 67: the differing value may be made before the last child called, and read only by the pivot)
        "detail": f"{head} between its observed children, before {pivot['boundary']}"
                  + (f": after {before[-1]['boundary']}, or before it in a value only {pivot['boundary']} reads"
                     if before else ""),
    }


def _prefixes(boundary: str) -> list[str]:
    parts = boundary.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _children(anc: dict, same: pl.DataFrame, phase: str) -> list[dict]:
    if phase in ("forward", "recompute"):
        kids = same.filter((pl.col("depth") == anc["depth"] + 1) & (pl.col("t_start_ns") >= anc["t_start_ns"])
                           & (pl.col("t_end_ns") <= anc["t_end_ns"]))
    else:
        depth = anc["boundary"].count(".") + 1
        kids = same.filter(pl.col("boundary").cast(pl.String).str.starts_with(anc["boundary"] + ".")
                           & (pl.col("boundary").cast(pl.String).str.count_matches(r"\.") == depth))
    return kids.sort("seq").select("seq", "boundary").to_dicts()
