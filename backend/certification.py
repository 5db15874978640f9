"""What a comparison can certify: the part of two runs where "identical" may be said.

A comparison may only answer `identical` when nothing is hidden from it. This module says,
per rank and for the whole pair, what is: a run that did not finish (its last recorded step may
be cut short), a damaged rank file (its events from some step on are not all there), ranks
that the manifest declares but that have no file, collector errors during the recording,
recorded step windows that differ, runs recorded in online mode (alerts, no boundary events),
and runs that paired nothing (often: module names that
differ by a prefix, as `torch.compile` adds `_orig_mod.`).

`Scope` is the per-rank answer compare.py applies: an event on one side only counts as a
structural divergence only inside it; outside it the event is "not compared". The reasons are
`bitguard.compare/1` `Reason` documents (result.py). Nothing here aligns or blames.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import polars as pl

from bitguard.backend.ingest import with_keys
from bitguard.schema import DIGEST_BUILD, JSON_FILE, NAMES_PATH, NUMBER_PATH, STRING_PATH
from bitguard.timed import clock_at, timed_before_10

# What trusted mode observes of module calls (collectors/hooks.py records with the same pattern):
# when the two runs were recorded in different modes, the other module calls are on one side only
# by construction, not a divergence.
from bitguard.modes import HEAVY_MODULES


@dataclass(frozen=True)
class Scope:
    """Steps of one rank where both sides' event lists are certified complete."""

    first: int | None = None  # first step both sides recorded (None: from the start)
    end: int | None = None  # steps from here on are not certified (None: every step)
    # from here on a side lost records (a damaged journal group: the events after it in its step,
    # and later ones, may be paired with the wrong partners), so a digest difference is no pivot
    damaged: int | None = None

    def contains(self, step: pl.Expr) -> pl.Expr:
        inside = pl.lit(True)
        if self.first is not None:
            inside = inside & (step >= self.first)
        if self.end is not None:
            inside = inside & (step < self.end)
        return inside


def first_error(errors: list) -> str:
    """A run's first collector error as a reason quotes it: whole up to 600 characters (the advice an
    error ends with, helper 33: it was cut at 200, mid-word, before it), else cut at a word with an ellipsis."""
    text = str(errors[0])
    return text if len(text) <= 600 else text[:600].rsplit(" ", 1)[0] + " …"


def reason(code: str, message: str, side: str | None = None, rank: int | None = None) -> dict:
    """A `Reason` document (result.py)."""
    return {"code": code, "message": message, "side": side, "rank": rank}


def _window(run) -> tuple[int | None, int | None]:
    """The steps `run` recorded (`--steps`; None: from the start, to the end), in the step numbers
    compare reads (RunInfo.step_shift added: a resumed process's step 0 is its run's step STEP)."""
    steps, shift = run.manifest.get("steps"), run.step_shift
    first = end = None
    if isinstance(steps, (list, tuple)) and len(steps) == 2:
        first, end = (v if isinstance(v, int) else None for v in steps)
    if shift:
        first, end = (first or 0) + shift, None if end is None else end + shift
    return first, end


def rank_scope(rank: int, run_a, run_b, ea: pl.DataFrame, eb: pl.DataFrame) -> tuple[Scope, list[dict]]:
    """The certified steps of `rank` and the reasons for each cut."""
    reasons: list[dict] = []
    end: int | None = None
    damaged: int | None = None

    def cut(step: int) -> None:
        nonlocal end
        end = step if end is None else min(end, step)

    for side, run, events in (("a", run_a, ea), ("b", run_b, eb)):
        label = side.upper()
        meta = run.rank_meta.get(rank, {})
        finished = (meta.get("status") == "complete" and run.manifest.get("status") == "complete"
                    and run.manifest.get("complete", True) is True)
        if not finished:
            last = int(events["step"].max()) if events.height else 0
            # steps before the last one recorded are whole (the writer keeps order); the last may be cut
            cut(last)
            why = run.incomplete_reason() or f"rank {rank} did not finish writing"
            compared = f"steps before {last} are compared; " if last else ""
            reasons.append(reason("incomplete", f"run {label} is incomplete ({why}): {compared}its last recorded "
                                                 f"step ({last}) may be cut short, so step {last} and later are not "
                                                 f"certified", side, rank))
        damage = (getattr(run, "damage", None) or {}).get(rank)
        if damage:
            from_step = damage.get("from_step")
            if from_step is not None:
                from_step = int(from_step) + run.step_shift
            lost = run.step_shift if from_step is None else from_step
            cut(lost)
            damaged = lost if damaged is None else min(damaged, lost)
            where = "from the start" if from_step is None else f"from step {from_step} on"
            reasons.append(reason("damaged", f"run {label} rank {rank} is damaged {where} "
                                              f"({damage.get('reason', 'unreadable records')})", side, rank))
    for side, run in (("a", run_a), ("b", run_b)):
        if run.manifest.get("mode") == "online":  # no boundary events: nothing of it can be certified
            cut(0)
            reasons.append(reason("online", f"run {side.upper()} was recorded in online mode: it holds alerts, not "
                                            f"boundary events (bitguard alerts reads them); record with --mode full to "
                                            f"compare", side, rank))
    wa, wb = compared_windows(run_a, run_b)
    first = max((w[0] for w in (wa, wb) if w[0] is not None), default=None)
    for w in (wa, wb):
        if w[1] is not None:
            cut(w[1])
    if wa != wb:
        reasons.append(reason("step_window", f"the runs recorded different step windows (A {window_text(wa)}, "
                                              f"B {window_text(wb)}): only steps {window_text((first, end))} are compared",
                              rank=rank))
    return Scope(first, end, damaged), reasons


def compared_windows(run_a, run_b) -> tuple[tuple, tuple]:
    """The step windows the two runs recorded, in the step numbers compare reads: B's shifted by
    --resumed-at, and A's from the step B resumed at (A's steps before it are left out by the
    user's choice; run_reasons says so)."""
    wa, wb = _window(run_a), _window(run_b)
    if run_b.step_shift:
        wa = (max(wa[0] or 0, wb[0]), wa[1])
    return wa, wb


def window_text(window) -> str:
    """A step window as --steps writes it (`2:4`, `3:`)."""
    first, end = window
    return f"{first or 0}:{'' if end is None else end}"


def since_filter(run_a, run_b, ea: pl.DataFrame, eb: pl.DataFrame, ta: pl.DataFrame,
                 tb: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """When one run was recorded before what the newer one records existed, that is left out of
    both sides (absent by construction in the older run, not a divergence): events of kind `params`
    (schema version 6), `saved` and the final state of what only an optimizer held (8); the rows of
    the Python numbers a module returned, and of a root call's keyword arguments in its batch event
    (7; both sides' alignment keys are then made again from what is kept); the number rows of saved
    events (9: every number of a save, 8 only an optimizer's or a scheduler's); the JSON files the
    training wrote, the params events of what only an optimizer holds, and a save's numbers under a
    key with a time word not at its end (10: `time_embedding_dim`); the string rows of saves other
    than JSON files (11, and 12: a NumPy string is one); the names (enum members, dtypes, classes)
    and dict keys of saves and JSON files, and their values under a key that names a duration by a
    word that is one since 12 (`dur`, `time_taken`); the Python numbers given to a module call as arguments (13)."""
    versions = [run.manifest.get("schema_version", 1) for run in (run_a, run_b)]
    oldest = min(v if isinstance(v, int) else 1 for v in versions)
    if oldest >= 13:
        return ea, eb, ta, tb
    newer = pl.lit(False)  # events left out
    if oldest < 10:  # the JSON files beside the saves, and a params event of what only an optimizer holds
        newer = (((pl.col("kind") == "saved") & (pl.col("module_type") == JSON_FILE))
                 | ((pl.col("kind") == "params") & (pl.col("module_type") == "optimizer")))
    if oldest < 8:
        newer = newer | pl.col("kind").is_in(["saved"] + (["params"] if oldest < 6 else [])) | (
            (pl.col("kind") == "final") & (pl.col("module_type") == "optimizer"))  # what only an optimizer held: 8
    newer = newer.fill_null(False)
    number = pl.col("path").cast(pl.String).str.contains(NUMBER_PATH).fill_null(False)
    string = pl.col("path").cast(pl.String).str.contains(STRING_PATH).fill_null(False)
    sides = []
    for events, tensors in ((ea, ta), (eb, tb)):
        if events.select(newer.any()).item():
            events = events.filter(~newer)
            tensors = tensors.filter(pl.col("seq").is_in(events["seq"].implode()))
        saves = pl.col("seq").is_in(events.filter(pl.col("kind") == "saved")["seq"].implode())
        pickled = pl.col("seq").is_in(events.filter((pl.col("kind") == "saved")
                                                    & (pl.col("module_type") != JSON_FILE))["seq"].implode())
        if oldest == 9:  # (10 compares `time_embedding_dim`: a key whose last word names no time, bitguard.timed)
            paths = tensors.filter(number & saves)["path"].unique().to_list()
            drop = pl.col("path").is_in([p for p in paths if timed_before_10(re.sub(NUMBER_PATH, "", p))]) & saves
        elif oldest == 8:  # (9: every number of a save; 8: an optimizer's and a scheduler's only: none on both sides)
            drop = number & saves
        elif oldest < 7:
            batches = events.filter(pl.col("kind") == "batch")["seq"]
            drop = number | (pl.col("seq").is_in(batches.implode()) & (pl.col("role") == "input")
                             & pl.col("path").cast(pl.String).str.starts_with("['").fill_null(False))
        else:
            drop = pl.lit(False)
        drop = drop | (number & (pl.col("role") == "input"))  # 13: a call's number arguments
        if oldest < 12:
            names = pl.col("path").cast(pl.String).str.contains(NAMES_PATH).fill_null(False)
            drop = drop | (string & pickled) | (names & saves)
            timed = [p for p in tensors.filter((number | string) & saves)["path"].unique().to_list()
                     if clock_at(re.sub(f"{NUMBER_PATH}|{STRING_PATH}", "", p)) == "duration"]  # (12: `['dur']`)
            drop = drop | (pl.col("path").is_in(timed) & saves)
        rows = tensors.select(drop).to_series()
        if rows.any():
            tensors = tensors.filter(~rows)
            events = rekey(events, tensors)
        sides.append((events, tensors))
    (ea, ta), (eb, tb) = sides
    return ea, eb, ta, tb


def mode_filter(run_a, run_b, ea: pl.DataFrame, eb: pl.DataFrame, ta: pl.DataFrame,
                tb: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame, list[dict]]:
    """When one run was recorded in full mode and the other in trusted mode, keep of the full one's
    what trusted mode observes: module calls of the heavy types, and of optimizer steps the
    parameter without its optimizer state. The rest is absent by construction, not a divergence;
    both sides' alignment keys are then made again from what is kept."""
    ma, mb = run_a.manifest.get("mode"), run_b.manifest.get("mode")
    if ma == mb or {ma, mb} != {"full", "trusted"}:
        return ea, eb, ta, tb, []
    # (the recorder's pattern is case-insensitive)
    trusted_only = (pl.col("kind") != "module") | pl.col("module_type").cast(pl.String).fill_null("").str.contains(
        "(?i)" + HEAVY_MODULES.pattern)
    sides = []
    for events, tensors, full in ((ea, ta, ma == "full"), (eb, tb, mb == "full")):
        if full:
            events = events.filter(trusted_only)
            steps = events.filter((pl.col("phase") == "optimizer") & (pl.col("kind") == "step"))["seq"]
            tensors = tensors.filter(pl.col("seq").is_in(events["seq"].implode())
                                     & ~(pl.col("seq").is_in(steps.implode()) & (pl.col("role") == "state")))
        # the buffers of a part a call ran without calling it (`.bank.queue`) are reported by the innermost
        # recorded call around it: another call in each mode (collectors/hooks.py, _unobserved_buffers)
        module_seqs = events.filter(pl.col("kind") == "module")["seq"].implode()
        tensors = tensors.filter(~((pl.col("role") == "state") & pl.col("seq").is_in(module_seqs)
                                   & pl.col("path").cast(pl.String).fill_null("").str.contains(r"^\.[^.]+\.")))
        sides.append((rekey(events, tensors), tensors))
    (ea, ta), (eb, tb) = sides
    return ea, eb, ta, tb, [reason("modes", f"the runs were recorded in different modes (A {ma}, B {mb}): only "
                                             f"what trusted mode observes is compared")]


def rekey(events: pl.DataFrame, tensors: pl.DataFrame) -> pl.DataFrame:
    """`key`, `loose_key` and `place_key` made again as ingest makes them, from the tensors kept."""
    return with_keys(events.drop("key", "loose_key", "place_key"), tensors).select(events.columns)


def _old_team_digests(manifest: dict) -> bool:
    """Recorded before the host digest's team fix (schema.DIGEST_BUILD) with more than one torch
    thread (or an unknown number): its multi-threaded host digests may be wrong."""
    build = manifest.get("digest_build")
    if isinstance(build, int) and build >= DIGEST_BUILD:
        return False
    threads = (manifest.get("determinism") or {}).get("torch_threads")
    return not (isinstance(threads, int) and threads <= 1)


def run_reasons(run_a, run_b, ranks: list[int], rank_selected: bool) -> list[dict]:
    """Reasons that concern a whole run: missing ranks, collector errors, an old host digest."""
    reasons = []
    for side, run in (("a", run_a), ("b", run_b)):
        label = side.upper()
        if _old_team_digests(run.manifest):
            reasons.append(reason("digest_build", f"run {label} was recorded by a bitguard whose multi-threaded host "
                                                   f"digest could give wrong digests (fixed in digest build "
                                                   f"{DIGEST_BUILD}); re-record it with this bitguard to certify it",
                                  side))
        missing = sorted(set(getattr(run, "missing_ranks", None) or [])
                         | set(range(run.world_size if isinstance(run.world_size, int) else 0)) - set(run.ranks))
        if missing and not rank_selected:
            reasons.append(reason("missing_ranks", f"run {label} declares world size {run.world_size} but has no "
                                                    f"rank file for rank(s) {', '.join(map(str, missing))}: those "
                                                    f"ranks are not compared", side))
        if run.step_shift:
            reasons.append(reason("resumed", f"run {label} resumed at step {run.step_shift} (--resumed-at): its step s "
                                             f"is compared with the other run's step {run.step_shift} + s, and that "
                                             f"run's steps before {run.step_shift} are not compared", side))
        errors = list(run.manifest.get("collector_errors") or [])
        for rank in ranks:
            errors += [e for e in (run.rank_meta.get(rank, {}).get("collector_errors") or []) if e not in errors]
        if errors:
            reasons.append(reason("collector_errors", f"run {label}'s recording reported {len(errors)} collector "
                                                       f"error(s), so events may be missing (first: {first_error(errors)})",
                                   side))
    return reasons


def group_reasons(run_a, run_b, members: set[int]) -> list[dict]:
    """Ranks the collectives name as members of their groups but a run has no rank file for: a
    process the launcher started without bitguard (Lightning's and Fabric's own DDP launch re-runs
    the script in a plain Python), whose manifest then says world size 1. Those ranks were not
    compared, whatever the manifest declares."""
    reasons = []
    for side, run in (("a", run_a), ("b", run_b)):
        declared = set(getattr(run, "missing_ranks", None) or []) | (
            set(range(run.world_size)) if isinstance(run.world_size, int) else set())
        missing = sorted(members - set(run.ranks) - declared)
        if missing:
            reasons.append(reason("missing_ranks", f"run {side.upper()}'s collectives name rank(s) "
                                                    f"{', '.join(map(str, missing))} of their groups, for which it has "
                                                    f"no rank file (a process started without bitguard, as Lightning's "
                                                    f"own DDP launch starts its other ranks): those ranks are not "
                                                    f"compared; launch with torchrun -m bitguard record", side))
    return reasons


def empty_or_unpaired(rank: int, ea: pl.DataFrame, eb: pl.DataFrame, matched: int,
                      failed: tuple[bool, bool] = (False, False)) -> dict | None:
    """A reason when a rank has nothing to compare: a side without events, or no event paired (`failed`:
    whether each run failed, its manifest's status)."""
    if not ea.height or not eb.height:
        if not ea.height and not eb.height and all(failed):  # (helper 59: both failed at once; "trains by hand")
            return reason("empty", f"neither run recorded an event on rank {rank}: both failed before their first "
                                   f"module call or optimizer step (the training's own error: its output says which); "
                                   f"fix it and record again", rank=rank)
        if not ea.height and not eb.height:
            return reason("empty", f"neither run recorded an event on rank {rank}: bitguard observes calls of "
                                   f"torch.nn modules, torch.optim steps and their tensors, so a script that trains "
                                   f"tensors by hand with neither has no boundary to record (wrap the computation "
                                   f"in an nn.Module, or step it with a torch.optim optimizer)", rank=rank)
        side = "a" if not ea.height else "b"
        other = eb if side == "a" else ea
        return reason("empty", f"run {side.upper()} recorded no events on rank {rank} (the other run recorded "
                                f"{other.height}): nothing to compare", side, rank)
    if matched:
        return None
    hint = name_hint(ea["boundary"].to_list(), eb["boundary"].to_list())
    return reason("nothing_paired", f"no event of rank {rank} paired (A {ea.height} events, B {eb.height})"
                                     + (f": {hint}" if hint else ": the runs record different boundaries"), rank=rank)


_COMPILED = re.compile(r"(^|\.)_orig_mod(\.|$)")


def name_hint(names_a: list[str], names_b: list[str]) -> str | None:
    """Why two runs' boundary names do not meet, when one side's names are the other's with a
    prefix (torch.compile's `_orig_mod.`, DDP's `module.`, a wrapper's attribute name)."""
    set_a, set_b = set(names_a), set(names_b)
    for big, small, label in ((set_b, set_a, "B"), (set_a, set_b, "A")):
        heads = Counter(n.split(".", 1)[0] for n in big if "." in n)
        for head, _ in heads.most_common(3):
            stripped = {n.split(".", 1)[1] for n in big if n.startswith(head + ".")}
            if stripped and len(stripped & small) >= max(1, len(stripped) // 2):
                extra = " (torch.compile names a compiled model's modules _orig_mod.*)" if head == "_orig_mod" else ""
                return f"run {label}'s boundary names carry the prefix '{head}.' that the other run's lack{extra}"
    compiled = [any(_COMPILED.search(n) for n in names) for names in (set_a, set_b)]
    if compiled[0] != compiled[1]:
        return (f"run {'A' if compiled[0] else 'B'}'s boundaries are named _orig_mod.* (a torch.compile'd model); "
                f"the other run's are not")
    return None
