"""What a resumed run did before its first training batch, checked against the run it resumed.

`compare --resumed-at N` leaves out of the alignment what each side recorded at step N before its
first training batch (ingest.resume_cut): the old process's tail (an evaluation, the checkpoint it
saved) and the new one's setup (loading it). Many trainings do the same thing there on both sides
(nanoGPT evaluates and saves at the resume step in both processes), and a resume that restored less
than it should shows first there: helper 38's B put its RNG state back only after that evaluation,
and compared identical. So B's events of that region are looked for in A's: one whose alignment key
A's region also has but whose digests differ from every such event of A's makes the comparison not
identical (`resume_setup`); an event A's region lacks (an evaluation only the resumed run makes) is
not compared, as the region is not.
"""

from __future__ import annotations

import dataclasses

import polars as pl

from bitguard.backend.certification import reason
from bitguard.backend.ingest import load_rank, resume_cut


def region_reasons(run_a, run_b, rank: int, rules=None) -> list[dict]:
    """A `resume_setup` reason when an event of B's resume region differs from A's events of the
    same key there (a tensor an `ignore` rule accepts left out); none otherwise. Reads the rank
    again (only a resumed comparison asks)."""
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
