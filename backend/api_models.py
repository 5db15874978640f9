"""What the browser sends and sees: the REST API's request and response models.

These are the API's shapes, kept apart from the catalogue rows in workspace.py and from the
engine's values. Where the API passes an engine value through (a comparison's summary, an
event's detail, a rules file) the model names it and says where its fields are defined
instead of retyping them: the rules file format is `bitguard.backend.rules`, the event columns
are `Comparison.events()`, the record fields are `bitguard.schema`, and the comparison document
(verdict, first divergence, inconclusive reasons) is `bitguard.backend.result`, whose models the
pivot route answers in.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bitguard.backend.result import FirstDivergence, Inconclusive, RuleFired, Verdict

# -- errors -------------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    type: str = Field(description="class name from bitguard.errors (NotARun, RulesError, NotFound...)")
    message: str = Field(description="what was wrong and what to do, on one line")


class ErrorBody(BaseModel):
    error: ErrorInfo


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in ((400, "bad input, not a run, corrupt run, invalid rules"), (404, "no such object"),
                       (409, "comparison not ready yet"), (413, "upload over a size limit"))
}

# -- runs ---------------------------------------------------------------------------------------

class RunPublic(BaseModel):
    id: str
    name: str
    created: float = Field(description="seconds since the epoch when it was uploaded")
    world_size: int
    ranks: list[int] = Field(description="ranks with a rank file")
    files: int
    bytes: int
    status: str | None = Field(description="manifest status: complete | failed | interrupted | running")
    command: list[str] | str | None = None
    mode: str | None = None
    start_time: str | None = None
    info: Any = Field(None, description="what the engine's open_run() read from the run")
    problem: str | None = Field(None, description="why this stored run cannot be used (a run kept by an older "
                                                  "version that fails today's checks); null when it is usable")


class UploadLimits(BaseModel):
    max_file_bytes: int
    max_run_bytes: int
    max_files: int

# -- rule sets ----------------------------------------------------------------------------------

RULES_DOC = "rules in the `bitguard.rules/1` format of `compare --rules` (see bitguard.backend.rules)"


class RuleSetCreate(BaseModel):
    name: str = Field(description="unique name, 1-80 characters")
    rules: list[dict[str, Any]] = Field(default_factory=list, description=RULES_DOC)


class RuleSetUpdate(BaseModel):
    name: str | None = Field(None, description="new name (rename), or absent")
    rules: list[dict[str, Any]] | None = Field(None, description=RULES_DOC + "; saved as the next version")


class RuleSetCopy(BaseModel):
    name: str = Field(description="name of the new rule set")
    version: int | None = Field(None, description="version to copy; the latest when absent")


class RuleSetVersion(BaseModel):
    version: int
    created: float
    rules: int = Field(description="number of rules in that version")


class RuleSetPublic(BaseModel):
    id: str
    name: str
    created: float
    updated: float
    version: int = Field(description="the version shown")
    latest_version: int
    rules: list[dict[str, Any]] = Field(description=RULES_DOC)
    file: dict[str, Any] = Field(description="the whole rules file, as `export` downloads it")
    versions: list[RuleSetVersion] | None = None
    comparisons: list[str] | None = Field(None, description="comparisons using this rule set (after an edit)")

# -- comparisons --------------------------------------------------------------------------------

class ComparisonCreate(BaseModel):
    run_a: str = Field(description="id of the reference run")
    run_b: str = Field(description="id of the suspect run")
    rule_set_id: str | None = Field(None, description="rule set whose latest version applies")
    resumed_at: int = Field(0, ge=0, le=2**31 - 1, strict=True, description="run B is a process that resumed run A's training from a checkpoint "
                                                 "of step RESUMED_AT: B's step s is compared with A's step "
                                                 "RESUMED_AT + s (`compare --resumed-at`); 0: step for step")


class ComparisonRerun(BaseModel):
    rule_set_id: str | None = Field(None, description="attach this rule set (null: no rules)")
    keep_rule_set: bool = Field(True, description="when true and rule_set_id is null, rerun with the current rule set")
    rule_set_version: int | None = Field(None, ge=1, description="a saved version of the rule set (null: its latest)")


class NamedRef(BaseModel):
    id: str
    name: str


class RuleSetRef(BaseModel):
    id: str
    name: str
    version: int | None
    latest_version: int


class PivotPosition(BaseModel):
    rank: int
    pos: int = Field(description="position of the pivot in its rank's timeline")


class ComparisonPublic(BaseModel):
    id: str
    run_a: NamedRef
    run_b: NamedRef
    rule_set: RuleSetRef | None
    resumed_at: int = Field(0, description="the step of run A that run B resumed at (0: compared step for step)")
    status: Literal["queued", "running", "ready", "failed", "stale"]
    revision: int = Field(description="bumped by every rerun")
    error: ErrorInfo | None
    created: float
    updated: float
    verdict: str | None = Field(description="identical | diverged | inconclusive, once ready")
    summary: dict[str, Any] | None = Field(
        description="the engine's `bitguard.compare/1` document (bitguard.backend.result.CompareResult), with "
                    "propagation reduced to node and edge counts (GET .../graph has the graph) and run_a/run_b "
                    "the runs' names; kept as stored, since one computed by an older version may lack new fields")
    ranks: list[int] | None
    pivot_position: PivotPosition | None


class Pivot(BaseModel):
    """The pivot of a ready comparison, in the engine's own types (bitguard.backend.result)."""

    verdict: Verdict
    first_divergence: FirstDivergence | None = Field(
        description="rank, step, phase, boundary, blame, stack, tensors...; `cause` is digest | structure, and a "
                    "structure divergence (an event on one side only) names the side lacking it in `missing_side`")
    position: PivotPosition | None
    rules_fired: list[RuleFired] = Field(default_factory=list)
    inconclusive: Inconclusive | None = Field(None, description="why the verdict is inconclusive, when it is")


class EventTensor(BaseModel):
    """One tensor of an event on one side; the columns of bitguard.schema's tensors table, digests as hex."""

    model_config = ConfigDict(extra="allow")  # every other field the engine adds passes through

    role: str
    index: int
    xor: str | None = None
    pos: str | None = None
    differs: bool | None = Field(None, description="this tensor's digests differ from the other side's")
    ignored: bool | None = Field(None, description="the difference is accepted by a benign-difference rule")
    rule_id: str | None = Field(None, description="the rule that accepted it")


class EventDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    rank: int
    side: Literal["a", "b"]
    status: str = Field(description="identical | benign | diverged | only_a | only_b")
    event: dict[str, Any] = Field(description="the event's columns (bitguard.schema events)")
    stack: list[str]
    pair: dict[str, Any]
    tensors_a: list[EventTensor]
    tensors_b: list[EventTensor]
    is_pivot: bool
    blame: dict[str, Any] | None = None
    pos: int | None = Field(None, description="position in its rank's timeline")


class TimelineLaneBins(BaseModel):
    side: Literal["a", "b"]
    phase: str
    status: list[int] = Field(description="worst status code per bin (index into status_codes)")
    n: list[int] = Field(description="events per bin")
    diverged: list[int] = Field(description="divergent events per bin")


class TimelineBins(BaseModel):
    start: float
    width: float
    count: int
    lanes: list[TimelineLaneBins]
    step_lo: list[int | None] | None = Field(None, description="first training step of the events in each bin")
    step_hi: list[int | None] | None = Field(None, description="last training step of the events in each bin")


class Timeline(BaseModel):
    rank: int
    axis: Literal["seq", "time"] = Field(description="seq: aligned position; time: ns since the side's first event")
    start: float
    end: float
    extent: list[float]
    mode: Literal["bins", "events"] = Field(description="bins when the window holds more than raw_event_limit events")
    lanes: list[dict[str, str]]
    status_codes: list[str]
    count_a: int
    count_b: int
    prefix: dict[str, Any] | None = Field(description="extent of the identical prefix per side")
    pivot: dict[str, Any] | None = Field(description="where the pivot is, when it is on this rank")
    steps: dict[str, Any] | None = Field(None, description="step boundaries in the window: {every, marks: [{step, x, b_x}]}")
    bins: TimelineBins | None = None
    events: list[dict[str, Any]] | None = Field(None, description="Comparison.events() rows plus pos, a_x, b_x and "
                                                                   "a_dur, b_dur (each side's call in ns)")


class EventsPage(BaseModel):
    rank: int | None
    total: int
    offset: int
    limit: int
    rows: list[dict[str, Any]] = Field(description="Comparison.events() columns plus pos")


class SearchHit(BaseModel):
    index: int = Field(description="the hit's place among all matches (0-based)")
    event: dict[str, Any] = Field(description="pos, status, step, phase, kind, boundary, module_type, a_seq, b_seq, "
                                              "is_pivot")


class SearchPage(BaseModel):
    schema_: Literal["bitguard.search/1"] = Field(alias="schema", serialization_alias="schema")
    rank: int
    query: dict[str, Any] = Field(description="the filters given")
    total: int = Field(description="how many events match")
    offset: int
    limit: int
    from_: int | None = Field(None, alias="from", description="the position the hit was looked for from")
    direction: Literal["next", "prev"]
    matches: list[dict[str, Any]] = Field(description="a page of matching events, as `hit.event`")
    hit: SearchHit | None = Field(description="the next (or previous) match from `from`; null past the end")


class Neighbours(BaseModel):
    node: dict[str, Any]
    consumers: list[dict[str, Any]]
    producers: list[dict[str, Any]]


# -- drills -------------------------------------------------------------------------------------

class DrillCreate(BaseModel):
    rank: int | None = Field(None, ge=0, description="the rank to drill; the pivot's rank when absent")


class DrillState(BaseModel):
    """A comparison's drill (bitguard.backend.drills): its state and, once done, the engine's document."""

    schema_: Literal["bitguard.drill-state/1"] = Field(alias="schema", serialization_alias="schema")
    comparison: str
    revision: int | None = Field(description="the comparison's revision whose pivot was drilled")
    rank: int | None = Field(description="the rank asked for; null: the pivot's")
    state: Literal["queued", "running", "done", "failed"] = Field(
        description="queued: waiting for another comparison's drill; running: replaying both runs")
    created: float | None = Field(description="seconds since the epoch when it was asked for")
    started: float | None
    finished: float | None
    elapsed_s: float | None = Field(description="seconds it has run (so far, while running)")
    error: ErrorInfo | None = Field(description="why it failed (e.g. NotSupported: the recorded script is not on "
                                                "this machine, the pivot is a data batch)")
    exit_status: int | None = Field(description="what `bitguard drill` exits with: 0 op pivot, 1 no difference, "
                                                "3 the replay does not reproduce the record")
    document: dict[str, Any] | None = Field(
        description="the engine's `bitguard.drill/1` document (op_pivot, signature, replay, ...; see docs/DRILL.md), "
                    "once done")
