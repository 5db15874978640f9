"""Fingerprint options of compare (backend/equivalence.py): when two paired tensors differ.

Each test builds real rank files holding only the `dumps` table (the one equivalence reads) and
a pairing frame shaped like compare.py's, so each fingerprint is checked against plain NumPy on
the same values.
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl
import pytest
import torch

from bitguard.backend import equivalence
from bitguard.errors import BadInput
from bitguard.schema import DUMPS


def _rank_file(path, tensors: list[np.ndarray | torch.Tensor]) -> str:
    """A rank file whose dumps hold tensor i as event i, role output, index 0."""
    con = duckdb.connect(str(path))
    con.execute(DUMPS.ddl())
    for seq, t in enumerate(tensors):
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(t, torch.Tensor) else t.tobytes()
        con.execute("INSERT INTO dumps VALUES (?, 'output', 0, ?)", [seq, data])
    con.close()
    return str(path)


def _diffs(a: list, b: list) -> pl.DataFrame:
    """compare.py's paired rows for event i of A paired with event i of B; digests all differ."""
    n = len(a)
    dtype = [str(t.dtype).removeprefix("torch.") for t in a]
    return pl.DataFrame({
        "a_seq": list(range(n)), "b_seq": list(range(n)), "role": ["output"] * n, "idx": [0] * n,
        "dtype": dtype, "shape": [list(t.shape) for t in a], "xor_b": [1] * n,
        "xor_differs": [True] * n, "pos_differs": [True] * n, "differs": [True] * n,
    }, schema_overrides={"idx": pl.Int32, "shape": pl.List(pl.Int64), "xor_b": pl.UInt64})


def _apply(tmp_path, fingerprint, a, b):
    fa, fb = _rank_file(tmp_path / "a.duckdb", a), _rank_file(tmp_path / "b.duckdb", b)
    return equivalence.apply(_diffs(a, b), fingerprint, fa, fb)["differs"].to_list()


def test_xor_alone_ignores_the_order_sensitive_digest():
    d = _diffs([torch.zeros(2)], [torch.zeros(2)]).with_columns(pl.lit(False).alias("xor_differs"))
    assert equivalence.apply(d, "xor", "unused", "unused")["differs"].to_list() == [False]
    assert equivalence.apply(d, "xor+pos", "unused", "unused")["differs"].to_list() == [True]


def test_sum_sees_a_changed_value_not_a_swap(tmp_path):
    x = torch.arange(8, dtype=torch.float32) / 7
    swapped, changed = x.clone(), x.clone()
    swapped[[1, 5]] = x[[5, 1]]
    changed[3] = torch.nextafter(x[3], torch.tensor(2.0))
    assert _apply(tmp_path, "sum", [x, x], [swapped, changed]) == [False, True]


def test_tolerance_is_allclose_at_rtol_1e_3(tmp_path):
    x = torch.linspace(1, 2, 16)
    near, far = x * (1 + 5e-4), x.clone()
    far[7] *= 1 + 2e-3
    assert _apply(tmp_path, "tolerance", [x, x, x], [near, far, x]) == [False, True, False]
    assert np.allclose(near.numpy(), x.numpy(), rtol=1e-3) and not np.allclose(far.numpy(), x.numpy(), rtol=1e-3)


def test_integer_tensors_compare_exactly_under_tolerance(tmp_path):
    ids = torch.arange(10, dtype=torch.int64) * 1000
    other = ids.clone()
    other[0] += 1  # 1 in 9000: within 1e-3 relatively, but a different token
    assert _apply(tmp_path, "tolerance", [ids], [other]) == [True]


def test_bf16_dumps_decode_exactly():
    t = torch.randn(3, 5).to(torch.bfloat16)
    got = equivalence.decode(t.view(torch.uint8).numpy().tobytes(), "bfloat16", [3, 5])
    want = t.float().numpy()
    assert np.array_equal(got, want), f"decoded {got} != torch {want}"


def test_a_tensor_without_bytes_keeps_the_digests_verdict(tmp_path):
    x = torch.ones(4)
    fa, fb = _rank_file(tmp_path / "a.duckdb", [x]), _rank_file(tmp_path / "b.duckdb", [x])
    d = pl.concat([_diffs([x], [x]), _diffs([x], [x]).with_columns(
        pl.lit(9, dtype=pl.Int64).alias("a_seq"), pl.lit(9, dtype=pl.Int64).alias("b_seq"))])
    assert equivalence.apply(d, "tolerance", fa, fb)["differs"].to_list() == [False, True]


def test_runs_without_dumps_are_refused_with_the_fix(tmp_path):
    x = torch.ones(4)
    fa = _rank_file(tmp_path / "a.duckdb", [x])
    fb = _rank_file(tmp_path / "b.duckdb", [])
    with pytest.raises(BadInput, match="record both runs with 'bitguard record --dump'"):
        equivalence.apply(_diffs([x], [x]), "sum", fa, fb)


def test_unknown_fingerprint_is_refused():
    with pytest.raises(BadInput, match="use one of: xor\\+pos, xor, sum, tolerance"):
        equivalence.check("crc32")
