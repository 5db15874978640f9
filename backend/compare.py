"""Compare two runs: align each rank's events, certify the identical prefix, find the pivot.

`compare(a, b, rules)` returns a `Comparison`, the one object the CLI report, the JSON, the
notebook and the web server all read. Per rank it aligns the two event streams by key
(alignment.py), compares the digests of every matched pair tensor by tensor, applies the
benign-difference rules, walks the pairs in run A's order to the first divergent pair (the
pivot), blames it (pivot.py) and follows what it corrupted (propagation.py).

Two analysis options exist for ablation studies (docs/EVALUATION.md): `fingerprint` picks what
makes two paired tensors differ (equivalence.py; default `xor+pos`, both digests), and `probes`
keeps only the events whose boundary matches one of the given globs, as if only those
boundaries had been instrumented.
"""

from __future__ import annotations

import fnmatch
from functools import partial
import threading
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from numba import njit

from bitguard.backend import api_diff, certification, check, collectives, content_pairs, equivalence, granularity
from bitguard.backend import pivot as pivot_mod
from bitguard.backend import bypassed, recompute, resumed
from bitguard.backend import params_blame, propagation, rank_pool, rank_summary, retype, threads
from bitguard.backend.ingest import RunInfo, in_order, load_rank, open_run
from bitguard.backend.rank_summary import RankSummary, hex16 as _hex, unobserved as _unobserved
from bitguard.backend.result import COMPARE_SCHEMA, EXIT_STATUS, CompareResult
from bitguard.backend.rules import RuleSet
from bitguard.errors import BadInput, BitguardError, IncompatibleRuns, NotFound

__all__ = ["COMPARE_SCHEMA", "Comparison", "compare"]
DEFAULT_BAND = 64


# A rank's frames: what a pool worker does not send back (rank_pool.py); the rest is small.
FRAMES = ("events_a", "events_b", "tensors_a", "tensors_b", "stacks_a", "stacks_b", "alignment", "pairs", "diffs",
          "gaps")
_again = threading.Lock()  # one rank compared again at a time (the server's threads may ask at once)


@dataclass(repr=False)
class RankComparison:
    """One rank's aligned events, digests compared, rules applied.

    A rank compared in a pool worker comes back `compact()`: its pivot, blame, propagation,
    reasons, scope, regions and `summary` (what the document is made of), without the frames
    (`FRAMES`). The first read of a frame compares the rank again in this process, from the same
    rank files with the same options, and keeps every frame: the same frames, field for field,
    as had the rank been compared here (a rank file changed since is refused, never mixed in)."""

    rank: int
    events_a: pl.DataFrame
    events_b: pl.DataFrame
    tensors_a: pl.DataFrame
    tensors_b: pl.DataFrame
    stacks_a: dict
    stacks_b: dict
    alignment: object
    pairs: pl.DataFrame  # a_seq, b_seq, a_pos, b_pos, reordered, status, rule_id
    diffs: pl.DataFrame  # per tensor of every pair: a_seq, role, idx, differs, ignored, ...
    gaps: pl.DataFrame  # side, seq, pos, order (in A's order), step, allowed, rule_id, counted
    pivot: dict | None = None
    blame: dict | None = None
    propagation: dict = field(default_factory=lambda: {"nodes": [], "edges": []})
    truncated: dict = field(default_factory=dict)
    reasons: list = field(default_factory=list)  # what of this rank cannot be certified (certification.py)
    scope: certification.Scope = field(default_factory=certification.Scope)
    regions: granularity.Regions = field(default_factory=granularity.Regions)  # compiled regions (torch.compile)
    summary: RankSummary | None = None  # what the document reads of this rank (rank_summary.py)
    again: tuple | None = None  # compact: (run_a, run_b, rules, band, fingerprint, probes) to compare it again
    fed_by: list = field(default_factory=list)  # ranks whose different input made this rank's collective differ (confirm_comm)
    digest_cache: bool = True  # either run reused digests of unchanged tensors (record's default; --no-digest-cache)
    step_shift: int = 0  # compare --resumed-at: added to run B's steps

    def compact(self) -> RankComparison:
        """This rank without its frames (what a pool worker sends back); set `again` to read them."""
        out = object.__new__(RankComparison)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k not in FRAMES and k != "again"})
        return out

    @property
    def frames_held(self) -> bool:
        """Every frame is here (compared in this process, or read once since)."""
        return all(k in self.__dict__ for k in FRAMES)

    def __getattr__(self, name: str):  # only called for an attribute not set: a compact rank's frame
        if name not in FRAMES or self.__dict__.get("again") is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        with _again:
            if name not in self.__dict__:
                self._compare_again()
        return self.__dict__[name]

    def _compare_again(self) -> None:
        run_a, run_b, rules, band, fingerprint, probes = self.again
        full = _compare_rank(self.rank, run_a, run_b, rules, {}, band, fingerprint, probes)
        if full.summary.alignment != self.summary.alignment or _where(full.pivot) != _where(self.pivot):
            raise BitguardError(f"rank {self.rank}'s files changed since the comparison (compared again, they give "
                                f"another alignment or pivot): compare the runs again")
        self.__dict__.update({k: full.__dict__[k] for k in FRAMES})

    def __repr__(self) -> str:
        where = "no divergence" if self.pivot is None else \
            f"pivot {self.pivot['phase']} {self.pivot['boundary']} step {self.pivot['step']}"
        held = "frames held" if self.frames_held else "frames on first read"
        return f"<RankComparison rank {self.rank}: {where}, {held}>"


def _where(pivot: dict | None) -> tuple | None:
    return None if pivot is None else (pivot["cause"], pivot["seq"], pivot["b_seq"], pivot["order"])


def _occurrence(tensors: pl.DataFrame) -> pl.Expr:
    """Which of an event's tensors with the same role and index this is (0 for nearly all): the
    join key that keeps two such rows from pairing as a cross product. The rows must be sorted by
    seq, role and idx (`_by_place`): the count runs along each stretch of equal ones (a window
    over the three columns took 1.5 s for 300,000 rows here, this 20 ms)."""
    same = ((pl.col("seq") == pl.col("seq").shift()) & (pl.col("role") == pl.col("role").shift())
            & (pl.col("idx") == pl.col("idx").shift())).fill_null(False)
    row = pl.int_range(pl.len(), dtype=pl.Int64)
    return (row - pl.when(same).then(None).otherwise(row).forward_fill()).alias("_nth")


def _by_place(tensors: pl.DataFrame) -> pl.DataFrame:
    """The rows in seq, role, idx order, rows with equal ones kept in their order (as load_rank
    gives them: then nothing is sorted again)."""
    return in_order(tensors, ("seq", "role", "idx"))


@njit(cache=True)
def _partners(new_event, lo, hi, a_role, a_idx, a_nth, b_role, b_idx, b_nth):  # pragma: no cover - compiled
    """For each A tensor row (rows of a paired event together, each event's rows and B's in
    (role, idx, nth) order): the row of B's partner event [lo, hi) with the same role, idx and
    nth, or -1. One merge per event pair."""
    out = np.full(len(a_role), -1, np.int64)
    p = 0
    for i in range(len(a_role)):
        if new_event[i]:
            p = lo[i]
        while p < hi[i] and (b_role[p] < a_role[i] or (b_role[p] == a_role[i] and (
                b_idx[p] < a_idx[i] or (b_idx[p] == a_idx[i] and b_nth[p] < a_nth[i])))):
            p += 1
        if p < hi[i] and b_role[p] == a_role[i] and b_idx[p] == a_idx[i] and b_nth[p] == a_nth[i]:
            out[i] = p
    return out


_PAIRED_A = ("seq", "role", "idx", "path", "shape", "dtype", "xor", "pos", "unobserved")  # A's columns in `diffs`


def _gathered(frame: pl.DataFrame, column: pl.Expr, at: pl.Series, name: str) -> pl.Expr | pl.Series:
    """`column` of `frame` gathered at the rows `at` (NULL: a NULL row). A column of one value
    (ingest._read_compact) stays that one value when every row has a partner, not 16 bytes a row."""
    if frame.height and not at.has_nulls() and frame.select(column.eq_missing(column.first()).all()).item():
        return pl.lit(frame.select(column.first()).item(), dtype=frame.select(column).dtypes[0]).alias(name)
    return frame.select(column.gather(at).alias(name)).to_series()


_PIECES = 64  # at most this many slices are joined (more: one filter copies the rows)


def _kept_rows(left: pl.DataFrame, kept: np.ndarray, right: pl.DataFrame) -> pl.DataFrame:
    """`left`'s rows where `kept`, beside `right` (one row for each kept one). Few rows are dropped
    (A's events without a partner: its gaps), so the kept ones are taken as slices of `left`, whose
    columns they share, instead of a filter's copy (~100 MB of a million-event run's tensors);
    `right` is cut at the same rows, so that every column has chunks of the same lengths (polars
    copies a frame into one chunk when they differ). The same rows, in the same order."""
    bounds = np.cumsum(left.get_column("a_seq").chunk_lengths())[:-1]  # (a_seq: never one value)
    runs = np.flatnonzero(np.diff(np.r_[0, kept.view(np.int8), 0]))  # starts and ends of the kept stretches
    cuts = np.union1d(runs, bounds[kept[bounds]] if len(bounds) else bounds)  # a chunk's start inside a stretch
    pieces, at = [], 0
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        if kept[lo] and len(pieces) <= _PIECES:
            pieces.append(pl.concat([left.slice(lo, hi - lo), right.slice(at, hi - lo)], how="horizontal"))
            at += hi - lo
    if not pieces or len(pieces) > _PIECES or at != right.height or any(max(p.n_chunks("all")) > 1 for p in pieces):
        return pl.concat([left.filter(pl.Series(kept)), right], how="horizontal")
    return pl.concat(pieces, rechunk=False) if len(pieces) != 1 else pieces[0]


def _pair_tensors(pairs: pl.DataFrame, ta: pl.DataFrame, tb: pl.DataFrame) -> pl.DataFrame:
    """Every tensor of A's paired events beside its partner in B (same role, index and
    occurrence; NULL when B has none), compared digest by digest. Both sides in place order, so
    the partner is found by one merge per event pair (NumPy and Numba; a polars join on four
    columns cost ten times as much at a million events)."""
    ta, tb = _by_place(ta), _by_place(tb)
    # (the occurrence apart: a column added to a frame read in chunks makes polars copy it into one)
    nth_a, nth_b = (t.select(_occurrence(t)).to_series().to_numpy() for t in (ta, tb))
    by_a = pairs.select("a_seq", "b_seq").sort("a_seq")
    pa, pb = by_a["a_seq"].to_numpy(), by_a["b_seq"].to_numpy()
    seq_a, seq_b = ta["seq"].to_numpy(), tb["seq"].to_numpy()
    at = np.clip(np.searchsorted(pa, seq_a), 0, max(len(pa) - 1, 0))
    paired = (pa[at] == seq_a) if len(pa) else np.zeros(len(seq_a), bool)
    rows = np.flatnonzero(paired)
    b_seq = pb[at[rows]] if len(pa) else np.empty(0, np.int64)
    roles = pl.Enum(sorted(set(ta["role"].unique().to_list()) | set(tb["role"].unique().to_list())))

    def place(t: pl.DataFrame, nth: np.ndarray) -> list[np.ndarray]:  # role (as its rank in byte order), idx, nth
        return [t["role"].cast(roles).to_physical().to_numpy(), t["idx"].to_numpy(), nth]

    kept = seq_a[rows]
    new_event = np.r_[True, kept[1:] != kept[:-1]] if len(kept) else np.empty(0, bool)
    partner = _partners(new_event, np.searchsorted(seq_b, b_seq, "left"), np.searchsorted(seq_b, b_seq, "right"),
                        *(c[rows] for c in place(ta, nth_a)), *place(tb, nth_b))
    at_b = pl.Series(partner).replace(-1, None)  # NULL: B has no partner (gathered as a NULL row)
    # shapes compared by their hashes (a list column costs ten times as much to gather): equal
    # shapes hash alike, and two shapes apart hash alike with a chance of 2^-64, as two digests do
    right = tb.select(pl.col("xor").alias("xor_b"), pl.col("pos").alias("pos_b"),
                      pl.col("shape").hash().alias("_shape_b")).select(pl.all().gather(at_b))
    right = right.with_columns(_gathered(tb, pl.col("dtype"), at_b, "dtype_b"),
                               _gathered(tb, _unobserved(tb), at_b, "unobserved_b"))
    # only what the verdict and the pivot's tensors read travels into the pairs (strides, sizes,
    # storages, identities and shards stay in `ta`: a million-event run's copy of them was ~100 MB)
    left = ta.select(_unobserved(ta).alias(c) if c == "unobserved" else c for c in _PAIRED_A).rename({"seq": "a_seq"})
    d = _kept_rows(left, paired, pl.concat([pl.Series("b_seq", b_seq, pl.Int64).to_frame(), right],
                                           how="horizontal"))
    return d.with_columns(
        (pl.col("xor") != pl.col("xor_b")).fill_null(True).alias("xor_differs"),
        (pl.col("pos") != pl.col("pos_b")).fill_null(True).alias("pos_differs"),
        # the same bytes as another shape or dtype are another tensor (pairs made by place or across
        # a dtype change, retype.py): the digests see only the bytes
        ((pl.col("shape").hash() != pl.col("_shape_b")) | (pl.col("dtype") != pl.col("dtype_b"))).fill_null(False)
        .alias("_form_differs"),
        # a tensor either side could not read: its digests mean nothing, it can be neither equal nor not
        (pl.col("unobserved").is_not_null() | pl.col("unobserved_b").is_not_null()).alias("unknown"),
    ).with_columns((pl.col("xor_differs") | pl.col("pos_differs") | pl.col("_form_differs")).alias("differs")
                   ).drop("_shape_b", "_form_differs")


def _group_members(ranks: dict) -> set[int]:
    """The global ranks that the compared ranks' collectives name as their groups' members."""
    members: set[int] = set()
    for rc in ranks.values():
        for boundary in rc.summary.comm["boundary"].unique().to_list():
            members |= set(collectives.group_of(boundary) or [])
    return members


def _apply_ignore(diffs: pl.DataFrame, events: pl.DataFrame, rules: RuleSet, rank: int, fired: dict) -> pl.DataFrame:
    diffs = diffs.with_columns(pl.lit(False).alias("ignored"), pl.lit(None, dtype=pl.String).alias("rule_id"))
    ignore = rules.of("ignore")
    if not ignore or diffs.is_empty():
        return diffs
    differing = diffs.filter(pl.col("differs")).join(
        events.select(pl.col("seq").alias("a_seq"), "boundary", "module_type", "phase", "step"), on="a_seq")
    hits: dict[tuple[int, str, int], str] = {}
    for row in differing.select("a_seq", "role", "idx", "path", "dtype", "boundary", "module_type", "phase",
                                "step").iter_rows(named=True):
        for rule in ignore:
            if rule.matches(boundary=row["boundary"], module_type=row["module_type"], phase=row["phase"],
                            step=row["step"], rank=rank, role=row["role"], dtype=row["dtype"], path=row["path"]):
                hits[(row["a_seq"], row["role"], row["idx"])] = rule.id
                break
    if not hits:
        return diffs
    events_hit: dict[str, set] = {}
    for (seq, _, _), rid in hits.items():
        events_hit.setdefault(rid, set()).add(seq)
    for rid, seqs in events_hit.items():
        fired[rid] = fired.get(rid, 0) + len(seqs)
    keys = pl.DataFrame({"a_seq": [k[0] for k in hits], "role": [k[1] for k in hits],
                         "idx": [k[2] for k in hits], "_rule": list(hits.values())},
                        schema={"a_seq": pl.Int64, "role": pl.Categorical, "idx": pl.Int32, "_rule": pl.String})
    diffs = diffs.drop("rule_id").join(keys, on=["a_seq", "role", "idx"], how="left")
    return diffs.with_columns(pl.col("_rule").is_not_null().alias("ignored")).rename({"_rule": "rule_id"})


def _keep_probes(events: pl.DataFrame, tensors: pl.DataFrame, probes) -> tuple[pl.DataFrame, pl.DataFrame]:
    if probes is None:
        return events, tensors
    names = events["boundary"].unique().to_list()
    kept = [b for b in names if any(fnmatch.fnmatchcase(b, g) for g in probes)]
    events = events.filter(pl.col("boundary").is_in(kept))
    return events, tensors.filter(pl.col("seq").is_in(events["seq"].implode()))


def _of_events(tensors: pl.DataFrame, events: pl.DataFrame) -> pl.DataFrame:
    """The tensors of `events`; `tensors` itself when it holds no others (nearly always: a filter
    that keeps every row still copies the frame, hundreds of MB at a million events)."""
    kept = tensors.select(pl.col("seq").is_in(events["seq"].implode())).to_series()
    return tensors if kept.all() else tensors.filter(kept)


def b_gap_order(al, positions: np.ndarray) -> np.ndarray:
    """Where events only in B sit in run A's order: just after the A event paired with their
    nearest preceding paired B event (before everything when there is none), in B's order."""
    positions = np.asarray(positions)
    if not positions.size:
        return positions.astype(np.float64)
    mb, ma = np.asarray(al.b_idx), np.asarray(al.a_idx)
    order_b = np.argsort(mb, kind="stable")
    mb_sorted, ma_sorted = mb[order_b], ma[order_b]
    k = np.searchsorted(mb_sorted, positions) - 1
    anchor = np.where(k >= 0, ma_sorted[np.clip(k, 0, None)] if len(ma_sorted) else -1, -1)
    return anchor + 0.5 + positions / (10.0 * (positions.max() + 1))


def _compare_rank(rank: int, run_a: RunInfo, run_b: RunInfo, rules: RuleSet, fired: dict, band: int,
                  fingerprint: str = "xor+pos", probes=None) -> RankComparison:
    # both sides at once: reading a rank file waits mostly outside the GIL (DuckDB, polars)
    with ThreadPoolExecutor(2) as pool:
        side_a, side_b = pool.submit(load_rank, run_a, rank), pool.submit(load_rank, run_b, rank)
        ea, ta, sa = side_a.result()  # A's error first when both fail, as one after the other
        eb, tb, sb = side_b.result()
    ea, eb, ta, tb = certification.since_filter(run_a, run_b, ea, eb, ta, tb)
    renamed = resumed.same_roots(ea, eb, run_b.step_shift) if run_b.step_shift else {}
    if renamed:  # (B's trained root named as A's: `Net` for `Net#2`)
        eb = certification.rekey(eb.with_columns(pl.col("boundary").replace(renamed)), tb)
    ea, eb, ta, tb, mode_reasons = certification.mode_filter(run_a, run_b, ea, eb, ta, tb)
    ea, eb, ta, tb, regions = granularity.split(ea, eb, ta, tb)
    ea, ta = _keep_probes(ea, ta, probes)
    eb, tb = _keep_probes(eb, tb, probes)
    ta, tb = _of_events(ta, ea), _of_events(tb, eb)
    al, retyped, resigned = content_pairs.by_content(*retype.align_retyped(ea, eb, band), ea, eb, ta, tb)
    seq_a, seq_b = ea["seq"].to_numpy(), eb["seq"].to_numpy()
    pairs = pl.DataFrame({
        "a_pos": al.a_idx, "b_pos": al.b_idx,
        "a_seq": seq_a[al.a_idx] if len(al.a_idx) else np.empty(0, np.int64),
        "b_seq": seq_b[al.b_idx] if len(al.b_idx) else np.empty(0, np.int64),
        "reordered": al.reordered, "retyped": retyped, "resigned": resigned,
    }, schema={"a_pos": pl.Int64, "b_pos": pl.Int64, "a_seq": pl.Int64, "b_seq": pl.Int64, "reordered": pl.Boolean,
               "retyped": pl.Boolean, "resigned": pl.Boolean})
    # (a tensor one side alone holds differs: a parameter one model alone has, helper 86, is an architecture changed)
    alone = ea.filter(pl.col("kind").is_in(["batch", "step", "params"]))["seq"]
    diffs = equivalence.apply(retype.pair_tensors(pairs, ta, tb, _pair_tensors, alone), fingerprint,
                              run_a.ranks[rank], run_b.ranks[rank])
    diffs = diffs.with_columns((pl.col("differs") & ~pl.col("unknown")).alias("differs"))
    diffs = _apply_ignore(diffs, ea, threads.rules_for(rules, run_a, run_b, rank), rank, fired)
    per_pair = diffs.group_by("a_seq").agg(
        (pl.col("differs") & ~pl.col("ignored")).any().alias("diverged"),
        (pl.col("differs") & pl.col("ignored")).any().alias("benign"),
        pl.col("unknown").any().alias("unknown"),
        pl.col("rule_id").drop_nulls().first().alias("rule_id"))
    pairs = pairs.join(per_pair, on="a_seq", how="left").with_columns(
        pl.when(pl.col("diverged").fill_null(False)).then(pl.lit("diverged"))
        .when(pl.col("unknown").fill_null(False)).then(pl.lit("unobserved"))
        .when(pl.col("benign").fill_null(False)).then(pl.lit("benign"))
        .otherwise(pl.lit("identical")).alias("status")).drop("diverged", "benign", "unknown").sort("a_pos")
    scope, reasons = certification.rank_scope(rank, run_a, run_b, ea, eb)
    if scope.damaged is not None:  # where a side lost records, a pair may be two different calls
        lost = ea["step"].gather(pairs["a_pos"]) >= scope.damaged
        pairs = pairs.with_columns(pl.when(lost & (pl.col("status") == "diverged")).then(pl.lit("unobserved"))
                                   .otherwise(pl.col("status")).alias("status"))
    pairs = _follows_accepted(pairs, diffs, ea, ta)
    nothing = certification.empty_or_unpaired(rank, ea, eb, pairs.height, tuple(
        run.manifest.get("status") == "failed" for run in (run_a, run_b)))
    reasons = mode_reasons + threads.reason(run_a, run_b, rank) + reasons + ([nothing] if nothing else [])
    gaps = _gaps(rank, ea, eb, al, rules, fired, scope, counted=nothing is None,
                 resumed_at=run_b.resume_from if run_b.step_shift else None,
                 windowed=any(r["code"] == "step_window" for r in reasons))
    gaps, recompute_reasons = recompute.one_sided(gaps, ea, eb, rank)  # checkpointing on one side only
    gaps, bypassed_reasons = bypassed.one_sided(gaps, ea, eb, ta, tb, pairs, rank)  # children called one by one
    gaps, loaded_reasons = resumed.loaded_checkpoint(gaps, ea, ta, eb, tb, run_b.resume_from if run_b.step_shift else None,
                                                     rank)
    reasons = reasons + recompute_reasons + bypassed_reasons + loaded_reasons
    gaps, region_reasons = granularity.inside(gaps, ea, eb, pairs, regions, rank)  # not observed in the other run
    rc = RankComparison(rank, ea, eb, ta, tb, sa, sb, al, pairs, diffs, gaps, reasons=reasons + region_reasons,
                        scope=scope, regions=regions, step_shift=run_b.step_shift,
                        digest_cache=any(run.manifest.get("digest_cache", True) is not False for run in (run_a, run_b)))
    _find_pivot(rc)
    rc.summary = rank_summary.summarize(rc, run_a)  # before confirm_comm: its blame's fields are read after
    return rc


def _place(at: str) -> str:
    """A read's place as a rule's path glob matches it wherever the file sits: its file's name and line."""
    return at.replace("\\", "/").rsplit("/", 1)[-1]


def _saves(events: pl.DataFrame) -> pl.Series:
    """The seqs of `saved` events: what the training wrote (a checkpoint, a JSON file), read by nothing it
    computes after (a run that loads a file back reads it in events of their own)."""
    return events.filter(pl.col("kind") == "saved")["seq"]


def _follows_accepted(pairs: pl.DataFrame, diffs: pl.DataFrame, ea: pl.DataFrame, ta: pl.DataFrame) -> pl.DataFrame:
    """Divergent pairs that follow from a difference a rule accepted get status `follows`, with
    the accepting rule's id: explained, not new faults, and not certified either. A pair follows
    when one of its inputs differs only by an accepted difference, or when it is reachable from
    an accepted one over the propagation edges (dataflow, nesting, activations, gradients,
    updates, weights). Not from an accepted difference in what the training saved (`_saves`): the
    tensors of a checkpoint are the weights' own, and its edges reached every later use of them (helper
    59: a wrong branch after a checkpoint whose timing row a rule accepted followed from it, no pivot)."""
    accepted = diffs.filter(pl.col("differs") & pl.col("ignored"))
    if accepted.is_empty():
        return pairs
    inputs = pl.DataFrame([(phase, kind, role) for (phase, kind), roles in pivot_mod.INPUT_ROLES.items()
                           for role in roles],
                          schema={"phase": pl.Categorical, "kind": pl.Categorical, "role": pl.Categorical},
                          orient="row")
    # a_seq -> rule: an input differs, and that difference is accepted (the first such tensor's rule)
    input_fed = (accepted.select("a_seq", "role", "rule_id").with_row_index("_i")
                 .join(ea.select(pl.col("seq").alias("a_seq"), "phase", "kind"), on="a_seq", how="left")
                 .join(inputs, on=["phase", "kind", "role"], how="semi").sort("_i")
                 .unique("a_seq", keep="first", maintain_order=True).select("a_seq", "rule_id"))
    benign = pairs.filter(pl.col("status") == "benign")
    rule_of = pl.concat([input_fed, benign.filter(~pl.col("a_seq").is_in(input_fed["a_seq"].implode()))
                         .select("a_seq", "rule_id")]).filter(~pl.col("a_seq").is_in(_saves(ea).implode()))
    if rule_of.is_empty():
        return pairs
    sources = rule_of.join(pairs.select("a_seq", "a_pos"), on="a_seq", how="left").sort(
        pl.col("a_pos").fill_null(0), maintain_order=True)["a_seq"].to_numpy()
    divergent = pairs.filter(pl.col("status").is_in(["benign", "diverged"]))["a_seq"].to_numpy()
    reached = propagation.reachable(propagation.graph(ea, ta, divergent, loss=True), sources)
    follows = reached.filter((pl.col("seq") >= 0) & ~pl.col("seq").is_in(benign["a_seq"].implode())).join(
        rule_of.select(pl.col("a_seq").alias("source"), pl.col("rule_id").alias("_src_rule")), on="source")
    if not follows.height:
        return pairs
    hit = follows.select(pl.col("seq").alias("a_seq"), "_src_rule")
    pairs = pairs.join(hit, on="a_seq", how="left")
    is_follow = (pl.col("status") == "diverged") & pl.col("_src_rule").is_not_null()
    return pairs.with_columns(
        pl.when(is_follow).then(pl.lit("follows")).otherwise(pl.col("status")).alias("status"),
        pl.when(is_follow).then(pl.col("_src_rule")).otherwise(pl.col("rule_id")).alias("rule_id")).drop("_src_rule")


def _gaps(rank, ea, eb, al, rules: RuleSet, fired: dict, scope, counted: bool = True,
          resumed_at: int | None = None, windowed: bool = False) -> pl.DataFrame:
    """Events on one side only: their A-order position, the rule that allows them, and whether they
    count as a structural divergence (inside the certified scope, not allowed, the rank paired; not
    a params event of the step a resumed run began at, `resumed_at`, nor the gradient of a tensor
    only an optimizer holds there: a process takes params events at its first step's every call,
    and finds such tensors at its first optimizer step, which the run it resumed had made; helper
    38. What they hold is compared at the steps after); nor, where the runs recorded different step
    windows (`windowed`), a final state, which a window's end records (helper 38: A recorded with
    --steps 0:3 against the whole run "ended here"; the step_window reason says what was compared)."""
    rows = []
    allow = rules.of("allow-gap")
    for side, events, positions in (("a", ea, al.gaps_a), ("b", eb, al.gaps_b)):
        if not len(positions):
            continue
        order = positions.astype(np.float64) if side == "a" else b_gap_order(al, positions)
        sub = events[positions.tolist()].select("seq", "step", "phase", "kind", "boundary", "module_type")
        for pos, at, r in zip(positions.tolist(), order.tolist(), sub.iter_rows(named=True)):
            rid = next((rule.id for rule in allow if rule.matches(
                boundary=r["boundary"], module_type=r["module_type"], phase=r["phase"], step=r["step"],
                rank=rank)), None)
            if rid is not None:
                fired[rid] = fired.get(rid, 0) + 1
            expected = (resumed_at is not None and r["step"] == resumed_at and (
                r["kind"] == "params" or (r["kind"] == "grad" and ".param_groups[" in r["boundary"]))) \
                or (windowed and r["kind"] == "final")
            rows.append((side, r["seq"], pos, at, r["step"], rid is not None, rid, expected))
    gaps = pl.DataFrame(rows, schema={"side": pl.String, "seq": pl.Int64, "pos": pl.Int64, "order": pl.Float64,
                                      "step": pl.Int64, "allowed": pl.Boolean, "rule_id": pl.String,
                                      "_expected": pl.Boolean}, orient="row")
    return gaps.with_columns((~pl.col("allowed") & scope.contains(pl.col("step")) & pl.lit(counted)
                              & ~pl.col("_expected")).alias("counted")).drop("_expected")


class _StatusOf:
    """`get(a_seq)`: a pair's status, looked up in the pairs frame when asked (blame asks about
    a few events; a dict of every pair cost half a second at a million)."""

    def __init__(self, pairs: pl.DataFrame):
        self._pairs = pairs

    def get(self, seq, default=None):
        hit = self._pairs.filter(pl.col("a_seq") == seq)["status"]
        return hit[0] if hit.len() else default


def _find_pivot(rc: RankComparison) -> None:
    """The rank's first divergence in A's order: the first divergent pair, or an event on one side
    only that counts (a structural divergence), whichever comes first."""
    diverged = rc.pairs.filter(pl.col("status") == "diverged")
    counted = rc.gaps.filter(pl.col("counted")).sort("order")
    digest_at = float(diverged["a_pos"][0]) if diverged.height else float("inf")
    gap_at = float(counted["order"][0]) if counted.height else float("inf")
    if digest_at == gap_at == float("inf"):
        return
    if digest_at <= gap_at:
        first = diverged.row(0, named=True)
        event = rc.events_a.row(first["a_pos"], named=True)
        rc.pivot = {**event, "cause": "digest", "side": None, "b_seq": first["b_seq"], "a_pos": first["a_pos"],
                    "b_pos": first["b_pos"], "order": digest_at, "retyped": first["retyped"]}
        rc.blame = pivot_mod.blame(rc.pivot, rc.events_a, _StatusOf(rc.pairs), rc.diffs, rc.tensors_a, rc.step_shift,
                                   rc.events_b, rc.tensors_b)
        if rc.blame["fault_class"] == "data" and rc.pivot["phase"] == "data":  # another model's output, not a batch?
            fed = pivot_mod.fed_by_model(rc.pivot, ((rc.events_a, rc.tensors_a), (rc.events_b, rc.tensors_b)), rc.diffs)
            if fed is not None:
                rc.blame["blame_window"] = {"module": None, "detail": fed}
        if rc.blame["blame"] in ("consumer", "data") and rc.blame["fault_class"] not in ("rng", "params"):
            rc.blame = params_blame.made_apart(rc.blame, rc.pivot, rc.events_a, rc.diffs)
        seed = event["seq"]
    else:
        gap = counted.row(0, named=True)
        side = gap["side"]
        events = rc.events_a if side == "a" else rc.events_b
        event = events.row(gap["pos"], named=True)
        rc.pivot = {**event, "cause": "structure", "side": side, "seq": event["seq"] if side == "a" else None,
                    "b_seq": event["seq"] if side == "b" else None, "a_pos": gap_at, "b_pos": None,
                    "order": gap_at, "retyped": False}
        other = rc.gaps.filter(pl.col("counted") & (pl.col("side") != side) & (pl.col("step") == event["step"]))
        twin = None
        if other.height:
            others = (rc.events_b if side == "a" else rc.events_a)[other["pos"].to_list()]
            same = others.filter((pl.col("phase") == event["phase"]) & (pl.col("kind") == event["kind"])
                                 & (pl.col("boundary") == event["boundary"]))
            twin = same.row(0, named=True) if same.height else None
        rc.pivot["twin_seq"] = None if twin is None else twin["seq"]  # (its tensors shown beside the pivot's)
        change = ""
        if twin is not None:
            seq_a, seq_b = (event["seq"], twin["seq"]) if side == "a" else (twin["seq"], event["seq"])
            change = pivot_mod.signature_change(rc.tensors_a.filter(pl.col("seq") == seq_a),
                                                rc.tensors_b.filter(pl.col("seq") == seq_b))
        rc.blame = pivot_mod.structure_blame(event, side, events, twin, change,
                                             rc.tensors_a if side == "a" else rc.tensors_b)
        if twin is None:  # (a container's random pick: the RNG state its call began from differs)
            rc.blame = pivot_mod.drawn_apart(rc.blame, event, side, events, rc.pairs, rc.diffs)
        seed = event["seq"] if side == "a" else None
    if seed is not None:
        divergent = pl.concat([diverged["a_seq"], pl.Series([seed], dtype=pl.Int64)]).unique().to_numpy()
        rc.propagation = propagation.build(rc.rank, rc.events_a, rc.tensors_a, divergent, seed)


def _read_field(d: dict) -> str:
    """` in its shape` where a read's values differ in their shape or dtype, not only their digest (helper 88)."""
    return f" in its {d['field']}" if d["kind"] == "read" and d["field"] not in (None, "value") else ""


def _in_a_steps(run_a: RunInfo, run_b: RunInfo) -> tuple[dict, dict]:
    """The two manifests with their recorded step windows as compare reads them (--resumed-at:
    certification.compared_windows)."""
    if not run_b.step_shift:
        return run_a.manifest, run_b.manifest
    return tuple({**run.manifest, "steps": None if w == (None, None) else list(w)}
                 for run, w in zip((run_a, run_b), certification.compared_windows(run_a, run_b)))


def manifest_differences(a: dict, b: dict) -> list[dict]:
    """Differences between two manifests that can by themselves explain a divergence."""
    out = []

    def check(name, va, vb, why):
        if va != vb:
            out.append({"field": name, "a": va, "b": vb, "why": why})

    va, vb = a.get("versions") or {}, b.get("versions") or {}
    # A run that never ended (killed: not complete, its end time still null) never listed what its script
    # imported (taken when the recording ends): a library only the other run lists is no difference.
    listed_a, listed_b = (m.get("end_time") is not None or m.get("status") not in ("running", "failed", "interrupted")
                          for m in (a, b))
    # versions first (an upgrade explains most divergences), those both runs imported before the rest
    for lib in sorted(set(va) | set(vb), key=lambda lib: (lib not in va or lib not in vb, lib)):
        if (lib not in va and not listed_a) or (lib not in vb and not listed_b):
            continue
        check(f"versions.{lib}", va.get(lib), vb.get(lib), "a different library version can change kernels and numerics"
              if lib in va and lib in vb else "imported by one run only (or recorded by an older bitguard)")
    da, db = a.get("determinism", {}) or {}, b.get("determinism", {}) or {}
    check("determinism.torch_threads", da.get("torch_threads"), db.get("torch_threads"),
          "on CPU the thread count alone changes reduction order and results")
    for key in sorted((set(da) | set(db)) - {"torch_threads"}):
        check(f"determinism.{key}", da.get(key), db.get(key), "determinism settings differ")
    check("devices", a.get("devices"), b.get("devices"), "different devices can compute differently")
    check("world_size", a.get("world_size"), b.get("world_size"), "a different parallel layout changes reductions")
    check("mode", a.get("mode"), b.get("mode"), "recording modes observe different boundaries (gaps expected)")
    check("steps", a.get("steps"), b.get("steps"), "different recorded step windows")
    if isinstance(a.get("env"), dict) and isinstance(b.get("env"), dict):  # (unset: None)
        check("env.PYTHONHASHSEED", a["env"].get("PYTHONHASHSEED"), b["env"].get("PYTHONHASHSEED"),
              "the hash seed orders sets of strings (peft's target_modules, a set of module names): another or an "
              "unset one can change what a run computes or saves")
    if a.get("recorder") and b.get("recorder"):  # (runs recorded before the field: unknown, not different)
        check("recorder", a["recorder"], b["recorder"], "recorded by different builds of bitguard: what one records "
              "and the other does not (a kind of row, a name) can differ by itself; record both with one build")
    return out


def _first_pivot(ranks: dict[int, RankComparison]) -> RankComparison | None:
    """The rank whose pivot comes first: the earliest step, then the earliest end in time; but a
    rank whose collective differs only because another rank fed it a different input (`fed_by`,
    confirm_comm) gives way to that rank's pivot of the same step or earlier: the fault is there."""
    def first(rcs):
        return min(rcs, key=lambda rc: (rc.pivot["step"], rc.pivot["t_end_ns"])) if rcs else None

    chosen = first([rc for rc in ranks.values() if rc.pivot is not None])
    seen = set()
    while chosen is not None and chosen.fed_by and chosen.rank not in seen:
        seen.add(chosen.rank)
        feeders = [ranks[r] for r in chosen.fed_by if r in ranks and ranks[r].pivot is not None
                   and ranks[r].pivot["step"] <= chosen.pivot["step"]]
        if not feeders:
            break
        chosen = first(feeders)
    return chosen


# API calls that compute: one run alone makes one, every recorded tensor equal, is no identical (`_calls_in_one_run`)
_TRAINING_CALLS = ("backward", "optimizer_step")
# API calls whose values outlive the last optimizer step (what the next step would use): _final_settings_differ
SETTINGS_AFTER = ("scheduler_step", "loss_scale", "optimizer_settings", "scheduler_settings")
# Reasons that stop a verdict from being `identical`; the others only describe what was compared.
_INFORMATIONAL = {"modes", "granularity", "recompute", "bypassed", "retyped", "resumed", "threads"}
# reasons after which no computed value is compared: nothing was paired, or the steps are not the same steps
# (helper 33: a run recorded with --steps 4: against a resumed one said "every recorded tensor is equal")
_UNPAIRED = {"empty", "nothing_paired", "step_window"}


class Comparison:
    """The result of comparing run A (reference) with run B (suspect)."""

    def __init__(self, run_a: RunInfo, run_b: RunInfo, rules: RuleSet, ranks: dict[int, RankComparison],
                 fired: dict, band: int, fingerprint: str = "xor+pos", probes: list[str] | None = None,
                 reasons: list[dict] | None = None):
        self.run_a, self.run_b, self.rules = run_a, run_b, rules
        self.ranks = ranks
        self.band = band
        self.fingerprint = fingerprint  # what made two paired tensors differ (equivalence.py)
        self.probes = probes  # boundary globs kept, None for every recorded event
        self.rules_fired = [{"id": k, "count": v} for k, v in sorted(fired.items())]
        self._first = _first_pivot(ranks)
        self.manifest_diffs = manifest_differences(*_in_a_steps(run_a, run_b))
        self.reasons = list(reasons or [])  # whole-run reasons; the ranks add theirs (certification.py)
        self._result: CompareResult | None = None
        self._reasons: list[dict] | None = None
        self._api_rows_read: dict[int, tuple] = {}  # rank -> both runs' API events (`_api_rows`)

    @property
    def verdict(self) -> str:
        if self._first is not None:
            return "diverged"
        return "inconclusive" if self.blocking_reasons() else "identical"

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    def certification_reasons(self) -> list[dict]:
        """Everything that stops part of the comparison from being certified (result.py `Reason`s)."""
        if self._reasons is None:
            self._reasons = self._collect_reasons()
        return self._reasons

    def _collect_reasons(self) -> list[dict]:
        reasons = list(self.reasons) + [r for rc in self.ranks.values() for r in rc.summary.reasons]
        if any(r["code"] in _UNPAIRED for r in reasons):  # ("every recorded tensor is equal" would be said of none)
            return reasons
        return reasons + self._computed_differs()

    def _read_accepted(self, rank: int, d: dict) -> bool:
        """Does a rule of phase `read` accept this value read out of a tensor (api_diff.differences)? Its
        fire is counted in `rules_fired`."""
        rule = self.rules.read_rule(d["target"], d.get("at"), d["step"], rank) if d["kind"] == "read" else None
        if rule is None:
            return False
        fired = next((f for f in self.rules_fired if f["id"] == rule.id), None)
        if fired is None:
            self.rules_fired = sorted(self.rules_fired + [{"id": rule.id, "count": 1}], key=lambda f: f["id"])
        else:
            fired["count"] += 1
        return True

    def _api_rows(self, rank: int) -> tuple:
        """Rank `rank`'s API events of both runs, read once (api_diff.rows_of)."""
        if rank not in self._api_rows_read:
            self._api_rows_read[rank] = api_diff.rows_of(self.run_a, self.run_b, rank)
        return self._api_rows_read[rank]

    def _computed_differs(self) -> list[dict]:
        """When no event differs: a value the training computed that differs all the same (helper 28:
        a constant added to the loss changes no gradient, yet the loss backward() started from, and
        the curve the user watches, differ): not identical; what computed it is outside every
        recorded boundary. The first rank's first such value. Not where a rule accepted a difference in
        what a rank computed (what follows it, the loss too, differs by consent; rank_summary.py `_accepted`)."""
        if self._first is not None or any(rc.summary.accepted_computation for rc in self.ranks.values()):
            return []
        for rank in sorted(self.ranks):
            found = api_diff.differences(self.run_a, self.run_b, rank, api_diff.EVERY_STEP, computed=True,
                                         rows=self._api_rows(rank), accepted=partial(self._read_accepted, rank))
            if found["differences"]:
                d = found["differences"][0]
                a, b = api_diff.value_pair(d["a"], d["b"])
                what = (f"a value the training read out of a tensor ({d['target']}(), read {d['call']} of the step"
                        + (f", at {d['at']}" if d.get("at") else "") +
                        ": a metric, an evaluation's loss or predictions, a logged number)" if d["kind"] == "read" else
                        f"{d['kind']} ({d['target']}): {d['field']}")
                where = ("the code that computed it from the model's outputs (an evaluation's metric, post-processing "
                         "of predictions) or from anything else" if d["kind"] == "read" else
                         "what computed it (a term of the loss without gradient, a constant, code between the "
                         "model's output and backward())")
                first, end = certification.compared_windows(self.run_a, self.run_b)[0]
                if (first is not None and d["step"] < first) or (end is not None and d["step"] >= end):
                    # (helper 53: a plant after a --steps window was said to run "outside the recorded boundaries")
                    where = (f"what computed it ran outside the recorded steps ({certification.window_text((first, end))}), "
                             f"which were all that was compared")
                else:
                    where += " runs outside the recorded boundaries"
                accept = (f"; if it is benign (a time, a count of the machine's), a rule accepts it: "
                          f'{{"id": "...", "action": "ignore", "match": {{"phase": "read", "path": "*{_place(d["at"])}"}}}}'
                          if d["kind"] == "read" and d.get("at") else "")
                return [certification.reason("computed", (
                    f"{what} differs{_read_field(d)} at step {d['step']} ({a} in A, {b} in B) while every recorded "
                    f"tensor is equal: "
                    f"{where}{accept}"), rank=rank)]
        return self._calls_in_one_run() or self._final_settings_differ()

    def _calls_in_one_run(self) -> list[dict]:
        """When no event differs: a backward() or an optimizer step one run alone made, at a step both runs
        recorded: a computation no recorded boundary saw (helper 83: a BoTorch script that never called
        `fit_gpytorch_mll`, whose gpytorch modules are called past nn.Module's call, compared identical to one
        that did, "backward (loss): called in A, not called in B" in a note). Not identical. Not where a run is
        incomplete: its last step's calls are missing because it stopped (helper 87: a run that crashed in step 2)."""
        if self.run_a.incomplete_reason() or self.run_b.incomplete_reason():
            return []
        for rank in sorted(self.ranks):
            sides = [side or [] for side in self._api_rows(rank)]
            steps = [{r["step"] for r in side if r["step"] is not None} for side in sides]
            if not steps[0] or not steps[1]:
                continue
            # (the steps both runs recorded: a killed run's missing tail or a resumed run's head is no call it missed)
            first, last = max(min(s) for s in steps), min(max(s) for s in steps)
            rows = [[r for r in side if r["kind"] in _TRAINING_CALLS and r["step"] is not None
                     and first <= r["step"] <= last] for side in sides]
            found = [d for d in self._apart(rank, rows, last) if d["field"] is None]
            if found:
                d = found[0]
                side = "A" if d["a"] == "called" else "B"
                return [certification.reason("computed", (
                    f"{d['kind']} ({d['target']}) is called at step {d['step']} in run {side} only while every recorded "
                    f"tensor is equal: what it computed is outside every recorded boundary (modules called past "
                    f"nn.Module's call, as gpytorch's are; tensors no module holds)"), rank=rank)]
        return []

    def _apart(self, rank: int, rows: list[list], step: int) -> list[dict]:
        """The differences of two runs' API rows (`api_diff.differences`, up to `step`); where one run has none,
        each call of the other's, made in it alone."""
        if rows[0] and rows[1]:
            return api_diff.differences(self.run_a, self.run_b, rank, step, rows=tuple(rows))["differences"]
        return [{"step": r["step"], "kind": r["kind"], "target": r["target"], "field": None,
                 "a": "called" if rows[0] else "not called"} for r in rows[0] or rows[1]]

    def _final_settings_differ(self) -> list[dict]:
        """A setting the training's API calls made after its last optimizer step (a scheduler's
        step() after the last update, a GradScaler's update) that differs: no recorded tensor used
        it, so every one can be equal, yet a training that went on, or resumed from this state, would
        differ (helper 37: a scheduler not restored by a resume that ended one step later). Not
        identical."""
        for rank in sorted(self.ranks):
            rows_a, rows_b = (rows or [] for rows in self._api_rows(rank))
            last = max((r["step"] for r in rows_a + rows_b if r["step"] is not None), default=None)
            if last is None or any(r["kind"] == "optimizer_step" and r["step"] == last for r in rows_a + rows_b):
                continue
            # (a kind an older build did not record is out of both: api_diff.rows_of)
            tail = [[r for r in rows if r["step"] == last and r["kind"] in SETTINGS_AFTER] for rows in (rows_a, rows_b)]
            if not tail[0] and not tail[1]:
                continue
            # (a field one build records and the other not is no difference of the runs: the manifests say so)
            found = [d for d in self._apart(rank, tail, api_diff.EVERY_STEP)
                     if d["field"] is None or (d["a"] is not None and d["b"] is not None)]
            found.sort(key=lambda d: SETTINGS_AFTER.index(d["kind"]))  # (what changed the settings, before them)
            if found:
                d = found[0]
                what = f"{d['kind']} ({d['target']})"
                if d["field"] is None:
                    side = "A" if d["a"] == "called" else "B"  # (helper 86: both runs may have rows there)
                    what += f" is called after the last optimizer step (step {last}) in run {side} only"
                elif d["kind"] == "optimizer_settings" and d["field"] == "state":  # (a digest: its values say nothing)
                    what += (f": the optimizer's state (its momentum buffers, moment estimates, step counts) differs "
                             f"after the last optimizer step (step {last})")
                else:
                    a, b = api_diff.value_pair(d["a"], d["b"])
                    when = ("when the recording ended" if d["kind"] == "scheduler_settings"  # (set when it was made)
                            else "after the last optimizer step")
                    what += f": {d['field']} differs {when} (step {last}: {a} in A, {b} in B)"
                return [certification.reason("final_settings", (
                    f"{what} while every recorded tensor is equal: no recorded step used it, but a training that "
                    f"went on, or resumed from this state, would differ"), rank=rank)]
        return []

    def blocking_reasons(self) -> list[dict]:
        return [r for r in self.certification_reasons() if r["code"] not in _INFORMATIONAL]

    # -- the report ------------------------------------------------------------------------
    @property
    def result(self) -> CompareResult:
        """The typed `bitguard.compare/1` document (result.py); `to_dict()` is its JSON."""
        if self._result is None:
            self._result = self._build_result()
        return self._result

    @property
    def first_divergence(self) -> dict | None:
        fd = self.result.first_divergence
        return None if fd is None else fd.model_dump()

    def _first_divergence(self) -> dict | None:
        rc = self._first
        if rc is None:
            return None
        blame = rc.blame  # after confirm_comm
        return {**rc.summary.divergence, "blame": blame["blame"], "fault_class": blame["fault_class"],
                "blame_window": blame["blame_window"], "differing_roles": blame["differing_roles"],
                "api_differences": api_diff.differences(self.run_a, self.run_b, rc.rank, rc.pivot["step"])}

    def alignment_summary(self) -> dict:
        tot = {"events_a": 0, "events_b": 0, "matched": 0, "reordered": 0, "gaps_a": 0, "gaps_b": 0,
               "allowed_gaps": 0, "identical_prefix": 0, "band": self.band, "max_window": 0, "anchors": 0,
               "gaps_before_pivot": [], "unobserved": 0, "follows_accepted": 0, "not_compared": 0}
        for rc in self.ranks.values():
            for k, v in rc.summary.alignment.items():
                tot[k] = max(tot[k], v) if k == "max_window" else tot[k] + v
        return tot

    def propagation_graph(self) -> dict:
        nodes, edges = [], []
        for rc in self.ranks.values():
            nodes += rc.propagation["nodes"]
            edges += rc.propagation["edges"]
        return {"nodes": nodes, "edges": edges}

    def incomplete(self) -> dict | None:
        out = {side: run.incomplete_reason() for side, run in (("a", self.run_a), ("b", self.run_b))
               if run.incomplete_reason()}
        return out or None

    def _build_result(self) -> CompareResult:
        graph = self.propagation_graph()
        verdict = self.verdict
        reasons = self.certification_reasons()
        blocking = [r for r in reasons if r["code"] not in _INFORMATIONAL]
        return CompareResult(
            verdict=verdict,
            run_a=str(self.run_a.path), run_b=str(self.run_b.path),
            ranks=sorted(self.ranks),
            first_divergence=self._first_divergence(),
            pivots_per_rank={str(r): ({"step": rc.pivot["step"], "phase": rc.pivot["phase"],
                                       "boundary": rc.pivot["boundary"], "blame": rc.blame["blame"],
                                       "cause": rc.pivot["cause"]}
                                      if rc.pivot else None) for r, rc in self.ranks.items()},
            alignment=self.alignment_summary(),
            propagation={"nodes": graph["nodes"], "edges": graph["edges"]},
            rules_fired=self.rules_fired,
            manifest_diffs=self.manifest_diffs,
            incomplete=self.incomplete(),
            analysis={"fingerprint": self.fingerprint, "probes": self.probes, "resumed_at": self.run_b.step_shift},
            inconclusive={"reasons": blocking} if verdict == "inconclusive" else None,
            certification={"reasons": reasons, "compared_steps": {
                str(r): [rc.scope.first, rc.scope.end] for r, rc in self.ranks.items()}},
            api_differences=self._api_differences_without_pivot(),
            run_checks=check.for_comparison(self),  # each run against itself (backend/check.py)
        )

    def _api_differences_without_pivot(self) -> dict | None:
        """When no event differs: the first rank's training API calls that differ, every step (a
        learning rate changed where every gradient was zero computes the same numbers, but the
        runs asked for different ones), None when none differ. Only the steps certified: after a run's end
        (a killed rank) what it did not call is no difference (helper 63)."""
        if self._first is not None:
            return None
        for rank in sorted(self.ranks):
            end = self.ranks[rank].scope.end
            diff = api_diff.differences(self.run_a, self.run_b, rank, api_diff.EVERY_STEP if end is None else end - 1,
                                        rows=self._api_rows(rank))
            if diff["differences"]:
                return {**diff, "rank": rank}
        return None

    def drill(self, rank: int | None = None, out=None, timeout: float | None = None):
        """Replay both runs for the pivot's step and name the first differing operation
        (backend/drill.py): a `DrillReport`, whose `to_dict()` is the bitguard.drill/1 document."""
        from bitguard.backend.drill import DEFAULT_TIMEOUT_S, drill_comparison

        return drill_comparison(self, rank=rank, out=out, timeout=timeout or DEFAULT_TIMEOUT_S)

    def to_dict(self) -> dict:
        return self.result.to_dict()

    # -- tables for the explorer and the notebook -------------------------------------------
    def events(self, rank: int | None = None) -> pl.DataFrame:
        frames = [self._events_rank(rc) for r, rc in self.ranks.items() if rank is None or r == rank]
        return pl.concat(frames) if frames else pl.DataFrame()

    def _events_rank(self, rc: RankComparison) -> pl.DataFrame:
        cols = ["seq", "step", "phase", "kind", "boundary", "module_type", "call", "depth", "t_start_ns", "t_end_ns"]
        a = rc.events_a.select(cols).with_row_index("a_pos").with_columns(pl.col("a_pos").cast(pl.Int64))
        matched = rc.pairs.select("a_pos", "b_seq", "reordered", "status", "rule_id")
        b_times = rc.events_b.select(pl.col("seq").alias("b_seq"), pl.col("t_start_ns").alias("b_t_start_ns"),
                                     pl.col("t_end_ns").alias("b_t_end_ns"))
        a = a.join(matched, on="a_pos", how="left").join(b_times, on="b_seq", how="left")
        gap_a = rc.gaps.filter(pl.col("side") == "a").select(pl.col("pos").alias("a_pos"),
                                                             pl.col("rule_id").alias("gap_rule"))
        a = a.join(gap_a, on="a_pos", how="left").with_columns(
            pl.col("status").fill_null("only_a"), pl.coalesce("rule_id", "gap_rule").alias("rule_id"),
            pl.col("reordered").fill_null(False), pl.col("a_pos").cast(pl.Float64).alias("order")).drop("gap_rule")
        a = a.rename({"seq": "a_seq", "t_start_ns": "a_t_start_ns", "t_end_ns": "a_t_end_ns"})
        # events only in B sit after the A event matched to their nearest preceding B event
        gb = rc.gaps.filter(pl.col("side") == "b")
        if gb.height:
            b = rc.events_b[gb["pos"].to_list()].select(cols).rename(
                {"seq": "b_seq", "t_start_ns": "b_t_start_ns", "t_end_ns": "b_t_end_ns"}).with_columns(
                gb["order"].alias("order"),
                pl.lit("only_b").alias("status"), gb["rule_id"].alias("rule_id"), pl.lit(False).alias("reordered"),
                pl.lit(None, dtype=pl.Int64).alias("a_seq"), pl.lit(None, dtype=pl.Int64).alias("a_pos"),
                pl.lit(None, dtype=pl.Int64).alias("a_t_start_ns"), pl.lit(None, dtype=pl.Int64).alias("a_t_end_ns"))
            a = pl.concat([a, b.select(a.columns)])
        a = granularity.mark_unobserved(a, rc.regions)  # one side only because the other compiled it
        p = rc.pivot
        if p is None:
            is_pivot = pl.lit(False)
        elif p["seq"] is not None:
            is_pivot = (pl.col("a_seq") == p["seq"]).fill_null(False)
        else:  # an event only in B
            is_pivot = (pl.col("a_seq").is_null() & (pl.col("b_seq") == p["b_seq"])).fill_null(False)
        pivot_order = float(p["order"]) if p else float("inf")
        out = a.sort("order").with_row_index("row").with_columns(
            pl.lit(rc.rank).alias("rank"),
            (pl.col("order") < pivot_order).alias("in_prefix"),
            is_pivot.alias("is_pivot"))
        return out.select("rank", "row", "status", "in_prefix", "reordered", "is_pivot", "step", "phase", "kind",
                          "boundary", "module_type", "call", "depth", "a_seq", "b_seq", "a_t_start_ns", "a_t_end_ns",
                          "b_t_start_ns", "b_t_end_ns", "rule_id").with_columns(  # (strings, as they always were)
            pl.col(c).cast(pl.String) for c in ("phase", "kind", "boundary", "module_type"))

    def divergent(self, rank: int | None = None) -> pl.DataFrame:
        return self.events(rank).filter(pl.col("status") == "diverged")

    def event_detail(self, rank: int, side: str, seq: int) -> dict:
        rc = self.ranks.get(rank)
        if rc is None:
            raise NotFound(f"rank {rank} is not in this comparison (ranks: {sorted(self.ranks)})")
        if side not in ("a", "b"):
            raise NotFound(f"side {side!r} is not 'a' or 'b'")
        events = rc.events_a if side == "a" else rc.events_b
        match = events.filter(pl.col("seq") == seq)
        if match.is_empty():
            raise NotFound(f"run {side.upper()} rank {rank} has no event {seq}")
        ev = match.row(0, named=True)
        col = "a_seq" if side == "a" else "b_seq"
        pair = rc.pairs.filter(pl.col(col) == seq)
        a_seq = pair["a_seq"][0] if pair.height else (seq if side == "a" else None)
        b_seq = pair["b_seq"][0] if pair.height else (seq if side == "b" else None)
        status = pair["status"][0] if pair.height else f"only_{side}"
        stacks = rc.stacks_a if side == "a" else rc.stacks_b
        is_pivot = self._is_pivot(rc, a_seq, b_seq)
        marks = self._tensor_marks(rc, a_seq) if pair.height else {}
        return {
            "rank": rank, "side": side, "status": status,
            "rule_id": pair["rule_id"][0] if pair.height else self._gap_rule(rc, side, seq),
            "event": {k: v for k, v in ev.items() if k != "key"},
            "stack": stacks.get(ev["stack_id"], []),
            "pair": {"a_seq": a_seq, "b_seq": b_seq},
            "tensors_a": self._tensors(rc.tensors_a, a_seq, marks),
            "tensors_b": self._tensors(rc.tensors_b, b_seq, marks),
            "is_pivot": is_pivot,
            "blame": rc.blame if is_pivot else None,
        }

    @staticmethod
    def _is_pivot(rc: RankComparison, a_seq, b_seq) -> bool:
        p = rc.pivot
        if p is None:
            return False
        return a_seq == p["seq"] if p["seq"] is not None else (a_seq is None and b_seq == p["b_seq"])

    @staticmethod
    def _gap_rule(rc: RankComparison, side: str, seq: int) -> str | None:
        g = rc.gaps.filter((pl.col("side") == side) & (pl.col("seq") == seq)) if rc.gaps.height else rc.gaps
        return g["rule_id"][0] if g.height else None

    @staticmethod
    def _tensor_marks(rc: RankComparison, a_seq: int) -> dict:
        """(role, idx) -> what the comparison made of that tensor of a pair."""
        rows = rc.diffs.filter(pl.col("a_seq") == a_seq)
        return {(r["role"], r["idx"]): {"differs": r["differs"], "ignored": r["ignored"], "rule_id": r["rule_id"],
                                        "unobserved": r["unobserved"] or r["unobserved_b"]}
                for r in rows.iter_rows(named=True)}

    @staticmethod
    def _tensors(tensors: pl.DataFrame, seq, marks: dict) -> list[dict]:
        if seq is None:
            return []
        rows = tensors.filter(pl.col("seq") == seq).sort("role", "idx")
        unobserved = rows.select(_unobserved(rows)).to_series().to_list()
        blank = {"differs": None, "ignored": False, "rule_id": None}
        return [{"role": r["role"], "index": r["idx"], "path": r["path"], "shape": r["shape"], "dtype": r["dtype"],
                 "strides": r["strides"], "nbytes": r["nbytes"], "xor": _hex(r["xor"]), "pos": _hex(r["pos"]),
                 "tid": r["tid"], **blank, **marks.get((r["role"], r["idx"]), {}), "unobserved": why}
                for r, why in zip(rows.iter_rows(named=True), unobserved)]

    def neighbours(self, node_id: str) -> dict:
        graph = self.propagation_graph()
        nodes = {n["id"]: n for n in graph["nodes"]}
        if node_id not in nodes:
            raise NotFound(f"node {node_id!r} is not in the propagation graph")
        return {"node": nodes[node_id],
                "consumers": [nodes[e["target"]] | {"edge": e["kind"]} for e in graph["edges"] if e["source"] == node_id],
                "producers": [nodes[e["source"]] | {"edge": e["kind"]} for e in graph["edges"] if e["target"] == node_id]}

    # -- exports and figures (thin layers over the same tables) ----------------------------
    def export_perfetto(self, path, max_events: int | None = None) -> Path:
        from bitguard.backend.perfetto_export import export

        return export(self, path, max_events)

    def timeline(self, rank: int | None = None):
        from bitguard.backend.figures import timeline

        return timeline(self, rank)

    def propagation(self):
        from bitguard.backend.figures import propagation_figure

        return propagation_figure(self)

    def _repr_html_(self) -> str:
        from bitguard.backend.figures import summary_html

        return summary_html(self)

    def __repr__(self) -> str:
        fd = self.first_divergence
        where = "" if fd is None else f" at {fd['phase']} {fd['boundary']} step {fd['step']} ({fd['blame']})"
        return f"<Comparison {self.run_a.name} vs {self.run_b.name}: {self.verdict}{where}>"


def compare(a, b, rules=None, rank: int | None = None, band: int = DEFAULT_BAND, fingerprint: str = "xor+pos",
            probes: list[str] | None = None, jobs: int | None = None, ray: str | None = None,
            frames: bool = True, resumed_at: int = 0) -> Comparison:
    """Compare run A (reference) with run B (suspect). `fingerprint` and `probes` are analysis
    options for ablations (see the module docstring); the defaults are bitguard's method. `jobs`:
    worker processes for the ranks (rank_pool.py; None: the cores, for a big enough comparison);
    `ray`: compare the ranks on a Ray cluster instead (its address, or "auto"). `frames` False:
    for a caller that reads only the verdict and the document (the CLI), no rank keeps its frames
    past its comparison (a frame read later compares that rank again): the memory of a run of
    many ranks is that of its biggest rank. `resumed_at`: run B is a process that resumed the training
    at that step (of run A's count) and counted its own steps from 0: its step s is compared with A's
    step `resumed_at` + s, A's steps before it are not compared."""
    equivalence.check(fingerprint)
    if isinstance(resumed_at, bool) or not isinstance(resumed_at, int) or resumed_at < 0:
        raise BadInput(f"--resumed-at must be a step number of 0 or more, not {resumed_at!r}")
    probes = None if probes is None else list(probes)
    # (runs opened here hold their rank files' connections for the first read: released when compared)
    run_a = a if isinstance(a, RunInfo) else open_run(a, hold=True)
    try:
        run_b = b if isinstance(b, RunInfo) else open_run(b, hold=True)
        try:
            return _compare_runs(run_a, run_b, rules, rank, band, fingerprint, probes, jobs, ray, frames, resumed_at)
        finally:
            run_b.release()
    finally:
        run_a.release()


def _compare_runs(run_a: RunInfo, run_b: RunInfo, rules, rank: int | None, band: int, fingerprint: str, probes,
                  jobs: int | None, ray: str | None, frames: bool, resumed_at: int) -> Comparison:
    done = run_a.manifest.get("steps_completed")
    if resumed_at and isinstance(done, int) and not isinstance(done, bool) and resumed_at >= done > 0:
        other = run_b.manifest.get("steps_completed")
        swapped = (f", or give the runs in the other order: run B completed {other} step(s), more than run A, and "
                   f"the resumed run goes second" if isinstance(other, int) and not isinstance(other, bool)
                   and other > done else "")
        raise BadInput(f"--resumed-at {resumed_at} is past run A's last step ({done - 1}: it completed {done} "
                       f"step(s)); give the step of A whose checkpoint run B resumed from{swapped}")
    if resumed_at:  # (RunInfo objects of an earlier comparison keep theirs: drill, a rank compared again)
        run_a = dataclasses.replace(run_a, step_shift=0, resume_from=resumed_at)
        run_b = dataclasses.replace(run_b, step_shift=resumed_at, resume_from=resumed_at)
    rule_set = RuleSet.load(rules)
    ranks_a, ranks_b = set(run_a.ranks), set(run_b.ranks)
    if rank is not None:
        missing = [side for side, ranks in (("A", ranks_a), ("B", ranks_b)) if rank not in ranks]
        if missing:
            raise IncompatibleRuns(f"rank {rank} is not recorded in run {' and '.join(missing)} "
                                   f"(A has ranks {sorted(ranks_a)}, B has ranks {sorted(ranks_b)}); pick another --rank")
        selected = [rank]
    else:
        if run_a.world_size != run_b.world_size:
            raise IncompatibleRuns(
                f"world sizes differ: run A has world size {run_a.world_size} (ranks {sorted(ranks_a)}), run B has "
                f"world size {run_b.world_size} (ranks {sorted(ranks_b)}); compare runs of the same layout or pick "
                f"one rank with --rank")
        selected = sorted(ranks_a & ranks_b)
        if not selected:
            raise IncompatibleRuns(f"the runs have no rank in common (A has ranks {sorted(ranks_a)}, B has ranks "
                                   f"{sorted(ranks_b)}); re-record the missing ranks")
    digests = (run_a.manifest.get("digest"), run_b.manifest.get("digest"))
    if digests[0] != digests[1]:
        raise IncompatibleRuns(f"the runs were digested differently (A: {digests[0] or 'unnamed, older'}, B: "
                               f"{digests[1] or 'unnamed, older'}); re-record the older run with this bitguard")
    ranks, fired = rank_pool.compare_ranks(selected, run_a, run_b, rule_set, band, fingerprint, probes, jobs, ray,
                                           frames)
    pivot_mod.confirm_comm(ranks, rank_selected=rank is not None)  # a collective's blame, seen from its group
    reasons = certification.run_reasons(run_a, run_b, selected, rank_selected=rank is not None)
    if run_b.step_shift:  # what B did on resuming, against A's tail (resumed.py)
        reasons += [r for rk in selected for r in resumed.region_reasons(run_a, run_b, rk, rule_set)]
    if rank is None:
        reasons += certification.group_reasons(run_a, run_b, _group_members(ranks))
    return Comparison(run_a, run_b, rule_set, ranks, fired, band, fingerprint, probes, reasons)
