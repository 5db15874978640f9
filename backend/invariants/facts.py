"""Step facts: what one training step of one rank did, as the invariant templates read it.

`step_facts(api_rows, event_rows, tensor_rows)` builds one `StepFacts` from rows shaped like the
rank file's tables (`api_events`, `events`, `tensors`: dicts keyed by column name) of ONE step
and rank. The same function serves offline checking (`facts_from_run` reads a run's tables and
groups them by step) and online checking (the recorder passes the rows it wrote for the step).

What a step's facts hold (docs: /work/notes/INVARIANTS_CONTRACT.md, section 2):
- `api`: the step's API events (zero_grad, backward, clip_grad_norm, optimizer_step,
  scheduler_step, loss_scale, params, modes) in `ord` order, `value` decoded from JSON;
- `grads`: per parameter, the digests (xor, pos) of the first gradient autograd delivered in the
  step (`grad_input`) and of `.grad` after it arrived (`grad`): unequal means it was accumulated
  onto an older gradient;
- `updates`: per parameter the optimizer stepped, (xor at the step's first forward from the
  `params` event or None, xor after step() from the optimizer step event);
- `batch`/`batches`: digests of the step's data events (the root forward's inputs, RNG rows left
  out; a root called with keyword arguments only has none recorded: then the integer inputs of
  the first forward after it, the token ids an embedding reads), `losses`: one-element float outputs of root forwards, decoded from their xor (their bits).

Digests compare equal or not; they say nothing of magnitudes (a gradient norm cannot be
recomputed from them). This module knows the tables' columns; it knows nothing of templates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bitguard.errors import BadInput

Digest = tuple[int, int]  # (xor, pos) as unsigned 64-bit integers
API_KINDS = ("zero_grad", "backward", "clip_grad_norm", "optimizer_step", "scheduler_step", "loss_scale", "params",
             "modes")
NO_API_EVENTS = "no API events recorded: re-record with bitguard >= this version"


@dataclass
class StepFacts:
    step: int
    rank: int
    world_size: int
    api: list[dict] = field(default_factory=list)  # the step's api_events rows in ord order, value decoded
    grads: dict[str, dict[str, Digest]] = field(default_factory=dict)  # param -> {"grad_input", "grad"}
    updates: dict[str, tuple[int | None, int]] = field(default_factory=dict)  # param -> (before xor, after xor)
    batch: Digest | None = None  # the step's first data event
    training_step: bool = False  # an optimizer step happened in this step
    batches: list[Digest] = field(default_factory=list)  # every data event of the step, in order
    losses: list[float] = field(default_factory=list)  # one-element float outputs of root forwards, in order
    grad_zero: dict[str, bool] = field(default_factory=dict)  # param -> the gradient step() used was all zero bits
    stepped: dict[str, Digest] = field(default_factory=dict)  # param -> (xor, pos) after the optimizer step
    grad_used: dict[str, Digest] = field(default_factory=dict)  # param -> the gradient step() used
    grad_last: dict[str, Digest] = field(default_factory=dict)  # param -> .grad after its last gradient event
    _params_choice: int | None = field(default=None, repr=False, compare=False)  # params_row()'s, once found

    def of(self, kind: str) -> list[dict]:
        """The step's API events of `kind`, in order."""
        return [a for a in self.api if a["kind"] == kind]

    def first(self, kind: str) -> dict | None:
        for a in self.api:
            if a["kind"] == kind:
                return a
        return None

    @property
    def params(self) -> dict[str, dict]:
        """The trained root's `params` event (name -> requires_grad, dtype, device, xor, storage), or {}; with
        the parameters of the other roots the step's optimizers step, under names the trained root's do not
        take (a loss with weights and an optimizer of its own, pytorch-metric-learning's ArcFaceLoss: helper 79,
        its weight frozen mid-run broke no invariant)."""
        row = self.params_row()
        params = row["value"] if row else {}
        others = [r["value"] for r in self.of("params") if r is not row and isinstance(r["value"], dict)]
        if not others:
            return params
        stepped, params = self.optimizer_params() - set(params), dict(params)  # (names are each root's own)
        for value in others:
            if stepped.intersection(value):
                params.update((n, p) for n, p in value.items() if n not in params)
        return params

    def params_row(self) -> dict | None:
        """The `params` event of the root module this step trains. A step may call several roots
        (an EMA copy or a teacher evaluated before the training forward, an evaluation model):
        the trained one is the root whose parameters the step's optimizer steps (the most of them);
        with no optimizer step, or none in any root, the first root's."""
        rows = self.of("params")
        if len(rows) < 2:
            return rows[0] if rows else None
        if self._params_choice is None:
            stepped = self.optimizer_params()
            overlap = [len(stepped.intersection(r["value"])) if isinstance(r["value"], dict) else 0 for r in rows]
            self._params_choice = max(range(len(rows)), key=lambda i: (overlap[i], -i))
        return rows[self._params_choice]

    def optimizer_params(self) -> set[str]:
        """Every parameter name in some param group of the step's optimizer steps."""
        return {p for a in self.of("optimizer_step") for g in a["value"].get("groups", []) for p in g.get("params", [])}


def _value(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if raw is not None else {}
    except (TypeError, ValueError):
        raise BadInput(f"an api_events value is not JSON ({str(raw)[:80]!r}); the rank file is damaged: "
                       f"re-record the run") from None
    return value if isinstance(value, dict) else {"value": value}


def _u64(v) -> int:
    return int(v) & (2**64 - 1)


def _hex(v) -> int | None:
    if v is None:
        return None
    return int(v, 16) if isinstance(v, str) else _u64(v)


def _inputs(rows: dict) -> list[dict]:
    return sorted((t for (role, _), t in rows.items() if role == "input"), key=lambda t: t["idx"])


def _combined(tensors: list[dict]) -> Digest:
    """One digest for a batch's tensors, in order."""
    x = p = 0
    for t in tensors:
        x ^= _u64(t["xor"])
        p = (p * 1_000_003 + _u64(t["pos"])) & (2**64 - 1)
    return x, p


def _decode_scalar(xor: int, dtype: str) -> float | None:
    from bitguard.backend.loss_curve import _FLOATS, decode

    if dtype not in _FLOATS:
        return None
    return float(decode(np.array([xor], dtype=np.uint64), dtype)[0])


def step_facts(api_rows, event_rows, tensor_rows, world_size: int | None = None) -> StepFacts:
    """The facts of one step of one rank from its rows (dicts shaped like the tables' rows)."""
    api_rows, event_rows = list(api_rows), list(event_rows)
    steps = {r["step"] for r in api_rows} | {r["step"] for r in event_rows}
    ranks = {r["rank"] for r in api_rows if r.get("rank") is not None} | {
        r["rank"] for r in event_rows if r.get("rank") is not None}
    if len(steps) > 1 or len(ranks) > 1:
        raise ValueError(f"step_facts takes one step of one rank (got steps {sorted(steps)}, ranks {sorted(ranks)})")
    if not steps:
        raise ValueError("step_facts needs at least one row")
    step = steps.pop()
    rank = ranks.pop() if ranks else 0
    if world_size is None:
        world_size = next((r["world_size"] for r in event_rows if r.get("world_size") is not None), 1)
    by_seq: dict[int, list[dict]] = {}
    for t in tensor_rows:
        by_seq.setdefault(t["seq"], []).append(t)
    api = sorted(({"ord": r["ord"], "kind": r["kind"], "target": r.get("target"), "value": _value(r.get("value")),
                   "t_ns": r.get("t_ns")} for r in api_rows), key=lambda a: a["ord"])
    facts = StepFacts(step=step, rank=rank, world_size=int(world_size), api=api,
                      training_step=any(a["kind"] == "optimizer_step" for a in api))
    before = {name: _hex(p.get("xor")) for name, p in facts.params.items() if isinstance(p, dict)}
    keyword_batch = False
    for e in sorted(event_rows, key=lambda e: e["seq"]):
        rows = {(t["role"], t["idx"]): t for t in by_seq.get(e["seq"], []) if t.get("unobserved") is None}
        kind, phase = e["kind"], e["phase"]
        if kind == "grad":
            if ("grad_input", 0) in rows and ("grad", 0) in rows:
                digests = {r: (_u64(rows[(r, 0)]["xor"]), _u64(rows[(r, 0)]["pos"])) for r in ("grad_input", "grad")}
                facts.grads.setdefault(e["boundary"], digests)
                facts.grad_last[e["boundary"]] = digests["grad"]
        elif kind == "step" and ("param", 0) in rows:
            facts.updates[e["boundary"]] = (before.get(e["boundary"]), _u64(rows[("param", 0)]["xor"]))
            facts.stepped[e["boundary"]] = (_u64(rows[("param", 0)]["xor"]), _u64(rows[("param", 0)]["pos"]))
            facts.training_step = True
            if ("grad", 0) in rows:
                g = rows[("grad", 0)]
                facts.grad_zero[e["boundary"]] = _u64(g["xor"]) == 0 and _u64(g["pos"]) == 0
                facts.grad_used[e["boundary"]] = (_u64(g["xor"]), _u64(g["pos"]))
        elif kind == "batch":
            inputs = _inputs(rows)
            if inputs:
                facts.batches.append(_combined(inputs))
            else:  # a model called with keyword arguments only: the collector digests positional ones
                keyword_batch = True  # the token ids its first embedding-like call reads stand for the batch
        elif kind == "module" and phase == "forward" and keyword_batch:
            ids = [t for t in _inputs(rows) if str(t.get("dtype", "")).startswith(("int", "uint"))]
            if ids:
                facts.batches.append(_combined(ids))
                keyword_batch = False
        if kind == "module" and phase == "forward" and e.get("depth") == 0:
            for (role, _), t in sorted(rows.items(), key=lambda kv: kv[0][1]):
                if role == "output" and list(t.get("shape") or []) in ([], [1]) and t.get("shard") is None:
                    value = _decode_scalar(_u64(t["xor"]), t["dtype"])
                    if value is not None:
                        facts.losses.append(value)
                        break
    facts.batch = facts.batches[0] if facts.batches else None
    return facts


# -- a recorded run ----------------------------------------------------------------------------

def _api_table(info, rank: int):
    """The api_events rows of one rank (rank file and journal), or None when the file has no such table."""
    from bitguard import schema
    from bitguard.backend.ingest import rank_table

    table = getattr(schema, "API_EVENTS", None)
    if table is None:
        return None
    return rank_table(info, rank, table)


def facts_from_run(run) -> dict[int, list[StepFacts]]:
    """Every rank's StepFacts of run directory `run` (or an ingest.RunInfo), in step order.
    BadInput when the run holds no API events (recorded before they existed)."""
    from bitguard.backend.ingest import RunInfo, load_rank, open_run

    info = run if isinstance(run, RunInfo) else open_run(Path(run))
    out: dict[int, list[StepFacts]] = {}
    any_api = False
    for rank in sorted(info.ranks):
        api = _api_table(info, rank)
        if api is None or api.height == 0:
            continue
        any_api = True
        events, tensors, _ = load_rank(info, rank)
        keep = [c for c in ("seq", "rank", "world_size", "step", "phase", "kind", "boundary", "depth")
                if c in events.columns]
        ev = events.filter(events["kind"].is_in(["grad", "step", "batch", "module"])).select(keep)
        ev = ev.filter((ev["kind"] != "module") | (ev["phase"] == "forward"))
        te = tensors.filter(tensors["seq"].is_in(ev["seq"].to_list())
                            & tensors["role"].is_in(["input", "output", "grad", "grad_input", "param"]))
        ev_by_step: dict[int, list[dict]] = {}
        for r in ev.to_dicts():
            ev_by_step.setdefault(r["step"], []).append(r)
        te_by_seq: dict[int, list[dict]] = {}
        for r in te.select([c for c in ("seq", "role", "idx", "shape", "dtype", "xor", "pos", "unobserved", "shard")
                            if c in te.columns]).to_dicts():
            te_by_seq.setdefault(r["seq"], []).append(r)
        api_by_step: dict[int, list[dict]] = {}
        for r in api.to_dicts():
            api_by_step.setdefault(r["step"], []).append({**r, "rank": rank})
        steps = []
        for step in sorted(set(api_by_step) | set(ev_by_step)):
            evs = [{**e, "rank": rank} for e in ev_by_step.get(step, [])]
            tens = [t for e in evs for t in te_by_seq.get(e["seq"], [])]
            steps.append(step_facts(api_by_step.get(step, []), evs, tens, world_size=info.world_size))
        out[rank] = steps
    if not any_api:
        raise BadInput(f"{info.path}: {NO_API_EVENTS}")
    return out
