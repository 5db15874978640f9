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
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import polars as pl

from bitguard.backend import equivalence
from bitguard.backend import pivot as pivot_mod
from bitguard.backend import propagation
from bitguard.backend.alignment import align
from bitguard.backend.ingest import RunInfo, load_rank, open_run
from bitguard.backend.rules import RuleSet
from bitguard.errors import IncompatibleRuns, NotFound

COMPARE_SCHEMA = "bitguard.compare/1"
DEFAULT_BAND = 64


def _hex(v) -> str | None:
    return None if v is None else f"{int(v):016x}"


@dataclass
class RankComparison:
    """One rank's aligned events, digests compared, rules applied."""

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
    gaps: pl.DataFrame  # side, seq, pos, allowed, rule_id
    pivot: dict | None = None
    blame: dict | None = None
    propagation: dict = field(default_factory=lambda: {"nodes": [], "edges": []})
    truncated: dict = field(default_factory=dict)


def _pair_tensors(pairs: pl.DataFrame, ta: pl.DataFrame, tb: pl.DataFrame) -> pl.DataFrame:
    left = ta.join(pairs.select("a_seq", "b_seq"), left_on="seq", right_on="a_seq").rename({"seq": "a_seq"})
    right = tb.select(pl.col("seq").alias("b_seq"), "role", "idx", pl.col("xor").alias("xor_b"),
                      pl.col("pos").alias("pos_b"), pl.col("dtype").alias("dtype_b"))
    d = left.join(right, on=["b_seq", "role", "idx"], how="left")
    return d.with_columns(
        (pl.col("xor") != pl.col("xor_b")).fill_null(True).alias("xor_differs"),
        (pl.col("pos") != pl.col("pos_b")).fill_null(True).alias("pos_differs"),
    ).with_columns((pl.col("xor_differs") | pl.col("pos_differs")).alias("differs"))


def _apply_ignore(diffs: pl.DataFrame, events: pl.DataFrame, rules: RuleSet, rank: int, fired: dict) -> pl.DataFrame:
    diffs = diffs.with_columns(pl.lit(False).alias("ignored"), pl.lit(None, dtype=pl.String).alias("rule_id"))
    ignore = rules.of("ignore")
    if not ignore or diffs.is_empty():
        return diffs
    differing = diffs.filter(pl.col("differs")).join(
        events.select(pl.col("seq").alias("a_seq"), "boundary", "module_type", "phase", "step"), on="a_seq")
    hits: dict[tuple[int, str, int], str] = {}
    for row in differing.select("a_seq", "role", "idx", "dtype", "boundary", "module_type", "phase",
                                "step").iter_rows(named=True):
        for rule in ignore:
            if rule.matches(boundary=row["boundary"], module_type=row["module_type"], phase=row["phase"],
                            step=row["step"], rank=rank, role=row["role"], dtype=row["dtype"]):
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
                        schema={"a_seq": pl.Int64, "role": pl.String, "idx": pl.Int32, "_rule": pl.String})
    diffs = diffs.drop("rule_id").join(keys, on=["a_seq", "role", "idx"], how="left")
    return diffs.with_columns(pl.col("_rule").is_not_null().alias("ignored")).rename({"_rule": "rule_id"})


def _align_with_retyped(ea: pl.DataFrame, eb: pl.DataFrame, band: int):
    """Align by full key; then pair what is left on both sides by the loose key (same step, phase,
    boundary and shapes, another module type or dtype): a retyped boundary is compared, not two gaps."""
    al = align(ea["key"].to_numpy().astype(np.uint64), eb["key"].to_numpy().astype(np.uint64), band=band)
    retyped = np.zeros(len(al.a_idx), dtype=bool)
    if not (len(al.gaps_a) and len(al.gaps_b)):
        return al, retyped
    loose_a = ea["loose_key"].to_numpy().astype(np.uint64)[al.gaps_a]
    loose_b = eb["loose_key"].to_numpy().astype(np.uint64)[al.gaps_b]
    extra = align(loose_a, loose_b, band=band)
    if not len(extra.a_idx):
        return al, retyped
    a_idx = np.concatenate([al.a_idx, al.gaps_a[extra.a_idx]])
    b_idx = np.concatenate([al.b_idx, al.gaps_b[extra.b_idx]])
    order = np.argsort(a_idx, kind="stable")
    merged = replace(al, a_idx=a_idx[order], b_idx=b_idx[order],
                     reordered=np.concatenate([al.reordered, extra.reordered])[order],
                     gaps_a=np.delete(al.gaps_a, extra.a_idx), gaps_b=np.delete(al.gaps_b, extra.b_idx))
    return merged, np.concatenate([retyped, np.ones(len(extra.a_idx), dtype=bool)])[order]


def _keep_probes(events: pl.DataFrame, tensors: pl.DataFrame, probes) -> tuple[pl.DataFrame, pl.DataFrame]:
    if probes is None:
        return events, tensors
    names = events["boundary"].unique().to_list()
    kept = [b for b in names if any(fnmatch.fnmatchcase(b, g) for g in probes)]
    events = events.filter(pl.col("boundary").is_in(kept))
    return events, tensors.filter(pl.col("seq").is_in(events["seq"].implode()))


def _compare_rank(rank: int, run_a: RunInfo, run_b: RunInfo, rules: RuleSet, fired: dict, band: int,
                  fingerprint: str = "xor+pos", probes=None) -> RankComparison:
    ea, ta, sa = load_rank(run_a, rank)
    eb, tb, sb = load_rank(run_b, rank)
    ea, ta = _keep_probes(ea, ta, probes)
    eb, tb = _keep_probes(eb, tb, probes)
    al, retyped = _align_with_retyped(ea, eb, band)
    seq_a, seq_b = ea["seq"].to_numpy(), eb["seq"].to_numpy()
    pairs = pl.DataFrame({
        "a_pos": al.a_idx, "b_pos": al.b_idx,
        "a_seq": seq_a[al.a_idx] if len(al.a_idx) else np.empty(0, np.int64),
        "b_seq": seq_b[al.b_idx] if len(al.b_idx) else np.empty(0, np.int64),
        "reordered": al.reordered, "retyped": retyped,
    }, schema={"a_pos": pl.Int64, "b_pos": pl.Int64, "a_seq": pl.Int64, "b_seq": pl.Int64, "reordered": pl.Boolean,
               "retyped": pl.Boolean})
    diffs = equivalence.apply(_pair_tensors(pairs, ta, tb), fingerprint, run_a.ranks[rank], run_b.ranks[rank])
    diffs = _apply_ignore(diffs, ea, rules, rank, fired)
    per_pair = diffs.group_by("a_seq").agg(
        (pl.col("differs") & ~pl.col("ignored")).any().alias("diverged"),
        (pl.col("differs") & pl.col("ignored")).any().alias("benign"),
        pl.col("rule_id").drop_nulls().first().alias("rule_id"))
    pairs = pairs.join(per_pair, on="a_seq", how="left").with_columns(
        pl.when(pl.col("diverged").fill_null(False)).then(pl.lit("diverged"))
        .when(pl.col("benign").fill_null(False)).then(pl.lit("benign"))
        .otherwise(pl.lit("identical")).alias("status")).drop("diverged", "benign").sort("a_pos")
    gaps = _gaps(rank, ea, eb, al, rules, fired)
    rc = RankComparison(rank, ea, eb, ta, tb, sa, sb, al, pairs, diffs, gaps)
    _find_pivot(rc)
    return rc


def _gaps(rank, ea, eb, al, rules: RuleSet, fired: dict) -> pl.DataFrame:
    rows = []
    allow = rules.of("allow-gap")
    for side, events, positions in (("a", ea, al.gaps_a), ("b", eb, al.gaps_b)):
        if not len(positions):
            continue
        sub = events[positions.tolist()].select("seq", "step", "phase", "boundary", "module_type")
        for pos, r in zip(positions.tolist(), sub.iter_rows(named=True)):
            rid = next((rule.id for rule in allow if rule.matches(
                boundary=r["boundary"], module_type=r["module_type"], phase=r["phase"], step=r["step"],
                rank=rank)), None)
            if rid is not None:
                fired[rid] = fired.get(rid, 0) + 1
            rows.append((side, r["seq"], pos, rid is not None, rid))
    return pl.DataFrame(rows, schema={"side": pl.String, "seq": pl.Int64, "pos": pl.Int64, "allowed": pl.Boolean,
                                      "rule_id": pl.String}, orient="row")


def _find_pivot(rc: RankComparison) -> None:
    diverged = rc.pairs.filter(pl.col("status") == "diverged")
    if diverged.is_empty():
        return
    first = diverged.row(0, named=True)
    event = rc.events_a.row(first["a_pos"], named=True)
    rc.pivot = {**event, "b_seq": first["b_seq"], "a_pos": first["a_pos"], "b_pos": first["b_pos"],
                "retyped": first["retyped"]}
    status = dict(zip(rc.pairs["a_seq"].to_list(), rc.pairs["status"].to_list()))
    rc.blame = pivot_mod.blame(rc.pivot, rc.events_a, status, rc.diffs)
    divergent = set(diverged["a_seq"].to_list())
    rc.propagation = propagation.build(rc.rank, rc.events_a, rc.tensors_a, divergent, event["seq"])


def manifest_differences(a: dict, b: dict) -> list[dict]:
    """Differences between two manifests that can by themselves explain a divergence."""
    out = []

    def check(name, va, vb, why):
        if va != vb:
            out.append({"field": name, "a": va, "b": vb, "why": why})

    va, vb = a.get("versions", {}), b.get("versions", {})
    for lib in sorted(set(va) | set(vb)):
        check(f"versions.{lib}", va.get(lib), vb.get(lib), "a different library version can change kernels and numerics")
    da, db = a.get("determinism", {}) or {}, b.get("determinism", {}) or {}
    check("determinism.torch_threads", da.get("torch_threads"), db.get("torch_threads"),
          "on CPU the thread count alone changes reduction order and results")
    for key in sorted((set(da) | set(db)) - {"torch_threads"}):
        check(f"determinism.{key}", da.get(key), db.get(key), "determinism settings differ")
    check("devices", a.get("devices"), b.get("devices"), "different devices can compute differently")
    check("world_size", a.get("world_size"), b.get("world_size"), "a different parallel layout changes reductions")
    check("mode", a.get("mode"), b.get("mode"), "recording modes observe different boundaries (gaps expected)")
    check("steps", a.get("steps"), b.get("steps"), "different recorded step windows")
    return out


class Comparison:
    """The result of comparing run A (reference) with run B (suspect)."""

    def __init__(self, run_a: RunInfo, run_b: RunInfo, rules: RuleSet, ranks: dict[int, RankComparison],
                 fired: dict, band: int, fingerprint: str = "xor+pos", probes: list[str] | None = None):
        self.run_a, self.run_b, self.rules = run_a, run_b, rules
        self.ranks = ranks
        self.band = band
        self.fingerprint = fingerprint  # what made two paired tensors differ (equivalence.py)
        self.probes = probes  # boundary globs kept, None for every recorded event
        self.rules_fired = [{"id": k, "count": v} for k, v in sorted(fired.items())]
        pivots = [rc for rc in ranks.values() if rc.pivot is not None]
        self._first = min(pivots, key=lambda rc: (rc.pivot["step"], rc.pivot["t_end_ns"])) if pivots else None
        self.manifest_diffs = manifest_differences(run_a.manifest, run_b.manifest)

    @property
    def verdict(self) -> str:
        return "identical" if self._first is None else "diverged"

    # -- the report ------------------------------------------------------------------------
    @property
    def first_divergence(self) -> dict | None:
        rc = self._first
        if rc is None:
            return None
        p, blame = rc.pivot, rc.blame
        stack_a = rc.stacks_a.get(p["stack_id"], [])
        return {
            "rank": rc.rank, "step": p["step"], "phase": p["phase"], "kind": p["kind"],
            "boundary": p["boundary"], "module_type": p["module_type"], "call": p["call"],
            "blame": blame["blame"], "fault_class": blame["fault_class"], "blame_window": blame["blame_window"],
            "differing_roles": blame["differing_roles"], "stack": stack_a,
            "a_seq": p["seq"], "b_seq": p["b_seq"],
            # paired although the module type or a dtype differs (e.g. a norm swapped for a subclass)
            "retyped": p.get("retyped", False), "module_type_b": rc.events_b.row(p["b_pos"], named=True)["module_type"],
            "tensors": self._tensor_pairs(rc, p["seq"]),
        }

    def _tensor_pairs(self, rc: RankComparison, a_seq: int) -> list[dict]:
        rows = rc.diffs.filter(pl.col("a_seq") == a_seq).sort("role", "idx")
        return [{"role": r["role"], "index": r["idx"], "path": r["path"], "shape": r["shape"], "dtype": r["dtype"],
                 "dtype_b": r["dtype_b"], "a": {"xor": _hex(r["xor"]), "pos": _hex(r["pos"])},
                 "b": {"xor": _hex(r["xor_b"]), "pos": _hex(r["pos_b"])},
                 "differs": r["differs"], "ignored": r["ignored"], "rule_id": r["rule_id"]}
                for r in rows.iter_rows(named=True)]

    def alignment_summary(self) -> dict:
        tot = {"events_a": 0, "events_b": 0, "matched": 0, "reordered": 0, "gaps_a": 0, "gaps_b": 0,
               "allowed_gaps": 0, "identical_prefix": 0, "band": self.band, "max_window": 0, "anchors": 0,
               "gaps_before_pivot": []}
        for rc in self.ranks.values():
            al = rc.alignment
            tot["events_a"] += rc.events_a.height
            tot["events_b"] += rc.events_b.height
            tot["matched"] += len(al.a_idx)
            tot["reordered"] += int(al.reordered.sum())
            tot["gaps_a"] += len(al.gaps_a)
            tot["gaps_b"] += len(al.gaps_b)
            tot["allowed_gaps"] += int(rc.gaps["allowed"].sum()) if rc.gaps.height else 0
            tot["max_window"] = max(tot["max_window"], int(al.max_window))
            tot["anchors"] += int(al.anchors)
            prefix, before = self._prefix(rc)
            tot["identical_prefix"] += prefix
            tot["gaps_before_pivot"] += before
        return tot

    def _prefix(self, rc: RankComparison) -> tuple[int, list[dict]]:
        if rc.pivot is None:
            prefix = rc.pairs.height
            a_lim, b_lim = rc.events_a.height, rc.events_b.height
        else:
            prefix = rc.pairs.filter(pl.col("a_pos") < rc.pivot["a_pos"]).height
            a_lim, b_lim = rc.pivot["a_pos"], rc.pivot["b_pos"]
        before = rc.gaps.filter(~pl.col("allowed") & (((pl.col("side") == "a") & (pl.col("pos") < a_lim))
                                                      | ((pl.col("side") == "b") & (pl.col("pos") < b_lim))))
        out = []
        for g in before.head(50).iter_rows(named=True):
            ev = (rc.events_a if g["side"] == "a" else rc.events_b).row(g["pos"], named=True)
            out.append({"rank": rc.rank, "side": g["side"], "seq": g["seq"], "step": ev["step"], "phase": ev["phase"],
                        "boundary": ev["boundary"], "module_type": ev["module_type"]})
        return prefix, out

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

    def to_dict(self) -> dict:
        graph = self.propagation_graph()
        return {
            "schema": COMPARE_SCHEMA,
            "verdict": self.verdict,
            "run_a": str(self.run_a.path), "run_b": str(self.run_b.path),
            "ranks": sorted(self.ranks),
            "first_divergence": self.first_divergence,
            "pivots_per_rank": {str(r): ({"step": rc.pivot["step"], "phase": rc.pivot["phase"],
                                          "boundary": rc.pivot["boundary"], "blame": rc.blame["blame"]}
                                         if rc.pivot else None) for r, rc in self.ranks.items()},
            "alignment": self.alignment_summary(),
            "propagation": {"nodes": graph["nodes"], "edges": graph["edges"]},
            "rules_fired": self.rules_fired,
            "manifest_diffs": self.manifest_diffs,
            "incomplete": self.incomplete(),
            "analysis": {"fingerprint": self.fingerprint, "probes": self.probes},
        }

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
            mb = np.asarray(rc.alignment.b_idx)
            ma = np.asarray(rc.alignment.a_idx)
            order_b = np.argsort(mb, kind="stable")
            mb_sorted, ma_sorted = mb[order_b], ma[order_b]
            pos = gb["pos"].to_numpy()
            k = np.searchsorted(mb_sorted, pos) - 1
            anchor = np.where(k >= 0, ma_sorted[np.clip(k, 0, None)] if len(ma_sorted) else -1, -1)
            b = rc.events_b[pos.tolist()].select(cols).rename(
                {"seq": "b_seq", "t_start_ns": "b_t_start_ns", "t_end_ns": "b_t_end_ns"}).with_columns(
                pl.Series("order", anchor + 0.5 + pos / (10.0 * (pos.max() + 1))),
                pl.lit("only_b").alias("status"), gb["rule_id"].alias("rule_id"), pl.lit(False).alias("reordered"),
                pl.lit(None, dtype=pl.Int64).alias("a_seq"), pl.lit(None, dtype=pl.Int64).alias("a_pos"),
                pl.lit(None, dtype=pl.Int64).alias("a_t_start_ns"), pl.lit(None, dtype=pl.Int64).alias("a_t_end_ns"))
            a = pl.concat([a, b.select(a.columns)])
        pivot_seq = rc.pivot["seq"] if rc.pivot else None
        pivot_order = float(rc.pivot["a_pos"]) if rc.pivot else float("inf")
        out = a.sort("order").with_row_index("row").with_columns(
            pl.lit(rc.rank).alias("rank"),
            (pl.col("order") < pivot_order).alias("in_prefix"),
            (pl.col("a_seq") == pivot_seq).fill_null(False).alias("is_pivot") if pivot_seq is not None
            else pl.lit(False).alias("is_pivot"))
        return out.select("rank", "row", "status", "in_prefix", "reordered", "is_pivot", "step", "phase", "kind",
                          "boundary", "module_type", "call", "depth", "a_seq", "b_seq", "a_t_start_ns", "a_t_end_ns",
                          "b_t_start_ns", "b_t_end_ns", "rule_id")

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
        return {
            "rank": rank, "side": side, "status": status,
            "event": {k: v for k, v in ev.items() if k != "key"},
            "stack": stacks.get(ev["stack_id"], []),
            "pair": {"a_seq": a_seq, "b_seq": b_seq},
            "tensors_a": self._tensors(rc.tensors_a, a_seq),
            "tensors_b": self._tensors(rc.tensors_b, b_seq),
            "is_pivot": rc.pivot is not None and a_seq == rc.pivot["seq"],
            "blame": rc.blame if rc.pivot is not None and a_seq == rc.pivot["seq"] else None,
        }

    @staticmethod
    def _tensors(tensors: pl.DataFrame, seq) -> list[dict]:
        if seq is None:
            return []
        rows = tensors.filter(pl.col("seq") == seq).sort("role", "idx")
        return [{"role": r["role"], "index": r["idx"], "path": r["path"], "shape": r["shape"], "dtype": r["dtype"],
                 "strides": r["strides"], "nbytes": r["nbytes"], "xor": _hex(r["xor"]), "pos": _hex(r["pos"]),
                 "tid": r["tid"]} for r in rows.iter_rows(named=True)]

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
            probes: list[str] | None = None) -> Comparison:
    """Compare run A (reference) with run B (suspect). `fingerprint` and `probes` are analysis
    options for ablations (see the module docstring); the defaults are bitguard's method."""
    equivalence.check(fingerprint)
    probes = None if probes is None else list(probes)
    run_a = a if isinstance(a, RunInfo) else open_run(a)
    run_b = b if isinstance(b, RunInfo) else open_run(b)
    rule_set = RuleSet.load(rules)
    ranks_a, ranks_b = set(run_a.ranks), set(run_b.ranks)
    if rank is not None:
        missing = [side for side, ranks in (("A", ranks_a), ("B", ranks_b)) if rank not in ranks]
        if missing:
            raise IncompatibleRuns(f"rank {rank} is not recorded in run {' and '.join(missing)} "
                                   f"(A has ranks {sorted(ranks_a)}, B has ranks {sorted(ranks_b)}); pick another --rank")
        selected = [rank]
    else:
        if run_a.world_size != run_b.world_size or ranks_a != ranks_b:
            raise IncompatibleRuns(
                f"world sizes differ: run A has world size {run_a.world_size} (ranks {sorted(ranks_a)}), run B has "
                f"world size {run_b.world_size} (ranks {sorted(ranks_b)}); compare runs of the same layout or pick "
                f"one rank with --rank")
        selected = sorted(ranks_a)
    digests = (run_a.manifest.get("digest"), run_b.manifest.get("digest"))
    if digests[0] != digests[1]:
        raise IncompatibleRuns(f"the runs were digested differently (A: {digests[0] or 'unnamed, older'}, B: "
                               f"{digests[1] or 'unnamed, older'}); re-record the older run with this bitguard")
    fired: dict[str, int] = {}
    ranks = {r: _compare_rank(r, run_a, run_b, rule_set, fired, band, fingerprint, probes) for r in selected}
    return Comparison(run_a, run_b, rule_set, ranks, fired, band, fingerprint, probes)
