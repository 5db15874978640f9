"""The timeline's status vocabulary, its severity order, and the worst status of each bin.

A cell of a timeline (one event, or a bin of many) shows one of `STATUS_CODES`, listed from least
to most severe: a bin shows the worst status it holds, `empty` where it holds nothing. The
engine's event statuses (`result.EVENT_STATUSES`) map onto them by `STATUS_OF_EVENT`: an event
on one side only (`only_a`, `only_b`) is a `gap`, whichever side it is on. The server sends both
to the browser (`GET /api/schema`, and `status_codes` with every timeline window), so the
JavaScript never retypes them; the server's windows (timelines.py) and the notebook's timeline
figure (figures.py) bin with the same `bin_counts` and `worst`.

This module knows nothing about lanes, axes, HTTP or drawing.
"""

from __future__ import annotations

import numpy as np

from bitguard.backend.result import EVENT_STATUSES

# least to most severe; follows: differs only downstream of a difference a rule accepted;
# unobserved: not comparable (cannot certify); gap: an event on one side only
STATUS_CODES = ("empty", "identical", "benign", "follows", "unobserved", "gap", "diverged")
STATUS_OF_EVENT = {s: ("gap" if s.startswith("only_") else s) for s in EVENT_STATUSES}
CODE_OF_EVENT = {s: STATUS_CODES.index(c) for s, c in STATUS_OF_EVENT.items()}  # event status -> code
EMPTY, GAP, DIVERGED = (STATUS_CODES.index(s) for s in ("empty", "gap", "diverged"))


def bin_counts(bin_of: np.ndarray, code: np.ndarray, n_bins: int) -> np.ndarray:
    """counts[b, c]: how many of the events fall in bin b with status code c.

    `bin_of` holds each event's bin (0 <= bin < n_bins), `code` its status code."""
    n = len(STATUS_CODES)
    key = np.asarray(bin_of, dtype=np.int64) * n + np.asarray(code, dtype=np.int64)
    return np.bincount(key, minlength=n_bins * n).reshape(n_bins, n)


def worst(counts: np.ndarray) -> np.ndarray:
    """The most severe code with a nonzero count along the last axis of `counts`; EMPTY where none."""
    present = np.asarray(counts) > 0
    last = present.shape[-1] - 1
    return np.where(present.any(axis=-1), last - np.argmax(present[..., ::-1], axis=-1), EMPTY)
