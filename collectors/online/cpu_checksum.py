"""The checksum sensor's column sums on the host, in one fused pass per operand (Numba).

`column_gaps` in checksum.py needs, for C = A·B (+ bias) with A m×p and B p×q, the output's column
sums 1ᵀC, A's column sums s = 1ᵀA and its squared Frobenius norm, and for every column j of B the
product s·B_j and the squared norm ‖B_j‖². Torch computes them in about ten dispatched ops, two
passes over A, and a float64 copy of B (each op, run right after a GEMM that evicted the caches,
costs tens of µs of interpreter time before it touches a number). Here each operand is read once,
in its own dtype and layout, every sum accumulated in float64 (more precise than torch's float32
sums: the clean gaps come out tighter, never looser than `column_bound` allows).

An operand is a 2-D float32 or float64 tensor that is row-major or the transpose of a row-major one
(a `.T` view, as the backward GEMMs' operands are); anything else (another dtype, another layout, a
device tensor) is not handled here (`host_operands` says None) and checksum.py falls back to torch.
The kernels release the GIL; they never write to an operand.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

_FLOATS = (torch.float32, torch.float64)


@njit(cache=True, nogil=True)
def _sums_rows(x, out):
    """out[j] = Σ_i x[i, j] of a row-major m×q x (rows added to a float64 vector: vectorised)."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[j] += x[i, j]


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sums_cols(xt, out):
    """out[j] = Σ_i xt[j, i]: the column sums of x given as its row-major transpose xt (q×m)."""
    for j in range(xt.shape[0]):
        acc = 0.0
        for i in range(xt.shape[1]):
            acc += xt[j, i]
        out[j] = acc


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sums_sq_rows(x, out):
    """Column sums into out (float64, length p) and the sum of squares of a row-major x."""
    sq = 0.0
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = np.float64(x[i, j])
            out[j] += v
            sq += v * v
    return sq


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sums_sq_cols(xt, out):
    sq = 0.0
    for j in range(xt.shape[0]):
        acc = 0.0
        for i in range(xt.shape[1]):
            v = np.float64(xt[j, i])
            acc += v
            sq += v * v
        out[j] = acc
    return sq


@njit(cache=True, nogil=True)
def _dots_rows(b, s, dots, nsq):
    """dots[j] = Σ_k s[k]·b[k, j] and nsq[j] = Σ_k b[k, j]² of a row-major p×q b, in float64."""
    for k in range(b.shape[0]):
        sk = s[k]
        for j in range(b.shape[1]):
            v = np.float64(b[k, j])
            dots[j] += sk * v
            nsq[j] += v * v


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _dots_cols(bt, s, dots, nsq):
    """The same for b given as its row-major transpose bt (q×p: a weight W when b = Wᵀ)."""
    for j in range(bt.shape[0]):
        d = 0.0
        n = 0.0
        for k in range(bt.shape[1]):
            v = np.float64(bt[j, k])
            d += s[k] * v
            n += v * v
        dots[j] = d
        nsq[j] = n


def _host(t: torch.Tensor):
    """(a NumPy view, transposed?) of a 2-D host float32/float64 tensor that is row-major or the
    transpose of a row-major one, else None."""
    if t.device.type != "cpu" or t.dtype not in _FLOATS or t.dim() != 2 or type(t) is not torch.Tensor:
        return None
    if t.is_contiguous():
        return t.numpy(), False
    if t.T.is_contiguous():
        return t.T.numpy(), True
    return None


def host_operands(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
    """The three operands as (array, transposed) pairs when every one (and the bias) can be read
    here, else None."""
    views = (_host(c), _host(a), _host(b))
    if None in views or (bias is not None and (bias.device.type != "cpu" or bias.dtype not in _FLOATS)):
        return None
    return views


def column_sums(views, bias: torch.Tensor | None):
    """(lhs, rhs, scale) as float64 NumPy vectors of length q, from host_operands' views: the
    output's column sums, (1ᵀA)·B_j + m·bias_j, and ‖A‖_F·‖B_j‖ + √m·|bias_j|."""
    (c, ct), (a, at), (b, bt) = views
    m = a.shape[1] if at else a.shape[0]
    p = a.shape[0] if at else a.shape[1]
    q = b.shape[0] if bt else b.shape[1]
    lhs = np.zeros(q)
    (_sums_cols if ct else _sums_rows)(c, lhs)
    s = np.zeros(p)
    sq = (_sums_sq_cols if at else _sums_sq_rows)(a, s)
    rhs, nsq = np.zeros(q), np.zeros(q)
    (_dots_cols if bt else _dots_rows)(b, s, rhs, nsq)
    scale = math.sqrt(sq) * np.sqrt(nsq)
    if bias is not None:
        bd = bias.detach().double().numpy()
        rhs += m * bd
        scale += math.sqrt(m) * np.abs(bd)
    return lhs, rhs, scale


def warm(dtypes=(np.float32,)) -> None:
    """Compile (or load from Numba's cache) every kernel for `dtypes`, before a training step would
    pay for it (about 0.2 s a dtype from the cache; a float64 training's first check loads its own)."""
    for dtype in dtypes:
        x, s, out, out2 = np.ones((2, 3), dtype), np.ones(3), np.zeros(3), np.zeros(3)
        _sums_rows(x, out)
        _sums_cols(x.T.copy(), out)
        _sums_sq_rows(x, out)
        _sums_sq_cols(x.T.copy(), out)
        _dots_rows(x.T.copy(), s, out, out2)
        _dots_cols(x, s, out, out2)
