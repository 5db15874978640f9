"""Checking: a run's steps against inferred invariants, offline (`bitguard invariants check`) or
online (the recorder calls `Checker.check_step` at each step end with the step's facts).

`Checker(invariants)` observes each step through the same templates as inference (one
`templates.Observer`, so a template's state carries from step to step) and, for every
observation whose invariant exists and whose precondition the step meets, compares the value
with the clean runs' one: a difference is a `Violation` (step, rank, invariant id, template,
evidence, message). What was never applied is reported with why (`skipped`): no observation of
its names in this run (another model, no clipping, one rank), or its precondition never met:
that is transfer, said, never a silent pass.

Cross-rank invariants (replicas equal after each step) need every rank's facts of a step:
`check_ranks` (offline); `check_step` alone never applies them. `load_invariants` reads and
validates a `bitguard.invariants/1` file. The offline document is `bitguard.invariant-check/1`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bitguard.backend.invariants.facts import StepFacts
from bitguard.backend.invariants.infer import SCHEMA, Invariant, compiled, holds, invariant_id, met, met_compiled
from bitguard.backend.invariants.templates import BY_NAME, Observer
from bitguard.errors import BadInput

CHECK_SCHEMA = "bitguard.invariant-check/1"
MAX_FILE_BYTES = 64 << 20


@dataclass
class Violation:
    step: int
    rank: int | None  # None: a cross-rank invariant (every rank of the step)
    invariant_id: str
    template: str
    evidence: dict
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def load_invariants(path) -> list[Invariant]:
    """The invariants of a `bitguard.invariants/1` file; BadInput (one line) when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path} is not a file; give the invariants file written by 'bitguard invariants infer -o'")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise BadInput(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB: not an invariants file")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{path} is not JSON ({str(exc).splitlines()[0][:120]}); give a file written by "
                       f"'bitguard invariants infer'") from None
    return parse_invariants(doc, str(path))


def parse_invariants(doc, where: str = "the invariants document") -> list[Invariant]:
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise BadInput(f"{where} is not a {SCHEMA} document (schema {found!r}); give a file written by "
                       f"'bitguard invariants infer'")
    out = []
    for i, d in enumerate(doc.get("invariants") or []):
        try:
            inv = Invariant.from_dict(d)
            if inv.template not in BY_NAME or inv.params["kind"] not in ("holds", "constant", "max") or "key" not in inv.params:
                raise ValueError(f"unknown template {inv.template!r} or kind")
            if inv.id != invariant_id(inv.template, inv.params["key"]):
                raise ValueError(f"id {inv.id!r} does not match its template and key")
            for c in inv.precondition:
                if c.get("op") not in ("==", "!=", "in") or "feature" not in c or (
                        c["op"] == "in" and not isinstance(c.get("value"), list)):
                    raise ValueError(f"bad precondition {c!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BadInput(f"{where}: invariant {i} is malformed ({exc}); re-infer the file") from None
        out.append(inv)
    return out


def _brief(evidence: dict) -> str:
    parts = []
    for k, v in evidence.items():
        text = json.dumps(v, sort_keys=True)
        parts.append(f"{k}={text if len(text) <= 80 else text[:77] + '...'}")
    return ", ".join(parts[:4])


class Checker:
    """Checks steps against invariants, keeping the templates' state between steps (one Checker
    per checked run)."""

    def __init__(self, invariants: list[Invariant]):
        self.invariants = {(i.template, i.params["key"]): i for i in invariants}
        self._conditions = {i.id: compiled(i.precondition) for i in invariants}
        self.observer = Observer()
        self.applied: dict[str, int] = {}  # id -> observations checked
        self.seen: set[str] = set()  # ids observed at all (names present)
        self.violated: dict[str, int] = {}
        self.conditions_held: dict[str, set[int]] = {}  # id -> conditions met at least once (unapplied ones)

    def _judge(self, pairs, step: int, rank: int | None) -> list[Violation]:
        out = []
        for t, o in pairs:
            inv = self.invariants.get((t.name, o.key))
            if inv is None:
                continue
            self.seen.add(inv.id)
            if not met_compiled(self._conditions[inv.id], o.ctx):
                held = self.conditions_held.setdefault(inv.id, set())
                if len(held) < len(inv.precondition):  # (which conditions ever held: for `skipped`)
                    held.update(i for i, c in enumerate(inv.precondition) if met([c], o.ctx))
                continue
            self.applied[inv.id] = self.applied.get(inv.id, 0) + 1
            kind = inv.params["kind"]
            expected = True if kind == "holds" else inv.params["expected"]
            if holds(kind, expected, o.value):
                continue
            self.violated[inv.id] = self.violated.get(inv.id, 0) + 1
            evidence = dict(o.evidence)
            if kind == "constant":
                evidence = {"expected": expected, "observed": o.value, **evidence}
            elif kind == "max":
                evidence = {"at_most": expected, "observed": o.value, **evidence}
            message = f"{inv.relation} [{inv.id}]: {_brief(evidence)}"
            out.append(Violation(step=step, rank=rank, invariant_id=inv.id, template=inv.template,
                                 evidence=evidence, message=message))
        return out

    def check_step(self, facts: StepFacts) -> list[Violation]:
        """The violations of one rank's step (steps of a rank in order)."""
        return self._judge(self.observer.step(facts), facts.step, facts.rank)

    def check_ranks(self, facts_by_rank: dict[int, StepFacts]) -> list[Violation]:
        """The cross-rank violations of one step (each rank's facts already passed to check_step)."""
        step = next(iter(facts_by_rank.values())).step if facts_by_rank else 0
        return self._judge(self.observer.ranks(facts_by_rank), step, None)

    def skipped(self) -> list[dict]:
        out = []
        for inv in sorted(self.invariants.values(), key=lambda i: i.id):
            if inv.id in self.applied:
                continue
            if inv.id not in self.seen:
                why = (f"names absent: this run has no observation of {', '.join(inv.names)}"
                       if inv.names != ["*"] else "names absent: nothing in this run that it covers")
                if BY_NAME[inv.template].cross_rank and inv.params["key"].startswith(("replicated:", "stable_replicated")):
                    why += " (a cross-rank invariant: needs two or more ranks, checked offline)"
            else:
                held = self.conditions_held.get(inv.id, set())
                never = [c for i, c in enumerate(inv.precondition) if i not in held] or inv.precondition
                why = "precondition absent: " + "; ".join(c.get("text") or f"{c['feature']} {c['op']} {c['value']}"
                                                           for c in never)
            out.append({"id": inv.id, "why": why})
        return out


def check_facts(facts_by_rank: dict[int, list[StepFacts]], invariants: list[Invariant], run: str = "") -> dict:
    """The `bitguard.invariant-check/1` document of one run's facts."""
    checker = Checker(invariants)
    violations: list[Violation] = []
    by_step: dict[int, dict[int, StepFacts]] = {}
    for rank in sorted(facts_by_rank):
        for facts in facts_by_rank[rank]:
            violations += checker.check_step(facts)
            by_step.setdefault(facts.step, {})[rank] = facts
    for step in sorted(by_step):
        violations += checker.check_ranks(by_step[step])
    violations.sort(key=lambda v: (v.step, -1 if v.rank is None else v.rank, v.invariant_id))
    first = {}
    for v in violations:
        first.setdefault(v.invariant_id, v.step)
    return {"schema": CHECK_SCHEMA, "run": run, "invariants": len(invariants),
            "applied": sorted(checker.applied), "skipped": checker.skipped(),
            "violated": [{"id": i, "count": n, "first_step": first[i]} for i, n in sorted(checker.violated.items())],
            "violations": [v.to_dict() for v in violations]}


def check_run(path, invariants: list[Invariant]) -> dict:
    from bitguard.backend.invariants.facts import facts_from_run

    return check_facts(facts_from_run(path), invariants, str(path))
