"""Containers called child by child in one run: not a structural divergence when nothing is lost.

A container module (an `nn.Sequential`, a `ModuleList` of blocks run by a loop) may be called
whole in one run and bypassed in the other, whose code calls its children one by one: timm's
`checkpoint_seq` does so when gradient checkpointing is on (helper 76). The other run then lacks
the container's forward (and backward) events, though it computed the same thing.

A container's event on one side only is excused when what it records is what its own children
record in that run, and those children are compared with the other run:

- forward: its direct children (modules named `<container>.<name>`, called within its call on
  the same thread and step) are all paired with the other run's events (or excused here, one
  level down); its inputs are its first child's inputs, its outputs its last child's outputs, and
  its RNG state (where recorded) is that of the first child that records one; it holds no other
  tensor, and none of these is unobserved;
- backward: its forward was excused, and its gradients are the children's backward events' (the
  gradient of its output is its last child's, the gradient of its input its first child's).

A container that computed anything of its own (a residual, a scaling between children, a
different order) fails these tests and stays a divergence. Excused events are no longer counted;
an informational reason (`bypassed`) says how many and which. compare.py calls `one_sided`.
"""

from __future__ import annotations

from collections import defaultdict

import polars as pl

from bitguard.backend.certification import reason

MAX_CANDIDATES = 20_000  # one-sided forwards looked at a rank (beyond: counted, as before)
_FORWARD = ("input", "output", "rng")
_BACKWARD = ("grad_input", "grad_output")


def _rows(tensors: pl.DataFrame, seqs: set[int]) -> dict[int, dict[str, frozenset]]:
    """seq -> role -> the set of (idx, path, xor, pos) it holds; an unobserved tensor as None."""
    out: dict[int, dict[str, frozenset]] = defaultdict(dict)
    if not seqs:
        return out
    cols = [c for c in ("seq", "role", "idx", "path", "xor", "pos", "unobserved") if c in tensors.columns]
    sub = tensors.filter(pl.col("seq").is_in(list(seqs))).select(cols)
    grouped: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in sub.iter_rows(named=True):
        grouped[r["seq"]][r["role"]].append(
            None if r.get("unobserved") is not None else (r["idx"], r.get("path"), r["xor"], r.get("pos")))
    for seq, roles in grouped.items():
        out[seq] = {role: frozenset(v) if None not in v else None for role, v in roles.items()}
    return out


def _same(holder: dict, role: str, source: dict) -> bool:
    """Both hold the same tensors in `role` (or neither holds one), all observed."""
    if role not in holder and role not in source:  # (a backward's input that needs no gradient: none)
        return True
    mine = holder.get(role)
    return mine is not None and mine == source.get(role)


def _side(events: pl.DataFrame, tensors: pl.DataFrame, candidates: list[int], paired: set[int]) -> dict[int, str]:
    """Of `candidates` (one-sided events of one side), those excused: seq -> the container's name."""
    cols = ["seq", "step", "phase", "kind", "boundary", "call", "thread", "t_start_ns", "t_end_ns"]
    if not candidates or any(c not in events.columns for c in cols):
        return {}
    modules = events.filter((pl.col("kind") == "module") & pl.col("phase").is_in(["forward", "backward"])).select(cols)
    by_seq = {r["seq"]: r for r in modules.filter(pl.col("seq").is_in(candidates)).iter_rows(named=True)}
    fwd = [by_seq[s] for s in candidates if s in by_seq and by_seq[s]["phase"] == "forward"]
    if not fwd:
        return {}
    names = list({r["boundary"] for r in fwd})
    # (filtered in polars first: a comparison of a million events with a few one-sided ones walks those only)
    boundary = pl.col("boundary").cast(pl.String)
    parent = boundary.str.replace(r"\.[^.]*$", "")
    kids = modules.filter((pl.col("phase") == "forward") & boundary.str.contains(".", literal=True)
                          & parent.is_in(names)).with_columns(parent.alias("_parent"))
    children: dict[tuple, list[dict]] = defaultdict(list)  # (step, thread, container) -> its children's forwards
    for r in kids.iter_rows(named=True):
        children[(r["step"], r["thread"], r["_parent"])].append(r)
    plan = {}  # container seq -> its children's forwards, in call order
    for c in fwd:
        if c["t_start_ns"] is None or c["t_end_ns"] is None:
            continue
        inner = [k for k in children.get((c["step"], c["thread"], c["boundary"]), ())
                 if k["t_start_ns"] is not None and k["t_end_ns"] is not None
                 and c["t_start_ns"] <= k["t_start_ns"] and k["t_end_ns"] <= c["t_end_ns"]]
        if inner:
            inner.sort(key=lambda k: (k["t_start_ns"], k["seq"]))
            plan[c["seq"]] = inner
    if not plan:
        return {}
    wanted = set(plan) | {k["seq"] for inner in plan.values() for k in inner}
    rows = _rows(tensors, wanted)
    excused: dict[int, str] = {}
    # deeper containers first: a child that is itself a bypassed container counts as compared
    for seq in sorted(plan, key=lambda s: -by_seq[s]["boundary"].count(".")):
        inner, held = plan[seq], rows.get(seq, {})
        if any(k["seq"] not in paired and k["seq"] not in excused for k in inner):
            continue
        if set(held) - set(_FORWARD) or not _same(held, "input", rows.get(inner[0]["seq"], {})) \
                or not _same(held, "output", rows.get(inner[-1]["seq"], {})):
            continue
        if "rng" in held:
            first = next((rows[k["seq"]] for k in inner if "rng" in rows.get(k["seq"], {})), {})
            if not _same(held, "rng", first):
                continue
        excused[seq] = by_seq[seq]["boundary"]
    # the backward of an excused call, when its gradients are its first and last child's
    done = {(by_seq[s]["boundary"], by_seq[s]["step"], by_seq[s]["call"]): s for s in excused}
    grads = [by_seq[s] for s in candidates if s in by_seq and by_seq[s]["phase"] == "backward"
             and (by_seq[s]["boundary"], by_seq[s]["step"], by_seq[s]["call"]) in done]
    if grads:
        backward: dict[tuple, int] = {}  # (boundary, step, call) -> the children's backwards' seqs
        names_below = kids["boundary"].cast(pl.String).unique().implode()
        below = modules.filter((pl.col("phase") == "backward") & boundary.is_in(names_below))
        for r in below.iter_rows(named=True):
            backward.setdefault((r["boundary"], r["step"], r["call"]), r["seq"])
        pairs = {}
        for g in grads:
            inner = plan[done[(g["boundary"], g["step"], g["call"])]]
            first, last = (backward.get((k["boundary"], k["step"], k["call"])) for k in (inner[0], inner[-1]))
            if first is not None and last is not None:
                pairs[g["seq"]] = (first, last)
        rows = _rows(tensors, set(pairs) | {s for fl in pairs.values() for s in fl})
        for seq, (first, last) in pairs.items():
            held = rows.get(seq, {})
            if not set(held) - set(_BACKWARD) and _same(held, "grad_output", rows.get(last, {})) \
                    and _same(held, "grad_input", rows.get(first, {})) and first in paired and last in paired:
                excused[seq] = by_seq[seq]["boundary"]
    return excused


def one_sided(gaps: pl.DataFrame, ea: pl.DataFrame, eb: pl.DataFrame, ta: pl.DataFrame, tb: pl.DataFrame,
              pairs: pl.DataFrame, rank: int) -> tuple[pl.DataFrame, list[dict]]:
    """`gaps` with the container events excused (module docstring) no longer counted, and a `bypassed`
    reason per side that had any."""
    if not gaps.height or not pairs.height:
        return gaps, []
    reasons, off = [], pl.lit(False)
    for side, events, tensors, other in (("a", ea, ta, "b"), ("b", eb, tb, "a")):
        candidates = gaps.filter((pl.col("side") == side) & pl.col("counted"))["seq"].head(MAX_CANDIDATES).to_list()
        excused = _side(events, tensors, candidates, set(pairs[f"{side}_seq"].to_list()))
        if not excused:
            continue
        off = off | ((pl.col("side") == side) & pl.col("seq").is_in(list(excused)))
        names = sorted(set(excused.values()))
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        reasons.append(reason("bypassed", side=side, rank=rank, message=
                              f"run {side.upper()} called {shown} whole where run {other.upper()} called its children "
                              f"one by one ({len(excused)} event(s) on rank {rank}; timm's checkpoint_seq does so): "
                              f"each call's inputs, outputs and gradients are its first and last child's, which are "
                              f"compared, so these are not a divergence"))
    if not reasons:
        return gaps, []
    return gaps.with_columns((pl.col("counted") & ~off).alias("counted")), reasons
