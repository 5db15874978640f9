"""How the two runs called the training API differently, up to the pivot's step: the likely cause
of a divergence the digests can only place.

A digest says *where* the runs part (an optimizer step, a module's forward); the recorded API
events (`api_events`, collectors/api_events.py, every mode) say what the script *asked for*: the
clipping threshold, each param group's learning rate and hyperparameters, `zero_grad`'s
`set_to_none`, the modules in training or eval mode, `requires_grad`, dtypes and devices, the loss
scale, calls made in one run only. `differences()` lines up one rank's API events of both runs
step by step (a kind and target's n-th call in the step with the other run's n-th) and lists the
fields that differ, earliest step first. Values the training computes rather than configures (the
loss, the clipped norm, a parameter's digest) are left out: they differ after any divergence and
explain nothing. A run recorded before API events existed gives no differences, not "no
difference": `available` says which.

This module knows the API events' JSON, not the comparison (compare.py attaches the result to the
first divergence; report.py prints it).
"""

from __future__ import annotations

import difflib
import json
from collections import defaultdict

from bitguard import timed

# what the training computes (a consequence of a divergence, never its cause), per kind
COMPUTED = {"backward": {"value"}, "clip_grad_norm": {"total_norm"}, "params": {"xor"},
            "read": {"value"}}  # (a `read`: a number the training took out of a tensor, `.item()`, `float()`)
# fields both compared as computed and listed as a call's: a read's shape and dtype ([1.5] and [1.5, 0.0, 0.0] digest
# alike: helper 88's decodes, [] and [0], compared identical, their shape listed as a setting)
ALSO_COMPUTED = {"read": {"shape", "dtype"}}
# where a call was made (a read's file:line): shown beside its difference, never compared (code moves between runs)
PLACES = {"read": "at"}
SHOWN = 12  # differences kept in the document; `more` counts the rest
EVERY_STEP = 2**62  # `differences(..., step)`: no step left out
# kinds a bitguard records only since: where one run has none (an older build recorded it), left out of both
RECORDED_SINCE = frozenset(("optimizer_settings", "scheduler_settings"))


def _api_rows(info, rank: int):
    from bitguard.backend.ingest import rank_table
    from bitguard.schema import API_EVENTS

    if rank not in info.ranks:
        return None
    frame = rank_table(info, rank, API_EVENTS)
    return None if frame is None else frame.sort("ord").to_dicts()


def param_names(run, rank: int, step: int) -> set[str]:
    """Every name the parameters of run `run`'s models have at `step` (rank `rank`), tied ones under each
    of their names (the API recorder's `params` rows); empty without those rows."""
    rows = _api_rows(run, rank) or []
    names: set[str] = set()
    for r in rows:
        if r["kind"] == "params" and r["step"] == step:
            value = _decode(r["value"])
            if isinstance(value, dict):
                names.update(value)
    return names


def _decode(text):
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return text  # shown as recorded; the invariants' reader is the one that refuses damage


def _flat(value, kind: str, path: str = "", out: dict | None = None, computed: bool = False) -> dict:
    """{field path: scalar} of one event's value: the computed fields left out, or (`computed`) only they
    (`ALSO_COMPUTED` fields in both)."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for k, v in value.items():
            leaf = k if not path else f"{path}.{k}"
            if not path and k == PLACES.get(kind):
                continue
            if k in COMPUTED.get(kind, ()) or (computed and k in ALSO_COMPUTED.get(kind, ())):
                if computed:
                    out[leaf] = v
                continue
            _flat(v, kind, leaf, out, computed)
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        for i, v in enumerate(value):
            _flat(v, kind, f"{path}[{i}]", out, computed)
    elif not computed:
        out[path] = value
    return out


def _by_step(rows: list[dict], last_step: int, computed: bool = False) -> tuple[dict[int, dict[tuple, dict]], dict]:
    """{step: {(kind, target, n-th in the step): flat value}} up to last_step (`computed`: see `_flat`),
    and {(step, kind, target, n-th): its place} for the calls whose place is recorded (`PLACES`), with
    {(step, "read", target, n-th, "value"): the value it read}."""
    out: dict[int, dict[tuple, dict]] = defaultdict(dict)
    places: dict[tuple, str] = {}
    seen: dict[tuple, int] = defaultdict(int)
    for r in rows:
        step = r["step"]
        if step is None or step > last_step:
            continue
        key = (step, r["kind"], r["target"])
        n = seen[key]
        seen[key] = n + 1
        value = _decode(r["value"])
        if computed and r["kind"] == "read" and isinstance(value, dict) and value.get("timed"):
            continue  # (a time the training read back: collectors/reads.py, `_time_at`)
        out[step][(r["kind"], r["target"], n)] = _flat(value, r["kind"], computed=computed)
        place = value.get(PLACES[r["kind"]]) if r["kind"] in PLACES and isinstance(value, dict) else None
        if isinstance(place, str):
            places[(*key, n)] = place
        if r["kind"] == "read" and isinstance(value, dict):  # (what it read: shown where one run alone reads it)
            places[(*key, n, "value")] = value.get("value")
    return out, places


def _reads_by_place(a: dict, b: dict, places_a: dict, places_b: dict) -> None:
    """B's reads of each step renumbered to pair with A's, in `b` and `places_b`: the two sequences of
    (what, line) are matched as a diff matches lines (difflib), reads in a matched run pair, a run of A's
    replaced by a run of B's pairs read by read (a script edited above them moves their lines), and what
    is left is one run's alone, B's numbered after A's. Numbered in the order of the step, a read one run
    alone made paired every later one with another line's (helper 72: A's loss compared with B's
    temperature, read one line before it in B alone)."""
    for s, calls_b in b.items():
        reads_b = sorted((k for k in calls_b if k[0] == "read"), key=lambda k: k[2])
        reads_a = sorted((k for k in a.get(s, {}) if k[0] == "read"), key=lambda k: k[2])
        if not reads_b or not reads_a:
            continue
        lines_a = [(k[1], places_a.get((s, *k))) for k in reads_a]
        lines_b = [(k[1], places_b.get((s, *k))) for k in reads_b]
        top = max(k[2] for k in reads_a)
        moved = {}
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, lines_a, lines_b, autojunk=False).get_opcodes():
            for i, j in zip(range(i1, i2), range(j1, j2)):
                if tag == "equal" or reads_a[i][1] == reads_b[j][1]:
                    moved[reads_b[j]] = reads_a[i]
            for j in range(j1, j2):
                if reads_b[j] not in moved:
                    top += 1
                    moved[reads_b[j]] = ("read", reads_b[j][1], top)
        if all(old == new for old, new in moved.items()):
            continue
        values = {old: calls_b.pop(old) for old in moved}
        calls_b.update({moved[old]: v for old, v in values.items()})
        for suffix in ((), ("value",)):
            kept = {old: places_b.pop((s, *old, *suffix)) for old in moved if (s, *old, *suffix) in places_b}
            places_b.update({(s, *moved[old], *suffix): v for old, v in kept.items()})


def _show(value) -> str:
    if isinstance(value, list):
        text = ", ".join(map(str, value[:6])) + (f", … ({len(value)} in all)" if len(value) > 6 else "")
        return f"[{text}]"
    return "absent" if value is None else json.dumps(value) if isinstance(value, str) else str(value)


def _numbers(a, b) -> bool:
    """Two lists of numbers of one length: compared position by position."""
    return (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in a + b))


def _names(a, b) -> bool:
    """Two lists told apart by what each holds that the other does not (parameter names, modules):
    not lists of numbers (a shape, one of another length), and not lists holding the same items a
    different number of times, whose difference no "only in" would show."""
    if not (isinstance(a, list) and isinstance(b, list)):
        return False
    if all(isinstance(x, (int, float)) for x in a + b):
        return False
    return any(x not in b for x in a) or any(x not in a for x in b) or sorted(map(repr, a)) == sorted(map(repr, b))


def value_pair(a, b) -> tuple[str, str]:
    """Two floats short where six digits tell them apart (0.0002 vs 0.0001), exact where not."""
    if isinstance(a, float) and isinstance(b, float) and f"{a:.6g}" != f"{b:.6g}":
        return f"{a:.6g}", f"{b:.6g}"
    return _show(a), _show(b)


def rows_of(run_a, run_b, rank: int) -> tuple:
    """Rank `rank`'s API event rows of runs A and B, read once for several `differences` calls
    (`recorded_by_both`)."""
    return recorded_by_both(_api_rows(run_a, rank), _api_rows(run_b, rank))


def recorded_by_both(rows_a: list | None, rows_b: list | None) -> tuple:
    """The rows, but those of a kind one run has none of where an older build did not record it
    (`RECORDED_SINCE`): no difference of the runs (helper 86: "scheduler_settings: not called in A")."""
    if not rows_a or not rows_b:
        return rows_a, rows_b
    newer = {kind for kind in RECORDED_SINCE if not all(any(r["kind"] == kind for r in rows) for rows in (rows_a, rows_b))}
    return (rows_a, rows_b) if not newer else tuple([r for r in rows if r["kind"] not in newer] for rows in (rows_a, rows_b))


def differences(run_a, run_b, rank: int, step: int, computed: bool = False, rows: tuple | None = None,
                accepted=None) -> dict:
    """`{available, differences: [{step, kind, target, call, field, a, b}], more}`: rank `rank`'s
    API events of runs A and B (ingest.RunInfo) that differ at steps ≤ `step`, earliest first. A
    call made in one run only has field None and a/b "called" / "not called". `computed`: the
    values the training computed (the loss backward() started from) instead of what it asked for,
    but a time the training read out of a tensor in both runs (`_timestamps`); `rows`: what `rows_of`
    read; `accepted(difference)`: True for one a rule accepts, left out."""
    rows_a, rows_b = rows if rows is not None else rows_of(run_a, run_b, rank)
    if not rows_a or not rows_b:
        missing = [side for side, rows in (("a", rows_a), ("b", rows_b)) if not rows]
        return {"available": False, "differences": [], "more": 0, "missing": missing}
    (a, places_a), (b, places_b) = _by_step(rows_a, step, computed), _by_step(rows_b, step, computed)
    _reads_by_place(a, b, places_a, places_b)
    found: list[dict] = []
    for s in sorted(set(a) | set(b)):
        calls_a, calls_b = a.get(s, {}), b.get(s, {})
        for key in _in_call_order(calls_a, calls_b):
            kind, target, n = key
            where = {"step": s, "kind": kind, "target": target, "call": n}
            place = places_a.get((s, *key)) or places_b.get((s, *key))
            if place is not None:  # (a read's line, A's where both have one)
                where["at"] = place
            if key not in calls_a or key not in calls_b:
                if computed:  # (a call one run made and the other did not: a killed run's last steps)
                    continue
                if kind == "params" and s == run_b.resume_from:  # (as compare leaves the events: a model's first
                    continue  # params of the resumed step may come before the cut in one run alone, helper 55)
                one = {**where, "field": None, "a": "called" if key in calls_a else "not called",
                       "b": "called" if key in calls_b else "not called"}
                if kind == "read":  # (what it read, in the run that read it: helper 49)
                    one["value"] = (places_a if key in calls_a else places_b).get((s, *key, "value"))
                found.append(one)
                continue
            fa, fb = calls_a[key], calls_b[key]
            for f in sorted(set(fa) | set(fb)):
                if fa.get(f) != fb.get(f) and not _in_effect_all_along(kind, f, fa, fb) \
                        and not (computed and kind == "read" and _timestamps(fa.get(f), fb.get(f))):
                    one = {**where, "field": f, "a": fa.get(f), "b": fb.get(f)}
                    if kind == "modes" and f in ("training", "eval"):  # (a module one model alone has, by its name)
                        one.update(_modules_apart(fa, fb))
                    if accepted is None or not accepted(one):
                        found.append(one)
    if not computed:  # (a step's reads after its calls to the training API: most are what the cause changed, helper
        found.sort(key=lambda d: (d["step"], d["kind"] == "read"))  # 84's and 88's library reads led "the likely cause")
    found = _folded(_merged(found))
    return {"available": True, "differences": found[:SHOWN], "more": max(0, len(found) - SHOWN), "missing": []}


def _modules_apart(fa: dict, fb: dict) -> dict:
    """`only_a` / `only_b`: the modules of a modes row one run's model has and the other's has in neither mode
    (helper 82: a LayerNorm in place of a BatchNorm read "training: only in A [norm.norm]", as if B's were in eval)."""
    names = [{n for f in ("training", "eval") for n in (side.get(f) or ()) if isinstance(n, str)} for side in (fa, fb)]
    apart = {"only_a": sorted(names[0] - names[1]), "only_b": sorted(names[1] - names[0])}
    return {k: v for k, v in apart.items() if v}


def _timestamps(a, b) -> bool:
    """Are both values a time since 1970 (`time.time()`, `time_ns()`: bitguard/timed.py), as a training
    reads one out of a tensor to agree on it across ranks (helper 59: mmengine's Runner broadcasts its
    start time as `torch.tensor(time.time())` and reads it back with `.item()`)?"""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and not timed.compared(None, v) for v in (a, b))


def _in_call_order(calls_a: dict, calls_b: dict) -> list[tuple]:
    """The calls of one step, of both runs, in the order run A made them (its rows' order), each call B alone
    made after the call B made before it (helper 86: the first of two metrics' values that differ was
    said to be the one whose name sorts first)."""
    at = {key: i for i, key in enumerate(calls_a)}
    rank: dict[tuple, tuple] = {key: (i, 0) for key, i in at.items()}
    before = -1
    for j, key in enumerate(calls_b):
        if key in at:
            before = at[key]
        else:
            rank[key] = (before, 1 + j)
    return sorted(rank, key=rank.__getitem__)


def _in_effect_all_along(kind: str, field: str, fa: dict, fb: dict) -> bool:
    """An optimizer's settings as the recording ended (`optimizer_settings`) that neither run set after
    its last step: a difference of them was in effect at every step, and is listed there (two runs that
    asked for other learning rates, to no effect, are identical)."""
    if kind != "optimizer_settings":
        return False
    return field == "set_after_step" or (field.startswith("groups") and not (fa.get("set_after_step")
                                                                           or fb.get("set_after_step")))


def _merged(found: list[dict]) -> list[dict]:
    """The same difference at several steps (a parameter group that differs, a zero_grad option) is
    one entry, at its first step, with every step in `steps`: listed step by step, it filled the list
    and left the cause at a later step out (helper 44)."""
    out, first = [], {}
    for d in found:
        key = (d["kind"], d["target"], d["call"], d["field"], repr(d["a"]), repr(d["b"]))
        seen = first.get(key)
        if seen is None:
            first[key] = {**d, "steps": [d["step"]]}
            out.append(first[key])
        else:
            seen["steps"].append(d["step"])
    return out


def _steps(steps: list[int]) -> str:
    """`step 3`, `steps 0-4`, `steps 0-2, 5`."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"step {text}" if len(steps) == 1 else f"steps {text}"


# calls one run alone makes that are listed as one entry when they follow one another
_FOLDED = ("modes", "read")


def _folded(found: list[dict]) -> list[dict]:
    """The calls of a root module one run alone makes, one after another in a step (a solver taking more
    steps: helper 79), or the reads one run alone makes at one line (a dataset's `np.asarray` in a loop, or
    moved into DataLoader workers: helper 81, a list of one line each), as one entry with their count, `calls`."""
    out: list[dict] = []
    open_: dict[tuple, dict] = {}  # what an entry folds by -> the last entry of it (two roots' calls alternate)
    for d in found:
        key = None if d["field"] is not None or d["kind"] not in _FOLDED else \
            tuple(repr(d.get(k)) for k in ("kind", "target", "at", "a", "b", "step", "steps"))
        last = open_.get(key)
        if last is not None and d["call"] == last["call"] + last.get("calls", 1):
            last["calls"] = last.get("calls", 1) + 1
            continue
        out.append(dict(d))
        if key is not None:
            open_[key] = out[-1]
    return out


def lines(diff: dict, indent: str = "  ", header: bool = True) -> list[str]:
    """The terminal report's lines for a `differences()` result (none when nothing differs)."""
    if not diff or not diff.get("differences"):
        return []
    out = [f"{indent}training API calls that differ (at or before this step; the likely cause):"] if header else []
    for d in diff["differences"]:
        when = _steps(d.get("steps") or [d["step"]])
        calls = d.get("calls") or 1
        call = f"call {d['call']}" if calls == 1 else f"calls {d['call']}-{d['call'] + calls - 1}"
        what = (f"{d['kind']} ({d['target']})" + (f" {call}" if d["call"] or calls > 1 else "")
                + (f" at {d['at']}" if d.get("at") else ""))
        if d["field"] is None and d["kind"] == "modes":  # (the row each call of a root module begins with)
            more = "A" if d["a"] == "called" else "B"
            made = (f"its call {d['call']}, counted from 0, is" if calls == 1 else
                    f"its {call}, counted from 0, are")
            out.append(f"{indent}  {when}: root module {d['target']}: run {more} calls it "
                       f"{'more often' if calls == 1 else f'{calls} times more'} in the step ({made} made in "
                       f"{more} only)")
        elif d["field"] is None:
            read = None if d.get("value") is None else value_pair(d["value"], d["value"])[0]
            value = "" if read is None else \
                f" ({'the first read' if calls > 1 else 'it read'} {read}" + \
                (f" at step {d['step']})" if len(d.get("steps") or ()) > 1 else ")")
            out.append(f"{indent}  {when}: {what}: {d['a']} in A, {d['b']} in B{value}")
        elif _numbers(d["a"], d["b"]):  # per position (a learning rate per group), not a set of names
            pairs = [value_pair(x, y) for x, y in zip(d["a"], d["b"])]
            a, b = (_show([p[i] for p in pairs]) for i in (0, 1))
            out.append(f"{indent}  {when}: {what}: {d['field']} {a} (A) vs {b} (B)")
        elif _names(d["a"], d["b"]):
            only_a = [x for x in d["a"] if x not in d["b"]]
            only_b = [x for x in d["b"] if x not in d["a"]]
            change = "; ".join(part for part in (f"only in A {_show(only_a)}" if only_a else "",
                                                  f"only in B {_show(only_b)}" if only_b else "") if part)
            apart = [f"{side}'s model alone has {_show(names)}" for side, names in
                     (("A", [n for n in only_a if n in (d.get("only_a") or ())]),
                      ("B", [n for n in only_b if n in (d.get("only_b") or ())])) if names]
            if apart:  # (not a mode changed: a module the other model does not have)
                change += f" ({'; '.join(apart)}, in neither mode in the other)"
            change = change or "the same items, in another order"
            out.append(f"{indent}  {when}: {what}: {d['field']}: {change}")
        else:
            a, b = value_pair(d["a"], d["b"])
            out.append(f"{indent}  {when}: {what}: {d['field']} {a} (A) vs {b} (B)")
    if diff.get("more"):
        out.append(f"{indent}  … and {diff['more']} more (--json lists the first {SHOWN})")
    return out
