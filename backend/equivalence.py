"""When two paired tensors count as different: the fingerprint a comparison uses.

bitguard's own test is `xor+pos`: a tensor differs when either 64-bit digest differs, which
sees every changed bit and every reordering. The others exist to measure what that choice buys
(docs/EVALUATION.md), as options of the same comparison rather than forks of it:

- `xor`        the XOR digest alone (blind to swapped elements and to flips that cancel);
- `sum`        the tensor's sum in float64, compared exactly (a scalar fingerprint);
- `tolerance`  the full tensors compared with numpy.allclose(rtol=1e-3) (what a numeric
               checker accepts as equal).

`sum` and `tolerance` read the tensors' bytes, so both runs must be recorded with `--dump`.
This module only decides `differs` for rows that compare.py has already paired; it does not
align, blame or load anything else.
"""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl

from bitguard import db
from bitguard.errors import BadInput

FINGERPRINTS = ("xor+pos", "xor", "sum", "tolerance")
RTOL = 1e-3  # relative tolerance of the `tolerance` fingerprint
ATOL = 1e-8  # numpy.allclose's default absolute tolerance, kept

_NUMPY = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "int64": np.int64,
          "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


def check(fingerprint: str) -> None:
    if fingerprint not in FINGERPRINTS:
        raise BadInput(f"unknown fingerprint {fingerprint!r}; use one of: {', '.join(FINGERPRINTS)}")


def decode(data: bytes, dtype: str, shape) -> np.ndarray:
    """A dumped tensor's values (bf16 widened exactly to float32)."""
    if dtype == "bfloat16":
        halves = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
        return halves.view(np.float32).reshape(shape)
    if dtype not in _NUMPY:
        raise BadInput(f"cannot decode dumped tensors of dtype {dtype}; compare with fingerprint 'xor+pos'")
    return np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(shape)


def load_dumps(rank_file, seqs: list[int]) -> dict[tuple[int, str, int], bytes]:
    """(seq, role, idx) -> bytes for the given events of one rank file."""
    con = db.connect(rank_file, read_only=True)
    try:
        con.register("wanted", pl.DataFrame({"seq": seqs}, schema={"seq": pl.Int64}).to_arrow())
        rows = con.sql("SELECT d.seq, d.role, d.idx, d.data FROM dumps d JOIN wanted w USING (seq)").fetchall()
    finally:
        con.close()
    return {(s, r, i): bytes(d) for s, r, i, d in rows}


def has_dumps(rank_file) -> bool:
    try:
        con = db.connect(rank_file, read_only=True)
    except duckdb.Error:
        return False
    try:
        return bool(con.execute("SELECT EXISTS (SELECT 1 FROM dumps)").fetchall()[0][0])
    except duckdb.Error:
        return False
    finally:
        con.close()


def _same(a: np.ndarray, b: np.ndarray, fingerprint: str) -> bool:
    if a.shape != b.shape:
        return False
    if fingerprint == "sum":
        sa, sb = a.astype(np.float64).sum(), b.astype(np.float64).sum()
        return bool(sa == sb or (np.isnan(sa) and np.isnan(sb)))
    if a.dtype.kind in "biu":
        return bool(np.array_equal(a, b))
    return bool(np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=RTOL, atol=ATOL, equal_nan=True))


def apply(diffs: pl.DataFrame, fingerprint: str, file_a, file_b) -> pl.DataFrame:
    """`diffs` (compare.py's paired tensor rows, with xor_differs and pos_differs) with `differs`
    decided by `fingerprint`. A tensor missing on one side differs under every fingerprint; one
    whose bytes were not dumped (a run recorded with --steps, say) keeps the digests' verdict."""
    check(fingerprint)
    if fingerprint == "xor+pos" or diffs.is_empty():
        return diffs
    if fingerprint == "xor":  # (xor_differs is already true where B lacks the tensor)
        return diffs.with_columns(pl.col("xor_differs").alias("differs"))
    for side, f in (("A", file_a), ("B", file_b)):
        if not has_dumps(f):
            raise BadInput(f"fingerprint {fingerprint!r} needs every tensor's bytes, and run {side} ({f}) has "
                           f"none: record both runs with 'bitguard record --dump'")
    b_idx = "idx_b" if "idx_b" in diffs.columns else "idx"  # B's own index of a re-signatured pair's tensor (retype.py)
    rows = diffs.select("a_seq", "b_seq", "role", "idx", pl.col(b_idx).alias("idx_b"), "dtype", "shape", "xor_b",
                        "differs").to_dicts()
    bytes_a = load_dumps(file_a, sorted({r["a_seq"] for r in rows}))
    bytes_b = load_dumps(file_b, sorted({r["b_seq"] for r in rows if r["b_seq"] is not None}))
    differs = []
    for r in rows:
        da = bytes_a.get((r["a_seq"], r["role"], r["idx"]))
        db = bytes_b.get((r["b_seq"], r["role"], r["idx_b"]))
        if r["xor_b"] is None or da is None or db is None:  # no bytes kept: the digests decide
            differs.append(r["differs"])
            continue
        a = decode(da, r["dtype"], r["shape"])
        b = decode(db, r["dtype"], r["shape"])
        differs.append(not _same(a, b, fingerprint))
    return diffs.with_columns(pl.Series("differs", differs, dtype=pl.Boolean))
