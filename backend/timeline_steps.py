"""Training steps on a timeline window: where each step begins, and which steps each bin holds.

A rank's aligned items carry the step each event was recorded in. Read in position order, a step
begins wherever that number changes; `StepIndex` keeps those positions and answers, for a window,
the step boundaries to draw (thinned to every 2nd, 5th, 10th... step when too many would crowd
the axis) and, for binned windows, the first and last step of the events in each bin (the bin
tooltips). It knows nothing about statuses, lanes or HTTP (timelines.py), and trusts the recorded
step numbers: a run whose steps were not counted (all 0) has one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_MARKS = 24  # most step boundaries drawn in one window ("step 1,200" is ~50 px wide)
_EVERY = (1, 2, 5)  # thinned to every 1, 2, 5, 10, 20, 50, ... steps


def thinning(n_marks: int, max_marks: int = MAX_MARKS) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50... that leaves at most `max_marks` of `n_marks` boundaries."""
    scale = 1
    while True:
        for k in _EVERY:
            if n_marks <= max_marks * k * scale:
                return k * scale
        scale *= 10


@dataclass(frozen=True)
class StepIndex:
    step: np.ndarray  # int64 step of each position (a missing step takes the one before it)
    starts: np.ndarray  # int64 positions where a step begins, the first one included

    @classmethod
    def from_steps(cls, steps) -> "StepIndex":
        s = np.asarray(steps, dtype=np.float64)
        if s.size and np.isnan(s).any():  # forward-fill a missing step; leading gaps take the first known
            idx = np.where(np.isnan(s), 0, np.arange(s.size))
            np.maximum.accumulate(idx, out=idx)
            s = s[idx]
            s[np.isnan(s)] = s[~np.isnan(s)][0] if (~np.isnan(s)).any() else 0
        step = s.astype(np.int64)
        starts = np.flatnonzero(np.diff(step) != 0) + 1 if step.size else np.zeros(0, np.int64)
        starts = np.concatenate([[0], starts]).astype(np.int64) if step.size else starts
        return cls(step=step, starts=starts)

    def marks(self, axis: str, start: float, end: float, a_x: np.ndarray, b_x: np.ndarray) -> dict:
        """The step boundaries in [start, end): {"every": k, "marks": [{"step", "x", "b_x"}]}.

        seq: x is the position where the step begins (b_x equals it); time: x is when the step's first
        event began on A and b_x on B, each None where that side lacks the event."""
        if axis == "seq":
            lo, hi = np.searchsorted(self.starts, [start, end], side="left")
            pos = self.starts[lo:hi]
            xa = xb = pos.astype(np.float64)
        else:
            # a step begins at its earliest event (a parent module starts before the children that complete first)
            xa_all, xb_all = np.fmin.reduceat(a_x, self.starts), np.fmin.reduceat(b_x, self.starts)
            x = np.where(np.isfinite(xa_all), xa_all, xb_all)
            keep = np.flatnonzero((x >= start) & (x < end))
            pos, xa, xb = self.starts[keep], xa_all[keep], xb_all[keep]
        steps = self.step[pos]
        every = thinning(len(pos))
        if every > 1:
            keep = np.flatnonzero(steps % every == 0)
            pos, steps, xa, xb = pos[keep], steps[keep], xa[keep], xb[keep]

        def num(v: float) -> float | None:
            return float(v) if np.isfinite(v) else None

        return {"every": every, "marks": [{"step": int(s), "x": num(a), "b_x": num(b)}
                                          for s, a, b in zip(steps.tolist(), xa.tolist(), xb.tolist())]}

    def bin_ranges(self, bins: int, sides: list[tuple[np.ndarray, np.ndarray]]) -> tuple[list, list]:
        """First and last step per bin over the events of both sides: `sides` holds, per side, the
        positions of its events in the window and the bin each falls in. None where a bin is empty."""
        big = np.iinfo(np.int64).max
        lo = np.full(bins, big, dtype=np.int64)
        hi = np.full(bins, -big, dtype=np.int64)
        for pos, b in sides:
            if pos.size:
                s = self.step[pos]
                np.minimum.at(lo, b, s)
                np.maximum.at(hi, b, s)
        empty = lo == big
        return ([None if e else int(v) for e, v in zip(empty.tolist(), lo.tolist())],
                [None if e else int(v) for e, v in zip(empty.tolist(), hi.tolist())])
