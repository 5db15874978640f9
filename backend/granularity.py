"""Granularity: comparing runs that observed a model at different depths (torch.compile).

A compiled region (collectors/compiled.py) is observed at its inputs, outputs and gradients only;
its forward event carries a marker row (`state` at `schema.COMPILED_REGION_PATH`, unobserved)
saying that the module boundaries inside it were not observed. Here that marker becomes a fact of
the comparison instead of an unobserved tensor:

- `split` takes the marker rows out of both sides' tensors (and makes the alignment keys again
  without them, so a region pairs with the same module's eager call) and returns the regions.
- `inside` finds the events one run observed inside a region of the other run: the module calls
  of the forward that lie within the twin of the region's call (its paired event: same step,
  thread, and time span), and the backward and recompute events of those modules at that step.
  Those events are on one side only by construction: they are not counted as a structural
  divergence, and they are not equal either: they are `unobserved`, a blocking reason, so an
  eager run against a compiled one is never `identical`. A difference at the region's outputs is
  still the pivot (the region's event is paired), named with the region.
- Two runs that compiled the same regions observed the same boundaries: their comparison may be
  `identical`, with the informational reason `granularity` saying what that certifies (every
  region's inputs, outputs and gradients, every parameter gradient and optimizer step matched;
  not what happened inside a region, where a difference that never reaches its outputs is
  invisible).

Nothing here aligns, loads or blames; compare.py calls `split` and `inside`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from bitguard.backend import certification
from bitguard.schema import COMPILED_REGION_PATH


@dataclass
class Regions:
    """The compiled regions' forward events of each side (`seq`, `step`, `boundary`)."""

    a: pl.DataFrame = field(default_factory=pl.DataFrame)
    b: pl.DataFrame = field(default_factory=pl.DataFrame)
    hidden: dict[str, set[int]] = field(default_factory=lambda: {"a": set(), "b": set()})  # `inside`'s finds

    def __bool__(self) -> bool:
        return bool(self.a.height or self.b.height)

    def of(self, side: str) -> pl.DataFrame:
        return self.a if side == "a" else self.b

    def boundaries(self, side: str) -> list[str]:
        frame = self.of(side)
        return sorted(set(frame["boundary"].to_list())) if frame.height else []


def _markers(tensors: pl.DataFrame) -> pl.Expr:
    if "unobserved" not in tensors.columns or "path" not in tensors.columns:
        return pl.lit(False)
    return (pl.col("role") == "state") & (pl.col("path") == COMPILED_REGION_PATH) & pl.col("unobserved").is_not_null()


def split(ea: pl.DataFrame, eb: pl.DataFrame, ta: pl.DataFrame,
          tb: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame, Regions]:
    """Both sides without their region markers (keys made again when either had one) and the regions."""
    seqs = [ta.filter(_markers(ta))["seq"], tb.filter(_markers(tb))["seq"]]
    if not (len(seqs[0]) or len(seqs[1])):
        return ea, eb, ta, tb, Regions()
    ta, tb = ta.filter(~_markers(ta)), tb.filter(~_markers(tb))
    ea, eb = certification.rekey(ea, ta), certification.rekey(eb, tb)
    cols = ["seq", "step", "boundary"]
    regions = Regions(ea.filter(pl.col("seq").is_in(seqs[0].implode())).select(cols),
                      eb.filter(pl.col("seq").is_in(seqs[1].implode())).select(cols))
    return ea, eb, ta, tb, regions


def _inside_of(twins: pl.DataFrame, events: pl.DataFrame, gap_seqs: pl.Series) -> pl.DataFrame:
    """Of `events` (one side) those among `gap_seqs` that lie inside one of `twins` (that side's
    events paired with a region of the other side): (seq, region) for each."""
    gaps = events.filter(pl.col("seq").is_in(gap_seqs.implode()))
    if not twins.height or not gaps.height:
        return pl.DataFrame(schema={"seq": pl.Int64, "region": pl.String})
    t = twins.select(pl.col("step"), pl.col("thread").alias("_thread"), pl.col("t_start_ns").alias("_t0"),
                     pl.col("t_end_ns").alias("_t1"), pl.col("depth").alias("_depth"), pl.col("region"))
    forward = gaps.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module")).join(t, on="step").filter(
        (pl.col("thread") == pl.col("_thread")) & (pl.col("t_start_ns") >= pl.col("_t0"))
        & (pl.col("t_end_ns") <= pl.col("_t1")) & (pl.col("depth") > pl.col("_depth")))
    forward = forward.select("seq", "step", "boundary", "region").unique("seq", keep="first")
    # the gradients and recomputes of the modules found inside, at the same step
    names = forward.select("step", "boundary", "region").unique(["step", "boundary"], keep="first")
    later = gaps.filter((pl.col("phase") != "forward") & (pl.col("kind") == "module")).join(
        names, on=["step", "boundary"]).select("seq", "region")
    return pl.concat([forward.select("seq", "region"), later]).unique("seq", keep="first")


def inside(gaps: pl.DataFrame, ea: pl.DataFrame, eb: pl.DataFrame, pairs: pl.DataFrame, regions: Regions,
           rank: int) -> tuple[pl.DataFrame, list[dict]]:
    """`gaps` with the events inside the other side's compiled regions no longer counted, and the
    reasons to give (certification.py `Reason`s); those events' seqs per side go to `regions.hidden`."""
    hidden = regions.hidden
    if not regions:
        return gaps, []
    reasons, first = [], {}
    for side, events, other in (("a", ea, "b"), ("b", eb, "a")):
        marked = regions.of(other)
        if not marked.height or not gaps.height:
            continue
        mine, theirs = ("a_seq", "b_seq") if side == "a" else ("b_seq", "a_seq")
        twins = pairs.select(mine, theirs).join(marked.select(pl.col("seq").alias(theirs), pl.col("boundary")
                                                              .alias("region")), on=theirs)
        twins = events.join(twins.select(pl.col(mine).alias("seq"), "region"), on="seq")
        gap_seqs = gaps.filter(pl.col("side") == side)["seq"]
        found = _inside_of(twins, events, gap_seqs)
        if found.height:
            hidden[side] = set(found["seq"].to_list())
            first[side] = events.filter(pl.col("seq").is_in(found["seq"].implode())).sort("seq").row(0, named=True) \
                | {"region": found.sort("seq")["region"][0]}
    if hidden["a"] or hidden["b"]:
        counted_off = ((pl.col("side") == "a") & pl.col("seq").is_in(list(hidden["a"]))) | (
            (pl.col("side") == "b") & pl.col("seq").is_in(list(hidden["b"])))
        gaps = gaps.with_columns((pl.col("counted") & ~counted_off).alias("counted"))
    for side, other in (("a", "b"), ("b", "a")):
        if hidden[side]:
            e = first[side]
            reasons.append(certification.reason(
                "unobserved", side=other, rank=rank, message=
                f"{len(hidden[side])} event(s) of run {side.upper()} on rank {rank} lie inside compiled regions of "
                f"run {other.upper()} (torch.compile), whose module boundaries were not observed there: they are "
                f"not compared (first: the {e['phase']} of {e['boundary']} at step {e['step']}, inside "
                f"{e['region']}); a difference inside a region shows only at its outputs"))
    both = [s for s in ("a", "b") if regions.of(s).height]
    names = sorted(set(regions.boundaries("a")) | set(regions.boundaries("b")))
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    runs = "both runs" if len(both) == 2 else f"run {both[0].upper()}"
    reasons.append(certification.reason(
        "granularity", rank=rank, side=None if len(both) == 2 else both[0], message=
        f"{runs} compiled {shown} (torch.compile): a compiled region is observed at its inputs, outputs and "
        f"gradients, with parameter gradients and optimizer steps as usual; the modules inside it are not, so a "
        f"match there certifies the region's boundary, not the computation inside it"))
    return gaps, reasons


def mark_unobserved(events: pl.DataFrame, regions: Regions) -> pl.DataFrame:
    """Comparison.events() rows (`status`, `a_seq`, `b_seq`): an event on one side only because
    the other side compiled the region it lies in is `unobserved`, not `only_a` / `only_b`."""
    if not (regions.hidden["a"] or regions.hidden["b"]):
        return events
    hidden = ((pl.col("status") == "only_a") & pl.col("a_seq").is_in(list(regions.hidden["a"]))) | (
        (pl.col("status") == "only_b") & pl.col("b_seq").is_in(list(regions.hidden["b"])))
    return events.with_columns(pl.when(hidden.fill_null(False)).then(pl.lit("unobserved"))
                               .otherwise(pl.col("status")).alias("status"))


def note(regions: Regions, pivot: dict) -> list[str]:
    """A note for a pivot that is a compiled region's event: where inside it cannot be said."""
    if not regions or pivot.get("kind") != "module":
        return []
    sides = [s.upper() for s in ("a", "b") if pivot["boundary"] in regions.boundaries(s)]
    if not sides:
        return []
    runs = "runs A and B" if len(sides) == 2 else f"run {sides[0]}"
    return [f"{pivot['boundary']} is a compiled region in {runs} (torch.compile): its inside "
            f"was not observed there, so where in it the difference arose cannot be narrowed further"]
