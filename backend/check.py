"""In-run checks: what one run says about itself, with no reference run (`bitguard check RUN`).

Some computations happen twice inside one training run and must agree bitwise: an activation
recompute and the forward it repeats (backend/recompute.py), outputs that should be equal on
every rank of a group (backend/crossrank.py). Each such check is a function registered here:

    from bitguard.backend.check import Finding, Outcome, register

    @register("recompute", reads=READS)  # READS: a polars filter of the events (and their tensors) it reads
    def check_recompute(run: LoadedRun) -> Outcome:
        ...
        return Outcome(compared=n, findings=[Finding(...)], notes=[...])

A check reads the run through `LoadedRun` (ingest.py's frames, loaded once per rank and shared by
every check) and answers an `Outcome`: how many comparisons it made (0: nothing in this run it
applies to), what differed (`Finding`s), and what it could not check, in sentences. The modules
holding checks are listed in `CHECK_MODULES`; adding a check is one line there. `reads` names the
events the check reads (with their tensors): a comparison hands the checks only those rows.

`run_checks` gives the `bitguard.check/1` document (`CheckResult`). Verdicts and exit statuses:
- `clean` (0): the run is complete and whole, at least one comparison was made, nothing differed;
- `findings` (1): something that must agree within the run differs (whatever else is true: a
  difference in the part that was recorded is real);
- `inconclusive` (3): no finding, but the run cannot be called clean: nothing could be checked
  (no recompute, one rank), or the run is incomplete, damaged, missing ranks, or reported
  collector errors (`reasons` says which). 2 is bad input, as for every command.

compare.py runs the same checks on both of its runs (`run_checks` in `bitguard.compare/1`).
This module knows the registry and the document; it knows nothing of what a check compares.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import polars as pl
from pydantic import ConfigDict, Field

from bitguard.backend.certification import first_error
from bitguard.backend.result import Against, DigestPair, Finding, TensorDiff, _Model

__all__ = ["Against", "CheckResult", "DigestPair", "Finding", "LoadedRun", "Outcome", "TensorDiff", "register",
           "run_checks"]

CHECK_SCHEMA = "bitguard.check/1"
EXIT_STATUS = {"clean": 0, "findings": 1, "inconclusive": 3}  # 2: bad input, 70: internal error
# The modules whose import registers the built-in checks (one line per check module).
CHECK_MODULES = (
    "bitguard.backend.recompute",
    "bitguard.backend.crossrank",
    "bitguard.backend.replicas",
)


class CheckSummary(_Model):
    name: str
    compared: int = Field(description="comparisons made (0: nothing in this run the check applies to)")
    findings: int
    notes: list[str] = Field(description="what the check could not check, and why")
    inputs_only: int = Field(0, description="of `compared`, comparisons of inputs alone (recomputes non-reentrant "
                                            "checkpointing cut short: their outputs were never made)")


class CheckReason(_Model):
    code: Literal["incomplete", "damaged", "missing_ranks", "collector_errors", "nothing_checked"]
    message: str
    rank: int | None = None


class CheckResult(_Model):
    schema_: str = Field(CHECK_SCHEMA, alias="schema", serialization_alias="schema")
    verdict: Literal["clean", "findings", "inconclusive"]
    run: str
    ranks: list[int]
    checks: list[CheckSummary]
    findings: list[Finding] = Field(description="in step order, then rank, then event order")
    reasons: list[CheckReason] = Field(description="why the run cannot be called clean (also qualifying findings)")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    def to_dict(self) -> dict:
        return self.model_dump(by_alias=True)


@dataclass
class Outcome:
    compared: int  # comparisons made: 0 when nothing in the run is what the check applies to
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, one sentence each
    inputs_only: int = 0  # of `compared`, those of inputs alone (a recompute cut short: no outputs to compare)


@dataclass
class LoadedRun:
    """A run as the checks read it: ingest's RunInfo and, per rank, its events and tensors
    (`load_rank`), loaded on first use. compare.py passes the frames it already holds."""

    info: object  # ingest.RunInfo
    ranks: list[int]
    frames: dict[int, tuple[pl.DataFrame, pl.DataFrame]] = field(default_factory=dict)

    def events(self, rank: int) -> pl.DataFrame:
        return self._load(rank)[0]

    def tensors(self, rank: int) -> pl.DataFrame:
        return self._load(rank)[1]

    def _load(self, rank: int) -> tuple[pl.DataFrame, pl.DataFrame]:
        if rank not in self.frames:
            from bitguard.backend.ingest import load_rank

            events, tensors, _ = load_rank(self.info, rank)
            self.frames[rank] = (events, tensors)
        return self.frames[rank]


CheckFn = Callable[[LoadedRun], Outcome]
_CHECKS: dict[str, CheckFn] = {}
_READS: dict[str, pl.Expr] = {}


def register(name: str, reads: pl.Expr) -> Callable[[CheckFn], CheckFn]:
    """Decorator: register `fn` as the in-run check `name` (names are unique). `reads` is the
    filter of a rank's events whose rows (and their tensors' rows) the check reads: a
    comparison keeps only those for `run_checks` (`rows_read`), so a check given a whole run and
    one given these rows must find the same."""
    def add(fn: CheckFn) -> CheckFn:
        if name in _CHECKS and _CHECKS[name] is not fn:
            raise ValueError(f"an in-run check named {name!r} is already registered")
        _CHECKS[name], _READS[name] = fn, reads
        return fn
    return add


def checks() -> dict[str, CheckFn]:
    """Every registered check, the built-in ones imported first, in CHECK_MODULES order (whatever
    imported one of them earlier), then the others as registered."""
    for module in CHECK_MODULES:
        importlib.import_module(module)
    order = {m: i for i, m in enumerate(CHECK_MODULES)}
    return dict(sorted(_CHECKS.items(), key=lambda item: order.get(item[1].__module__, len(order))))


def hexdigest(value) -> str | None:
    return None if value is None else f"{int(value) & (2**64 - 1):016x}"


def _run_reasons(info, ranks: list[int]) -> list[CheckReason]:
    """What keeps a run without findings from being called clean (whole-run facts)."""
    out = []
    why = info.incomplete_reason()
    if why:
        out.append(CheckReason(code="incomplete", message=f"the run is incomplete ({why}): what it did not record "
                                                          f"is not checked"))
    for rank, damage in sorted((info.damage or {}).items()):
        where = "from the start" if damage.get("from_step") is None else f"from step {damage['from_step']} on"
        out.append(CheckReason(code="damaged", rank=rank, message=f"rank {rank} is damaged {where} "
                                                                  f"({damage.get('reason', 'unreadable records')})"))
    missing = sorted(set(info.missing_ranks or []))
    if missing:
        out.append(CheckReason(code="missing_ranks", message=f"the run declares world size {info.world_size} but has "
                                                             f"no rank file for rank(s) {', '.join(map(str, missing))}"))
    errors = list(info.manifest.get("collector_errors") or [])
    for rank in ranks:
        errors += [e for e in (info.rank_meta.get(rank, {}).get("collector_errors") or []) if e not in errors]
    if errors:
        out.append(CheckReason(code="collector_errors", message=f"the recording reported {len(errors)} collector "
                                                                f"error(s), so events may be missing (first: "
                                                                f"{first_error(errors)})"))
    return out


def run_checks(run, rank: int | None = None, frames: dict | None = None) -> CheckResult:
    """Every registered check on `run` (a path or an ingest.RunInfo), on one rank or all."""
    from bitguard.backend.ingest import RunInfo, open_run
    from bitguard.errors import BadInput

    info = run if isinstance(run, RunInfo) else open_run(run)
    if rank is not None and rank not in info.ranks:
        raise BadInput(f"rank {rank} is not recorded in {info.name} (it has ranks {sorted(info.ranks)}); "
                       f"pick another --rank")
    ranks = [rank] if rank is not None else sorted(info.ranks)
    loaded = LoadedRun(info, ranks, dict(frames or {}))
    summaries, findings = [], []
    for name, fn in checks().items():
        outcome = fn(loaded)
        findings += outcome.findings
        summaries.append(CheckSummary(name=name, compared=outcome.compared, findings=len(outcome.findings),
                                      notes=outcome.notes, inputs_only=outcome.inputs_only))
    findings.sort(key=lambda f: (f.step, f.rank, f.seq))
    reasons = _run_reasons(info, ranks)
    if not any(s.compared for s in summaries):
        what = "; ".join(f"{s.name}: {s.notes[0]}" if s.notes else s.name for s in summaries)
        reasons.append(CheckReason(code="nothing_checked", message=f"no in-run check applies to this run ({what})"))
    verdict = "findings" if findings else ("inconclusive" if reasons else "clean")
    return CheckResult(verdict=verdict, run=str(info.path), ranks=ranks, checks=summaries, findings=findings,
                       reasons=reasons)


def rows_read(events: pl.DataFrame, tensors: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rows of one rank's events and tensors that the registered checks read (their `reads`),
    in their order: what a comparison keeps of a rank for `run_checks` (rank_summary.py)."""
    checks()
    kept = events.filter(pl.any_horizontal(list(_READS.values()))) if _READS else events[:0]
    return kept, tensors.filter(pl.col("seq").is_in(kept["seq"].implode()))


def for_comparison(comparison) -> dict[str, list[Finding]]:
    """The findings of each run of a comparison (compare.py's `Comparison`), on the ranks it
    compared, from the rows of its frames the checks read (each rank's summary): `run_checks` in
    `bitguard.compare/1`."""
    out = {}
    for side, info in (("a", comparison.run_a), ("b", comparison.run_b)):
        frames = {r: rc.summary.checks[side] for r, rc in comparison.ranks.items()}
        loaded = LoadedRun(info, sorted(comparison.ranks), frames)
        findings = [f for fn in checks().values() for f in fn(loaded).findings]
        out[side] = sorted(findings, key=lambda f: (f.step, f.rank, f.seq))
    return out
