"""The violations a run recorded while it trained (`bitguard record --check inv.json`): the
`violations` table of every rank, as the explorer's violations view and its API read them.

`read_violations(run)` gives `bitguard.violations/1`: every row (step, rank, invariant id,
template, message, evidence decoded from JSON) in step order, counts per invariant with the
first step, and notes on what the document cannot vouch for: a rank file written before the
table existed (not read), a run that was not recorded with --check (an empty table then means
nothing was checked, not that nothing was violated: the rank's `check` meta says which), an
incomplete or damaged run. Offline checking against a file is check.py's; this module only reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from bitguard.errors import CorruptRun

SCHEMA = "bitguard.violations/1"
MAX_EVIDENCE_BYTES = 1 << 20


def _evidence(text, path) -> dict:
    if text is None:
        return {}
    if len(text) > MAX_EVIDENCE_BYTES:
        raise CorruptRun(f"{path}: a violations.evidence value is {len(text):,} characters long; the rank file is "
                         f"damaged: re-record the run")
    try:
        value = json.loads(text)
    except ValueError:
        raise CorruptRun(f"{path}: a violations.evidence value is not JSON; the rank file is damaged: re-record "
                         f"the run") from None
    return value if isinstance(value, dict) else {"value": value}


def read_violations(run) -> dict:
    """The `bitguard.violations/1` document of run directory `run` (or an ingest.RunInfo)."""
    from bitguard import schema
    from bitguard.backend.ingest import RunInfo, open_run, rank_table

    info = run if isinstance(run, RunInfo) else open_run(Path(run))
    table = getattr(schema, "VIOLATIONS", None)
    rows, without, checked, unchecked = [], [], [], []
    for rank in sorted(info.ranks):
        frame = rank_table(info, rank, table) if table is not None else None
        if frame is None:
            without.append(rank)
            continue
        meta = info.rank_meta.get(rank, {})
        (checked if meta.get("check") else unchecked).append(rank)
        for r in frame.to_dicts():
            rows.append({"step": r["step"], "rank": r["rank"], "invariant_id": r["invariant_id"],
                         "template": r["template"], "message": r["message"],
                         "evidence": _evidence(r.get("evidence"), info.ranks[rank]), "t_ns": r.get("t_ns")})
    rows.sort(key=lambda r: (r["step"], -1 if r["rank"] is None else r["rank"], r["invariant_id"], r["t_ns"] or 0))
    counts: dict[str, dict] = {}
    for r in rows:
        c = counts.setdefault(r["invariant_id"], {"id": r["invariant_id"], "template": r["template"], "count": 0,
                                                  "first_step": r["step"], "ranks": set()})
        c["count"] += 1
        c["ranks"].add(r["rank"])
    notes = []
    if without:
        notes.append(f"rank(s) {', '.join(map(str, without))} hold no violations table (recorded before bitguard "
                     f"checked invariants while recording): not read")
    if unchecked and not rows:
        notes.append("the run does not say it was recorded with --check: no violation recorded does not mean none "
                     "happened (check it offline: bitguard invariants check RUN --invariants inv.json)")
    why = info.incomplete_reason()
    if why:
        notes.append(f"the recording did not finish ({why}): steps after the last recorded one were not checked")
    for rank, damage in sorted((info.damage or {}).items()):
        notes.append(f"rank {rank} is damaged ({damage.get('reason')}): its violations from there may be missing")
    return {"schema": SCHEMA, "run": info.name, "ranks": sorted(info.ranks), "checked_ranks": checked,
            "violations": rows,
            "by_invariant": [{**c, "ranks": sorted(x for x in c["ranks"] if x is not None)}
                             for c in sorted(counts.values(), key=lambda c: (c["first_step"], c["id"]))],
            "notes": notes}
