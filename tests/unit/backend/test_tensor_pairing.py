"""Tensor pairing's row taking (compare.py `_kept_rows`, `_gathered`): the same rows and values as
a filter and a gather, whichever way they are taken."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from bitguard.backend.compare import _PIECES, _gathered, _kept_rows


def _left(chunks: list[int]) -> pl.DataFrame:
    """A frame in chunks of these lengths (as DuckDB's results come), one column of one value."""
    parts, at = [], 0
    for n in chunks:
        parts.append(pl.DataFrame({"a_seq": np.arange(at, at + n, dtype=np.int64),
                                   "path": [f"[{i}].some.long.path" for i in range(at, at + n)],
                                   "shape": [[i, 2] for i in range(at, at + n)]}))
        at += n
    return pl.concat(parts, rechunk=False).with_columns(pl.lit("float32").alias("dtype"))


def _expected(left: pl.DataFrame, kept: np.ndarray, right: pl.DataFrame) -> pl.DataFrame:
    return pl.concat([left.filter(pl.Series(kept)), right], how="horizontal")


@pytest.mark.parametrize("kept", [
    "all", "none", "one_dropped", "across_chunks", "first_and_last_dropped", "many_stretches"])
def test_kept_rows_are_the_filtered_rows(kept):
    left = _left([5, 7, 3, 9])
    n = left.height
    mask = {"all": np.ones(n, bool), "none": np.zeros(n, bool),
            "one_dropped": np.arange(n) != 6, "across_chunks": (np.arange(n) >= 3) & (np.arange(n) < 14),
            "first_and_last_dropped": (np.arange(n) > 0) & (np.arange(n) < n - 1),
            "many_stretches": np.arange(n) % 2 == 0}[kept]
    if kept == "many_stretches":  # more stretches than slices are taken: the filter's copy
        left = _left([2 * _PIECES + 10])
        mask = np.arange(left.height) % 2 == 0
    right = pl.DataFrame({"b_seq": np.flatnonzero(mask) + 100, "xor_b": np.flatnonzero(mask) * 3})
    got = _kept_rows(left, mask, right)
    want = _expected(left, mask, right)
    assert got.schema == want.schema
    assert got.equals(want, null_equal=True), f"got\n{got}\nwant\n{want}"
    # an expression over the result keeps every column's chunks (no copy into one chunk)
    shown = got.with_columns((pl.col("a_seq") != pl.col("b_seq")).alias("differs"))
    assert len(set(shown.n_chunks("all"))) <= 2  # the chunks of the slices, and 1 for the one-value column


def test_kept_rows_share_the_columns_of_left():
    left = _left([40_000, 40_000])
    mask = np.arange(left.height) != 123
    right = pl.DataFrame({"b_seq": np.flatnonzero(mask)})
    got = _kept_rows(left, mask, right)
    assert got.n_chunks("all")[0] == 3  # [0, 123), [124, 40000), [40000, 80000): slices, not a copy
    assert got.equals(_expected(left, mask, right))


def test_gathered_one_value_and_nulls():
    tb = pl.DataFrame({"x": [1, 2, 3]}).with_columns(pl.lit("bfloat16").alias("dtype"))
    full = pl.Series([2, 0, 1, 1])
    with_null = pl.Series([2, None, 1])
    for at in (full, with_null):
        got = pl.DataFrame({"i": range(len(at))}).with_columns(_gathered(tb, pl.col("dtype"), at, "dtype_b"))
        want = tb.select(pl.col("dtype").gather(at).alias("dtype_b"))
        assert got["dtype_b"].to_list() == want["dtype_b"].to_list(), (got, want)
        assert got.schema["dtype_b"] == pl.String
    varied = pl.DataFrame({"dtype": ["a", "b", "c"]})
    got = pl.DataFrame({"i": range(3)}).with_columns(_gathered(varied, pl.col("dtype"), with_null, "d"))
    assert got["d"].to_list() == ["c", None, "b"]
