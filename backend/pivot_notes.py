"""The notes said beside a pivot blamed as a source (rank_summary.py): where what the recorder did
not see between two observations could explain it. Each is a sentence or nothing, read from run A's
events and tensors: weights edited between calls after their last params event (`unstepped_note`,
`midstep_note`), an input whose digest was reused from an earlier call (`cached_input_note`), a
backward's input that the root also returned to the training's code (`returned_input_note`), a
backward that ran on activations checkpointing recomputed (`recompute_note`); beside a pivot of the
RNG state, a model's weights that differ later in its step (`weights_later_note`); and
beside any pivot, tensors whose memory layout differs between the runs (`layout_note`). Knows nothing
of how the pivot was found (pivot.py)."""

from __future__ import annotations

import polars as pl

from bitguard.backend.params_blame import differing_later


def unstepped_note(pivot: dict, events_a: pl.DataFrame) -> list[str]:
    """A module call blamed as a source (its inputs matched, an output differs) whose parameters
    had gradients that no optimizer step recorded before it: a training that updates its weights
    by hand (`p.data.add_(...)`, no torch.optim) shows a changed update first here, as if the
    module computed differently. Said as a note: the parameters themselves are only observed in
    the recording's final state."""
    if pivot["phase"] not in ("forward", "recompute") or pivot["kind"] != "module":
        return []
    before = events_a.filter(pl.col("seq") < pivot["seq"])
    grads = before.filter(pl.col("kind") == "grad")
    if pivot["depth"] > 0:  # the root module (depth 0) holds every parameter
        grads = grads.filter(pl.col("boundary").cast(pl.String).str.starts_with(pivot["boundary"] + "."))
    params = set(grads.get_column("boundary").unique().to_list())
    if not params:
        return []
    stepped = set(before.filter((pl.col("phase") == "optimizer") & (pl.col("kind") == "step")
                                & pl.col("boundary").is_in(list(params))).get_column("boundary").to_list())
    unstepped = sorted(params - stepped)
    if not unstepped:
        return []
    named = ", ".join(unstepped[:3]) + (f" and {len(unstepped) - 3} more" if len(unstepped) > 3 else "")
    return [f"{len(unstepped)} parameter(s) of {pivot['boundary']} ({named}) had gradients before this call but no "
            f"optimizer step recorded them: weights updated outside torch.optim (by hand, through .data) are "
            f"observed only in the recording's final state, so a difference in such an update also shows first "
            f"here, as if this module computed differently"]


def midstep_note(pivot: dict, events_a: pl.DataFrame, tensors_a: pl.DataFrame | None = None,
                 names=None) -> list[str]:
    """A module call blamed as a source after a backward inside its step (a later micro-batch of
    gradient accumulation), or after other calls of the model in its step (a rollout's): the weights
    were last recorded as the step began (its params event) and are recorded again only when a
    version counter moves or the model's mode changes, and only after a backward, so an edit
    between the two (peft's merge_adapter/unmerge_adapter, a callback's) shows first here."""
    if pivot["phase"] not in ("forward", "recompute") or pivot["kind"] != "module":
        return []
    step = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("seq") < pivot["seq"]))
    params = step.filter(pl.col("kind") == "params")
    if params.is_empty() or not _holds_parameters(pivot, params, tensors_a, names):
        return []
    after = step.filter(pl.col("seq") > params["seq"].max())
    if not after.filter(pl.col("phase") == "backward").is_empty():
        return [f"a backward ran in step {pivot['step']} after its parameters were last recorded (their params "
                f"event) and before this call: weights changed since then without moving their version counters "
                f"(through .data, as merging and unmerging an adapter does) are not observed, and a difference "
                f"there also shows first here, as if this module computed differently"]
    ended = after.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module") & (pl.col("depth") == 0)
                         & (pl.col("t_end_ns") <= pivot["t_start_ns"]))
    if ended.is_empty():
        return []
    # (helper 28: SB3's rollout calls its policy many times a step in eval mode, and a callback edited a weight
    # between two of them: blamed on the Linear as if it computed differently)
    return [f"{ended.height} earlier call(s) of the model ran in step {pivot['step']} after its parameters were "
            f"last recorded (their params event), with no backward nor change of mode since, which is when a step "
            f"records them again: weights edited between two calls (a callback, an in-place update under no_grad, "
            f"through .data) are not observed, and a difference there also shows first here, as if this module "
            f"computed differently"]


def cached_input_note(pivot: dict, events_a: pl.DataFrame, tensors_a: pl.DataFrame | None,
                      diffs: pl.DataFrame | None = None) -> list[str]:
    """A module call blamed as a source whose input is a tensor an earlier call of its step returned:
    the recorder digested it there and reused that digest here, its version counter unchanged
    (collectors/hooks.py `_row`), so an edit through `.data` or `.numpy()` between the two calls is
    not observed and shows first here, as if this module computed differently (helper 36). Not where
    the pivot's outputs are equal (`diffs` says: only its buffers differ, a running statistic or a buffer
    set by hand; an input that differed would have changed what the call returned; helper 58)."""
    if tensors_a is None or pivot["phase"] != "forward" or pivot["kind"] != "module" \
            or not str(pivot.get("device") or "cpu").startswith("cpu"):  # (a GPU tensor is digested at every observation)
        return []
    if diffs is not None and diffs.filter((pl.col("a_seq") == pivot["seq"]) & pl.col("differs")
                                          & (pl.col("role") == "output")).is_empty():
        return []
    inputs = tensors_a.filter((pl.col("seq") == pivot["seq"]) & (pl.col("role") == "input") & (pl.col("tid") > 0))
    if inputs.is_empty():
        return []
    earlier = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("seq") < pivot["seq"]))["seq"]
    made = tensors_a.filter(pl.col("seq").is_in(earlier.implode()) & (pl.col("role") == "output")).join(
        inputs.select("tid", "xor", "pos"), on=["tid", "xor", "pos"], how="semi")
    if made.is_empty():
        return []
    producers = events_a.filter(pl.col("seq").is_in(made["seq"].implode()))["boundary"].unique(maintain_order=True)
    # (helper 47: "the tensor model.0, model.1 returned" read as one module's name)
    what = f"its input is the tensor {producers[0]} returned" if producers.len() == 1 else \
        f"its inputs include tensors that {' and '.join(producers.to_list()[:2])} returned"
    return [f"{what}, digested there and not again (its version counter had not moved): an edit of it between the "
            f"two calls through .data or .numpy() is not observed and would show first here, as if this module "
            f"computed differently; record with --no-digest-cache to digest every observation"]


def returned_input_note(pivot: dict, events_a: pl.DataFrame, tensors_a: pl.DataFrame | None) -> list[str]:
    """A module's backward blamed as a source whose input the root also returned to the training's
    code: the gradient recorded for that input sums what the code reading it sends back, and an edit
    of it there through `.data` (no version bump: the root's output row reused the digest taken at
    this call) is not observed and shows first here (helper 46)."""
    if tensors_a is None or (pivot["phase"], pivot["kind"]) != ("backward", "module"):
        return []
    forward = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("phase") == "forward")
                              & (pl.col("kind") == "module") & (pl.col("boundary") == pivot["boundary"])
                              & (pl.col("call") == pivot["call"]))
    if forward.is_empty():
        return []
    inputs = tensors_a.filter((pl.col("seq") == forward["seq"][0]) & (pl.col("role") == "input") & (pl.col("tid") > 0))
    roots = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("phase") == "forward")
                            & (pl.col("kind") == "module") & (pl.col("depth") == 0))
    returned = tensors_a.filter(pl.col("seq").is_in(roots["seq"].implode()) & (pl.col("role") == "output")
                                & pl.col("tid").is_in(inputs["tid"].implode()))
    if returned.is_empty():
        return []
    root = roots.filter(pl.col("seq") == returned["seq"][0])["boundary"][0]
    return [f"its input is also what {root} returns to the training's code (output{returned['path'][0]}): the "
            f"gradient recorded for it sums what that code sends back, and an edit of it there through .data (its "
            f"digest reused, the version counter unchanged) is not observed and would show first here; record with "
            f"--no-digest-cache to digest every observation"]


def _holds_parameters(pivot: dict, params: pl.DataFrame, tensors_a: pl.DataFrame | None, names=None) -> bool:
    """Could weights edited between calls explain the pivot module's output: does it hold parameters,
    by the paths of its root's last params event (helper 33: a torchmetrics metric, none, was given
    the note), or by `names()`, every name of the root's parameters (a params event names a tied
    weight once, by its first name: helper 36's output layer tied to its embedding)? True when the
    tensors are not at hand."""
    if tensors_a is None:
        return True
    last = params.filter(pl.col("seq") == params["seq"].max()).row(0, named=True)
    if last["boundary"] == pivot["boundary"]:
        return True
    paths = tensors_a.filter((pl.col("seq") == last["seq"]) & (pl.col("role") == "param"))["path"]
    if paths.cast(pl.String).str.starts_with(f".{pivot['boundary']}.").any():
        return True
    return names is not None and any(n.startswith(f"{pivot['boundary']}.") for n in names())


def layout_note(pivot: dict, tensors_a: pl.DataFrame | None, tensors_b: pl.DataFrame | None) -> list[str]:
    """Where the pivot's tensors have the same shape in both runs but other strides (channels_last in one,
    helper 60's composer ChannelsLast: "its inputs matched, its computation differs", nothing said of the
    layout): digests read a tensor's values in order, whatever its layout, so they match, while kernels for
    another layout sum in another order."""
    if tensors_a is None or tensors_b is None or pivot.get("b_seq") is None or "strides" not in tensors_a.columns \
            or "strides" not in tensors_b.columns:
        return []
    a = tensors_a.filter(pl.col("seq") == pivot["seq"]).select("role", "idx", "path", "shape", "strides")
    b = tensors_b.filter(pl.col("seq") == pivot["b_seq"]).select("role", "idx", "shape", "strides")
    both = a.join(b, on=["role", "idx"], suffix="_b")
    other = [r for r in both.iter_rows(named=True) if r["shape"] is not None and r["shape"] == r["shape_b"]
             and r["strides"] and r["strides_b"] and r["strides"] != r["strides_b"]]
    if not other:
        return []

    def last(shape, strides) -> bool:  # (a 4-d tensor whose channels are adjacent in memory)
        return len(shape) == 4 and shape[1] > 1 and strides[1] == 1

    shown = "; ".join(f"{r['role']}{r['path']}: strides {list(r['strides'])} in A, {list(r['strides_b'])} in B"
                      + (" (channels_last in B)" if last(r["shape"], r["strides_b"]) and not last(r["shape"], r["strides"])
                         else " (channels_last in A)" if last(r["shape"], r["strides"]) else "")
                      for r in other[:2])
    return [f"the memory layout of {len(other)} of its tensors differs between the runs ({shown}): their digests "
            f"read the values in order, whatever the layout, but a kernel for another layout (channels_last, a "
            f"transposed view) sums in another order and rounds differently"]


def recompute_note(pivot: dict, events_a: pl.DataFrame) -> list[str]:
    """A backward blamed as a source (a module's, or a parameter's gradient) in a step where activation
    checkpointing recomputed a call beside or around it before it: the backward read the recomputed
    activations, so a recompute that computed otherwise than the forward (code reading a flag or a state
    changed between the two, an RNG state not preserved) shows first here, as if the backward computed
    differently; and torch's non-reentrant checkpoint stops its recompute once it holds what backward
    needs, so the call that differs may have no recompute event to show it (helper 64)."""
    if pivot["phase"] != "backward" or pivot["kind"] not in ("module", "grad"):
        return []
    module = pivot["boundary"].rpartition(".")[0] if pivot["kind"] == "grad" else pivot["boundary"]
    recomputed = events_a.filter((pl.col("step") == pivot["step"]) & (pl.col("seq") < pivot["seq"])
                                 & (pl.col("phase") == "recompute"))["boundary"].unique(maintain_order=True)
    near = [r for r in recomputed.to_list() if module == r or module.startswith(f"{r}.")
            or ("." in r and module.startswith(r.rpartition(".")[0] + "."))]
    if not near:
        return []
    return [f"activation checkpointing recomputed {near[0]} in this step's backward before this: the backward read "
            f"the recomputed activations, so a recompute that computed otherwise than the forward (code that reads a "
            f"flag or a state changed between the two, an RNG state not preserved) shows first here, as if the "
            f"backward computed differently; a non-reentrant checkpoint stops recomputing once it has what the "
            f"backward needs, so the call that differs may have no recompute event"]


def weights_later_note(pivot: dict, events_a: pl.DataFrame, diffs: pl.DataFrame) -> list[str]:
    """A pivot of the RNG state a call began from (fault_class rng), followed in its step by a model's parameters
    that differ as its first call meets them (a `params` event): code that made or changed those weights before
    the step, an initialisation, drew from the same generator, and is the likelier cause (helper 88: a reinit of
    one weight before a standalone augmentation was said to be an extra draw, the weights never named)."""
    found = differing_later(pivot, events_a, diffs)
    if found is None:
        return []
    first = found[0]
    return [f"the parameters of {first['boundary']} differ too, as its first call later in this step meets them (its "
            f"params event): code that made or changed those weights before, an initialisation, draws from the same "
            f"generator and would explain the different draws here"]
