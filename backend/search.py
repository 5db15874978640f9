"""Finding events in one rank's aligned timeline: search by boundary glob, module type, phase,
step and status, and the next or previous match from a position (next divergence, next gap).

Matches are positions (the timeline's aligned order, `RankTimeline.frame["pos"]`), kept as one
sorted numpy array per query so that a page of matches or the next one after a position is a
slice or a binary search, however many events the rank holds. Patterns are matched against the
distinct boundaries and module types (hundreds), never row by row in Python. This module knows
the timeline's columns and nothing about HTTP, the catalogue or how runs are aligned.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from bitguard.backend.result import EVENT_STATUSES
from bitguard.errors import BadInput

# status filters beyond the engine's own statuses: a gap is an event on one side only, a
# difference is what "next divergence" stops at (a divergent pair or a gap)
STATUS_GROUPS = {"gap": ("only_a", "only_b"), "difference": ("diverged", "only_a", "only_b")}
STATUS_FILTERS = tuple(EVENT_STATUSES) + tuple(STATUS_GROUPS)
# the columns of a match sent to the browser (enough to select it and to list it)
MATCH_COLUMNS = ("pos", "status", "step", "phase", "kind", "boundary", "module_type", "a_seq", "b_seq", "is_pivot")
_CACHED_QUERIES = 32  # per rank: the queries a user steps through with next and previous
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Query:
    """What to find; every field left None matches everything."""

    boundary: str | None = None  # glob over dotted names, from any part: "blocks.5.mlp*"; plain text: substring
    module_type: str | None = None  # glob or exact name: "Linear", "*Norm"
    phase: str | None = None  # forward | backward | optimizer | ... (comma-separated for several)
    step_min: int | None = None  # first step, inclusive
    step_max: int | None = None  # last step, inclusive
    status: str | None = None  # one of STATUS_FILTERS

    def __post_init__(self):
        if self.status is not None and self.status not in STATUS_FILTERS:
            raise BadInput(f"unknown status {self.status!r}: use one of {', '.join(STATUS_FILTERS)}")
        if self.step_min is not None and self.step_max is not None and self.step_min > self.step_max:
            raise BadInput(f"step_min {self.step_min} is after step_max {self.step_max}")

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def boundary_matcher(pattern: str):
    """A predicate on boundary names. A glob matches the whole name or any dotted tail of it
    (`blocks.5.mlp*` finds `model.blocks.5.mlp.fc`); text without * ? [ is found anywhere."""
    if not _GLOB.search(pattern):
        return lambda name: pattern in name
    return lambda name: fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def _type_matcher(pattern: str):
    if not _GLOB.search(pattern):
        return lambda name: name == pattern
    return lambda name: fnmatch.fnmatchcase(name, pattern)


class Finder:
    """One rank's searches, each query's matches cached as a sorted array of positions."""

    def __init__(self, frame: pl.DataFrame):
        self.frame = frame  # RankTimeline.frame: one row per position, in position order
        self._lock = threading.Lock()
        self._matches: OrderedDict[Query, np.ndarray] = OrderedDict()
        self._distinct: dict[str, list[str]] = {}

    @property
    def size(self) -> int:
        return int(self.frame.height)

    def _values(self, column: str) -> list[str]:
        if column not in self._distinct:
            col = self.frame[column] if column in self.frame.columns else pl.Series(column, [], dtype=pl.String)
            self._distinct[column] = [v for v in col.unique().to_list() if v is not None]
        return self._distinct[column]

    def _mask(self, q: Query) -> pl.Expr | None:
        parts = []
        if q.boundary:
            match = boundary_matcher(q.boundary)
            parts.append(pl.col("boundary").is_in([b for b in self._values("boundary") if match(b)]))
        if q.module_type:
            match = _type_matcher(q.module_type)
            parts.append(pl.col("module_type").is_in([t for t in self._values("module_type") if match(t)]))
        if q.phase:
            parts.append(pl.col("phase").is_in([p.strip() for p in q.phase.split(",") if p.strip()]))
        if q.step_min is not None:
            parts.append(pl.col("step") >= q.step_min)
        if q.step_max is not None:
            parts.append(pl.col("step") <= q.step_max)
        if q.status:
            parts.append(pl.col("status").is_in(list(STATUS_GROUPS.get(q.status, (q.status,)))))
        if not parts:
            return None
        mask = parts[0]
        for p in parts[1:]:
            mask = mask & p
        return mask.fill_null(False)

    def matches(self, q: Query) -> np.ndarray:
        """Positions of the events `q` matches, ascending."""
        with self._lock:
            hit = self._matches.get(q)
            if hit is not None:
                self._matches.move_to_end(q)
                return hit
        mask = self._mask(q)
        if mask is None:
            pos = np.arange(self.size, dtype=np.int64)
        else:
            pos = np.flatnonzero(self.frame.select(mask).to_series().to_numpy()).astype(np.int64)
        with self._lock:
            self._matches[q] = pos
            while len(self._matches) > _CACHED_QUERIES:
                self._matches.popitem(last=False)
        return pos

    def rows(self, positions: np.ndarray) -> list[dict]:
        keep = [c for c in MATCH_COLUMNS if c in self.frame.columns]
        if not positions.size:
            return []
        return self.frame[positions.tolist()].select(keep).to_dicts()

    def search(self, q: Query, offset: int = 0, limit: int = 50, at: int | None = None,
               direction: str = "next") -> dict:
        """A page of matches and, from position `at`, the next (or previous) match.

        `at` None: the hit is the first match (the last for direction "prev"). The hit's `index`
        is its place among all matches, so "3 of 120" can be shown and the page holding it asked for."""
        if direction not in ("next", "prev"):
            raise BadInput(f"direction is next or prev, not {direction!r}")
        pos = self.matches(q)
        total = int(pos.size)
        offset = min(max(int(offset), 0), total)
        page = pos[offset:offset + max(int(limit), 0)]
        index = step_index(pos, at, direction)
        hit = None
        if index is not None:
            hit = {"index": index, "event": self.rows(pos[index:index + 1])[0]}
        return {"query": q.public(), "total": total, "offset": offset, "limit": int(limit),
                "from": at, "direction": direction, "matches": self.rows(page), "hit": hit}


def step_index(positions: np.ndarray, at: int | None, direction: str) -> int | None:
    """The index in `positions` (ascending) of the first one after `at` ("next") or the last one
    before it ("prev"); None when there is none (no wrapping round: the end is said, not hidden)."""
    n = int(positions.size)
    if not n:
        return None
    if at is None:
        return 0 if direction == "next" else n - 1
    if direction == "next":
        i = int(np.searchsorted(positions, at, side="right"))
        return i if i < n else None
    i = int(np.searchsorted(positions, at, side="left")) - 1
    return i if i >= 0 else None


def finder(timeline) -> Finder:
    """The Finder of a RankTimeline, made on first use and kept with it (a result is immutable)."""
    f = getattr(timeline, "_finder", None)
    if f is None:
        f = Finder(timeline.frame)
        timeline._finder = f
    return f
