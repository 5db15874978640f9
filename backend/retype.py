"""Pairing across a type or signature change: a module renamed or re-signatured between library
versions (transformers' `LlamaSdpaAttention` became `LlamaAttention`, with other inputs and
outputs) is still compared, as `retyped`, instead of leaving two gaps.

Events are aligned in three passes, each over what the previous left unpaired on both sides
(the keys come from ingest.py):

1. `key`: step, phase, kind, boundary, module type and every tensor's role, shape and dtype.
2. `loose_key`: the same without module type and dtypes (a norm swapped for a subclass, autocast).
3. `place_key`: step, phase, kind, boundary and the shards held only: the same module position
   and role, whatever its type and tensors (a shard never pairs with another part). Two events pair here only when both sit at the same dotted path (the
   same place in the model), in the same phase, in the order the alignment keeps: different
   modules never pair, since their paths differ.

A pair of the third pass is `resigned` (its tensors differ in number, shape or path). Its tensors
pair by role and path, then by role, shape and dtype in order; a tensor that only one side
records is marked unobserved ("only run B records ..."), so it is neither equal nor different:
such a pair is never certified identical, and a tensor both sides record still shows a real
difference. A gradient a module's backward sends to an input, or one its output receives, in one
run alone is a difference, not a signature change: that run computes a gradient the other does not
(a detached input, a loss term dropped), and so is the RNG state a call began from in one run alone (it drew
random numbers in that run only), a tensor of the input batch one run alone gives the model (a hidden
state carried into the call in one run, reset to None in the other), an optimizer state one run alone
keeps at a step (Lookahead's slow weights made a step earlier), and a parameter one run's model alone has (its
params event: the models are built differently). What a save wrote (kind `saved`)
pairs by its full key only: a save of other tensors is a difference. This module knows nothing of
digests, rules or pivots.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl

from bitguard.backend.alignment import align

LOOSE_KEYS = ("loose_key", "place_key")  # the passes after the full key, loosest last
_APART = 1 << 30  # added to a B tensor's idx that has no partner in A: it joins nothing
ONLY_A = "only run A records this tensor: the module's signature changed between the runs"
ONLY_B = "only run B records this tensor: the module's signature changed between the runs"
# but a gradient a module's backward sends to an input in one run alone, or one its output receives in one
# run alone, is one that run computes and the other does not (an input detached, or made under no_grad; a
# loss term dropped): a difference (helpers 45, 46)
GRADIENTS = ("grad_input", "grad_output")
# and so is the RNG state a call started from in one run alone: the call drew random numbers in that run only (a
# dropout or a stochastic depth added, whose draw may change nothing of its output: helper 60, composer's
# StochasticDepth; the difference was said to be a signature change, and the pivot came a step later)
ALONE_DIFFERS = (*GRADIENTS, "rng")


def align_retyped(ea: pl.DataFrame, eb: pl.DataFrame, band: int):
    """(alignment, retyped, resigned): align by the full key, then pair what is left on both sides
    by each looser key in turn. `retyped[i]` is set for a pair made by a looser key, `resigned[i]`
    for one made by `place_key` whose tensors (roles and shapes) differ."""
    al = align(ea["key"].to_numpy().astype(np.uint64), eb["key"].to_numpy().astype(np.uint64), band=band)
    how = np.zeros(len(al.a_idx), dtype=np.int8)  # 0: full key, k: the k-th looser key
    for level, column in enumerate(LOOSE_KEYS, start=1):
        if not (len(al.gaps_a) and len(al.gaps_b)) or column not in ea.columns or column not in eb.columns:
            break
        loose_a = _unless_saved(ea, column, al.gaps_a, 1)
        loose_b = _unless_saved(eb, column, al.gaps_b, 2)
        extra = align(loose_a, loose_b, band=band)
        if not len(extra.a_idx):
            continue
        a_idx = np.concatenate([al.a_idx, al.gaps_a[extra.a_idx]])
        b_idx = np.concatenate([al.b_idx, al.gaps_b[extra.b_idx]])
        order = np.argsort(a_idx, kind="stable")
        al = replace(al, a_idx=a_idx[order], b_idx=b_idx[order],
                     reordered=np.concatenate([al.reordered, extra.reordered])[order],
                     gaps_a=np.delete(al.gaps_a, extra.a_idx), gaps_b=np.delete(al.gaps_b, extra.b_idx))
        how = np.concatenate([how, np.full(len(extra.a_idx), level, dtype=np.int8)])[order]
    resigned = how == len(LOOSE_KEYS)
    if resigned.any():  # by place: resigned unless the shapes agree after all (then only the type or a dtype changed)
        shapes_a = ea["loose_key"].to_numpy().astype(np.uint64)[al.a_idx]
        shapes_b = eb["loose_key"].to_numpy().astype(np.uint64)[al.b_idx]
        resigned &= shapes_a != shapes_b
    return al, how > 0, resigned


def _unless_saved(events: pl.DataFrame, column: str, rows: np.ndarray, side: int) -> np.ndarray:
    """The loose keys of `rows`, but for what a save wrote (kind `saved`) by place, given a value the other
    side's never equals: two saves of other tensors are a difference in what was saved (a structure
    divergence), not a signature change whose one-sided tensors are passed over as unobserved. Two saves of
    the same tensors in another container (a `dict` of a state_dict's tensors, an `OrderedDict`), or in
    other dtypes, pair by the loose key: their tensors are compared (helper 77: the wrong weights saved in
    a plain dict were "different tensors (roles, shapes or dtypes)", every digest said equal)."""
    keys = events[column].to_numpy().astype(np.uint64)[rows]
    if column == "place_key" and "kind" in events.columns:
        keys[events["kind"].to_numpy()[rows] == "saved"] = side
    return keys


def pair_tensors(pairs: pl.DataFrame, ta: pl.DataFrame, tb: pl.DataFrame, pair,
                 alone: pl.Series | None = None) -> pl.DataFrame:
    """`pair(pairs, ta, tb)` (compare.py's tensor join on role and idx), with the tensors of
    resigned pairs matched as the module docstring says first: B's matched tensors take their A
    partner's idx, and what one side alone records is a row marked unobserved, but in the events
    of A whose seqs are `alone` (the input batches and the optimizer steps) and the roles of ALONE_DIFFERS:
    a difference there (helper 71: a GRU's hidden state reset to None at a step was blamed on the GRU;
    helper 76: timm's Lookahead with k=2 against k=3 makes its slow weights a step earlier in one run, and
    that state, kept by one run alone, was passed over as a signature change: the pivot came a step late)."""
    if "resigned" not in pairs.columns or not pairs["resigned"].any():
        return pair(pairs, ta, tb)
    resigned = pairs.filter(pl.col("resigned")).select("a_seq", "b_seq")
    sides = {"a": ta.filter(pl.col("seq").is_in(resigned["a_seq"].implode())),
             "b": tb.filter(pl.col("seq").is_in(resigned["b_seq"].implode()))}
    by_seq = {side: {key[0]: frame for key, frame in sides[side].partition_by("seq", as_dict=True).items()}
              for side in sides}
    remap, only_b = [], []  # (b_seq, role, old idx, new idx); (a_seq, role, new idx, B row)
    cache: dict[tuple, tuple] = {}
    empty = sides["a"].clear()
    for a_seq, b_seq in resigned.iter_rows():
        rows_a = _signature(by_seq["a"].get(a_seq, empty))
        rows_b = _signature(by_seq["b"].get(b_seq, empty))
        sig = (tuple(rows_a), tuple(rows_b))
        if sig not in cache:
            cache[sig] = _match(rows_a, rows_b)
        matched, lone_b = cache[sig]
        remap += [(b_seq, role, idx_b, idx_a) for role, idx_b, idx_a in matched]
        for role, idx_b, shown in lone_b:
            remap.append((b_seq, role, idx_b, _APART + idx_b))
            only_b.append((a_seq, b_seq, role, idx_b, shown))
    moves = pl.DataFrame(remap, schema={"seq": pl.Int64, "role": pl.Categorical, "idx": pl.Int32, "_to": pl.Int32},
                         orient="row")
    tb = tb.join(moves, on=["seq", "role", "idx"], how="left").with_columns(
        pl.coalesce("_to", "idx").alias("idx")).drop("_to")
    d = pair(pairs, ta, tb).join(  # idx_b: where B holds the tensor (its dumped bytes, equivalence.py)
        moves.select(pl.col("seq").alias("b_seq"), "role", pl.col("_to").alias("idx"), pl.col("idx").alias("idx_b")),
        on=["b_seq", "role", "idx"], how="left").with_columns(pl.coalesce("idx_b", "idx").alias("idx_b"))
    in_resigned = pl.col("a_seq").is_in(resigned["a_seq"].implode())
    alone_differs = pl.col("role").is_in(ALONE_DIFFERS)
    if alone is not None:
        alone_differs = alone_differs | pl.col("a_seq").is_in(alone.implode())
    d = d.with_columns(pl.when(in_resigned & pl.col("xor_b").is_null() & pl.col("pos_b").is_null()
                               & pl.col("unobserved_b").is_null() & ~alone_differs)
                       .then(pl.lit(ONLY_A)).otherwise(pl.col("unobserved_b")).alias("unobserved_b"))
    d = pl.concat([d, _b_rows(only_b, tb, d, alone_differs)], how="diagonal_relaxed") if only_b else d
    return d.with_columns((pl.col("unobserved").is_not_null() | pl.col("unobserved_b").is_not_null()).alias("unknown"))


def _signature(frame: pl.DataFrame) -> list[tuple]:
    """(role, idx, path, shape, dtype) of an event's tensors, in idx order."""
    cols = frame.select("role", "idx", "path", "shape", "dtype").sort("role", "idx")
    return [(r, i, p, tuple(s) if s is not None else None, d) for r, i, p, s, d in cols.iter_rows()]


def _match(rows_a: list[tuple], rows_b: list[tuple]) -> tuple[list, list]:
    """Which B tensor is which A tensor: same role and path (the n-th such with the n-th), then
    same role, shape and dtype in order. Returns ((role, idx_b, idx_a) matched, (role, idx_b,
    idx to show) for B's tensors without a partner, numbered after A's of that role)."""
    free_a = list(rows_a)
    matched, rest_b = [], []
    for row in rows_b:
        partner = next((a for a in free_a if a[0] == row[0] and a[2] == row[2]), None)
        if partner is None:
            rest_b.append(row)
            continue
        free_a.remove(partner)
        matched.append((row[0], row[1], partner[1]))
    lone_b = []
    for row in rest_b:
        partner = next((a for a in free_a if a[0] == row[0] and a[3] == row[3] and a[4] == row[4]), None)
        if partner is None:
            lone_b.append(row)
            continue
        free_a.remove(partner)
        matched.append((row[0], row[1], partner[1]))
    top = {}
    for role, idx, *_ in rows_a:
        top[role] = max(top.get(role, -1), idx)
    shown = []
    for role, idx, *_ in lone_b:
        top[role] = top.get(role, -1) + 1
        shown.append((role, idx, top[role]))
    return matched, shown


def _b_rows(only_b: list[tuple], tb: pl.DataFrame, like: pl.DataFrame, alone_differs: pl.Expr) -> pl.DataFrame:
    """Rows in the shape of the paired tensors for B's tensors that A does not record (`alone_differs`:
    those that differ by being there, the others unobserved)."""
    keys = pl.DataFrame(only_b, schema={"a_seq": pl.Int64, "b_seq": pl.Int64, "role": pl.Categorical,
                                        "_b_idx": pl.Int32, "_shown": pl.Int32}, orient="row")
    b = tb.with_columns((pl.col("idx") - _APART).alias("_b_idx")).join(
        keys, left_on=["seq", "role", "_b_idx"], right_on=["b_seq", "role", "_b_idx"])
    rows = b.select(
        "a_seq", pl.col("seq").alias("b_seq"), "role", pl.col("_shown").alias("idx"),
        pl.col("_b_idx").alias("idx_b"), "path", "shape",
        pl.lit(None, dtype=pl.String).alias("dtype"), pl.col("dtype").alias("dtype_b"),
        pl.col("xor").alias("xor_b"), pl.col("pos").alias("pos_b"),
        pl.when(alone_differs).then(None).otherwise(pl.lit(ONLY_B)).alias("unobserved"),
        pl.lit(None, dtype=pl.String).alias("unobserved_b"),
        pl.lit(True).alias("xor_differs"), pl.lit(True).alias("pos_differs"), pl.lit(True).alias("differs"))
    return rows.select([c for c in rows.columns if c in like.columns])


def note(pairs: pl.DataFrame, a_seq: int | None, diffs: pl.DataFrame) -> list[str]:
    """The pivot's note when its pair was made by position across a signature change."""
    if a_seq is None or "resigned" not in pairs.columns:
        return []
    row = pairs.filter(pl.col("a_seq") == a_seq)
    if not row.height or not row["resigned"][0]:
        return []
    mine = diffs.filter(pl.col("a_seq") == a_seq)
    only_a = mine.filter(pl.col("unobserved_b") == ONLY_A).height
    only_b = mine.filter(pl.col("unobserved") == ONLY_B).height
    alone = [(role, side, mine.filter((pl.col("role") == role) & pl.col(digest).is_null() & pl.col(why).is_null()).height)
             for role in (*ALONE_DIFFERS, "input", "state", "param")
             for side, digest, why in (("A", "xor_b", "unobserved_b"), ("B", "xor", "unobserved"))]
    out = [f"paired by position across a signature change (same module path and phase, other tensors): "
           f"{only_a} tensor(s) only in A, {only_b} only in B, the others paired by path, shape and dtype"] \
        if only_a or only_b or not any(n for *_, n in alone) else []
    for role, side, n in alone:
        other = "B" if side == "A" else "A"
        if n and role == "grad_input":
            out.append(f"run {side} alone sends a gradient back to {n} input(s) of this module: in run {other} that "
                       f"input does not require one (detached, made under no_grad, or its requires_grad changed), or "
                       f"this module's forward cut it off there (a .detach() or no_grad inside it)")
        elif n and role == "input":  # (an input batch's: pair_tensors `alone`)
            out.append(f"run {side} alone gives the model {n} input(s) of this batch: in run {other} the call does not "
                       f"take it (an argument left out or passed as None: a hidden state reset, a mask dropped)")
        elif n and role == "state":  # (an optimizer step's: pair_tensors `alone`)
            out.append(f"run {side} alone keeps {n} optimizer state tensor(s) for this parameter here: its optimizer "
                       f"made that state at this step in one run only (a setting that decides when, such as "
                       f"Lookahead's k, another optimizer, or state loaded in one run)")
        elif n and role == "param":  # (a params event's: pair_tensors `alone`)
            digest, why = ("xor_b", "unobserved_b") if side == "A" else ("xor", "unobserved")
            names = mine.filter((pl.col("role") == "param") & pl.col(digest).is_null() & pl.col(why).is_null())["path"]
            shown = ", ".join(str(p).lstrip(".") for p in names.head(4)) + (", ..." if n > 4 else "")
            out.append(f"run {side}'s model alone has {n} parameter(s) here ({shown}): the two models are built "
                       f"differently (a layer added or removed, another head or output distribution, a size or "
                       f"option of the model's constructor changed)")
        elif n and role != "rng":  # (a draw in one run alone: the blame says so, pivot.py `_drew_alone`)
            out.append(f"{n} output(s) of this module receive a gradient in run {side} alone: in run {other} nothing "
                       f"backpropagates into them (a loss term dropped, an output detached or left unused), or this "
                       f"module's forward made them without a gradient there (a .detach() or no_grad inside it)")
    return out
