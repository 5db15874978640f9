"""Why a `params` pivot's weights differ: a root's parameters as a call of a step meets them differ
although every event before matched (backend/pivot.py's `blame` asks). The answer reads which
optimizer steps updated those tensors before and after the pivot, by their identities (`tid`), in
either run: weights changed by hand after a step, a copy kept beside the trained ones (an EMA, a
target network, a reference sharing the trained weights in one run only), a model initialised
differently after another's training, LBFGS or SAM inside a step, a resume from another step.

Reads polars frames prepared by compare.py, as pivot.py does.
"""

from __future__ import annotations

import polars as pl

from bitguard.schema import FIRST_STEP


def params_detail(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame,
                   tensors_a: pl.DataFrame | None = None, shift: int = 0, events_b: pl.DataFrame | None = None,
                   tensors_b: pl.DataFrame | None = None) -> str:
    """A root's parameters differ as a call of a step meets them, every event before matched."""
    before = events_a.filter(pl.col("seq") < pivot["seq"])
    steps = before.filter((pl.col("phase") == "optimizer") & (pl.col("kind") == "step"))
    stepped = steps.height
    differing = diffs.filter((pl.col("a_seq") == pivot["seq"]) & pl.col("differs") & (pl.col("role") == "param"))
    names = [p.lstrip(".") for p in differing["path"].to_list()]
    if pivot.get("module_type") == "optimizer":  # (collectors/weights.py, _orphan_params)
        stepping = pivot["boundary"].removesuffix(FIRST_STEP)
        held = (f"tensors that only {stepping} steps and no recorded module call holds ({', '.join(names[:3])}: "
                "a learned temperature such as SAC's log_alpha, weights stacked for vmap or given to functional_call, "
                "the parameters of a model whose __call__ skips torch's, as gpytorch's modules do, or that is run "
                "through its .forward())")
        if before.filter((pl.col("boundary") == pivot["boundary"]) & (pl.col("kind") == "params")).is_empty():
            # (their first params event: taken as their first step() found them, helper 56)
            return (f"{held} differ as the first step() found them, although every event before matched: they were "
                    "made differently (their initialisation, its seed, a loaded checkpoint, weights copied in), or "
                    "changed before that step() (an in-place edit under no_grad, through .data, a clamp); their "
                    "gradients were not observed before that step")
        return (f"{held} differ at the start of this step although every event before matched: code outside "
                "torch.optim changed them after the last step() (an in-place edit under no_grad, through .data, a "
                "clamp, load_state_dict)")
    made = made_in_call(pivot, events_a)
    if made is not None:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        one = len(names) == 1
        return (f"{shown or 'its parameters'} {'was' if one else 'were'} made during this {made} call of "
                f"{pivot['boundary']}, inside it, and {'differs' if one else 'differ'} as made: made differently "
                "(their initialisation, its scale or seed, the random numbers drawn before it, the shapes it met), "
                "or taken from a store the run kept from before (Pyro's param store not cleared between two fits); "
                "`bitguard drill` names the line that made them")
    if pivot["call"] > 0 and _other_tensors(pivot, before, tensors_a):
        # (helpers 85 and 92: a teacher pass through functional_call with 0.8 x params was said to be an edit)
        return ("the parameters differ at this call of the step, and they are other tensors than its earlier call met "
                "(torch.func.functional_call or torch.nn.utils.stateless.functional_call given tensors, weights swapped "
                "in for this call): the tensors the training's code gave this call were made differently")
    # (a part called alone names its parameters from itself, `2.weight`; its optimizer events are named from
    # the model, `actor.2.weight`)
    stepped_names = steps["boundary"].to_list()
    if stepped and names and not any(b == n or b.endswith("." + n) for n in names for b in stepped_names):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"{shown} {'differs' if len(names) == 1 else 'differ'} at the start of this step, and no optimizer "
                "step before updated them: parameters new to the model or to its training (a layer added, a "
                "parameter replaced or unfrozen) made differently "
                "(their initialisation, the weights copied in), or frozen ones changed outside torch.optim")
    if stepped and names and tensors_a is not None and before.filter(pl.col("boundary") == pivot["boundary"]).is_empty() \
            and _stepped_later(pivot, events_a, tensors_a) and not _stepped_before(pivot, steps, tensors_a):
        # (helper 46: skorch's GridSearchCV trains a clone after the first model: its initialisation differed; not a new
        # wrapper around the trained tensors, made at each call: torchdiffeq's _PerturbFunc, helper 53)
        return (f"the parameters of {pivot['boundary']} differ at its first call, after the training of another "
                "model: a model made since (a sweep's or a cross-validation's next model, a clone, a model rebuilt) "
                "was initialised differently: the seed, the random numbers drawn before it was built, its "
                "initialisation or its sizes")
    if stepped and names and tensors_a is not None and not _stepped_before(pivot, steps, tensors_a):
        # (by the parameters' identities: an EMA's have the trained model's names, helper 34's ModelEmaV2)
        if _stepped_in_b(pivot, events_b, tensors_b):  # (helper 51: a DPO reference made by copy.copy)
            return (f"the parameters of {pivot['boundary']} differ at the start of this step: in run A they are a copy "
                    "kept beside the trained parameters (no optimizer step updated them), in run B they are the "
                    "trained parameters themselves, which an optimizer steps (a model that shares its weights with the "
                    "trained one, as a shallow copy.copy() of it does, or is that model)")
        return (f"the parameters of {pivot['boundary']} differ at the start of this step, and no optimizer step before "
                "updated them: they are not the trained parameters but a copy the training keeps beside them (an EMA "
                "or averaged model, a teacher or target network) or frozen weights: what updates them outside "
                "torch.optim (an EMA's decay or update, an averaging, a copy from the trained model) computed "
                "differently, or they were changed by hand")
    optimized = stepped or not events_a.filter((pl.col("phase") == "optimizer") & (pl.col("kind") == "step")).is_empty()
    if pivot["call"] > 0 and optimized:  # (in step 0 too: helpers 27 and 29, SAM's perturbation was said to be an update)
        return ("the parameters differ at this call of the step although they matched at an earlier call and every "
                "event since matched: they changed inside the step, where an optimizer that calls its closure "
                "again (LBFGS) moves them inside step(), or by code between the two calls (a perturbation such as "
                "SAM's first step, an edit through .data or by hand)")
    if stepped:
        text = ("the parameters differ at the start of this step although every optimizer step before matched: code "
                "outside torch.optim changed them after the last step() (a clamp or an update through .data, a "
                "hand-written update, load_state_dict, weights copied in")
        left = {side: _as_last_step_left(seq, events, tensors) for side, seq, events, tensors in
                (("A", pivot["seq"], events_a, tensors_a), ("B", pivot.get("b_seq"), events_b, tensors_b))}
        moved = [side for side, same in left.items() if same is False]
        if len(moved) == 1 and None not in left.values():  # (helper 77: which run's eval() swapped them)
            other = "B" if moved[0] == "A" else "A"
            return (f"{text}, or weights swapped for an evaluation, as a schedule-free optimizer's eval() or an EMA's "
                    f"swap does): run {moved[0]}'s are not what its last step() left, run {other}'s are, so run "
                    f"{moved[0]}'s code changed them")
        return text + ")"
    if before.filter(pl.col("kind") == "grad").height:
        return ("the parameters differ at the start of this step although every gradient before matched, and no "
                "optimizer step was recorded: the weights were updated outside torch.optim (by hand, through .data, "
                "or by another library's optimizer, as Keras') differently, or edited between steps (or an optimizer "
                "that calls its closure again, LBFGS, moved them inside its first step())")
    resumed = _resumed_at(pivot, diffs, events_a, tensors_a)
    swapped = None if resumed is not None or shift else _resumed_at(pivot, diffs, events_b, tensors_b, side="a")
    if swapped is not None and swapped > pivot["step"]:  # (the resumed run given as A)
        return (f"run A's parameters at step {pivot['step']} are run B's at step {swapped}: A is the run that resumed "
                f"from a checkpoint of B's step {swapped}? Give the resumed run as B: `bitguard compare B A --resumed-at "
                f"{swapped - pivot['step']}` compares its steps with B's from there")
    if resumed is not None:  # (a resume in a new process counts its steps from 0 again)
        better = shift + resumed - pivot["step"]
        how = f"`bitguard compare --resumed-at {better}`" if better else "`bitguard compare` without --resumed-at"
        if shift:
            return (f"run B's parameters at step {pivot['step']} (its own step {pivot['step'] - shift}) are run A's at "
                    f"step {resumed}: --resumed-at {shift} pairs B's steps with the wrong ones of A; {how} compares "
                    f"them with A's from there")
        return (f"run B's parameters at step {pivot['step']} are run A's at step {resumed}: B resumed from a checkpoint "
                f"of A's step {resumed} in a new process, which counted its steps from 0? {how} compares B's steps "
                f"with A's from there")
    if shift and pivot["step"] == shift:  # (B's first step: what it resumed from)
        return (f"the parameters run B resumed with differ from run A's at step {shift} (B's first, --resumed-at "
                f"{shift}) and at every later step: the checkpoint did not restore them (the model's state not loaded, "
                f"loaded from another run), or it is an earlier step's than --resumed-at says (A's steps before "
                f"{shift} are not compared: compare without --resumed-at to find the step of A they are)")
    if pivot["step"] > 0:
        return (f"the parameters already differ at the model's first recorded call, in step {pivot['step']}: they "
                f"differed before the recorded steps began (an earlier step, the initialisation, a loaded checkpoint)")
    ran = before.filter((pl.col("phase") == "forward") & (pl.col("boundary") != pivot["boundary"])).height
    return ("the parameters differ before the model's first recorded call, although everything before matched: "
            "they were made differently (the initialisation, its seed, a loaded checkpoint, weights copied in)"
            + (", or updated from another model's weights before this call (a momentum or EMA update at the start of "
               "a step, as MoCo's and BYOL's key encoders are, with another momentum)" if ran else ""))


def _resumed_at(pivot: dict, diffs: pl.DataFrame, events_a: pl.DataFrame, tensors_a: pl.DataFrame | None,
                side: str = "b") -> int | None:
    """The other step of run A, the nearest, at whose same event (boundary and kind) A's parameters
    are, digest for digest, run B's at the pivot; None when there is none. (`side` "a", with B's events
    and tensors: the step of B whose parameters are A's at the pivot.)"""
    xor, pos = ("xor_b", "pos_b") if side == "b" else ("xor", "pos")
    if tensors_a is None or events_a is None or xor not in diffs.columns:
        return None
    b = diffs.filter((pl.col("a_seq") == pivot["seq"]) & (pl.col("role") == "param")).select(
        "idx", pl.col(xor).alias("xor"), pl.col(pos).alias("pos"))
    if not b.height or b["xor"].null_count():
        return None
    later = events_a.filter((pl.col("step") != pivot["step"]) & (pl.col("boundary") == pivot["boundary"])
                            & (pl.col("kind") == pivot["kind"]) & (pl.col("phase") == pivot["phase"])).select("seq", "step")
    rows = tensors_a.filter(pl.col("seq").is_in(later["seq"].implode()) & (pl.col("role") == "param"))
    same = rows.join(b, on=["idx", "xor", "pos"], how="semi").group_by("seq").len()
    whole = same.filter(pl.col("len") == b.height).join(later, on="seq").with_columns(
        (pl.col("step") - pivot["step"]).abs().alias("_far")).sort("_far", "seq")
    return int(whole["step"][0]) if whole.height else None


def _stepped_before(pivot: dict, steps: pl.DataFrame, tensors_a: pl.DataFrame) -> bool:
    """Is any of the pivot's parameters (by its tensor identity) one an optimizer step before it
    updated? (Not one: a model the training keeps beside the trained one. One weight replaced by a
    new tensor in a trained model is not that: its other weights were stepped.)"""
    mine = tensors_a.filter((pl.col("seq") == pivot["seq"]) & (pl.col("role") == "param"))["tid"]
    updated = tensors_a.filter(pl.col("seq").is_in(steps["seq"].implode()) & (pl.col("role") == "param"))["tid"]
    return bool(mine.is_in(updated.implode()).any())


def _stepped_in_b(pivot: dict, events_b: pl.DataFrame | None, tensors_b: pl.DataFrame | None) -> bool:
    """Are the pivot's parameters, in run B, ones an optimizer step of B updated before it?"""
    if events_b is None or tensors_b is None or pivot.get("b_seq") is None:
        return False
    steps = events_b.filter((pl.col("seq") < pivot["b_seq"]) & (pl.col("phase") == "optimizer") & (pl.col("kind") == "step"))
    return _stepped_before({"seq": pivot["b_seq"]}, steps, tensors_b)


def _stepped_later(pivot: dict, events_a: pl.DataFrame, tensors_a: pl.DataFrame) -> bool:
    """Does an optimizer step after the pivot update any of its parameters (by identity)? A model
    trained from there (a sweep's next model), not a copy kept beside the trained one (an EMA)."""
    later = events_a.filter((pl.col("seq") > pivot["seq"]) & (pl.col("phase") == "optimizer") & (pl.col("kind") == "step"))
    return _stepped_before(pivot, later, tensors_a)


def _as_last_step_left(seq: int | None, events: pl.DataFrame | None, tensors: pl.DataFrame | None) -> bool | None:
    """Are the parameters of params event `seq` (each by its tensor identity) what the last optimizer step
    before it left them, digest for digest? None when that cannot be told (no step before holds one of them)."""
    if seq is None or events is None or tensors is None or not {"tid", "xor", "pos"} <= set(tensors.columns):
        return None
    mine = tensors.filter((pl.col("seq") == seq) & (pl.col("role") == "param")).select("tid", "xor", "pos")
    steps = events.filter((pl.col("seq") < seq) & (pl.col("phase") == "optimizer") & (pl.col("kind") == "step"))["seq"]
    last = tensors.filter(pl.col("seq").is_in(steps.implode()) & (pl.col("role") == "param")).sort("seq").group_by(
        "tid").agg(pl.col("xor").last().alias("xor_left"), pl.col("pos").last().alias("pos_left"))
    both = mine.join(last, on="tid", how="left")
    if not both.height or both["xor_left"].null_count() or both["xor"].null_count():
        return None
    return bool(((both["xor"] == both["xor_left"]) & (both["pos"] == both["pos_left"])).all())


def made_in_call(pivot: dict, events_a: pl.DataFrame) -> str | None:
    """The phase ("forward") of the module call during which the pivot's parameters were made, when they were
    (collectors/weights.py, `_made_params`: their event is taken as that call ends, just before its event, and
    starts when the first was made, after the call began)."""
    if "t_start_ns" not in events_a.columns:
        return None
    own = events_a.filter(pl.col("seq") == pivot["seq"])
    if own.is_empty() or own["t_start_ns"][0] is None:
        return None
    after = events_a.filter(pl.col("seq") > pivot["seq"]).sort("seq").head(1)
    if after.is_empty() or after["kind"][0] != "module" or after["boundary"][0] != pivot["boundary"]:
        return None  # (a params event taken as a call begins, a root's or swapped weights', starts with the call)
    return after["phase"][0] if (after["t_start_ns"][0] or 0) < own["t_start_ns"][0] else None


def made_apart(blame: dict, pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> dict:
    """A `consumer` or `data` pivot's `blame` (one not naming the weights already), or, where the parameters an
    optimizer holds differ before its first update later in the pivot's step (its `(before its first step)` params
    event) and no params event before the pivot held them, `source`/`params` there: the weights were made differently, and no module call observed them
    before the pivot (helper 83: gpytorch's models, called past nn.Module's call, initialised differently, were
    said to differ "by the loss", or to come from the data under LBFGS)."""
    if events_a.filter((pl.col("seq") < pivot["seq"]) & (pl.col("kind") == "params")).height:
        return blame
    found = differing_later(pivot, events_a, diffs, FIRST_STEP)
    if found is not None:
        event, paths = found
        names = ", ".join(p.lstrip(".") for p in paths[:3])
        return {"blame": "source", "fault_class": "params", "differing_roles": ["param"], "blame_window": {
            "module": event["boundary"], "detail": (
                f"the parameters {event['boundary'].removesuffix(FIRST_STEP)} holds ({names}) already differ before "
                f"its first update, later in this step, and no module call observed them before: they were made "
                f"differently (the initialisation, its seed, a loaded checkpoint, a value set by hand); the model is "
                f"called past nn.Module's call (gpytorch's are) or through its .forward(), so its first observed "
                f"consequence comes first ({blame['blame']}: {blame['blame_window']['detail']})")}}
    return blame


def differing_later(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame,
                    suffix: str = "") -> tuple[dict, list[str]] | None:
    """The first params event after the pivot in its step (of a boundary ending in `suffix`) whose parameters
    differ, and their paths; None where none does. (`made_apart`; pivot_notes.weights_later_note)"""
    later = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("seq") > pivot["seq"])
                            & (pl.col("kind") == "params") & pl.col("boundary").cast(pl.String).str.ends_with(suffix))
    differing = diffs.filter(pl.col("a_seq").is_in(later["seq"].implode()) & (pl.col("role") == "param")
                             & pl.col("differs") & ~pl.col("ignored"))
    if differing.is_empty():
        return None
    seq = differing["a_seq"].min()
    paths = differing.filter(pl.col("a_seq") == seq)["path"].to_list()
    return later.filter(pl.col("seq") == seq).row(0, named=True), paths


def _other_tensors(pivot: dict, before: pl.DataFrame, tensors_a: pl.DataFrame | None) -> bool:
    """Whether the pivot's params event holds other tensors (identities) than the same root's params event of an
    earlier call in its step: the call ran on tensors given to it, not on the module's own."""
    if tensors_a is None or "tid" not in tensors_a.columns:
        return False
    earlier = before.filter((pl.col("boundary") == pivot["boundary"]) & (pl.col("kind") == "params")
                            & (pl.col("step") == pivot["step"]))
    if earlier.is_empty():
        return False
    def tids(seq: int) -> dict:
        rows = tensors_a.filter((pl.col("seq") == seq) & (pl.col("role") == "param"))
        return dict(zip(rows["path"].to_list(), rows["tid"].to_list()))
    mine, theirs = tids(pivot["seq"]), tids(earlier["seq"].max())
    return any(tid != theirs.get(path) for path, tid in mine.items() if path in theirs and tid)
