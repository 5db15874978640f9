"""Inference: invariants with preconditions from recorded clean runs (`bitguard invariants infer`).

Every observation the templates make in the clean runs (templates.observe_run) is grouped by
template and key: one candidate invariant each. A candidate whose observations all agree (holds:
all True; constant: one value) becomes an invariant whose precondition keeps the features its
template names relevant where they were the same in every observation (a scheduler attached,
clipping in the step, ...): it is not carried to runs unlike every run it was seen in. A
candidate that failed somewhere is kept only if one feature separates its failures from its
passes (`first_step != True`, `world_size == 2`): the precondition is that condition. Without
one it is dropped, and listed as dropped with why: a miss is better than a false alarm.

The file is `bitguard.invariants/1` (see `document`); the same runs in the same order give the
same file, byte for byte. This module knows observations and the file; not how facts are read.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from bitguard.backend.invariants.templates import (BY_NAME, FEATURE_TEXT, FEATURES, MAX_MARGIN, SEEN_VALUES, TEMPLATES,
                                                   observe_run)

SCHEMA = "bitguard.invariants/1"
MIN_SUPPORT = 3  # observations an invariant needs in the clean runs
# the features a failure may be separated by: not the optimizer class, which tells the clean runs
# apart by accident (a hyperparameter that differs between two pipelines is no precondition)
SEPARATING = tuple(f for f in FEATURES if f != "optimizer")


@dataclass
class Invariant:
    id: str
    template: str
    names: list[str]
    relation: str
    precondition: list[dict]  # [{"feature", "op": "==" | "!=" | "in", "value", "text"}]; [] = always
    support: int
    params: dict  # {"key", "kind": holds | constant | max, "expected"}
    runs: int = 0  # clean runs it was observed in

    def to_dict(self) -> dict:
        return {"id": self.id, "template": self.template, "names": self.names, "relation": self.relation,
                "precondition": self.precondition, "support": self.support, "runs": self.runs, "params": self.params}

    @classmethod
    def from_dict(cls, d: dict) -> "Invariant":
        return cls(id=d["id"], template=d["template"], names=list(d["names"]), relation=d["relation"],
                   precondition=list(d["precondition"]), support=int(d["support"]), params=dict(d["params"]),
                   runs=int(d.get("runs", 0)))


def condition(feature: str, op: str, value) -> dict:
    if op == "in":
        return {"feature": feature, "op": op, "value": value,
                "text": f"{FEATURE_TEXT[feature]} is one of {', '.join(json.dumps(v) for v in value)}"}
    if isinstance(value, bool):
        text = FEATURE_TEXT[feature] if value == (op == "==") else f"not: {FEATURE_TEXT[feature]}"
    else:
        text = f"{FEATURE_TEXT[feature]} {'is' if op == '==' else 'is not'} {json.dumps(value)}"
    return {"feature": feature, "op": op, "value": value, "text": text}


def met(precondition: list[dict], ctx: dict) -> bool:
    """Whether a step's (or a name's) features satisfy every condition."""
    return met_compiled(compiled(precondition), ctx)


_ABSENT = object()


def compiled(precondition: list[dict]) -> tuple:
    """A precondition as (feature, op, value) triples, for `met_compiled` (a checker reads each
    invariant's many times a step)."""
    return tuple((c["feature"], c["op"], c["value"]) for c in precondition)


def met_compiled(conditions: tuple, ctx) -> bool:
    """`met` of a `compiled` precondition: a feature absent from ctx meets no condition."""
    for feature, op, value in conditions:
        x = ctx.get(feature, _ABSENT)
        if x is _ABSENT:
            return False
        if op == "in":
            if x not in value:
                return False
        elif (x == value) != (op == "=="):
            return False
    return True


def invariant_id(template: str, key: str) -> str:
    return f"{template}/{key}"


@dataclass
class _Candidate:
    template: str
    key: str
    names: tuple
    kind: str
    obs: list = field(default_factory=list)  # (value, ctx, where)


def holds(kind: str, expected, value) -> bool:
    """Whether an observed value keeps an invariant of `kind` with the clean runs' `expected`."""
    if kind == "holds":
        return value is True
    if kind == "max":
        return isinstance(value, (int, float)) and value <= expected
    return value == expected


def _expected(c: _Candidate):
    if c.kind == "holds":
        return True, None
    if c.kind == "max":
        top = max(v for v, _, _ in c.obs)
        if not top > 0:
            return None, f"largest value {top} is not positive: no bound"
        return float(f"{top * MAX_MARGIN:.6g}"), None
    counts = Counter(json.dumps(v, sort_keys=True) for v, _, _ in c.obs)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None, f"no majority value ({ranked[0][0]} and {ranked[1][0]} seen as often)"
    return json.loads(ranked[0][0]), None


def _separating(passing: list[dict], failing: list[dict]) -> list[dict] | None:
    """The precondition that holds in every passing observation and in no failing one: one
    feature condition (first the passes' common value ==, then the failures' common value !=),
    else two of the passes' common values together (a scheduler attached AND not the first step).
    None when no such condition exists: the candidate is dropped."""
    common = []
    for op in ("==", "!="):
        for f in SEPARATING:
            side = passing if op == "==" else failing
            values = {json.dumps(ctx.get(f), sort_keys=True) for ctx in side if f in ctx}
            if len(values) != 1 or any(f not in ctx for ctx in side):
                continue
            cond = condition(f, op, json.loads(values.pop()))
            if not all(met([cond], ctx) for ctx in passing):
                continue
            if not any(met([cond], ctx) for ctx in failing):
                return [cond]
            if op == "==":
                common.append(cond)
    for i, a in enumerate(common):
        for b in common[i + 1:]:
            if not any(met([a, b], ctx) for ctx in failing):
                return [a, b]
    return None


def _common(feature: str, ctxs: list[dict]):
    values = {json.dumps(ctx.get(feature), sort_keys=True) for ctx in ctxs}
    return (True, json.loads(values.pop())) if len(values) == 1 and all(feature in c for c in ctxs) else (False, None)


def decide(c: _Candidate) -> tuple[Invariant | None, str | None]:
    """The invariant a candidate gives, or None and why it was dropped."""
    expected, why = _expected(c)
    if why:
        return None, why
    passing = [ctx for v, ctx, _ in c.obs if holds(c.kind, expected, v)]
    failing = [(ctx, where) for v, ctx, where in c.obs if not holds(c.kind, expected, v)]
    pre: list[dict] = []
    if failing:
        sep = _separating(passing, [ctx for ctx, _ in failing])
        if sep is None:
            run, rank, step = failing[0][1]
            return None, (f"failed in {len(failing)} of {len(c.obs)} clean observations (first: {run} step {step}"
                          f"{'' if rank is None else f' rank {rank}'}) and no precondition separates them")
        pre += sep
    if not passing:
        return None, f"never held in the clean runs ({len(c.obs)} observations)"
    if len(passing) < MIN_SUPPORT:
        return None, f"{len(passing)} supporting observation(s), fewer than {MIN_SUPPORT}"
    template = BY_NAME[c.template]
    for f in template.relevant_features(c.key):
        if any(p["feature"] == f for p in pre):
            continue
        same, value = _common(f, passing)
        if same:
            pre.append(condition(f, "==", value))
        elif f in SEEN_VALUES and all(f in ctx for ctx in passing):
            # seen on several configurations (or learning-rate magnitudes): only those, never another
            values = sorted({json.dumps(ctx[f], sort_keys=True) for ctx in passing})
            pre.append(condition(f, "in", [json.loads(v) for v in values]))
    runs = len({where[0] for v, _, where in c.obs if holds(c.kind, expected, v)})
    return Invariant(id=invariant_id(c.template, c.key), template=c.template, names=list(c.names),
                     relation=template.relation(c.key, expected), precondition=pre, support=len(passing),
                     params={"key": c.key, "kind": c.kind, "expected": expected}, runs=runs), None


def infer(runs: dict[str, dict]) -> dict:
    """The `bitguard.invariants/1` document from clean runs: {run name: facts_from_run(...)}."""
    candidates: dict[tuple[str, str], _Candidate] = {}
    for run, facts_by_rank in runs.items():
        for t, o, rank, step in observe_run(facts_by_rank):
            c = candidates.get((t.name, o.key))
            if c is None:
                c = candidates[(t.name, o.key)] = _Candidate(t.name, o.key, o.names, o.kind)
            c.obs.append((o.value, o.ctx, (run, rank, step)))
    order = {t.name: i for i, t in enumerate(TEMPLATES)}
    invariants, dropped = [], []
    for (name, key) in sorted(candidates, key=lambda k: (order[k[0]], k[1])):
        inv, why = decide(candidates[(name, key)])
        if inv is not None:
            invariants.append(inv.to_dict())
        else:
            dropped.append({"id": invariant_id(name, key), "template": name, "why": why})
    return document(list(runs), invariants, dropped)


def document(runs: list[str], invariants: list[dict], dropped: list[dict]) -> dict:
    body = {"schema": SCHEMA, "inferred_from": runs, "invariants": invariants, "dropped": dropped}
    body["digest"] = hashlib.sha256(json.dumps(body["invariants"], sort_keys=True).encode()).hexdigest()[:16]
    return body


def infer_runs(paths: list) -> dict:
    """Infer from run directories (each read with facts.facts_from_run)."""
    from bitguard.backend.invariants.facts import facts_from_run

    return infer({str(p): facts_from_run(p) for p in paths})
