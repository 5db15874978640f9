"""The cross-rank check: what a collective delivers to every rank of its group alike must be
bitwise alike on each of them.

An all-reduce, an all-gather and a broadcast hand each rank of the group the same bytes, and
DDP's reduced buckets (the gradients every replica then applies) are the same on every rank:
the `output` rows of such a `comm` event (collectors/comm.py) are compared across the ranks
that recorded it. The same collective is found on each rank by its step, its boundary (which
names the function and the group's ranks) and its issue order on the group (`@N` at the end of
its rows' paths). A reduce-scatter is not checked: each rank gets its own shard.

A rank that disagrees is named when a strict majority of the group agrees without it. With no
majority (two ranks, or as many on each side) the tie is broken only by what the run itself
shows: when the bytes a rank holds came from an earlier collective on the same buffer (a DDP
comm hook that all-reduces the bucket, then edits it) whose output every rank agreed on, the
ranks whose buffer changed since are named. Otherwise every rank of the tie is named and the
finding says it cannot tell which is wrong. Ranks not recorded or not selected, and outputs that
could not be observed, are not compared, and the outcome's notes say so.

This module reads ingest's frames (comm boundaries through backend/collectives.py); it knows
nothing of how they were recorded.
"""

from __future__ import annotations

from collections import defaultdict

import polars as pl

from bitguard.backend.check import Against, DigestPair, Finding, LoadedRun, Outcome, TensorDiff, hexdigest, register
from bitguard.backend.collectives import function_of, group_of, issue_of

REPLICATED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast")  # and every DDP bucket
_DDP_BUCKET = "ddp_bucket"


def _replicated(function: str) -> bool:
    return function in REPLICATED or function.startswith(_DDP_BUCKET)


class _Instance:
    """One rank's view of one collective: its event and its output rows."""

    __slots__ = ("rank", "seq", "call", "module_type", "outputs", "unobserved")

    def __init__(self, rank: int, event: dict, outputs: list[dict]):
        self.rank, self.seq, self.call, self.module_type = rank, event["seq"], event["call"], event["module_type"]
        self.outputs = sorted(outputs, key=lambda r: r["idx"])
        self.unobserved = any(r["unobserved"] is not None for r in self.outputs)

    @property
    def digest(self) -> tuple:
        return tuple((r["idx"], r["xor"], r["pos"]) for r in self.outputs)

    @property
    def buffer(self) -> tuple | None:
        """(storage, nbytes) of the one buffer its outputs are (parts of), None when not known."""
        storages = {r["storage"] for r in self.outputs}
        if len(storages) != 1 or not self.outputs[0]["storage"]:
            return None
        return self.outputs[0]["storage"], sum(r["nbytes"] for r in self.outputs)


def _instances(run: LoadedRun, rank: int) -> tuple[dict[tuple, _Instance], list[tuple[tuple, _Instance]]]:
    """This rank's collectives by (step, boundary, issue), and all of them in event order."""
    events = run.events(rank).filter(pl.col("phase") == "comm")
    if events.is_empty():
        return {}, []
    tensors = run.tensors(rank).filter(pl.col("seq").is_in(events["seq"].implode()) & (pl.col("role") == "output"))
    rows = defaultdict(list)
    for row in tensors.select("seq", "idx", "path", "shape", "dtype", "xor", "pos", "storage", "nbytes",
                              "unobserved").iter_rows(named=True):
        rows[row["seq"]].append(row)
    by_key, ordered = {}, []
    for event in events.sort("seq").select("seq", "step", "boundary", "module_type", "call").iter_rows(named=True):
        outputs = rows.get(event["seq"], [])
        issue = next((issue_of(r["path"]) for r in outputs if issue_of(r["path"]) is not None), None)
        key = (event["step"], event["boundary"], issue if issue is not None else f"call {event['call']}")
        inst = _Instance(rank, event, outputs)
        by_key.setdefault(key, inst)
        ordered.append((key, inst))
    return by_key, ordered


def _source(ordered: list[tuple[tuple, _Instance]], key: tuple) -> tuple[tuple, _Instance] | None:
    """The latest collective before `key`'s, in the same step, whose output is the same buffer."""
    at = next((i for i, (k, _) in enumerate(ordered) if k == key), None)
    if at is None or ordered[at][1].buffer is None:
        return None
    buffer = ordered[at][1].buffer
    for k, inst in reversed(ordered[:at]):
        if k[0] == key[0] and inst.buffer == buffer:
            return k, inst
    return None


def _tie_break(members: list[_Instance], ordered: dict[int, list]) -> list[int] | None:
    """The ranks whose buffer changed after an earlier collective that delivered it alike to all
    (None when the run does not show one)."""
    sources = {m.rank: _source(ordered[m.rank], _key_of(ordered[m.rank], m)) for m in members}
    if any(s is None for s in sources.values()) or len({s[0] for s in sources.values()}) != 1:
        return None
    if len({s[1].digest for s in sources.values()}) != 1 or any(s[1].unobserved for s in sources.values()):
        return None
    changed = [m.rank for m in members if m.digest != sources[m.rank][1].digest]
    return changed if 0 < len(changed) < len(members) else None


def _key_of(ordered: list, inst: _Instance) -> tuple:
    return next(k for k, i in ordered if i is inst)


def _diffs(expected: _Instance, got: _Instance) -> list[TensorDiff]:
    exp = {r["idx"]: r for r in expected.outputs}
    out = []
    for r in got.outputs:
        e = exp.get(r["idx"])
        if e is not None and (e["xor"], e["pos"]) == (r["xor"], r["pos"]):
            continue
        out.append(TensorDiff(role="output", index=r["idx"], path=r["path"], shape=list(r["shape"] or []),
                              dtype=r["dtype"],
                              expected=DigestPair(xor=hexdigest(e["xor"]) if e else None, pos=hexdigest(e["pos"]) if e else None),
                              got=DigestPair(xor=hexdigest(r["xor"]), pos=hexdigest(r["pos"]))))
    return out


def _finding(key: tuple, got: _Instance, expected: _Instance, detail: str) -> Finding:
    step, boundary, _ = key
    return Finding(check="crossrank", rank=got.rank, step=step, phase="comm", kind="collective", boundary=boundary,
                   module_type=got.module_type, call=got.call, seq=got.seq,
                   against=Against(rank=expected.rank, seq=expected.seq, phase="comm", call=expected.call),
                   blame="source", differing_roles=["output"], tensors=_diffs(expected, got), detail=detail)


def _ranks(ranks) -> str:
    return ", ".join(map(str, sorted(ranks)))


@register("crossrank", reads=pl.col("phase") == "comm")  # the events `_instances` reads
def check_crossrank(run: LoadedRun) -> Outcome:
    """Outputs that must agree on every rank of a collective's group, compared across the ranks."""
    views, ordered = {}, {}
    for rank in run.ranks:
        views[rank], ordered[rank] = _instances(run, rank)
    keys = sorted({k for v in views.values() for k in v if _replicated(function_of(k[1]) or "")},
                  key=lambda k: (k[0], k[1], k[2]))
    compared, findings = 0, []
    lone = unobserved = 0
    for key in keys:
        group = group_of(key[1]) or []
        members = [views[r][key] for r in group if r in views and key in views[r]]
        seen = [m for m in members if not m.unobserved]
        unobserved += len(members) - len(seen)
        if len(seen) < 2:
            lone += 1
            continue
        compared += 1
        classes = defaultdict(list)
        for m in seen:
            classes[m.digest].append(m)
        if len(classes) == 1:
            continue
        ranked = sorted(classes.values(), key=len, reverse=True)
        where = f"{function_of(key[1])} of group {_ranks(group)} at step {key[0]}"
        if len(ranked[0]) > len(ranked[1]):
            agree = ranked[0][0]
            for m in (m for cls in ranked[1:] for m in cls):
                findings.append(_finding(key, m, agree, f"the {where} delivered different bytes to rank {m.rank} "
                                         f"than to rank(s) {_ranks(x.rank for x in ranked[0])}, which agree"))
            continue
        changed = _tie_break(seen, ordered)
        if changed is not None:
            kept = next(m for m in seen if m.rank not in changed)
            for m in (m for m in seen if m.rank in changed):
                findings.append(_finding(key, m, kept, f"the {where} ends with different bytes on rank {m.rank} "
                                         f"than on rank {kept.rank}; the collective before it on the same buffer "
                                         f"delivered the same bytes to every rank, and rank {m.rank}'s changed "
                                         f"after it (e.g. in a DDP comm hook)"))
            continue
        for m in seen:
            other = next(x for x in seen if x.digest != m.digest)
            findings.append(_finding(key, m, other, f"the ranks of the {where} disagree ({len(ranked)} different "
                                     f"results, no majority): which rank is wrong cannot be told from this run"))
    notes = []
    if len(run.ranks) < 2:
        notes.append("one rank selected or recorded: nothing to compare across ranks")
    elif not keys:
        notes.append("no all-reduce, all-gather, broadcast or DDP bucket was recorded")
    if lone:
        notes.append(f"{lone} collective(s) had fewer than two ranks with observed outputs in the selection "
                     f"(ranks not recorded, not selected, or outside the recorded steps)")
    if unobserved:
        notes.append(f"{unobserved} collective output(s) could not be observed and were not compared")
    return Outcome(compared=compared, findings=findings, notes=notes)
