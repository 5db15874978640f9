"""The replicas check: data-parallel replicas hold the same weights.

Under DistributedDataParallel every rank holds the whole model, starts from the weights DDP
broadcast, and applies the same averaged gradients: every rank's parameters are bitwise alike at
the start of every step. A replica whose weights drifted (a flipped bit in its optimizer state, a
bad device's update, an edit on one rank) trains on silently, and the collective check
(crossrank.py) never sees it: the gradients it all-reduces agree on every rank. Each step's
`params` event (a root module's parameters as its first call of the step meets them, recorded
since schema version 6) is compared here across the ranks that ran DDP's bucketed all-reduce
together (their group named by the bucket's boundary, `comm.ddp_bucket0#0-3`), parameter by
parameter, for the parameters each rank holds whole (a shard is its rank's own part).

A rank that disagrees is named when a strict majority of the group agrees without it. With no
majority (two ranks), the ranks whose parameters differ from what their own last optimizer step
left them are named (changed after step() on that rank alone); when that does not tell them apart
(the step itself computed differently), every rank of the tie is named and the finding says which
cannot be told.
Each rank is reported at the first step where it disagrees (the drift stays in every later step).
This module reads ingest's frames; it knows nothing of how they were recorded.
"""

from __future__ import annotations

from collections import defaultdict

import polars as pl

from bitguard.backend.check import Against, DigestPair, Finding, LoadedRun, Outcome, TensorDiff, hexdigest, register
from bitguard.backend.collectives import function_of, group_of

_DDP_BUCKET = (pl.col("phase") == "comm") & pl.col("boundary").cast(pl.String).str.starts_with("comm.ddp_bucket")
# a rank's params and optimizer step events only when it ran DDP buckets (a pool worker sends back
# what the checks read: nothing more for a rank without them)
_READS = (pl.col("kind").is_in(["params", "step"]) & _DDP_BUCKET.any()) | _DDP_BUCKET


def _groups(run: LoadedRun) -> list[tuple[int, ...]]:
    """The groups of ranks that ran DDP buckets together, as the buckets' boundaries name them."""
    found = set()
    for rank in run.ranks:
        comm = run.events(rank).filter(pl.col("phase") == "comm").select("boundary").unique()
        for boundary in comm["boundary"].to_list():
            if (function_of(boundary) or "").startswith("ddp_bucket") and group_of(boundary):
                found.add(tuple(group_of(boundary)))
    return sorted(found)


def _states(run: LoadedRun, rank: int) -> dict[tuple, tuple[dict, dict]]:
    """(step, root, call) -> (the params event, {path: row}) of the rank's whole, observed parameters."""
    events = run.events(rank).filter(pl.col("kind") == "params")
    if events.is_empty():
        return {}
    rows = run.tensors(rank).filter(pl.col("seq").is_in(events["seq"].implode()) & (pl.col("role") == "param")
                                    & pl.col("shard").is_null() & pl.col("unobserved").is_null())
    by_seq = defaultdict(dict)
    for r in rows.select("seq", "idx", "path", "shape", "dtype", "xor", "pos").iter_rows(named=True):
        by_seq[r["seq"]][r["path"]] = r
    return {(e["step"], e["boundary"], e["call"]): (e, by_seq.get(e["seq"], {}))
            for e in events.select("seq", "step", "boundary", "module_type", "call").iter_rows(named=True)}


def _after_steps(run: LoadedRun, rank: int) -> dict[str, list[tuple[int, tuple]]]:
    """Parameter name -> [(seq, its digest after that optimizer step)], in order: what each step left."""
    steps = run.events(rank).filter(pl.col("kind") == "step")
    if steps.is_empty():
        return {}
    rows = run.tensors(rank).filter(pl.col("seq").is_in(steps["seq"].implode()) & (pl.col("role") == "param")
                                    & pl.col("shard").is_null() & pl.col("unobserved").is_null())
    names = dict(steps.select("seq", "boundary").iter_rows())
    out = defaultdict(list)
    for seq, xor, pos in rows.sort("seq").select("seq", "xor", "pos").iter_rows():
        out[names[seq]].append((seq, (xor, pos)))
    return out


def _moved(state: tuple, after: dict) -> bool:
    """Whether a parameter of this params event differs from what this rank's last optimizer step
    before it left: changed on this rank after its step() (an edit, a flipped bit)."""
    event, rows = state
    for path, r in rows.items():
        left = [d for seq, d in after.get(path.lstrip("."), ()) if seq < event["seq"]]
        if left and left[-1] != (r["xor"], r["pos"]):
            return True
    return False


def _diffs(expected: dict, got: dict) -> list[TensorDiff]:
    out = []
    for path in sorted(set(expected) | set(got)):
        e, g = expected.get(path), got.get(path)
        if e is not None and g is not None and (e["xor"], e["pos"]) == (g["xor"], g["pos"]):
            continue
        r = g or e
        out.append(TensorDiff(role="param", index=r["idx"], path=path, shape=list(r["shape"] or []), dtype=r["dtype"],
                              expected=DigestPair(xor=hexdigest(e["xor"]) if e else None,
                                                  pos=hexdigest(e["pos"]) if e else None),
                              got=DigestPair(xor=hexdigest(g["xor"]) if g else None,
                                             pos=hexdigest(g["pos"]) if g else None)))
    return out


def _finding(rank: int, key: tuple, got: tuple, expected_rank: int, expected: tuple, detail: str) -> Finding:
    event, rows = got
    return Finding(check="replicas", rank=rank, step=key[0], phase="optimizer", kind="params", boundary=key[1],
                   module_type=event["module_type"], call=key[2], seq=event["seq"],
                   against=Against(rank=expected_rank, seq=expected[0]["seq"], phase="optimizer", call=key[2]),
                   blame="source", differing_roles=["param"], tensors=_diffs(expected[1], rows), detail=detail)


def _digest(rows: dict) -> tuple:
    return tuple(sorted((p, r["xor"], r["pos"]) for p, r in rows.items()))


def _odd_ones(seen: list, key: tuple, after: dict) -> list[tuple]:
    """(rank, state, the rank and state it must agree with, why) of each replica that disagrees at
    `key`: the few against a strict majority; in a tie, the ranks whose weights are not what their
    own last step left them; else every rank of the tie."""
    classes = defaultdict(list)
    for r, state in seen:
        classes[_digest(state[1])].append((r, state))
    if len(classes) == 1:
        return []
    ranked = sorted(classes.values(), key=len, reverse=True)
    where = f"at the start of step {key[0]} ({key[1]}, call {key[2]})"
    if len(ranked[0]) > len(ranked[1]):
        agree_rank, agree = ranked[0][0]
        agreeing = ", ".join(str(x) for x, _ in ranked[0])
        return [(r, state, agree_rank, agree,
                 f"rank {r}'s parameters {where} differ from those of rank(s) {agreeing}, which agree: DDP replicas "
                 f"hold the same weights, so this replica's drifted (an update or an edit on this rank alone)")
                for r, state in (m for cls in ranked[1:] for m in cls)]
    moved = {r for r, state in seen if _moved(state, after[r])}
    if 0 < len(moved) < len(seen):
        kept_rank, kept = next((r, st) for r, st in seen if r not in moved)
        return [(r, state, kept_rank, kept,
                 f"rank {r}'s parameters {where} differ from rank {kept_rank}'s and from what its own last "
                 f"optimizer step left them: changed on this rank alone after step() (an edit, a flipped bit), "
                 f"while rank {kept_rank}'s are as its step left them")
                for r, state in seen if r in moved]
    return [(r, state, *next((x, st) for x, st in seen if _digest(st[1]) != _digest(state[1])),
             f"the DDP replicas' parameters {where} disagree ({len(ranked)} different sets, no majority): one "
             f"replica's weights drifted, and which cannot be told from this run") for r, state in seen]


@register("replicas", reads=_READS)
def check_replicas(run: LoadedRun) -> Outcome:
    """Each step's parameters compared across the ranks of each DDP group."""
    groups = _groups(run)
    if not groups:
        note = ("one rank selected or recorded: nothing to compare across replicas" if len(run.ranks) < 2 else
                "no DDP bucket was recorded: no ranks are known to be replicas of one model")
        return Outcome(compared=0, notes=[note])
    states = {rank: _states(run, rank) for rank in run.ranks}
    after = {rank: _after_steps(run, rank) for rank in run.ranks}
    compared, findings, notes = 0, [], []
    for group in groups:
        members = [r for r in group if r in states]
        reported: set[int] = set()
        keys = sorted({k for r in members for k in states[r]})
        for key in keys:
            seen = [(r, states[r][key]) for r in members if key in states[r] and states[r][key][1]]
            if len(seen) < 2:
                continue
            compared += 1
            for r, state, other_rank, other, detail in _odd_ones(seen, key, after):
                if r not in reported:
                    reported.add(r)
                    findings.append(_finding(r, key, state, other_rank, other, detail))
        if not keys:
            notes.append(f"no params events on the ranks of DDP group {', '.join(map(str, group))} (recorded "
                         f"before schema version 6, or outside the recorded steps)")
    return Outcome(compared=compared, findings=findings, notes=notes)
