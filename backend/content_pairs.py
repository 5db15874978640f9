"""Collectives paired by what they carry. A collective's event is named by its function and group
only (`comm.all_gather_into_tensor#0-1`, collectors/comm.py), so the alignment pairs the k-th such
call of a step in run A with the k-th in run B. A run that issues the same calls in another order
(FSDP's explicit prefetching gathers the next layers' weights before this layer's forward) would
then compare each gather with another layer's gather, and diverge where nothing computed
differently.

`by_content` re-pairs, among the events of one alignment key (step, phase, boundary, shapes and
dtypes), A's and B's collectives whose inputs and outputs digest alike, the n-th of a content with
the n-th; what no partner carries alike stays paired in the order of the runs, so a collective that
did move different bytes is still paired and found. A re-paired pair is marked reordered.

So are the optimizer steps of parameters that share a name within a step (two models whose parts
have the same paths, an encoder's and a decoder's `fc.bias`), by the gradient each step used: Pyro
steps each parameter's optimizer in the order of a set, which differs from process to process, and
the k-th `fc.bias` of run A was compared with the other model's `fc.bias` in run B (helper 78: two
recordings of one script diverged). A step is re-paired within its own step only.

A module's call is named by its place in the model, and its order is the model's: not re-paired.
This module knows nothing of rules, verdicts or pivots.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl

from bitguard.backend.alignment import Alignment

_CONTENT_ROLES = {"comm": ("input", "output"), "optimizer": ("grad",)}  # what an event carries, by phase


def _members(events: pl.DataFrame) -> np.ndarray:
    """Positions of the events re-paired by content: the collectives, and the optimizer steps whose
    parameter's name is another's in the same step."""
    if not events.height:
        return np.empty(0, np.int64)
    steps = (pl.col("phase") == "optimizer") & (pl.col("kind") == "step")
    twin = steps & pl.struct("step", "boundary").is_duplicated().over(steps)
    return np.flatnonzero(events.select((pl.col("phase") == "comm") | twin.fill_null(False)).to_series().to_numpy())


def _contents(events: pl.DataFrame, tensors: pl.DataFrame, positions: np.ndarray) -> list:
    """A hash of each event's input and output digests (an optimizer step's: the gradient it used;
    None when one of them was not observed), for the events at `positions`."""
    seqs = events["seq"].gather(positions)
    roles = events.select("seq", "phase").filter(pl.col("seq").is_in(seqs.implode()))
    carried = pl.col("role").is_in(_CONTENT_ROLES["comm"]) & pl.col("seq").is_in(
        roles.filter(pl.col("phase") == "comm")["seq"].implode())
    carried = carried | (pl.col("role").is_in(_CONTENT_ROLES["optimizer"]) & pl.col("seq").is_in(
        roles.filter(pl.col("phase") == "optimizer")["seq"].implode()))
    rows = tensors.filter(pl.col("seq").is_in(seqs.implode()) & carried)
    per_event = rows.group_by("seq", maintain_order=True).agg(
        pl.struct("role", "idx", "xor", "pos").hash().alias("h"), pl.col("unobserved").is_not_null().any().alias("u"))
    per_event = per_event.select("seq", pl.when(pl.col("u")).then(None).otherwise(pl.col("h").hash()).alias("c"))
    found = dict(zip(per_event["seq"].to_list(), per_event["c"].to_list()))
    return [found.get(s, 0) for s in seqs.to_list()]  # no input or output row: all such events carry alike


def by_content(al: Alignment, retyped: np.ndarray, resigned: np.ndarray, ea: pl.DataFrame, eb: pl.DataFrame,
               ta: pl.DataFrame, tb: pl.DataFrame) -> tuple[Alignment, np.ndarray, np.ndarray]:
    """(alignment, retyped, resigned) with each boundary's collectives re-paired by content, as the
    module docstring says; the arguments themselves when no boundary gains a pair alike."""
    comm_a, comm_b = _members(ea), _members(eb)
    if not len(comm_a) or not len(comm_b) or len(comm_a) + len(comm_b) < 3 or "place_key" not in ea.columns:
        return al, retyped, resigned
    partner = np.full(ea.height, -1, np.int64)
    partner[al.a_idx] = al.b_idx
    partner_b = np.full(eb.height, -1, np.int64)
    partner_b[al.b_idx] = al.a_idx
    # a boundary's members: its collectives, unpaired or paired with a collective of the same boundary
    side: dict[str, tuple[list, list]] = {}
    bound_a = dict(zip(comm_a.tolist(), ea["boundary"].gather(comm_a).to_list()))
    bound_b = dict(zip(comm_b.tolist(), eb["boundary"].gather(comm_b).to_list()))
    for a, boundary in bound_a.items():
        if partner[a] < 0 or bound_b.get(int(partner[a])) == boundary:
            side.setdefault(boundary, ([], []))[0].append(a)
    for b, boundary in bound_b.items():
        if partner_b[b] < 0 or bound_a.get(int(partner_b[b])) == boundary:
            side.setdefault(boundary, ([], []))[1].append(b)
    side = {k: g for k, g in side.items() if g[0] and g[1] and len(g[0]) + len(g[1]) > 2}
    if not side:
        return al, retyped, resigned
    run_a = _Side(ea, ta, comm_a)
    run_b = _Side(eb, tb, comm_b)
    flags_of = {a: (r, t, s) for a, r, t, s in zip(al.a_idx.tolist(), al.reordered.tolist(), retyped.tolist(),
                                                    resigned.tolist())}
    made: list[tuple[int, int, tuple]] = []  # (a, b, (reordered, retyped, resigned))
    dropped: set[int] = set()
    for members_a, members_b in side.values():
        alike = lambda a, b: run_a.content[a] is not None and run_a.content[a] == run_b.content[b]  # noqa: E731
        before = sum(1 for a in members_a if partner[a] >= 0 and alike(a, int(partner[a])))
        pairs = _repair(members_a, members_b, run_a, run_b, partner)
        if sum(1 for a, b in pairs if alike(a, b)) <= before:
            continue
        dropped.update(members_a)
        made += [(a, b, flags_of[a] if partner[a] == b else (True, False, False)) for a, b in pairs]
    if not made:
        return al, retyped, resigned
    keep = ~np.isin(al.a_idx, np.fromiter(dropped, np.int64))
    a_idx = np.concatenate([al.a_idx[keep], np.array([m[0] for m in made], np.int64)])
    b_idx = np.concatenate([al.b_idx[keep], np.array([m[1] for m in made], np.int64)])
    order = np.argsort(a_idx, kind="stable")
    flags = [np.concatenate([f[keep], np.array([m[2][i] for m in made], bool)])[order]
             for i, f in enumerate((al.reordered, retyped, resigned))]
    taken_a, taken_b = np.zeros(ea.height, bool), np.zeros(eb.height, bool)
    taken_a[a_idx], taken_b[b_idx] = True, True
    return (replace(al, a_idx=a_idx[order], b_idx=b_idx[order], reordered=flags[0],
                    gaps_a=np.flatnonzero(~taken_a).astype(np.int64), gaps_b=np.flatnonzero(~taken_b).astype(np.int64)),
            flags[1], flags[2])


class _Side:
    """One run's members: by position, their content, step, alignment key, place and the steps a
    partner may be away (a collective's prefetch: one; an optimizer step: none)."""

    def __init__(self, events: pl.DataFrame, tensors: pl.DataFrame, positions: np.ndarray):
        at = positions.tolist()
        self.content = dict(zip(at, _contents(events, tensors, positions)))
        self.step = dict(zip(at, events["step"].gather(positions).to_list()))
        self.slack = dict(zip(at, (int(p == "comm") for p in events["phase"].gather(positions).to_list())))
        self.key = dict(zip(at, events["key"].gather(positions).to_list()))
        self.place = dict(zip(at, events["place_key"].gather(positions).to_list()))


def _repair(members_a: list, members_b: list, run_a: _Side, run_b: _Side, partner: np.ndarray) -> list[tuple]:
    """Pairs of one boundary's collectives (each side in its run's order): the n-th of a content in
    A with the n-th of it in B within a step either way (a prefetch issued after the optimizer
    step is counted in the step before the forward it serves); then a pair the alignment made of
    two events both left; then what is left of a place (step and shards), the n-th of a key in A
    with the n-th of it in B."""
    waiting: dict = {}
    for b in members_b:
        if run_b.content[b] is not None:
            waiting.setdefault(run_b.content[b], []).append(b)
    pairs, left, used = [], [], set()
    for a in members_a:
        queue = waiting.get(run_a.content[a]) if run_a.content[a] is not None else None
        slack = run_a.slack[a]
        while queue and run_b.step[queue[0]] < run_a.step[a] - slack:
            queue.pop(0)  # too early for this A and for every later one
        if queue and run_b.step[queue[0]] <= run_a.step[a] + slack:
            b = queue.pop(0)
            pairs.append((a, b))
            used.add(b)
        else:
            left.append(a)
    rest = []
    for a in left:
        b = int(partner[a])
        if b >= 0 and b not in used:
            pairs.append((a, b))
            used.add(b)
        else:
            rest.append(a)
    by_key: dict[tuple, list] = {}
    for b in members_b:
        if b not in used:
            by_key.setdefault((run_b.place[b], run_b.key[b]), []).append(b)
    for a in rest:
        queue = by_key.get((run_a.place[a], run_a.key[a]))
        if queue:
            pairs.append((a, queue.pop(0)))
    return pairs
