"""The explorer's view of one computed comparison: per-rank timelines binned for the browser.

`Result` holds the engine's comparison object with its summary (the `bitguard.compare/1`
document, propagation reduced to counts, paths in the user's terms) and, per rank, a
`RankTimeline`: the aligned events as flat numpy columns (status code, phase lane, time offsets)
from which any window is answered, binned by worst status when it holds many events and event
by event when few. This module knows nothing about HTTP or the catalogue (workspace.py) and
nothing about how runs are aligned (the engine).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from bitguard.backend.statuses import CODE_OF_EVENT, DIVERGED, STATUS_CODES, bin_counts, worst
from bitguard.backend.timeline_steps import StepIndex
from bitguard.backend.user_paths import PathNames
from bitguard.errors import BadInput, NotFound
from bitguard.schema import PHASES

DEFAULT_BINS = 800  # bins of a timeline window when the browser does not say


@dataclass
class RankTimeline:
    """One rank's aligned items as flat arrays, in A order (position = index)."""

    frame: pl.DataFrame  # the engine's events(rank) rows, in position order, with a `pos` column
    code: np.ndarray  # int8 status code per position (STATUS_CODES)
    lane_a: np.ndarray  # int8 phase index of the A event, -1 where A has none
    lane_b: np.ndarray  # int8 phase index of the B event, -1 where B has none
    a_x: np.ndarray  # float64 ns since A's first event on this rank, NaN where A has none
    b_x: np.ndarray  # float64 ns since B's first event on this rank, NaN where B has none
    phases: list[str]  # the phases present, in PHASES order
    pivot: int | None  # position of the pivot on this rank
    prefix_end: int  # positions [0, prefix_end) are the identical prefix
    whole: dict = field(default_factory=dict, repr=False)  # (axis, bins, raw_limit) -> whole-rank window
    steps: StepIndex | None = field(default=None, repr=False)  # where each training step begins

    @classmethod
    def from_frame(cls, frame: pl.DataFrame) -> "RankTimeline":
        frame = frame.sort("row").with_row_index("pos")
        code = frame.select(pl.col("status").replace_strict(CODE_OF_EVENT, default=0, return_dtype=pl.Int8))
        code = code.to_series().to_numpy()
        present = [p for p in frame["phase"].unique().to_list() if p is not None]
        phases = [p for p in PHASES if p in present] + sorted(p for p in present if p not in PHASES)
        phase_idx = frame.select(pl.col("phase").replace_strict({p: i for i, p in enumerate(phases)},
                                                                default=0, return_dtype=pl.Int8))
        phase_idx = phase_idx.to_series().to_numpy()
        has_a = frame["a_seq"].is_not_null().to_numpy()
        has_b = frame["b_seq"].is_not_null().to_numpy()

        def offsets(col: str, has: np.ndarray) -> np.ndarray:
            # subtract in int64 first: ns since the epoch do not fit a float64 exactly
            t = frame[col]
            t0 = t.min() if has.any() else 0
            t = (t - t0).cast(pl.Float64).to_numpy().astype(np.float64, copy=True)
            t[~has] = np.nan
            return t

        pivots = np.flatnonzero(frame["is_pivot"].fill_null(False).to_numpy())
        in_prefix = frame["in_prefix"].fill_null(False).to_numpy()
        not_prefix = np.flatnonzero(~in_prefix)
        return cls(
            frame=frame,
            code=code,
            lane_a=np.where(has_a, phase_idx, -1).astype(np.int8),
            lane_b=np.where(has_b, phase_idx, -1).astype(np.int8),
            a_x=offsets("a_t_start_ns", has_a),
            b_x=offsets("b_t_start_ns", has_b),
            phases=phases,
            pivot=int(pivots[0]) if len(pivots) else None,
            prefix_end=int(not_prefix[0]) if len(not_prefix) else int(frame.height),
            steps=StepIndex.from_steps(frame["step"].cast(pl.Float64).to_numpy()),
        )

    @property
    def size(self) -> int:
        return int(self.code.shape[0])

    def extent(self, axis: str) -> tuple[float, float]:
        if axis == "seq":
            return 0.0, float(max(self.size, 1))
        ends = [np.nanmax(x) for x in (self.a_x, self.b_x) if np.isfinite(x).any()]
        return 0.0, float(max(ends) + 1) if ends else 1.0

    def _positions(self, axis: str, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the A events and of the B events whose x lies in [start, end)."""
        if axis == "seq":
            lo, hi = max(int(np.floor(start)), 0), min(int(np.ceil(end)), self.size)
            idx = np.arange(lo, max(lo, hi))
            return idx[self.lane_a[idx] >= 0], idx[self.lane_b[idx] >= 0]
        out = []
        for x in (self.a_x, self.b_x):
            with np.errstate(invalid="ignore"):
                out.append(np.flatnonzero((x >= start) & (x < end)))
        return out[0], out[1]

    def around(self, axis: str, pos: int, span: int) -> tuple[float, float]:
        """A window of about `span` events with position `pos` a third of the way in."""
        pos = min(max(int(pos), 0), max(self.size - 1, 0))
        first, last = max(pos - span // 3, 0), min(pos + span - span // 3, self.size)
        if axis == "seq":
            return float(first), float(max(last, first + 1))
        xs = np.concatenate([self.a_x[first:last], self.b_x[first:last]])
        xs = xs[np.isfinite(xs)]
        if not xs.size:
            return self.extent(axis)
        return float(xs.min()), float(xs.max() + 1)

    def window(self, axis: str, start: float | None, end: float | None, bins: int, raw_limit: int) -> dict:
        """The timeline between start and end: binned counts, or the raw events when few."""
        if start is None and end is None:  # the overview strip asks for this on every open
            key = (axis, bins, raw_limit)
            if key not in self.whole:
                self.whole[key] = self._window(axis, None, None, bins, raw_limit)
            return self.whole[key]
        return self._window(axis, start, end, bins, raw_limit)

    def _window(self, axis: str, start: float | None, end: float | None, bins: int, raw_limit: int) -> dict:
        lo, hi = self.extent(axis)
        for value in (start, end):
            if value is not None and not math.isfinite(value):
                raise BadInput(f"a timeline window bound must be a finite number, not {value}")
        # clamped into the extent: a window outside it is the nearest window inside
        start = lo if start is None else min(max(float(start), lo), hi)
        end = hi if end is None else max(min(float(end), hi), lo)
        if end <= start:
            end = start + 1.0
        pos_a, pos_b = self._positions(axis, start, end)
        lanes = [{"side": side, "phase": p} for side in ("a", "b") for p in self.phases]
        out = {
            "axis": axis, "start": start, "end": end, "extent": [lo, hi], "lanes": lanes,
            "status_codes": list(STATUS_CODES), "count_a": int(pos_a.size), "count_b": int(pos_b.size),
            "prefix": self._prefix(axis), "pivot": self._marker(self.pivot),
            "steps": self.steps.marks(axis, start, end, self.a_x, self.b_x) if self.steps else None,
        }
        if max(pos_a.size, pos_b.size) <= raw_limit:  # only then is the union worth making
            both = np.union1d(pos_a, pos_b)
            if both.size <= raw_limit:
                out["mode"] = "events"
                out["events"] = self._raw(both)
                return out
        out["mode"] = "bins"
        out["bins"] = self._bins(axis, start, end, bins, pos_a, pos_b)
        return out

    def _bins(self, axis, start, end, bins, pos_a, pos_b) -> dict:
        n_phase = len(self.phases)
        width = (end - start) / bins
        lanes_out = []
        in_bins = []  # (positions, bin of each) per side, for the steps each bin holds
        for side, pos, lane, x in (("a", pos_a, self.lane_a, self.a_x), ("b", pos_b, self.lane_b, self.b_x)):
            coord = pos.astype(np.float64) if axis == "seq" else x[pos]
            b = np.clip(((coord - start) / width).astype(np.int64), 0, bins - 1)
            in_bins.append((pos, b))
            counts = bin_counts(lane[pos].astype(np.int64) * bins + b, self.code[pos], n_phase * bins)
            counts = counts.reshape(n_phase, bins, len(STATUS_CODES))
            total, shown = counts.sum(axis=2), worst(counts)
            for i, phase in enumerate(self.phases):
                lanes_out.append({"side": side, "phase": phase, "status": shown[i].tolist(),
                                  "n": total[i].tolist(), "diverged": counts[i, :, DIVERGED].tolist()})
        out = {"start": start, "width": width, "count": bins, "lanes": lanes_out}
        if self.steps:
            out["step_lo"], out["step_hi"] = self.steps.bin_ranges(bins, in_bins)
        return out

    def _raw(self, pos: np.ndarray) -> list[dict]:
        rows = self.frame[pos.tolist()] if pos.size else self.frame.head(0)
        rows = rows.with_columns(a_x=pl.Series(self.a_x[pos]), b_x=pl.Series(self.b_x[pos])).with_columns(
            pl.col("a_x").fill_nan(None), pl.col("b_x").fill_nan(None))
        if "a_t_end_ns" in rows.columns:  # how long each side's call took: the slices drawn by time
            rows = rows.with_columns(a_dur=pl.col("a_t_end_ns") - pl.col("a_t_start_ns"),
                                     b_dur=pl.col("b_t_end_ns") - pl.col("b_t_start_ns"))
        keep = ["pos", "status", "in_prefix", "reordered", "is_pivot", "step", "phase", "boundary", "module_type",
                "call", "depth", "a_seq", "b_seq", "a_x", "b_x", "a_dur", "b_dur"]
        return rows.select([c for c in keep if c in rows.columns]).to_dicts()

    def _prefix(self, axis: str) -> dict | None:
        if self.prefix_end == 0:
            return None
        if axis == "seq":
            return {"a": [0.0, float(self.prefix_end)], "b": [0.0, float(self.prefix_end)]}
        a = self.a_x[:self.prefix_end]
        b = self.b_x[:self.prefix_end]
        return {"a": [0.0, float(np.nanmax(a))] if np.isfinite(a).any() else None,
                "b": [0.0, float(np.nanmax(b))] if np.isfinite(b).any() else None}

    def _marker(self, pos: int | None) -> dict | None:
        if pos is None:
            return None
        ax, bx = self.a_x[pos], self.b_x[pos]
        row = self.frame.row(pos, named=True)
        return {"pos": pos, "a_x": None if np.isnan(ax) else float(ax), "b_x": None if np.isnan(bx) else float(bx),
                "a_seq": row.get("a_seq"), "b_seq": row.get("b_seq"), "phase": row.get("phase")}

    def locate(self, side: str, seq: int) -> int | None:
        col = "a_seq" if side == "a" else "b_seq"
        hit = self.frame.filter(pl.col(col) == seq)
        return int(hit["pos"][0]) if hit.height else None


class Result:
    """A computed comparison: the engine's object and the timelines drawn from it."""

    def __init__(self, engine_obj, revision: int, raw_limit: int | None = None, names: PathNames | None = None):
        self.engine = engine_obj
        self.revision = revision
        self.lock = threading.RLock()  # the engine's object may hold DuckDB connections
        full = engine_obj.to_dict()
        graph = full.pop("propagation", None) or {}
        full["propagation"] = {"nodes": len(graph.get("nodes", [])), "edges": len(graph.get("edges", []))}
        self.summary = names.value(full) if names else full  # run_a/run_b: the runs' names, not workspace paths
        events = engine_obj.events()
        self.ranks = sorted(int(r) for r in events["rank"].unique().to_list()) if events.height else []
        self.timelines = {r: RankTimeline.from_frame(events.filter(pl.col("rank") == r)) for r in self.ranks}
        if raw_limit is not None:  # the overview strip of every rank, ready before "ready"
            for tl in self.timelines.values():
                tl.window("seq", None, None, DEFAULT_BINS, raw_limit)

    def timeline(self, rank: int) -> RankTimeline:
        if rank not in self.timelines:
            raise NotFound(f"rank {rank} is not in this comparison; its ranks are {self.ranks}")
        return self.timelines[rank]

    def pivot_position(self) -> dict | None:
        fd = self.summary.get("first_divergence")
        if not fd:
            return None
        tl = self.timelines.get(fd.get("rank"))
        if tl is None or tl.pivot is None:
            return None
        return {"rank": fd.get("rank"), "pos": tl.pivot}

    def with_positions(self, node: dict) -> dict:
        """A graph node plus its position in its rank's timeline (what the browser scrolls to)."""
        tl = self.timelines.get(node.get("rank"))
        pos = None
        if tl is not None:
            if node.get("a_seq") is not None:
                pos = tl.locate("a", node["a_seq"])
            if pos is None and node.get("b_seq") is not None:
                pos = tl.locate("b", node["b_seq"])
        return {**node, "pos": pos}
