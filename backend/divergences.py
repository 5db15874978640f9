"""The divergences table of a computed comparison: every event that is not identical, grouped per
rank, step, phase, boundary, module type and status, filtered and paged on the server.

One row says "at step 7, rank 1, the backward of model.layers.3.weight differs (digest), 2 events";
`first_pos` (its earliest aligned position) and the side and sequence number of that event are
what the browser selects in the timeline. Benign and follows rows name the rules that accepted the
difference. The grouped table is built once per result (polars over the timelines' frames, no
per-row Python) and then only filtered and sliced, so a page stays cheap at a million events.

This module knows the timelines' frames (`timelines.RankTimeline.frame`) and the event statuses;
it knows nothing about HTTP (api_panels.py) nor how statuses are decided (the engine).
"""

from __future__ import annotations

import threading
import weakref

import polars as pl

from bitguard.backend.result import EVENT_STATUSES
from bitguard.errors import BadInput

SCHEMA = "bitguard.divergences/1"
# what each non-identical status means in the table's "cause" column
CAUSES = {"diverged": "digest", "only_a": "structure: only in A", "only_b": "structure: only in B",
          "benign": "accepted by a rule", "follows": "follows an accepted difference",
          "unobserved": "not observed on a side"}
KEYS = ["rank", "step", "phase", "boundary", "module_type", "status"]
MAX_LIMIT = 500

_tables: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def grouped(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """The non-identical events of `frames` (one per rank, in position order), one row per
    (rank, step, phase, boundary, module type, status), in rank then position order."""
    cols = ["rank", "pos", "status", "step", "phase", "boundary", "module_type", "a_seq", "b_seq", "rule_id"]
    parts = [f.lazy().select(cols).filter(pl.col("status") != "identical") for f in frames if f.height]
    if not parts:
        return pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "phase": pl.String, "boundary": pl.String,
                                    "module_type": pl.String, "status": pl.String, "count": pl.UInt32,
                                    "first_pos": pl.Int64, "a_seq": pl.Int64, "b_seq": pl.Int64,
                                    "rules": pl.List(pl.String)})
    # categorical keys group several times faster than strings; frames are in position order and
    # first() keeps it within a group. Rules are gathered apart: few rows carry one.
    cat = [pl.col(c).cast(pl.Categorical) for c in ("phase", "boundary", "module_type", "status")]
    events = pl.concat(parts, how="vertical_relaxed").with_columns(cat).collect()
    out = (events.lazy().group_by(KEYS)
           .agg(pl.len().alias("count"), pl.col("pos").first().cast(pl.Int64).alias("first_pos"),
                pl.col("a_seq").first().cast(pl.Int64), pl.col("b_seq").first().cast(pl.Int64)))
    rules = (events.lazy().filter(pl.col("rule_id").is_not_null()).group_by(KEYS)
             .agg(pl.col("rule_id").unique(maintain_order=True).alias("rules")))
    out = (out.join(rules, on=KEYS, how="left")
           .with_columns(pl.col("rules").fill_null(pl.lit([], dtype=pl.List(pl.String))),
                         *[pl.col(c).cast(pl.String) for c in ("phase", "boundary", "module_type", "status")],
                         pl.col("rank").cast(pl.Int64), pl.col("step").cast(pl.Int64))
           .sort(["rank", "first_pos"]))
    return out.collect()


def _facets(table: pl.DataFrame) -> dict:
    """What the filters can choose from, with how many events each value covers."""
    def counts(col: str) -> list[dict]:
        g = table.group_by(col).agg(pl.col("count").sum().alias("events")).sort(col, nulls_last=True)
        return [{"value": v, "events": int(n)} for v, n in g.iter_rows()]
    return {k: counts(k) for k in ("rank", "phase", "module_type", "status")}


def table_of(result) -> dict:
    """The grouped table of a `timelines.Result` and its facets, built once per result."""
    with _lock:
        cached = _tables.get(result)
    if cached is None:
        frames = [result.timeline(r).frame for r in result.ranks]
        t = grouped(frames)
        cached = {"table": t, "facets": _facets(t), "events": int(t["count"].sum()) if t.height else 0}
        with _lock:
            _tables[result] = cached
    return cached


def _statuses(status: str | None) -> list[str] | None:
    if not status:
        return None
    wanted = [s.strip() for s in status.split(",") if s.strip()]
    bad = [s for s in wanted if s not in EVENT_STATUSES or s == "identical"]
    if bad:
        raise BadInput(f"status {', '.join(bad)!s} is not a divergence status; use one or more of "
                       f"{', '.join(s for s in EVENT_STATUSES if s != 'identical')} (comma-separated)")
    return wanted


def _cause(status: str, rules: list[str]) -> str:
    """The row's cause in words, naming the rules that accepted or allowed it."""
    named = ", ".join(rules)
    if not rules:
        return CAUSES.get(status, status)
    if status == "benign":
        return f"accepted by rule {named}"
    if status == "follows":
        return f"follows the difference rule {named} accepted"
    if status in ("only_a", "only_b"):
        return f"{CAUSES[status]}, allowed by rule {named}"
    return f"{CAUSES.get(status, status)} (rule {named})"


def page(result, *, rank: int | None = None, phase: str | None = None, module_type: str | None = None,
         status: str | None = None, offset: int = 0, limit: int = 50) -> dict:
    """One page of the table under the filters (each None: any).

    The document: {"schema": "bitguard.divergences/1", "total" (rows under the filters),
    "events" (events those rows hold), "offset", "limit", "rows": [{rank, step, phase, boundary,
    module_type, status, cause, count, first_pos, a_seq, b_seq, side, seq, rules}], "facets":
    {rank|phase|module_type|status: [{value, events}]} of the whole table, "all_events"}. `side`
    and `seq` name the group's first event as `/events/{rank}/{side}/{seq}` reads it."""
    cached = table_of(result)
    t = cached["table"]
    conds = []
    if rank is not None:
        conds.append(pl.col("rank") == rank)
    if phase:
        conds.append(pl.col("phase") == phase)
    if module_type:
        conds.append(pl.col("module_type") == module_type)
    wanted = _statuses(status)
    if wanted:
        conds.append(pl.col("status").is_in(wanted))
    if conds:
        t = t.filter(pl.all_horizontal(conds))
    limit = max(1, min(int(limit), MAX_LIMIT))
    offset = max(0, min(int(offset), t.height))
    rows = t.slice(offset, limit).to_dicts()
    for r in rows:
        r["cause"] = _cause(r["status"], r["rules"])
        r["side"], r["seq"] = ("a", r["a_seq"]) if r["a_seq"] is not None else ("b", r["b_seq"])
    return {"schema": SCHEMA, "total": t.height, "events": int(t["count"].sum()) if t.height else 0,
            "offset": offset, "limit": limit, "rows": rows, "facets": cached["facets"],
            "all_events": cached["events"]}
