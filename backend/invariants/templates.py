"""Relation templates: what each kind of invariant observes in a step's facts.

A template turns one rank's `StepFacts`, seen in step order, into observations (`Obs`): a key
naming the relation (`dtype:blocks.0.ln_1.weight`, `order:backward<optimizer_step`), what it
covers, the value seen, and the step's context (the features preconditions are made of). An
observation is either of a relation that must hold (`holds`: the value is True or False) or of
a value that must stay the same (`constant`: the clean runs' value is learned). Inference
(infer.py) gathers the observations of clean runs, checking (check.py) those of any run; both
feed steps in order through the same `observe`, so what is inferred is exactly what is checked.

Templates: Consistent (a value equal across steps or ranks, coverage of the optimizer and of
clipping), EventContain (what each training step must contain), Sequence (the order of API
calls in a step), Update (which parameters change, and when), Bound (clipping's returned norm,
the learning rate against the scheduler, the backward root against the loss), Mode (train/eval
of the modules whose mode matters), Distinct (a step's batch is not the previous one's).

Each template keeps a small state per rank between steps (`state`, a dict the caller owns and
starts empty for each rank of each run). This module knows StepFacts; nothing of files.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field

from bitguard.backend.invariants.facts import StepFacts

# The step features a precondition may name, in the order the inference tries them.
FEATURES = ("world_size", "accum", "scheduler", "clip", "amp", "optimizer", "model_dtype", "first_step",
            "set_to_none", "frozen_at_start", "tied_at_start", "dtypes_at_start", "eval_at_start", "dtype",
            "requires_grad", "lr_decade")
FEATURE_TEXT = {
    "world_size": "world size", "accum": "backward calls per optimizer step", "scheduler": "an LR scheduler is attached",
    "clip": "gradients are clipped in the step", "amp": "a GradScaler scales the loss",
    "optimizer": "optimizer class", "model_dtype": "the parameters' most common dtype",
    "first_step": "first training step of the run", "set_to_none": "zero_grad's set_to_none (last seen)",
    "dtype": "the parameter's dtype", "requires_grad": "the parameter requires grad",
    "lr_decade": "the parameter's learning rate's power of ten (floor of log10)",
    # the model's configuration as its first training step showed it (count:digest of the names):
    # a per-name relation learned on one configuration is not carried to another
    "frozen_at_start": "the parameters frozen at the first training step",
    "tied_at_start": "the parameters sharing storage at the first training step",
    "dtypes_at_start": "the parameters' dtypes at the first training step",
    "eval_at_start": "the modules in eval mode at the first training step",
}
# per-name relations: the configuration features that must match the clean runs' (the first
# training step's), so that a model frozen, tied or cast by design is not read as a bug
CONFIG = ("frozen_at_start", "tied_at_start", "dtypes_at_start", "eval_at_start")
# features a precondition holds to the values the clean runs showed ("is one of") when they were
# several: the configuration, and the learning rate's order of magnitude (an update smaller than a
# parameter's last bit leaves it unchanged: `changes_at_step` is known only at the rates it was seen at)
SEEN_VALUES = (*CONFIG, "lr_decade")
MAX_MARGIN = 1.5  # a `max` invariant's bound: this times the largest value the clean runs showed
SEQ_KINDS = ("zero_grad", "backward", "clip_grad_norm", "clip_grad_value", "optimizer_step", "scheduler_step",
             "loss_scale")


@dataclass(frozen=True)
class Obs:
    key: str  # the relation: the invariant's id within its template
    names: tuple[str, ...]  # what it covers ("*": every name its descriptor selects)
    value: object  # holds: True/False; constant: a JSON value
    ctx: dict = field(hash=False, compare=False)  # feature -> value in this step (and for this name)
    evidence: dict = field(hash=False, compare=False, default_factory=dict)
    kind: str = "holds"  # holds | constant | max (at most MAX_MARGIN x the clean runs' largest)


def context(facts: StepFacts, state: dict) -> dict:
    """The step's features (state: the rank's state dict, shared with the templates)."""
    run = state.setdefault("_run", {"training_steps": 0, "scheduler": False, "amp": False, "set_to_none": None})
    for a in facts.api:
        if a["kind"] in ("scheduler_init", "scheduler_step"):
            run["scheduler"] = True
        elif a["kind"] == "loss_scale" and a["value"].get("enabled", True):  # (a disabled GradScaler scales nothing)
            run["amp"] = True
        elif a["kind"] == "zero_grad":
            run["set_to_none"] = a["value"].get("set_to_none")
        elif a["kind"] == "optimizer_step":
            if any("initial_lr" in g for g in a["value"].get("groups", [])):
                run["scheduler"] = True
    dtypes = Counter(p.get("dtype") for p in facts.params.values() if isinstance(p, dict))
    if dtypes:
        run["model_dtype"] = sorted(dtypes.items(), key=lambda kv: (-kv[1], str(kv[0])))[0][0]
    if facts.training_step and "frozen_at_start" not in run and facts.params:
        run.update(_configuration(facts))
    optimizers = sorted({str(a["target"]).split("#")[0] for a in facts.of("optimizer_step")})
    ctx = {"world_size": facts.world_size, "accum": len(facts.of("backward")), "scheduler": run["scheduler"],
           "clip": bool(facts.of("clip_grad_norm") or facts.of("clip_grad_value")), "amp": run["amp"],
           "optimizer": "+".join(optimizers) or None, "model_dtype": run.get("model_dtype"),
           "first_step": facts.training_step and run["training_steps"] == 0, "set_to_none": run["set_to_none"],
           **{k: run[k] for k in CONFIG if k in run}}
    if facts.training_step:
        run["training_steps"] += 1
    return ctx


def _signature(names) -> str:
    names = sorted(names)
    return f"{len(names)}:{hashlib.sha256(chr(0).join(names).encode()).hexdigest()[:8]}"


def _configuration(facts: StepFacts) -> dict:
    params = {n: p for n, p in facts.params.items() if isinstance(p, dict)}
    tied = _tied(params)
    backward = _ords(facts, "backward")
    modes = [a for a in facts.of("modes") if not backward or a["ord"] < backward[0]]
    return {"frozen_at_start": _signature(n for n, p in params.items() if p.get("requires_grad") is False),
            "tied_at_start": _signature(f"{n}={t}" for n, t in tied.items() if n != t),
            "dtypes_at_start": _signature(f"{n}:{p.get('dtype')}" for n, p in params.items()),
            "eval_at_start": _signature(modes[-1]["value"].get("eval") or [] if modes else [])}


def _ords(facts: StepFacts, kind: str) -> list[int]:
    return [a["ord"] for a in facts.api if a["kind"] == kind]


class Template:
    name = ""
    relevant: dict[str, tuple[str, ...]] = {}  # key prefix -> features kept in the precondition when constant
    cross_rank = False

    def observe(self, facts: StepFacts, ctx: dict, state: dict) -> list[Obs]:
        return []

    def observe_ranks(self, facts_by_rank: dict[int, StepFacts], ctx: dict, state: dict | None = None) -> list[Obs]:
        return []

    def relation(self, key: str, expected) -> str:
        raise NotImplementedError

    def relevant_features(self, key: str) -> tuple[str, ...]:
        return self.relevant.get(key.split(":")[0], ())


class Features:
    """A parameter's own features over the step's (a view, not a copy: one per parameter per step).
    Read-only, with the three reads preconditions use (`in`, `[]`, `get`); a plain class rather
    than a ChainMap, whose every lookup walks its maps in Python (the online check makes hundreds a
    step)."""

    __slots__ = ("own", "step")

    def __init__(self, own: dict, step: dict):
        self.own, self.step = own, step

    def __contains__(self, key) -> bool:
        return key in self.own or key in self.step

    def __getitem__(self, key):
        own = self.own
        return own[key] if key in own else self.step[key]

    def get(self, key, default=None):
        own = self.own
        return own[key] if key in own else self.step.get(key, default)


def _of_param(ctx: dict, p: dict) -> Features:
    """The step's features and a parameter's own."""
    return Features({"dtype": p.get("dtype"), "requires_grad": p.get("requires_grad")}, ctx)


def _decade(lr) -> int | None:
    """floor(log10(lr)) of a positive finite learning rate, else None."""
    return math.floor(math.log10(lr)) if isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0 else None


def _word(v) -> int:
    return int(v, 16) if isinstance(v, str) else int(v)


def _tied(params: dict) -> dict[str, str]:
    """name -> the first name (sorted) sharing its storage: itself when untied."""
    by_storage: dict = {}
    for name in sorted(params):
        sid = params[name].get("storage")
        if sid is not None:
            by_storage.setdefault(sid, name)
    return {n: by_storage.get(params[n].get("storage"), n) for n in params}


class Consistent(Template):
    name = "Consistent"
    relevant = {"clip_covers": ("clip",), "stable_max_norm": ("clip",), "replicated": ("world_size",),
                "stable_replicated": ("world_size",),
                "dtype": CONFIG, "requires_grad": CONFIG, "storage": CONFIG}

    def observe(self, facts, ctx, state):
        if not facts.training_step:
            return []
        out = []
        params = {n: p for n, p in facts.params.items() if isinstance(p, dict)}
        tied = _tied(params)
        in_opt = facts.optimizer_params()
        groups = {tied.get(m, m) for m in in_opt}
        in_opt |= {n for n in params if tied[n] in groups}  # a tied alias is in too
        first = state.setdefault("first", {})  # name -> (requires_grad, dtype, storage) at its first step
        for n in sorted(params):
            p = params[n]
            feat = _of_param(ctx, p)
            now = {"requires_grad": p.get("requires_grad"), "dtype": p.get("dtype"), "shares_storage_with": tied[n]}
            was = first.setdefault(n, (facts.step, now))
            for what, value in now.items():
                out.append(Obs(f"stable_{what}", ("*",), value == was[1][what], feat,
                               {"param": n, what: value, "at_step": was[0], "was": was[1][what]}))
            out.append(Obs(f"dtype:{n}", (n,), p.get("dtype"), feat, {"param": n, "dtype": p.get("dtype")}, "constant"))
            out.append(Obs(f"requires_grad:{n}", (n,), p.get("requires_grad"), feat,
                           {"param": n, "requires_grad": p.get("requires_grad")}, "constant"))
            out.append(Obs(f"storage:{n}", (n,), tied[n], feat, {"param": n, "shares_storage_with": tied[n]},
                           "constant"))
            if p.get("requires_grad") and facts.of("optimizer_step"):
                out.append(Obs("in_optimizer", ("*",), n in in_opt, feat, {"param": n}))
        stepped = set(facts.updates)
        for a in facts.of("clip_grad_norm") + facts.of("clip_grad_value"):
            clipped = set(a["value"].get("params") or [])
            missing = sorted(stepped - clipped)
            out.append(Obs("clip_covers", ("*",), not missing, ctx,
                           {"not_clipped": missing[:10], "not_clipped_count": len(missing), "ord": a["ord"]}))
            if a["kind"] == "clip_grad_norm":  # a hyperparameter: constant within a run, not across runs
                m = a["value"].get("max_norm")
                was = state.setdefault("max_norm", (facts.step, m))
                out.append(Obs("stable_max_norm", ("clip_grad_norm",), m == was[1], ctx,
                               {"max_norm": m, "was": was[1], "at_step": was[0], "ord": a["ord"]}))
        return out

    cross_rank = True

    def observe_ranks(self, facts_by_rank, ctx, state=None):
        """Parameters replicated across ranks (data parallel): equal after each step on every rank.
        Per name (`replicated:NAME`, the clean runs' names) and name-free (`stable_replicated`: a
        parameter equal on every rank at its first cross-rank observation stays equal; it transfers
        to any model, and one sharded or different per rank from the start is never asked)."""
        state = {} if state is None else state
        equal_at_start = state.setdefault("equal_at_start", {})  # name -> (step, equal on every rank then)
        ranks = sorted(facts_by_rank)
        if len(ranks) < 2 or not all(facts_by_rank[r].training_step for r in ranks):
            return []
        out = []
        starts = {r: {n: p.get("xor") for n, p in facts_by_rank[r].params.items() if isinstance(p, dict)}
                  for r in ranks}
        names = set.intersection(*(set(facts_by_rank[r].updates) | set(starts[r]) for r in ranks))
        for n in sorted(names):
            evidence = {"param": n}
            same = True
            for what, by_rank in (("xor_at_forward", {r: starts[r].get(n) for r in ranks}),
                                  ("xor_after_step", {r: facts_by_rank[r].updates.get(n, (None, None))[1]
                                                      for r in ranks})):
                if any(v is None for v in by_rank.values()):
                    continue
                values = {r: int(v, 16) if isinstance(v, str) else v for r, v in by_rank.items()}
                same = same and len(set(values.values())) == 1
                evidence[what] = {str(r): f"{v:016x}" for r, v in values.items()}
            if len(evidence) > 1:
                out.append(Obs(f"replicated:{n}", (n,), same, ctx, evidence))
                start = equal_at_start.setdefault(n, (facts_by_rank[ranks[0]].step, same))
                if start[1] and start[0] != facts_by_rank[ranks[0]].step:
                    out.append(Obs("stable_replicated", ("*",), same, ctx,
                                   {**evidence, "equal_since_step": start[0]}))
        return out

    def relation(self, key, expected):
        what, _, name = key.partition(":")
        return {
            "dtype": f"{name} has dtype {expected} in every training step",
            "requires_grad": f"{name} has requires_grad={expected} in every training step",
            "storage": (f"{name} shares its storage with {expected} (tied)" if expected != name
                        else f"{name} shares its storage with no other parameter"),
            "in_optimizer": "every parameter that requires grad is in some param group of the optimizer",
            "stable_requires_grad": "a parameter's requires_grad stays what it was at its first training step",
            "stable_dtype": "a parameter's dtype stays what it was at its first training step",
            "stable_shares_storage_with": "the parameters sharing storage (tied) stay those of the first training step",
            "clip_covers": "gradient clipping covers every parameter the optimizer steps",
            "stable_max_norm": "clip_grad_norm_'s max_norm stays what it was at the run's first clipping",
            "stable_replicated": "a parameter equal on every rank at its first training step stays equal on every "
                                 "rank at each step's forward and after its optimizer step (replicated)",
            "replicated": f"{name} is equal on every rank at each step's forward and after its optimizer step "
                          f"(replicated)",
        }[what]


class EventContain(Template):
    name = "EventContain"
    relevant = {"scheduler_stepped": ("scheduler",)}

    def observe(self, facts, ctx, state):
        if not facts.training_step:
            return []
        out = []
        backward = _ords(facts, "backward")
        steps = _ords(facts, "optimizer_step")
        if backward and not ctx.get("first_step"):  # (the first has no older gradient to clear: grads_fresh checks it)
            zero = [o for o in _ords(facts, "zero_grad") if o < backward[0]]
            out.append(Obs("zero_grad_before_backward", ("zero_grad", "backward"), bool(zero), ctx,
                           {"first_backward_ord": backward[0], "zero_grad_ords": _ords(facts, "zero_grad")}))
        if facts.grads:
            stale = sorted(n for n, g in facts.grads.items() if g["grad"] != g["grad_input"])
            out.append(Obs("grads_fresh", ("*",), not stale, ctx,
                           {"accumulated_onto_old_grad": stale[:10], "count": len(stale)}))
        if steps:
            ok = bool(backward) and backward[-1] < steps[0]
            out.append(Obs("step_after_backward", ("backward", "optimizer_step"), ok, ctx,
                           {"backward_ords": backward[-3:], "optimizer_step_ord": steps[0]}))
        out.append(Obs("scheduler_stepped", ("scheduler_step",), bool(facts.of("scheduler_step")), ctx,
                       {"scheduler_steps": len(facts.of("scheduler_step"))}))
        # a run that clipped in every training step so far keeps clipping (a run's own habit: not
        # carried from the clean runs' configuration, so a run that never clips is not asked)
        clipped = ctx.get("clip", False)
        kept = state.setdefault("clip_history", [0, 0])  # [training steps so far, of them clipped]
        if kept[0] and kept[1] == kept[0]:
            out.append(Obs("clip_kept", ("clip",), clipped, ctx,
                           {"clipped_steps_before": kept[1], "clip_calls": len(facts.of("clip_grad_norm")
                                                                               + facts.of("clip_grad_value"))}))
        kept[0] += 1
        kept[1] += bool(clipped)
        return out

    def relation(self, key, expected):
        return {
            "zero_grad_before_backward": "each training step after the run's first calls zero_grad before its first "
                                         "backward",
            "grads_fresh": "each parameter's first gradient in a step is not accumulated onto an older one "
                           "(.grad was zeroed or None before backward)",
            "step_after_backward": "each training step's optimizer step comes after its backward",
            "scheduler_stepped": "each training step steps the LR scheduler",
            "clip_kept": "a run that clipped gradients in every training step so far clips them in this one too",
        }[key]


class Sequence(Template):
    name = "Sequence"

    def observe(self, facts, ctx, state):
        if not facts.training_step:
            return []
        ords = {k: _ords(facts, k) for k in SEQ_KINDS}
        out = []
        for a in SEQ_KINDS:
            for b in SEQ_KINDS:
                if a != b and ords[a] and ords[b]:
                    out.append(Obs(f"order:{a}<{b}", (a, b), ords[a][-1] < ords[b][0], ctx,
                                   {f"{a}_ords": ords[a][-3:], f"{b}_ords": ords[b][:3]}))
        return out

    def relation(self, key, expected):
        a, _, b = key.partition(":")[2].partition("<")
        return f"in each training step where both happen, every {a} comes before the first {b}"


class Update(Template):
    name = "Update"
    relevant = {"changes_at_step": ("amp", "lr_decade"), "gets_grad": CONFIG}

    def observe(self, facts, ctx, state):
        out = []
        params = {n: p for n, p in facts.params.items() if isinstance(p, dict)}
        expect = state.setdefault("update_expect", {})  # name -> (xor, why, step)
        for n in sorted(params):
            now = params[n].get("xor")
            now = int(now, 16) if isinstance(now, str) else now
            if n in expect and now is not None:
                xor, why, step = expect[n]
                feat = _of_param(ctx, params[n])
                out.append(Obs(why, ("*",), now == xor, feat,
                               {"param": n, "since_step": step, "expected_xor": f"{xor:016x}", "xor": f"{now:016x}"}))
        lrs = {}
        for a in facts.of("optimizer_step"):
            for g in a["value"].get("groups", []):
                for p in g.get("params", []):
                    lrs[p] = g.get("lr")
        if facts.training_step:
            got = set(facts.grads) | set(facts.updates)
            for n in sorted(params):
                out.append(Obs(f"gets_grad:{n}", (n,), n in got, _of_param(ctx, params[n]),
                               {"param": n, "received_gradient": n in got}, "constant"))
            for n in sorted(params):
                if params[n].get("requires_grad") is False:
                    before, after = facts.updates.get(n, (None, None))
                    out.append(Obs("frozen_unchanged", ("*",), before is None or before == after,
                                   _of_param(ctx, params[n]),
                                   {"param": n, "stepped": n in facts.updates}))
            prev = state.setdefault("after", {})  # name -> (xor, pos) after its last optimizer step
            for n, after in sorted(facts.stepped.items()):
                # before: the digest after its previous step, or at this step's forward when the params
                # row has both words (an xor alone cancels on a tensor of equal values: no "unchanged")
                p = params.get(n, {})
                before = prev.get(n) or ((_word(p["xor"]), _word(p["pos"])) if p.get("pos") and p.get("xor") else None)
                prev[n] = after
                if before is None or facts.grad_zero.get(n) or not lrs.get(n):
                    continue
                feat = Features({"dtype": p.get("dtype"), "requires_grad": True,
                                 "lr_decade": _decade(lrs[n])}, ctx)
                out.append(Obs("changes_at_step", ("*",), before != after, feat,
                               {"param": n, "lr": lrs.get(n), "xor": f"{after[0]:016x}", "pos": f"{after[1]:016x}"}))
        # what the next step's first forward must find
        new = {}
        for n in params:
            xor = params[n].get("xor")
            if n in facts.updates:
                new[n] = (facts.updates[n][1], "no_edit_between_steps", facts.step)
            elif xor is not None:
                new[n] = (int(xor, 16) if isinstance(xor, str) else xor, "unstepped_unchanged", facts.step)
        if params:
            state["update_expect"] = new
        return out

    def relation(self, key, expected):
        what, _, name = key.partition(":")
        return {
            "changes_at_step": "each parameter the optimizer steps with a nonzero gradient and lr > 0 changes",
            "no_edit_between_steps": "no parameter changes between an optimizer step and the next step's forward "
                                     "(no in-place edit outside the optimizer)",
            "unstepped_unchanged": "a parameter the optimizer did not step keeps its value into the next step",
            "frozen_unchanged": "a parameter with requires_grad=False is not changed by the optimizer step",
            "gets_grad": f"{name} {'receives' if expected else 'never receives'} a gradient in a training step",
        }[what]


class Bound(Template):
    name = "Bound"
    relevant = {"clip_total_norm": ("clip",), "clip_scales_grads": ("clip", "world_size"), "lr_is_scheduled": ("scheduler",), "loss_over_accum": ("amp",),
                "loss_bound": ("amp", "model_dtype", *CONFIG)}

    def observe(self, facts, ctx, state):
        out = []
        for a in facts.api:
            if a["kind"] == "scheduler_step":
                state["last_lr"] = (a["value"].get("last_lr"), facts.step)
            elif a["kind"] == "optimizer_step" and state.get("last_lr"):
                last, since = state["last_lr"]
                lrs = [g.get("lr") for g in a["value"].get("groups", [])]
                if last is not None and len(last) == len(lrs):
                    ok = all(x is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
                             for x, y in zip(lrs, last))
                    out.append(Obs("lr_is_scheduled", ("optimizer_step", "scheduler_step"), ok, ctx,
                                   {"lr": lrs, "scheduler_last_lr": last, "scheduler_step_in": since}))
            elif a["kind"] == "clip_grad_norm":
                n = a["value"].get("total_norm")
                ok = isinstance(n, (int, float)) and math.isfinite(n) and n > 0
                out.append(Obs("clip_total_norm", ("clip_grad_norm",), ok, ctx,
                               {"total_norm": n, "max_norm": a["value"].get("max_norm"), "ord": a["ord"]}))
                out += self._clip_applied(facts, a, ctx)
        if facts.training_step:
            out += self._loss_bound(facts, ctx)
            roots = [b["value"].get("value") for b in facts.of("backward")]
            if roots and len(roots) == len(facts.losses) and all(isinstance(r, (int, float)) for r in roots):
                n = len(roots)
                ratios = [r * n / loss for r, loss in zip(roots, facts.losses) if loss not in (0, None)
                          and math.isfinite(loss) and math.isfinite(r)]
                if len(ratios) == n:
                    value = round(sum(ratios) / n, 3)
                    out.append(Obs("loss_over_accum", ("backward", "loss"), value, ctx,
                                   {"backward_roots": roots[:4], "losses": facts.losses[:4], "backward_calls": n},
                                   "constant"))
        return out

    @staticmethod
    def _clip_applied(facts, clip: dict, ctx) -> list[Obs]:
        """Over its max norm, clipping scales the gradients: those step() used differ from those
        backward left (a digest cannot give a norm, but it tells scaled from untouched)."""
        total, top = clip["value"].get("total_norm"), clip["value"].get("max_norm")
        backward = _ords(facts, "backward")
        if not (isinstance(total, (int, float)) and isinstance(top, (int, float)) and math.isfinite(total)
                and total > top * (1 + 1e-6)) or not backward or clip["ord"] < backward[-1]:
            return []
        names = [n for n in clip["value"].get("params") or [] if n in facts.grad_used and n in facts.grad_last]
        if not names:
            return []
        untouched = sorted(n for n in names if facts.grad_used[n] == facts.grad_last[n])
        return [Obs("clip_scales_grads", ("clip_grad_norm", "*"), not untouched, ctx,
                    {"total_norm": total, "max_norm": top, "unscaled": untouched[:10], "count": len(untouched)})]

    @staticmethod
    def _loss_bound(facts, ctx) -> list[Obs]:
        """The backward root (unscaled) times the step's backward calls: the loss the step trained
        on as if it were one call. Keyed by the root module, whose loss scale it is."""
        backward = facts.of("backward")
        row = facts.params_row()
        root = row["target"] if row else None
        values = []
        for b in backward:
            v, scale = b["value"].get("value"), b["value"].get("scaled_by")
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                return []
            values.append(v / scale if isinstance(scale, (int, float)) and scale else v)
        if not values or root is None:
            return []
        worst = max(values) * len(values)
        return [Obs(f"loss_bound:{root}", ("backward", root), worst, ctx,
                    {"backward_roots": values[:4], "backward_calls": len(values), "root_x_calls": worst}, "max")]

    def relation(self, key, expected):
        if key.startswith("loss_bound:"):
            return (f"the backward root of {key.partition(':')[2]} times the backward calls per step is at most "
                    f"{expected:g} ({MAX_MARGIN}x the largest in the clean runs: the loss divided by the accumulation "
                    f"count)")
        return {
            "clip_total_norm": "clip_grad_norm_ returns a finite, positive total norm (gradients exist when clipped)",
            "clip_scales_grads": "over max_norm, clipping scales every gradient it covers before the optimizer "
                                 "uses it (the post-clip norm is brought to max_norm)",
            "lr_is_scheduled": "each param group's lr at optimizer step is the scheduler's last_lr",
            "loss_over_accum": (f"backward root x backward calls per step / root module loss = {expected} "
                                f"(the loss divided by the accumulation count)"),
        }[key]


class Mode(Template):
    name = "Mode"
    relevant = {"mode": CONFIG}

    def observe(self, facts, ctx, state):
        if not facts.training_step:
            return []
        backward = _ords(facts, "backward")
        modes = [a for a in facts.of("modes") if not backward or a["ord"] < backward[0]]
        if not modes:
            return []
        m = modes[-1]["value"]
        out = []
        training, evaluating = list(m.get("training") or []), list(m.get("eval") or [])
        out.append(Obs("all_training", ("*",), not evaluating, ctx, {"eval": evaluating[:10]}))
        for name in sorted(training):
            out.append(Obs(f"mode:{name}", (name,), "training", ctx, {"module": name, "mode": "training"}, "constant"))
        for name in sorted(evaluating):
            out.append(Obs(f"mode:{name}", (name,), "eval", ctx, {"module": name, "mode": "eval"}, "constant"))
        return out

    def relation(self, key, expected):
        if key == "all_training":
            return "in training steps every dropout-like module is in training mode at the forward before backward"
        return f"{key.partition(':')[2]} is in {expected} mode in training steps"


class Distinct(Template):
    name = "Distinct"

    def observe(self, facts, ctx, state):
        if not facts.training_step or not facts.batches:
            return []
        prev = state.get("last_batch")
        state["last_batch"] = facts.batches[-1]
        out = []
        seen, repeats = ([prev] if prev is not None else []), 0
        for b in facts.batches:
            repeats += b in seen
            seen.append(b)
        if prev is not None or len(facts.batches) > 1:
            out.append(Obs("batch_changes", ("batch",), repeats == 0, ctx,
                           {"batches": len(facts.batches), "repeated": repeats,
                            "batch_xor": f"{facts.batches[0][0]:016x}"}))
        return out

    def relation(self, key, expected):
        return "each data batch of a training step differs from the one before it"


TEMPLATES: tuple[Template, ...] = (Consistent(), EventContain(), Sequence(), Update(), Bound(), Mode(), Distinct())
BY_NAME = {t.name: t for t in TEMPLATES}


class Observer:
    """Feeds steps in order through every template, keeping each rank's state: what inference and
    checking both use, so a relation is observed the same way in clean and checked runs."""

    def __init__(self, templates: tuple[Template, ...] = TEMPLATES):
        self.templates = templates
        self.states: dict[int, dict] = {}
        self.cross_states: dict[str, dict] = {}  # template -> its cross-rank state (one per run)
        self.contexts: dict[tuple[int, int], dict] = {}  # (rank, step) -> ctx, for the cross-rank pass

    def step(self, facts: StepFacts) -> list[tuple[Template, Obs]]:
        state = self.states.setdefault(facts.rank, {})
        ctx = context(facts, state)
        self.contexts[(facts.rank, facts.step)] = ctx
        return [(t, o) for t in self.templates for o in t.observe(facts, ctx, state.setdefault(t.name, {}))]

    def ranks(self, facts_by_rank: dict[int, StepFacts]) -> list[tuple[Template, Obs]]:
        """The cross-rank observations of one step (every rank's facts of that step, each already
        passed to `step`)."""
        if len(facts_by_rank) < 2:
            return []
        first = min(facts_by_rank)
        ctx = self.contexts.get((first, facts_by_rank[first].step), {})
        return [(t, o) for t in self.templates if t.cross_rank
                for o in t.observe_ranks(facts_by_rank, ctx, self.cross_states.setdefault(t.name, {}))]


def observe_run(facts_by_rank: dict[int, list[StepFacts]]):
    """Every observation of one run: (template, obs, rank, step), rank by rank in step order, then
    the cross-rank ones step by step (rank None)."""
    observer = Observer()
    for rank in sorted(facts_by_rank):
        for facts in facts_by_rank[rank]:
            for t, o in observer.step(facts):
                yield t, o, rank, facts.step
    by_step: dict[int, dict[int, StepFacts]] = {}
    for rank, steps in facts_by_rank.items():
        for facts in steps:
            by_step.setdefault(facts.step, {})[rank] = facts
    for step in sorted(by_step):
        for t, o in observer.ranks(by_step[step]):
            yield t, o, None, step
