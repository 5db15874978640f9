"""The alerts of a run recorded in online mode: what `bitguard alerts`, the API and the explorer show.

`read_alerts(DIR)` opens a run directory as ingest does (manifest, meta, every rank file and
what a killed run left in its journal, read in memory, never folded) and reads two tables of
each rank: `alerts`, one row per state change of an alert (the latest row of an alert id is its
state: pending, confirmed, transient, cleared or warning), and `sensor_stats`, each sensor's totals per
step and its operators' rows (one may sum several steps: `steps`). The document it returns (`bitguard.alerts/1`) holds every alert once, in
its latest state with the row that raised it and the verifier's verdict, the counts by state, a
coverage summary per sensor (what it saw and checked, at what cost) and the verifier's figures
(queue length, latency in steps, seconds). For each confirmed alert it carries the advice of
afterwards.py: how to replay the suspect step offline and compare it bitwise.

A run recorded in another mode (its manifest says which) is a `NotSupported` naming the mode,
never an empty list that reads as "no alerts" (since schema version 4 every rank file has an
empty `alerts` table; older ones have none). An online run's rank without the table is named
in the notes. What this module
cannot vouch for is said: a run that did not finish (alerts after its last step are not there,
pending ones were never verified), a damaged rank (from which step), ranks with no file.
Nothing here knows how sensors work; the tables' columns are bitguard.schema's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from bitguard import runfiles
from bitguard.backend import ingest
from bitguard.backend.afterwards import advice
from bitguard.errors import CorruptRun, NotSupported
from bitguard.schema import ALERTS, SENSOR_STATS

SCHEMA = "bitguard.alerts/1"
STATES = ("pending", "confirmed", "transient", "cleared", "warning")
VERDICTS = ("confirmed", "transient", "cleared")
SENSORS = ("checksum", "recompute", "crossrank", "guard")  # the sensors bitguard ships (a run may hold others)
MAX_EVIDENCE_BYTES = 1 << 20  # one evidence value, as JSON text


# -- reading the tables ----------------------------------------------------------------------------

def _json(text, path: Path, what: str):
    if text is None:
        return None
    if len(text) > MAX_EVIDENCE_BYTES:
        raise CorruptRun(f"{path}: an alert's {what} is {len(text):,} characters, more than bitguard writes; "
                         f"the rank file is damaged: re-record the run")
    try:
        return runfiles.loads(text)
    except runfiles.JSONRefused as exc:
        raise CorruptRun(f"{path}: an alert's {what} is not valid JSON ({exc}); the rank file is damaged: "
                         f"re-record the run") from None


# -- the document ----------------------------------------------------------------------------------

@dataclass
class AlertsReport:
    """`bitguard.alerts/1` of one run (`to_dict()` is the JSON)."""

    run: str
    mode: str | None
    status: str | None
    command: list[str] | str | None
    world_size: int
    ranks: list[int]
    alerts: list[dict] = field(default_factory=list)
    coverage: list[dict] = field(default_factory=list)
    verifier: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the report cannot vouch for

    @property
    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATES}
        for a in self.alerts:
            out[a["state"]] = out.get(a["state"], 0) + 1
        return out

    @property
    def confirmed(self) -> list[dict]:
        return [a for a in self.alerts if a["state"] == "confirmed"]

    @property
    def exit_status(self) -> int:
        """0: no confirmed alert, 1: some confirmed (`bitguard alerts`' contract)."""
        return 1 if self.confirmed else 0

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "run": self.run, "mode": self.mode, "status": self.status,
                "command": self.command, "world_size": self.world_size, "ranks": self.ranks,
                "counts": self.counts, "alerts": self.alerts, "coverage": self.coverage,
                "verifier": self.verifier, "notes": self.notes, "exit_status": self.exit_status}


def _verdict_first(rows: pl.DataFrame) -> pl.DataFrame:
    """Rows of one table in the order their state changes happened: by time, a verdict after the
    pending row it settles when both carry one clock reading."""
    return rows.with_columns(pl.col("state").is_in(VERDICTS).cast(pl.Int8).alias("_verdict")).sort(
        "rank", "alert_id", "t_ns", "_verdict", nulls_last=False)


def _alerts(rows: pl.DataFrame, path_of: dict[int, Path], command, world_size: int) -> list[dict]:
    out = []
    ordered = _verdict_first(rows)
    for (rank, alert_id), group in ordered.group_by(["rank", "alert_id"], maintain_order=True):
        history = group.to_dicts()
        raised, latest = history[0], history[-1]
        path = path_of.get(rank, Path("?"))
        verdict = latest if latest["state"] in VERDICTS else None
        state = latest["state"]
        if state not in STATES:
            raise CorruptRun(f"{path}: alert {alert_id} has state {state!r}, not one of {', '.join(STATES)}; the "
                             f"rank file is damaged: re-record the run")
        alert = {
            "alert_id": alert_id, "rank": rank, "step": raised["step"], "sensor": raised["sensor"],
            "boundary": raised["boundary"], "op": raised["op"], "severity": raised["severity"], "state": state,
            "evidence": _json(raised["evidence"], path, "evidence"), "threshold": raised["threshold"],
            "t_ns": raised["t_ns"],
            "verdict": None if verdict is None else {
                "state": verdict["state"], "evidence": _json(verdict["evidence"], path, "verdict evidence"),
                "t_ns": verdict["t_ns"], "latency_steps": verdict["latency_steps"],
                "verifier_s": verdict["verifier_s"]},
            "latency_steps": latest["latency_steps"], "verifier_s": latest["verifier_s"],
            "history": [{"state": h["state"], "t_ns": h["t_ns"], "step": h["step"]} for h in history],
        }
        if state == "pending":
            alert["unverified"] = "the recording ended before the verifier reached it"
        if state == "confirmed":
            alert["afterwards"] = advice(alert, command, world_size)
        out.append(alert)
    out.sort(key=lambda a: (a["step"] if a["step"] is not None else -1, a["t_ns"] or 0, a["rank"], a["alert_id"]))
    return out


def _coverage(stats: pl.DataFrame) -> tuple[list[dict], dict]:
    """Per sensor: steps it wrote rows for, calls seen and checked, FLOPs, seconds, the sampling
    rate (mean of its steps) and its operators; the verifier queue's length over steps."""
    if not stats.height:
        return [], {"queue_max": None, "queue_last": None}
    sums = ["calls", "checked", "seconds", "flops_seen", "flops_checked"]
    out = []
    for (sensor,), rows in stats.sort("sensor").group_by(["sensor"], maintain_order=True):
        whole = rows.filter(pl.col("op").is_null())
        per_op = rows.filter(pl.col("op").is_not_null())
        base = whole if whole.height else per_op  # a sensor's NULL-op rows are its totals: never add both
        totals = {c: _num(base[c].sum()) for c in sums}
        ops = (per_op.group_by("op").agg([pl.col(c).sum() for c in sums] + [pl.col("rate").mean(),
                                                                             pl.col("threshold").last()])
               .sort("flops_seen", "calls", descending=True, nulls_last=True))
        out.append({
            "sensor": sensor, "steps": rows["step"].n_unique(), "ranks": sorted(rows["rank"].unique().to_list()),
            **totals,
            "checked_share": (totals["flops_checked"] / totals["flops_seen"]) if totals["flops_seen"] else None,
            "rate": _num(base["rate"].mean()),
            "ops": [{k: _num(v) if k != "op" else v for k, v in r.items()} for r in ops.to_dicts()],
        })
    last_step = stats["step"].max()
    queue = stats.filter(pl.col("queue").is_not_null())
    verifier = {"queue_max": _num(queue["queue"].max()) if queue.height else None,
                "queue_last": _num(queue.filter(pl.col("step") == last_step)["queue"].max()) if queue.height else None}
    return out, verifier


def _num(v):
    if v is None:
        return None
    f = float(v)
    return int(f) if f.is_integer() and abs(f) < 2**53 else f


def _verifier(alerts: list[dict], queue: dict) -> dict:
    settled = [a for a in alerts if a["verdict"] is not None]
    latencies = sorted(a["verdict"]["latency_steps"] for a in settled if a["verdict"]["latency_steps"] is not None)
    seconds = [a["verdict"]["verifier_s"] for a in settled if a["verdict"]["verifier_s"] is not None]
    return {"tasks": sum(a["severity"] == "alert" for a in alerts), "verified": len(settled),
            "unverified": sum(a["state"] == "pending" for a in alerts),
            "latency_steps_median": latencies[len(latencies) // 2] if latencies else None,
            "latency_steps_max": latencies[-1] if latencies else None,
            "seconds": sum(seconds) if seconds else 0.0, **queue}


def read_alerts(path: str | Path) -> AlertsReport:
    """The alerts document of run directory `path`; a BitguardError when it is not a readable run
    or was not recorded in online mode."""
    run = ingest.open_run(path)
    manifest = run.manifest
    mode = manifest.get("mode")
    if mode != "online":
        raise NotSupported(f"{run.path} was recorded in {mode or 'an older'} mode: it holds boundary events, not "
                           f"alerts (compare it with 'bitguard compare'); record with 'bitguard record --mode online' "
                           f"for alerts")
    alert_frames, stat_frames, without = [], [], []
    for rank in run.ranks:
        alerts = ingest.rank_table(run, rank, ALERTS)
        stats = ingest.rank_table(run, rank, SENSOR_STATS)
        if alerts is None:
            without.append(rank)
            continue
        alert_frames.append(alerts)
        if stats is not None:
            stat_frames.append(stats)
    empty_alerts = pl.DataFrame(schema={c.name: _polars(c.sql) for c in ALERTS.columns})
    empty_stats = pl.DataFrame(schema={c.name: _polars(c.sql) for c in SENSOR_STATS.columns})
    rows = pl.concat(alert_frames, how="vertical_relaxed") if alert_frames else empty_alerts
    stats = pl.concat(stat_frames, how="vertical_relaxed") if stat_frames else empty_stats
    alerts = _alerts(rows, dict(run.ranks), manifest.get("command"), run.world_size)
    coverage, queue = _coverage(stats)
    report = AlertsReport(run=str(run.path), mode=mode, status=manifest.get("status"),
                          command=manifest.get("command"), world_size=run.world_size, ranks=list(run.ranks),
                          alerts=alerts, coverage=coverage, verifier=_verifier(alerts, queue))
    report.notes = _notes(run, stats, without)
    return report


def _polars(sql: str):
    return {"BIGINT": pl.Int64, "INTEGER": pl.Int32, "VARCHAR": pl.String, "DOUBLE": pl.Float64}[sql]


def _notes(run: ingest.RunInfo, stats: pl.DataFrame, without: list[int]) -> list[str]:
    notes = []
    if not run.complete:
        last = stats["step"].max() if stats.height else None
        upto = f" (its last step with sensor figures: {last})" if last is not None else ""
        notes.append(f"the recording did not finish ({run.incomplete_reason()}){upto}: alerts of later steps were "
                     f"never raised, and pending ones were never verified")
    for rank, damage in sorted(run.damage.items()):
        where = "from the start" if damage.get("from_step") is None else f"from step {damage['from_step']} on"
        notes.append(f"rank {rank} is damaged {where} ({damage.get('reason')}): its alerts there may be missing")
    if run.missing_ranks:
        notes.append(f"rank(s) {', '.join(map(str, run.missing_ranks))} of world size {run.world_size} have no rank "
                     f"file: their alerts are not here")
    if without:
        notes.append(f"rank(s) {', '.join(map(str, without))} hold no alerts table: not read")
    return notes


# -- text ------------------------------------------------------------------------------------------

def _brief(evidence) -> str:
    if not isinstance(evidence, dict):
        return "" if evidence is None else str(evidence)[:120]
    if isinstance(evidence.get("summary"), str):
        return evidence["summary"][:300]
    parts = []
    for k, v in evidence.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.3g}")
        elif isinstance(v, (int, str, bool)) and len(str(v)) <= 40:
            parts.append(f"{k} {v}")
        if len(parts) == 4:
            break
    return ", ".join(parts)


def render_text(report: AlertsReport) -> str:
    """What `bitguard alerts DIR` prints."""
    c = report.counts
    lines = [f"bitguard alerts: {report.run} (mode {report.mode}, {report.status or 'status unknown'}, "
             f"{len(report.ranks)} rank{'s' if len(report.ranks) != 1 else ''})",
             "  " + ", ".join(f"{c[s]} {s}" for s in STATES)]
    for note in report.notes:
        lines.append(f"  note: {note}")
    if report.alerts:
        lines.append("")
    for a in report.alerts:
        op = f" ({a['op']})" if a["op"] else ""
        threshold = f" threshold {a['threshold']:.3g}" if isinstance(a["threshold"], float) else ""
        lines.append(f"  #{a['alert_id']} step {a['step']} rank {a['rank']} {a['sensor']} {a['boundary']}{op}: "
                     f"{a['state']}{threshold}")
        seen = _brief(a["evidence"])
        if seen:
            lines.append(f"      seen: {seen}")
        if a["verdict"]:
            v = a["verdict"]
            latency = f" after {v['latency_steps']} step(s)" if v["latency_steps"] is not None else ""
            lines.append(f"      verifier: {v['state']}{latency}" + (f" ({_brief(v['evidence'])})" if v["evidence"] else ""))
        if a.get("afterwards"):
            lines.extend("      " + line for line in a["afterwards"]["text"].splitlines())
    if report.coverage:
        lines += ["", "  coverage (whole run):"]
        for s in report.coverage:
            share = f", {s['checked_share']:.1%} of the FLOPs seen checked" if s["checked_share"] is not None else ""
            flops = f", {s['flops_seen']:.3g} FLOPs seen" if s["flops_seen"] else ""
            lines.append(f"    {s['sensor']}: {s['steps']} steps, {s['checked']:,} of {s['calls']:,} calls checked"
                         f"{flops}{share}, {s['seconds']:.3g} s on the critical path")
    v = report.verifier
    if v.get("tasks"):
        latency = (f", latency median {v['latency_steps_median']} / max {v['latency_steps_max']} steps"
                   if v["latency_steps_median"] is not None else "")
        lines.append(f"  verifier: {v['verified']} of {v['tasks']} tasks verified{latency}, {v['seconds']:.3g} s, "
                     f"queue max {v['queue_max']}")
    return "\n".join(lines)


def to_json(report: AlertsReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
