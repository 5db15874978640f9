"""The comparison's result document, typed once: `bitguard.compare/1`.

Every consumer of a comparison reads these models: `Comparison.to_dict()` is
`CompareResult.model_dump()`, the terminal report (report.py) reads the model, the notebook's
summary and the web API pass the same document through. A field is added here, never renamed
or removed: scripts parse this JSON.

Verdicts and exit statuses of `bitguard compare`:
- `identical` (0): both runs complete (or recorded the same window), the same ranks on both
  sides, every event paired or its gap allowed by a rule, no tensor unobserved, every digest
  equal or its difference accepted by a rule that nothing downstream depends on;
- `diverged` (1): a digest differs (`cause: "digest"`) or an event is on one side only
  (`cause: "structure"`), and no rule accepts it;
- `inconclusive` (3): the part that could be compared is identical, but the rest cannot be
  certified; `inconclusive.reasons` says why and `certification` what was compared.

This module knows the document's shape, not how it is computed (compare.py, pivot.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

COMPARE_SCHEMA = "bitguard.compare/1"
VERDICTS = ("identical", "diverged", "inconclusive")
EXIT_STATUS = {"identical": 0, "diverged": 1, "inconclusive": 3}  # 2: bad input, 70: internal error

Verdict = Literal["identical", "diverged", "inconclusive"]
# What the comparison made of each aligned event (`Comparison.events()["status"]`), mildest first:
# follows = differs only downstream of a difference a rule accepted; unobserved = not comparable.
EVENT_STATUSES = ("identical", "benign", "follows", "unobserved", "only_a", "only_b", "diverged")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DigestPair(_Model):
    xor: str | None = Field(description="16 hex digits, None when the side has no such tensor")
    pos: str | None


class TensorPair(_Model):
    role: str = Field(description="input | output | grad_input | grad_output | grad | param | state | rng")
    index: int
    path: str | None
    shape: list[int] | None
    dtype: str | None
    dtype_b: str | None
    a: DigestPair
    b: DigestPair
    differs: bool = Field(description="the digests differ (or a side lacks the tensor)")
    ignored: bool = Field(description="the difference is accepted by rule `rule_id`")
    rule_id: str | None
    unobserved: str | None = Field(None, description="why this tensor could not be observed on a side (None: it was)")
    shape_b: list[int] | None = Field(None, description="run B's shape where it is not `shape` (None: the same)")
    path_b: str | None = Field(None, description="run B's path of the tensor paired with this one where it is not "
                                                 "`path` (an optimizer's state across another optimizer: "
                                                 "`['momentum_buffer']` against `['exp_avg']`; None: the same)")


class BlameWindow(_Model):
    module: str | None = Field(description="where to look: a module, a parameter or None (upstream of every boundary)")
    detail: str = Field(description="the reasoning, in one sentence")
    module_type: str | None = None
    excluding_children: list[str] | None = None
    after: str | None = None
    before: str | None = None


class ApiDifference(_Model):
    step: int
    kind: str = Field(description="the api_events kind: zero_grad, clip_grad_norm, optimizer_step, modes, ...")
    target: str | None = Field(description="optimizer or scheduler `Class#i`, a module name, `loss` or `clip`")
    call: int = Field(description="the kind and target's n-th call in the step, from 0")
    field: str | None = Field(description="the value's field that differs (e.g. groups[0].lr); None: called in one run only")
    a: Any = Field(description="run A's value (or 'called' / 'not called')")
    b: Any = Field(description="run B's value (or 'called' / 'not called')")
    steps: list[int] = Field(default_factory=list, description="every step at which this same difference is found, "
                                                                "`step` the first: it is listed once")
    at: str | None = Field(None, description="a read's place, `file:line` of the code that read the value (run A's "
                                             "where both recorded one); never compared")
    value: Any = Field(None, description="a read made in one run only (`field` None): the value it read there, at "
                                         "`step`")
    only_a: list[str] | None = Field(None, description="a `modes` row's training or eval field: the modules run A's "
                                                       "model has and run B's has in neither mode")
    only_b: list[str] | None = Field(None, description="the same, of run B's model")
    calls: int | None = Field(None, description="`field` None: the calls this entry stands for, from `call` on, one "
                                                "after another (a root module's calls, or the reads at one line, that "
                                                "one run alone makes)")


class ApiDifferences(_Model):
    available: bool = Field(description="both runs recorded API events on this rank (else nothing was compared)")
    differences: list[ApiDifference] = Field(description="at or before the pivot's step, earliest first")
    more: int = Field(description="differences left out of the list")
    missing: list[Literal["a", "b"]] = Field(default_factory=list, description="the runs without API events")
    rank: int | None = Field(None, description="the rank compared (in the document's `api_differences`, where no "
                                               "first divergence names one)")


class FirstDivergence(_Model):
    cause: Literal["digest", "structure"] = Field(
        "digest", description="digest: paired tensors differ; structure: an event is on one side only")
    missing_side: Literal["a", "b"] | None = Field(None, description="structure: the run that lacks the event")
    rank: int
    step: int
    phase: str
    kind: str
    boundary: str
    module_type: str | None
    call: int
    blame: str = Field(description="source | consumer | data | structure")
    fault_class: str
    blame_window: BlameWindow | None
    differing_roles: list[str]
    stack: list[str] = Field(description="user call stack of the event, outermost first")
    stack_b: list[str] | None = Field(None, description="run B's user call stack of the paired event, where it "
                                                         "differs from run A's (`stack`); null otherwise")
    a_seq: int | None
    b_seq: int | None
    retyped: bool = Field(description="paired although the module type or a dtype differs")
    module_type_b: str | None
    tensors: list[TensorPair]
    notes: list[str] = Field(default_factory=list, description="what qualifies this pivot (e.g. unobserved events before it)")
    api_differences: ApiDifferences | None = Field(
        None, description="how the runs called the training API differently up to this step (backend/api_diff.py): "
                          "the clipping threshold, learning rates, zero_grad, modes, flags; the likely cause")


class RankPivot(_Model):
    step: int
    phase: str
    boundary: str
    blame: str
    cause: str = "digest"


class GapEvent(_Model):
    rank: int
    side: Literal["a", "b"]
    seq: int
    step: int
    phase: str
    kind: str | None = Field(None, description="the event's kind (module, grad, params, saved, ...)")
    boundary: str
    module_type: str | None


class AlignmentSummary(_Model):
    events_a: int
    events_b: int
    matched: int
    reordered: int
    gaps_a: int
    gaps_b: int
    allowed_gaps: int
    identical_prefix: int = Field(description="paired events before the first divergence (all of them when none)")
    band: int
    max_window: int
    anchors: int
    gaps_before_pivot: list[GapEvent]
    unobserved: int = Field(0, description="paired events holding a tensor that could not be observed")
    follows_accepted: int = Field(0, description="divergent events that follow from differences rules accepted")
    not_compared: int = Field(0, description="events outside the certifiable part (after an incomplete or damaged "
                                             "side ends, outside the common step window)")


class Reason(_Model):
    code: Literal["incomplete", "missing_ranks", "damaged", "unobserved", "collector_errors", "nothing_paired",
                  "empty", "step_window", "modes", "follows_accepted", "granularity", "recompute", "bypassed",
                  "online", "digest_build", "retyped", "computed", "resumed", "final_settings", "resume_setup",
                  "threads"]
    message: str = Field(description="what could not be certified and why, in one sentence")
    side: Literal["a", "b"] | None = None
    rank: int | None = None


class Inconclusive(_Model):
    reasons: list[Reason]


class Certification(_Model):
    """What the verdict rests on: the reasons a part could not be certified (also with a
    `diverged` verdict, where they qualify the pivot) and the steps compared per rank."""

    reasons: list[Reason]
    compared_steps: dict[str, list[int | None]] = Field(
        description="rank -> [first, last] step certified on both sides (None: open), before cut-offs")


class Node(_Model):
    id: str
    rank: int
    phase: str
    kind: str
    boundary: str
    module_type: str | None
    step: int
    first_step: int
    count: int
    a_seq: int
    is_pivot: bool


class Edge(_Model):
    source: str
    target: str
    kind: str
    count: int
    first_step: int


class Graph(_Model):
    nodes: list[Node]
    edges: list[Edge]


class ManifestDiff(_Model):
    field: str
    a: Any
    b: Any
    why: str


class RuleFired(_Model):
    id: str
    count: int


class Analysis(_Model):
    fingerprint: str
    probes: list[str] | None
    resumed_at: int = Field(0, description="`compare --resumed-at`: run B's step s was compared with run A's step "
                                           "resumed_at + s (0: step for step)")


class TensorDiff(_Model):
    """A tensor of an in-run finding (backend/check.py) that differs from the event it is checked against."""

    role: str
    index: int
    path: str | None
    shape: list[int] | None
    dtype: str | None
    expected: DigestPair = Field(description="the tensor of the event it is checked against")
    got: DigestPair = Field(description="the tensor of the event with the finding")


class Against(_Model):
    """The event an in-run finding's event was checked against (the original forward, another rank's event)."""

    rank: int
    seq: int
    phase: str
    call: int


class Finding(_Model):
    """What one run says about itself (`bitguard check`, backend/check.py; `run_checks` here)."""

    check: str = Field(description="name of the check that found it (recompute, crossrank, ...)")
    rank: int
    step: int
    phase: str
    kind: str
    boundary: str
    module_type: str | None
    call: int
    seq: int = Field(description="the event with the finding, on `rank`")
    against: Against | None = Field(description="the event it must agree with")
    blame: Literal["source", "consumer"] = Field(
        description="source: its inputs agreed and its outputs differ (it computed differently); "
                    "consumer: its inputs already differed")
    differing_roles: list[str]
    tensors: list[TensorDiff]
    detail: str = Field(description="what differed, in one sentence")


class CompareResult(_Model):
    schema_: str = Field(COMPARE_SCHEMA, alias="schema", serialization_alias="schema")
    verdict: Verdict
    run_a: str
    run_b: str
    ranks: list[int]
    first_divergence: FirstDivergence | None
    pivots_per_rank: dict[str, RankPivot | None]
    alignment: AlignmentSummary
    propagation: Graph
    rules_fired: list[RuleFired]
    manifest_diffs: list[ManifestDiff]
    incomplete: dict[str, str] | None = Field(description="side -> why that run is incomplete")
    analysis: Analysis
    inconclusive: Inconclusive | None = Field(None, description="set when the verdict is inconclusive")
    certification: Certification
    api_differences: ApiDifferences | None = Field(
        None, description="set when there is no first divergence and the runs called the training API differently "
                          "(the first rank whose calls differ, every step): the numbers compared matched all the same, "
                          "e.g. a learning rate changed where every gradient was zero")
    run_checks: dict[str, list[Finding]] | None = Field(
        None, description="side (a, b) -> what the run says about itself, without the other (bitguard check, "
                          "backend/check.py: a recompute that differs from its original forward, ...); the "
                          "verdict is about A against B and does not depend on it")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    def to_dict(self) -> dict:
        return self.model_dump(by_alias=True)
