"""Alignment keys: which events of two runs may be the same call, as one uint64 per event.

An event's `key` hashes its place (step, phase, kind, boundary), its module type and the
sequence of its tensors' (role, shape, shard, dtype) in (role, idx) order; `loose_key` the
place and the tensors' roles, shapes and shards only (to pair a retyped boundary); `place_key`
the place and the shards held (to pair a re-signatured one: retype.py). ingest.load_rank gives
every event all three. A key only has to agree within one process (both runs of a comparison
are keyed by the same code): what matters is which events share one, never its value.

Columnar: polars hashes each column once (nulls hash alike), one Numba pass folds a row's
column hashes together and an event's rows in order, another combines them with the event's
place. 64-bit hashes: two different events share a key with a chance of about 2^-64 per pair,
and a pair made by a collision still has its tensors compared by role, index, shape and dtype.
"""

from __future__ import annotations

import numpy as np
import polars as pl
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, inline="always")
def _mix(h):  # pragma: no cover - compiled
    """splitmix64's finaliser: every input bit moves every output bit."""
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@njit(cache=True)
def _fold_rows(seq, role, shape, shard, dtype, has_shard, event_seq, sig, shapes, shards):  # pragma: no cover
    """Tensor rows sorted by seq, events sorted by seq: each event's rows folded in row order
    into `sig` (role, shape, shard, dtype), `shapes` (role, shape, shard) and `shards` (the
    shards held, 0 when none is)."""
    n, m = len(seq), len(event_seq)
    e = 0
    i = 0
    while i < n:
        s = seq[i]
        j = i
        a = _GOLDEN
        b = _GOLDEN
        c = _GOLDEN
        held = 0
        while j < n and seq[j] == s:
            r = _mix(_mix(_mix(_mix(_GOLDEN * _GOLDEN + role[j]) * _GOLDEN + shape[j]) * _GOLDEN + shard[j]))
            a = _mix(a * _GOLDEN + _mix(r * _GOLDEN + dtype[j]))
            b = _mix(b * _GOLDEN + r)
            if has_shard[j]:
                c = _mix(c * _GOLDEN + shard[j])
                held += 1
            j += 1
        while e < m and event_seq[e] < s:
            e += 1
        if e < m and event_seq[e] == s:
            sig[e] = _mix(a + np.uint64(j - i))
            shapes[e] = _mix(b + np.uint64(j - i))
            shards[e] = _mix(c + np.uint64(held)) if held else np.uint64(0)
        i = j


@njit(cache=True)
def _place(step, phase, kind, boundary, module_type, sig, shapes, shards, key, loose, place):  # pragma: no cover
    for i in range(len(step)):
        p = _mix(_mix(_mix(_mix(_GOLDEN * _GOLDEN + step[i]) * _GOLDEN + phase[i]) * _GOLDEN + kind[i])
                 * _GOLDEN + boundary[i])
        key[i] = _mix(_mix(p * _GOLDEN + module_type[i]) * _GOLDEN + sig[i])
        loose[i] = _mix(p * _GOLDEN + shapes[i])
        place[i] = _mix(p * _GOLDEN + shards[i])


def _hash(frame: pl.DataFrame, name: str) -> np.ndarray:
    return frame.select(pl.col(name).hash()).to_series().to_numpy()  # (an expression: a column held as
    # one value, ingest._read_compact, stays one value in the frame)


def with_keys(events: pl.DataFrame, tensors: pl.DataFrame) -> pl.DataFrame:
    """events with their `key`, `loose_key` and `place_key` (the module docstring says what each
    holds). An event's tensor rows are taken in the order `tensors` holds them (load_rank gives
    them sorted by seq, role, idx)."""
    if tensors.height and not tensors["seq"].is_sorted():
        tensors = tensors.sort("seq", maintain_order=True)  # an event's rows keep their order
    order = None if events["seq"].is_sorted() else np.argsort(events["seq"].to_numpy(), kind="stable")
    event_seq = events["seq"].to_numpy() if order is None else events["seq"].to_numpy()[order]
    sig, shapes, shards = (np.zeros(events.height, np.uint64) for _ in range(3))
    if tensors.height:
        _fold_rows(tensors["seq"].to_numpy(), *(_hash(tensors, c) for c in ("role", "shape", "shard", "dtype")),
                   tensors.select(pl.col("shard").is_not_null()).to_series().to_numpy(), event_seq.astype(np.int64), sig, shapes, shards)
    if order is not None:  # back to the events' own order
        for values in (sig, shapes, shards):
            values[order] = values.copy()
    key, loose, place = (np.empty(events.height, np.uint64) for _ in range(3))
    _place(*(_hash(events, c) for c in ("step", "phase", "kind", "boundary", "module_type")), sig, shapes, shards,
           key, loose, place)
    return events.with_columns(pl.Series("key", key), pl.Series("loose_key", loose), pl.Series("place_key", place))
