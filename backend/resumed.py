"""A run resumed from a checkpoint in a new process, compared with the run it resumed.

`compare --resumed-at N` shifts B's steps by N (ingest, `RunInfo.step_shift`) and leaves out of the
alignment what each side recorded at step N before its first training batch (`resume_cut`): the old
process's tail (an evaluation, the checkpoint it saved) and the new one's setup (loading it). Many trainings do the same thing there on both sides
(nanoGPT evaluates and saves at the resume step in both processes), and a resume that restored less
than it should shows first there: helper 38's B put its RNG state back only after that evaluation,
and compared identical. So B's events of that region are looked for in A's: one whose alignment key
A's region also has but whose digests differ from every such event of A's makes the comparison not
identical (`resume_setup`); an event A's region lacks (an evaluation only the resumed run makes) is
not compared, as the region is not.

A root module is named by its class, numbered by the roots of that class met before it (`Net#2`): a
resumed process that builds fewer models before its training names the trained one otherwise
(`same_roots`).
"""

from __future__ import annotations

import dataclasses
import re

import polars as pl

_NUMBERED = re.compile(r"#\d+$")


def region_reasons(run_a, run_b, rank: int, rules=None) -> list[dict]:
    """A `resume_setup` reason when an event of B's resume region differs from A's events of the
    same key there (a tensor an `ignore` rule accepts left out); none otherwise. Reads the rank
    again (only a resumed comparison asks)."""
    from bitguard.backend.certification import reason  # (certification reads ingest, which reads this module)

    ignore = rules.of("ignore") if rules is not None else []
    regions = [_region(run, rank, ignore) for run in (run_a, run_b)]
    (_, digests_a), (events_b, digests_b) = regions
    for row in events_b.iter_rows(named=True):
        theirs = digests_a.get(row["key"])
        if theirs is not None and digests_b[row["seq"]] not in theirs:
            return [reason("resume_setup", (
                f"run B's {row['phase']} of {row['boundary']} at step {row['step']}, before its first training batch "
                f"(what it did on resuming: an evaluation, a save), differs from run A's at that point of step "
                f"{row['step']}, which --resumed-at leaves out of the alignment: the state B resumed with differs "
                f"there (an RNG restored later, a metric or a buffer not restored)"), "b", rank)]
    return []


def _region(run, rank: int, ignore: list) -> tuple[pl.DataFrame, dict]:
    """(the region's events, {seq: digests} for B's side / {key: [digests, ...]} for A's)."""
    from bitguard.backend.ingest import load_rank  # (ingest reads resume_cut from here)

    events, tensors, _ = load_rank(dataclasses.replace(run, resume_from=None), rank)
    seq, step, t_ns = resume_cut(events, run.resume_from)
    region = events.filter((pl.col("step") == step) & ((pl.col("seq") < seq) | (pl.col("t_start_ns") < (t_ns or 0)))
                           & (pl.col("kind") != "params")).select("seq", "key", "step", "phase", "boundary",
                                                                  "module_type")
    rows = tensors.filter(pl.col("seq").is_in(region["seq"].implode())).sort("seq", "role", "idx").join(
        region.select("seq", "step", "phase", "boundary", "module_type"), on="seq")
    digests: dict[int, tuple] = {}
    for r in rows.iter_rows(named=True):
        if any(rule.matches(boundary=r["boundary"], module_type=r["module_type"], phase=r["phase"], step=r["step"],
                            rank=rank, role=r["role"], dtype=r["dtype"], path=r["path"]) for rule in ignore):
            continue  # (a difference the user accepted: nanoGPT's config.init_from in its save)
        digests[r["seq"]] = digests.get(r["seq"], ()) + ((r["role"], r["idx"], r["xor"], r["pos"]),)
    if run.step_shift:  # B: by event
        return region, {s: digests.get(s, ()) for s in region["seq"].to_list()}
    by_key: dict[int, list] = {}
    for s, k in region.select("seq", "key").iter_rows():
        by_key.setdefault(k, []).append(digests.get(s, ()))
    return region, by_key


def start_of_step(kept: pl.DataFrame, step: int, kind: str, name: str) -> pl.Expr:
    """The `params` records of `step` that come before a resume's cut, of a model with none after it
    (`kept`: what the cut keeps): a step's parameters are taken at its first call of the model, and
    that call may be one before the cut (an evaluation before the checkpoint was saved), while the
    resumed run's first call is its training batch."""
    after = kept.filter((pl.col("step") == step) & (pl.col(kind) == "params"))[name].unique().implode()
    first = (pl.col("step") == step) & (pl.col(kind) == "params") & ~pl.col(name).is_in(after)
    return (first & (pl.int_range(pl.len()).over(first, name) == 0)).fill_null(False)


def resume_cut(events: pl.DataFrame, step: int) -> tuple[int, int, int | None]:
    """(seq, step, time) where the comparison of a resumed run begins (RunInfo.resume_from, `step` in
    compare's numbering): the first training batch of that step or later (a batch a backward follows
    before the next one: not an evaluation's), from its params event on (taken as the batch's call
    began, just before it). What a side recorded before it is the old process's tail (an evaluation,
    the checkpoint it saved, its scheduler's last step) or the new one's setup (loading it), not a
    training step of either (helper 37: an evaluation before the save and the params event before
    the batch were compared, or cut)."""
    later = events.filter(pl.col("step") >= step).select("seq", "step", "phase", "kind", "module_type", "t_start_ns")
    if not later.height:  # nothing from there on: everything is cut
        return (int(events["seq"].max()) + 1 if events.height else 0), step, None
    batch = (pl.col("phase") == "data").fill_null(False)
    marked = later.with_columns(batch.cum_sum().alias("_batch"), (pl.col("phase") == "backward").alias("_back"))
    trained = marked.filter(pl.col("_batch") > 0).group_by("_batch").agg(pl.col("_back").any()).filter("_back")
    firsts = marked.filter(batch)
    if trained.height:
        firsts = firsts.filter(pl.col("_batch") == trained["_batch"].min())
    row = (firsts if firsts.height else later).row(0, named=True)
    at = later.filter((pl.col("step") == row["step"]) & (pl.col("t_start_ns") >= row["t_start_ns"])
                      & (pl.col("seq") <= row["seq"]))
    return int(at["seq"].min()), row["step"], row["t_start_ns"]


def loaded_checkpoint(gaps: pl.DataFrame, ea: pl.DataFrame, ta: pl.DataFrame, eb: pl.DataFrame, tb: pl.DataFrame,
                      resumed_at: int | None, rank: int) -> tuple[pl.DataFrame, list[dict]]:
    """Run B's final states that A lacks and that hold, tensor for tensor, A's parameters at the
    resume step: the checkpoint B loaded, kept alive to its end (`ck = torch.load(...)` at the
    script's top level, its list of weights found as an EMA's would be; helper 38: "run B ends
    here" on a correct resume). Not counted, and said so (an informational `resumed` reason)."""
    if resumed_at is None or not gaps.height:
        return gaps, []
    extra = gaps.filter((pl.col("side") == "b") & pl.col("counted")).select("seq").join(
        eb.select("seq", "kind", "boundary"), on="seq").filter(pl.col("kind") == "final")
    if not extra.height:
        return gaps, []
    at_resume = ea.filter((pl.col("kind") == "params") & (pl.col("step") == resumed_at))["seq"]
    weights = set(ta.filter(pl.col("seq").is_in(at_resume.implode())).select("xor", "pos").iter_rows())
    loaded = []
    for seq, boundary in extra.select("seq", "boundary").iter_rows():
        held = tb.filter(pl.col("seq") == seq)
        if held.height and held["unobserved"].is_null().all() and set(held.select("xor", "pos").iter_rows()) <= weights:
            loaded.append((seq, boundary))
    if not loaded:
        return gaps, []
    from bitguard.backend.certification import reason  # (certification reads ingest, which reads this module)

    seqs = [seq for seq, _ in loaded]
    gaps = gaps.with_columns((pl.col("counted") & ~((pl.col("side") == "b") & pl.col("seq").is_in(seqs))).alias("counted"))
    names = ", ".join(boundary for _, boundary in loaded)
    return gaps, [reason("resumed", f"run B keeps the checkpoint it resumed from to its end ({names}: run A's parameters "
                                    f"at step {resumed_at}, tensor for tensor): its final state is not one of B's "
                                    f"training, and is not compared", "b", rank)]



def same_roots(ea: pl.DataFrame, eb: pl.DataFrame, shift: int) -> dict[str, str]:
    """{B's name: A's} of the root modules (called outside any other) of each class that B calls from its
    first step on and A from step `shift` on, as many in both, in the order each run first called them,
    where their names differ: roots are numbered by the roots of their class met before them, and a
    resumed process that built fewer models before its training (helper 61: `YOLO(last.pt).train(resume=
    True)` builds no probe model first) named the trained one `Net` where the full run named it `Net#2`,
    and nothing after the resume paired. Empty where a new name is one B holds already."""
    def roots(events: pl.DataFrame) -> dict[str, list[str]]:
        called = events.filter((pl.col("step") >= shift) & (pl.col("phase") == "forward") & (pl.col("depth") == 0))
        out: dict[str, list[str]] = {}
        for name in called.group_by("boundary").agg(pl.col("seq").min()).sort("seq")["boundary"].to_list():
            out.setdefault(_NUMBERED.sub("", name), []).append(name)
        return out

    in_a, rename = roots(ea), {}
    for base, names_b in roots(eb).items():
        names_a = in_a.get(base)
        if names_a and len(names_a) == len(names_b):
            rename.update({b: a for b, a in zip(names_b, names_a) if a != b})
    held = set(eb["boundary"].unique().to_list()) - set(rename)
    return {} if held & set(rename.values()) else rename
