"""What a comparison's merge reads of each rank, taken from the rank's frames once: small enough
for a pool worker to send back instead of the frames (rank_pool.py).

compare.py's `Comparison` builds the `bitguard.compare/1` document from every rank's pivot,
blame, propagation, scope and regions (fields of `RankComparison`) and from this summary: the
rank's share of the alignment summary, its certification reasons, the body of the first
divergence it would give (all but the blame's fields, which `pivot.confirm_comm` may still change
in the parent, and the API differences, read from the runs), run A's collectives as
`confirm_comm` reads them, and the rows the in-run checks read (check.py `rows_read`). Nothing
else of a rank's frames is read to make the document; the explorer and the notebook read the
frames themselves (a pooled rank compares itself again in the parent on first access, compare.py).

This module knows what the merge needs from a rank; it knows nothing of how the rank was
compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from bitguard.backend import api_diff, certification, check, granularity, pivot_notes, retype
from bitguard.backend import pivot as pivot_mod

GAPS_LISTED = 50  # unallowed gaps before the pivot listed per rank (AlignmentSummary.gaps_before_pivot)


def hex16(v) -> str | None:
    return None if v is None else f"{int(v):016x}"


def unobserved(tensors: pl.DataFrame) -> pl.Expr:
    """A tensor's `unobserved` reason (older rank files have no such column: every tensor observed)."""
    return pl.col("unobserved") if "unobserved" in tensors.columns else pl.lit(None, dtype=pl.String)


@dataclass
class RankSummary:
    """One rank's part of the document, before the cross-rank merge."""

    alignment: dict  # the rank's counts of result.py `AlignmentSummary` (band aside), its gaps before the pivot
    reasons: list  # the rank's certification reasons (result.py `Reason`), in the document's order
    divergence: dict | None  # `FirstDivergence` fields of its pivot but the blame's and api_differences
    comm: pl.DataFrame  # run A's collectives (pivot.collective_rows)
    checks: dict  # "a" / "b" -> (events, tensors): the rows the in-run checks read (check.rows_read)
    accepted_computation: bool = False  # a rule accepted a difference in what the rank computed (`_accepted`)


def summarize(rc, run_a=None) -> RankSummary:
    """The summary of a compared rank (compare.py `RankComparison`, pivot found); `run_a` (ingest.RunInfo)
    for what only its API events say (the names of tied parameters)."""
    return RankSummary(
        alignment=_alignment(rc), reasons=rc.reasons + _reasons(rc), divergence=_divergence(rc, run_a),
        comm=pivot_mod.collective_rows(rc.events_a, rc.tensors_a, rc.pairs, rc.diffs),
        checks={"a": check.rows_read(rc.events_a, rc.tensors_a), "b": check.rows_read(rc.events_b, rc.tensors_b)},
        accepted_computation=_accepted(rc))


def _accepted(rc) -> bool:
    """Did a rule accept a difference in what the rank computed (a pair it made benign, or one that
    follows from one), not only in what the training saved (a `saved` event: helper 59, a checkpoint's
    row accepted let a metric read out of a tensor that differs go unsaid, and the comparison said
    identical)? compare.py's check of the values read then stands aside: what follows, differs by consent."""
    accepted = rc.pairs.filter(pl.col("status").is_in(["benign", "follows"]))["a_seq"]
    return bool(accepted.len()) and bool(rc.events_a.filter(pl.col("seq").is_in(accepted.implode())
                                                            & (pl.col("kind") != "saved")).height)


def _alignment(rc) -> dict:
    al = rc.alignment
    counted = rc.gaps.height > 0
    prefix, before = _prefix(rc)
    return {"events_a": rc.events_a.height, "events_b": rc.events_b.height, "matched": len(al.a_idx),
            "reordered": int(al.reordered.sum()), "gaps_a": len(al.gaps_a), "gaps_b": len(al.gaps_b),
            "allowed_gaps": int(rc.gaps["allowed"].sum()) if counted else 0,
            "max_window": int(al.max_window), "anchors": int(al.anchors),
            "unobserved": rc.pairs.filter(pl.col("status") == "unobserved").height,
            "follows_accepted": rc.pairs.filter(pl.col("status") == "follows").height,
            "not_compared": rc.gaps.filter(~pl.col("allowed") & ~pl.col("counted")).height if counted else 0,
            "identical_prefix": prefix, "gaps_before_pivot": before}


def _prefix(rc) -> tuple[int, list[dict]]:
    """Paired events before the rank's pivot, and the events on one side only there that no rule
    allows (outside the certified scope: a counted one would be the pivot itself)."""
    at = float("inf") if rc.pivot is None else rc.pivot["order"]
    prefix = rc.pairs.filter(pl.col("a_pos") < at).height
    before = rc.gaps.filter(~pl.col("allowed") & (pl.col("order") < at)) if rc.gaps.height else rc.gaps
    out = []
    for g in before.head(GAPS_LISTED).iter_rows(named=True):
        ev = (rc.events_a if g["side"] == "a" else rc.events_b).row(g["pos"], named=True)
        out.append({"rank": rc.rank, "side": g["side"], "seq": g["seq"], "step": ev["step"], "phase": ev["phase"],
                    "kind": ev["kind"], "boundary": ev["boundary"], "module_type": ev["module_type"]})
    return prefix, out


def _reasons(rc) -> list[dict]:
    """The reasons the rank's statuses give: unobserved tensors, divergences that follow from accepted ones."""
    out = []
    unobserved_pairs = rc.pairs.filter(pl.col("status") == "unobserved")
    if unobserved_pairs.height:
        first = rc.events_a.row(int(unobserved_pairs["a_pos"][0]), named=True)
        why = rc.diffs.filter((pl.col("a_seq") == first["seq"]) & pl.col("unknown")).select(
            pl.coalesce("unobserved", "unobserved_b")).to_series().drop_nulls()
        out.append(certification.reason("unobserved", rank=rc.rank, message=
                   f"{unobserved_pairs.height} paired event(s) on rank {rc.rank} hold a tensor that could not be "
                   f"observed, first the {pivot_mod.phase_words(first['phase'], first['kind'])} of {first['boundary']} at step "
                   f"{first['step']}"
                   + (f" ({why[0]})" if why.len() else "")))
    retyped = rc.pairs.filter(pl.col("retyped"))
    if retyped.height and "key" in rc.events_a.columns and "key" in rc.events_b.columns:
        # (a pair the loose pass made whose full keys are equal is no change of type: events paired out of the
        # order around them, after the runs parted; helper 57 read "with tensors of another dtype" there)
        same = rc.events_a["key"].gather(retyped["a_pos"]) == rc.events_b["key"].gather(retyped["b_pos"])
        retyped = retyped.filter(~same)
    if retyped.height:  # informational: compared by their tensors, the numbers decide
        a = rc.events_a.row(int(retyped["a_pos"][0]), named=True)
        b = rc.events_b.row(int(retyped["b_pos"][0]), named=True)
        if a["module_type"] != b["module_type"]:
            what = f"{a['module_type']} in A, {b['module_type']} in B"
        elif retyped["resigned"][0]:  # (paired by place: the same module, other tensors: helper 33's GAN)
            what = f"{a['module_type']} in both, with tensors that differ in number, shape or path"
        else:
            what = f"{a['module_type']} in both, with tensors of another dtype"
        out.append(certification.reason("retyped", rank=rc.rank, message=
                   f"{retyped.height} event(s) on rank {rc.rank} were paired across a change of module type, dtype "
                   f"or tensors and compared by their tensors, first the {pivot_mod.phase_words(a['phase'], a['kind'])} "
                   f"of {a['boundary']} at step {a['step']} ({what})"))
    follows = rc.pairs.filter(pl.col("status") == "follows")
    if follows.height:
        rules = sorted(set(follows["rule_id"].drop_nulls().to_list()))
        out.append(certification.reason("follows_accepted", rank=rc.rank, message=
                   f"{follows.height} divergent event(s) on rank {rc.rank} follow from differences accepted "
                   f"by rule(s) {', '.join(rules)}: events downstream of an accepted difference cannot "
                   f"be certified"))
    return out


def _divergence(rc, run_a=None) -> dict | None:
    p = rc.pivot
    if p is None:
        return None
    structure = p["cause"] == "structure"
    stacks = rc.stacks_b if p["side"] == "b" else rc.stacks_a
    if structure:
        seq = p["seq"] if p["side"] == "a" else p["b_seq"]
        twin = p.get("twin_seq")
        tensors = _one_side_tensors(rc, p["side"], seq) if twin is None else \
            _twin_tensors(rc, *((seq, twin) if p["side"] == "a" else (twin, seq)))
        module_type_b = p["module_type"] if p["side"] == "b" else None
    else:
        tensors = _tensor_pairs(rc, p["seq"])
        event_b = rc.events_b.row(p["b_pos"], named=True)
        module_type_b = event_b["module_type"]
    stack = stacks.get(p["stack_id"], [])
    stack_b = None if structure else rc.stacks_b.get(event_b["stack_id"], [])
    stack_b = stack_b if stack_b and stack and stack_b != stack else None  # (only where it says more)
    notes = [] if stack_b is None else _extra_call_note(rc, p, event_b, stack, stack_b)
    if stack_b is not None and not notes and p.get("retyped") and stack[-1] != stack_b[-1]:
        # (helper 91: TD3's policy_delay 2 -> 1, the rollout's predict in A paired with the actor update's call in B)
        notes.append(f"the two calls paired here are made from different places ({stack[-1]} in A, {stack_b[-1]} in "
                     f"B) and have other tensors: the runs likely call {p['boundary']} in another order, or one makes "
                     f"a call the other does not, and the pairing by position is off; see both stacks and the training "
                     f"API calls that differ")
    if p["side"] is None or p["side"] == "a":
        earlier = rc.pairs.filter((pl.col("status") == "unobserved") & (pl.col("a_pos") < p["order"]))
        if earlier.height:
            alone = " or that one run alone records" if earlier["resigned"].any() else ""  # retype.py
            notes.append(f"{earlier.height} event(s) before this one hold tensors that could not be observed"
                         f"{alone}: the runs may have parted earlier")
    # most events unpaired: often names that differ by a prefix (torch.compile's _orig_mod.)
    mostly_unpaired = 2 * rc.pairs.height < max(rc.events_a.height, rc.events_b.height)
    hint = certification.name_hint(rc.events_a["boundary"].to_list(), rc.events_b["boundary"].to_list()) \
        if structure and mostly_unpaired else None
    if hint:
        notes.append(hint)
    if structure and rc.pairs.height and (rc.pairs["status"] == "identical").all():
        # (helper 55: timm's checkpoint_seq calls a Sequential's blocks one by one, the container never)
        alone = rc.gaps.filter(pl.col("counted")).height  # (not a recompute, nor a gap a rule allows)
        notes.append(f"every event both runs record has equal digests ({rc.pairs.height} paired): the runs differ "
                     f"only in what one of them records and the other does not ({alone} event(s)), as where "
                     f"one calls a container and the other its parts one by one, or one run makes a call the other "
                     f"does not")
    notes += retype.note(rc.pairs, None if structure else p["seq"], rc.diffs)
    notes += [] if structure else pivot_notes.layout_note(p, rc.tensors_a, rc.tensors_b)
    notes += granularity.note(rc.regions, p)
    if not structure and rc.blame and rc.blame.get("fault_class") == "rng":
        notes += pivot_notes.weights_later_note(p, rc.events_a, rc.diffs)
    if not structure and rc.blame and rc.blame.get("blame") == "source":
        names = None if run_a is None else (lambda: api_diff.param_names(run_a, rc.rank, p["step"]))
        notes += pivot_notes.unstepped_note(p, rc.events_a) + pivot_notes.midstep_note(p, rc.events_a, rc.tensors_a, names) \
            + pivot_notes.recompute_note(p, rc.events_a)
        if rc.digest_cache:
            notes += pivot_notes.cached_input_note(p, rc.events_a, rc.tensors_a, rc.diffs) \
                + pivot_notes.returned_input_note(p, rc.events_a, rc.tensors_a)
    return {
        "cause": p["cause"], "missing_side": None if not structure else ("b" if p["side"] == "a" else "a"),
        "rank": rc.rank, "step": p["step"], "phase": p["phase"], "kind": p["kind"],
        "boundary": p["boundary"], "module_type": p["module_type"], "call": p["call"],
        "stack": stack, "stack_b": stack_b, "a_seq": p["seq"], "b_seq": p["b_seq"],
        # paired although the module type or a dtype differs (e.g. a norm swapped for a subclass)
        "retyped": p.get("retyped", False), "module_type_b": module_type_b,
        "tensors": tensors, "notes": notes,
    }


def _extra_call_note(rc, p: dict, event_b: dict, stack: list[str], stack_b: list[str]) -> list[str]:
    """Where the pivot's two calls were made from different places and one run makes a later call of
    the same boundary in the step from the other's place, that run made a call the other did not (a
    "sanity" forward, an evaluation): the calls after it are paired one off (helper 43). (Stacks that
    differ only because a script's lines moved match no call of the other run: no note then. Places are
    compared by the innermost frame: the same line reached from two callers is one place.)"""
    same = ((pl.col("step") == p["step"]) & (pl.col("phase") == p["phase"]) & (pl.col("kind") == p["kind"])
            & (pl.col("boundary") == p["boundary"]))

    if stack[-1] == stack_b[-1]:  # (the same line, called from different places further out)
        return []

    def calls_from(events, stacks, where: list[str], other_than: int) -> list[int]:
        """The calls made at the innermost line of `where` (a function called from two places is one)."""
        rows = events.filter(same & (pl.col("call") != other_than)).select("call", "stack_id")
        return [r["call"] for r in rows.iter_rows(named=True) if (stacks.get(r["stack_id"]) or [None])[-1] == where[-1]]

    for extra, other, calls, call, place, theirs in (
            ("B", "A", calls_from(rc.events_b, rc.stacks_b, stack, event_b["call"]), event_b["call"], stack_b, stack),
            ("A", "B", calls_from(rc.events_a, rc.stacks_a, stack_b, p["call"]), p["call"], stack, stack_b)):
        if calls:
            return [f"run {extra} calls {p['boundary']} from {place[-1]} (its call {call}), where run {other} calls it "
                    f"from {theirs[-1]}, and run {extra}'s call {calls[0]} is made from that place: run {extra} makes a "
                    f"call run {other} does not (an extra forward, an evaluation), and the calls after it are paired "
                    f"one off; see both stacks"]
    return []


def _tensor_pairs(rc, a_seq: int) -> list[dict]:
    rows = rc.diffs.filter(pl.col("a_seq") == a_seq).sort("role", "idx")
    shapes_b, paths_b = _shapes_b(rc, rows)
    return [{"role": r["role"], "index": r["idx"], "path": r["path"], "shape": r["shape"], "dtype": r["dtype"],
             "shape_b": _other_shape(shapes_b.get((r["role"], r.get("idx_b", r["idx"]))), r["shape"])
             if r["dtype_b"] is not None else None,  # (a tensor only A records has no shape in B)
             "path_b": _other_path(paths_b.get((r["role"], r.get("idx_b", r["idx"]))), r["path"])
             if r["dtype_b"] is not None else None,  # (helper 54: a parameter moved from Muon to AdamW)
             "dtype_b": r["dtype_b"], "a": {"xor": hex16(r["xor"]), "pos": hex16(r["pos"])},
             "b": {"xor": hex16(r["xor_b"]), "pos": hex16(r["pos_b"])},
             "differs": r["differs"], "ignored": r["ignored"], "rule_id": r["rule_id"],
             "unobserved": r["unobserved"] or r["unobserved_b"]}
            for r in rows.iter_rows(named=True)]


def _other_shape(b: list[int] | None, a) -> list[int] | None:
    return b if b is not None and b != list(a or []) else None


def _other_path(b: str | None, a: str | None) -> str | None:
    return b if b is not None and b != (a or "") else None


def _shapes_b(rc, rows: pl.DataFrame) -> tuple[dict[tuple[str, int], list[int]], dict[tuple[str, int], str]]:
    """(role, idx) -> shape, and -> path, of B's tensors of the pair's B event (a row's partner is B's
    `idx_b`: across a signature change, another place than its own; helper 51)."""
    b_seqs = rows["b_seq"].drop_nulls().unique().to_list() if "b_seq" in rows.columns else []
    if len(b_seqs) != 1:
        return {}, {}
    b = rc.tensors_b.filter(pl.col("seq") == b_seqs[0]).select("role", "idx", "shape", "path")
    return ({(r, i): list(s or []) for r, i, s, _ in b.iter_rows()},
            {(r, i): p or "" for r, i, _, p in b.iter_rows()})


def _twin_tensors(rc, a_seq: int, b_seq: int) -> list[dict]:
    """The tensors of a signature pivot (both runs record the event, with other tensors) beside
    those of its twin, paired by role and path: what both hold is compared, what one holds alone
    is said so (helper 13: a checkpoint with one more tensor listed every tensor as differing)."""
    theirs = {(t["role"], t["path"]): t for t in _one_side_tensors(rc, "b", b_seq)}
    out = []
    for t in _one_side_tensors(rc, "a", a_seq):
        b = theirs.pop((t["role"], t["path"]), None)
        if b is not None:
            t.update(b=b["b"], dtype_b=b["dtype_b"], shape_b=_other_shape(list(b["shape"] or []), t["shape"]),
                     unobserved=t["unobserved"] or b["unobserved"],
                     differs=(t["a"], t["dtype"], list(t["shape"] or [])) != (b["b"], b["dtype_b"], list(b["shape"] or [])))
        out.append(t)
    return out + list(theirs.values())


def _one_side_tensors(rc, side: str, seq: int) -> list[dict]:
    tensors = rc.tensors_a if side == "a" else rc.tensors_b
    rows = tensors.filter(pl.col("seq") == seq).sort("role", "idx")
    out = []
    for r, why in zip(rows.iter_rows(named=True), rows.select(unobserved(rows)).to_series().to_list()):
        digest = {"xor": hex16(r["xor"]), "pos": hex16(r["pos"])}
        none = {"xor": None, "pos": None}
        out.append({"role": r["role"], "index": r["idx"], "path": r["path"], "shape": r["shape"],
                    "dtype": r["dtype"] if side == "a" else None, "dtype_b": r["dtype"] if side == "b" else None,
                    "a": digest if side == "a" else none, "b": digest if side == "b" else none,
                    "differs": True, "ignored": False, "rule_id": None, "unobserved": why})
    return out
