"""Alignment keys (backend/event_keys.py): which events share a key is what counts, never its value."""

from __future__ import annotations

import polars as pl

from bitguard.backend.event_keys import with_keys


def _events(n: int, **over) -> pl.DataFrame:
    base = {"seq": list(range(n)), "step": [0] * n, "phase": ["forward"] * n, "kind": ["module"] * n,
            "boundary": ["m"] * n, "module_type": ["Linear"] * n}
    return pl.DataFrame({**base, **over}, schema_overrides={"seq": pl.Int64, "step": pl.Int64})


def _tensors(rows: list[tuple]) -> pl.DataFrame:
    """rows: (seq, role, idx, shape, dtype, shard)"""
    return pl.DataFrame(rows, schema={"seq": pl.Int64, "role": pl.String, "idx": pl.Int32, "shape": pl.List(pl.Int64),
                                      "dtype": pl.String, "shard": pl.String}, orient="row")


def _same(frame: pl.DataFrame, column: str, i: int, j: int) -> bool:
    return frame[column][i] == frame[column][j]


def test_the_same_place_and_tensors_share_every_key_and_each_difference_parts_them():
    t = _tensors([
        (0, "input", 0, [2, 3], "float32", None), (0, "output", 0, [2, 3], "float32", None),
        (1, "input", 0, [2, 3], "float32", None), (1, "output", 0, [2, 3], "float32", None),  # as 0
        (2, "input", 0, [3, 2], "float32", None), (2, "output", 0, [2, 3], "float32", None),  # a shape
        (3, "input", 0, [2, 3], "bfloat16", None), (3, "output", 0, [2, 3], "float32", None),  # a dtype
        (4, "input", 0, [2, 3], "float32", None),  # one tensor fewer
        (5, "input", 0, [2, 3], "float32", "0:2"), (5, "output", 0, [2, 3], "float32", None),  # a shard held
        (6, "input", 0, [2, 3], "float32", None), (6, "output", 0, [2, 3], "float32", None),  # module type below
    ])
    k = with_keys(_events(8, module_type=["Linear"] * 6 + ["LinearX", "Linear"]), t)
    assert _same(k, "key", 0, 1) and _same(k, "loose_key", 0, 1) and _same(k, "place_key", 0, 1)
    for other in (2, 3, 4, 5, 6, 7):
        assert not _same(k, "key", 0, other), other
    assert _same(k, "loose_key", 0, 3) and not _same(k, "loose_key", 0, 2)  # loose: dtypes left out
    assert _same(k, "loose_key", 0, 6) and not _same(k, "key", 0, 6)  # loose: module type left out
    assert _same(k, "place_key", 0, 2) and _same(k, "place_key", 0, 4)  # place: only the shards held
    assert not _same(k, "place_key", 0, 5)
    assert not _same(k, "key", 7, 0) and _same(k, "key", 7, 7)  # an event without tensors has its own


def test_the_order_of_an_events_tensors_counts_and_unsorted_events_are_keyed_alike():
    t = _tensors([(0, "input", 0, [2], "float32", None), (0, "input", 1, [3], "float32", None),
                  (1, "input", 0, [3], "float32", None), (1, "input", 1, [2], "float32", None)])
    k = with_keys(_events(2), t)
    assert not _same(k, "key", 0, 1)  # the same tensors in another (role, idx) order
    # events and tensors not in seq order (an event's rows still in theirs): the same keys
    shuffled = with_keys(_events(2).reverse(), pl.concat([t.filter(pl.col("seq") == 1), t.filter(pl.col("seq") == 0)]))
    assert shuffled.sort("seq")["key"].to_list() == k["key"].to_list()


def test_the_place_parts_keys():
    t = _tensors([(i, "output", 0, [2], "float32", None) for i in range(4)])
    k = with_keys(_events(4, step=[0, 1, 0, 0], phase=["forward", "forward", "backward", "forward"],
                          boundary=["m", "m", "m", "n"]), t)
    assert k["key"].n_unique() == 4 and k["loose_key"].n_unique() == 4 and k["place_key"].n_unique() == 4
