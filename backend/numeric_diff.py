"""The element-wise measurements behind a fault signature: which elements of two tensors differ,
by how much, and in which bits.

`diff_bitwise` compares two tensors of one dtype and shape on their raw element words (an
element differs when its bits differ, as the digests see it); `diff_cast` compares two of
different dtypes as float64 values (and counts ULPs in the narrower float format); `diff_none`
is the empty measurement of a pair that cannot be compared element by element. All of it is
vectorized torch on the CPU: no per-element Python beyond the few first elements listed.

Definitions (max_abs, max_rel, max_ulp, the heat map) are in `backend/signature.py`'s docstring,
which also classifies the result. This module knows float formats only as bit layouts
(`FloatLayout`), nothing about what a difference means.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ONE_WAY_MIN = 16  # one_way: at least this many differing elements (noise: all 16 one way, p = 2^-15) ...
ONE_WAY_FRACTION = 0.95  # ... of which at least this fraction moved the same way


@dataclass(frozen=True)
class FloatLayout:
    """The bit fields of a float format's element word (bit 0 = least significant)."""

    name: str  # the dtype as bitguard records it
    bits: int  # the element's width
    exponent: int  # exponent bits, above the mantissa
    mantissa: int  # mantissa (fraction) bits, the lowest ones
    signed: bool = True  # the top bit is a sign bit (float8_e8m0fnu has none)

    def ulp(self, x: float) -> float:
        """The spacing of this format's values at magnitude x (subnormal spacing below the normals)."""
        lowest = 2 - 2 ** (self.exponent - 1)  # the smallest normal exponent (IEEE bias)
        e = math.frexp(abs(x))[1] - 1 if x else lowest
        return 2.0 ** (max(e, lowest) - self.mantissa)

    def field(self, position: int) -> str:
        if position < self.mantissa:
            return "mantissa"
        if position < self.mantissa + self.exponent:
            return "exponent"
        return "sign"


def _known_layouts() -> dict[torch.dtype, FloatLayout]:
    table = {
        "float64": (64, 11, 52), "float32": (32, 8, 23), "float16": (16, 5, 10), "bfloat16": (16, 8, 7),
        "float8_e4m3fn": (8, 4, 3), "float8_e4m3fnuz": (8, 4, 3),
        "float8_e5m2": (8, 5, 2), "float8_e5m2fnuz": (8, 5, 2),
    }
    out = {getattr(torch, n): FloatLayout(n, *f) for n, f in table.items() if hasattr(torch, n)}
    if hasattr(torch, "float8_e8m0fnu"):
        out[torch.float8_e8m0fnu] = FloatLayout("float8_e8m0fnu", 8, 8, 0, signed=False)
    return out


_LAYOUTS = _known_layouts()


def layout(dtype: torch.dtype) -> FloatLayout | None:
    """The bit layout of a real float dtype; None for integers, bool and complex."""
    if dtype in _LAYOUTS:
        return _LAYOUTS[dtype]
    if not dtype.is_floating_point:
        return None
    info = torch.finfo(dtype)  # a float format this table does not know: its fields from finfo
    mantissa = round(-math.log2(info.eps))
    return FloatLayout(str(dtype).removeprefix("torch."), info.bits, info.bits - 1 - mantissa, mantissa)


@dataclass
class Diff:
    """One pair's measurements. Counts are over elements (of the real view for complex)."""

    total: int  # elements compared (or, with nothing compared, the larger side's count)
    differing: int | None = None  # None: not compared element by element
    compared: str | None = None  # "bitwise" (raw words), "float64" (cast values) or None
    first_indices: list | None = None  # multi-dim indices of the first differing elements
    first_values: list | None = None  # [a, b] at those indices (non-finite as "nan", "inf", "-inf")
    first_words: list | None = None  # [a, b] raw element words in hex (bitwise only)
    max_abs: float | None = None
    max_rel: float | None = None
    max_ulp: int | None = None
    ulp_dtype: str | None = None  # the float format max_ulp counts in
    max_ulp_rms: float | None = None  # max_abs in ULPs of the tensors' RMS value (floats)
    bits: dict | None = None  # {"position": count} over the XOR of differing words (bitwise only)
    bit_fields: dict | None = None  # the same counts per float field: sign, exponent, mantissa
    popcount_max: int | None = None  # the most bits any one element differs in
    permuted: bool = False  # the differing elements hold the same multiset of words
    rows_permuted: bool = False  # ... and whole rows of the last dimension moved
    heatmap: dict | None = None
    nan_a: int | None = None  # NaN / infinite values over the whole tensor (floats only)
    nan_b: int | None = None
    inf_a: int | None = None
    inf_b: int | None = None
    nonfinite_differing: int | None = None  # differing elements non-finite on one side only
    finite_differing: int | None = None  # differing elements finite on both sides; of those:
    b_greater: int | None = None  # ... where B's value is greater than A's
    b_smaller: int | None = None  # ... smaller (neither: +0 against -0)
    b_greater_abs: int | None = None  # ... where B's magnitude is greater than A's
    b_smaller_abs: int | None = None  # ... smaller
    layout: FloatLayout | None = field(default=None, repr=False)  # the compared words' format
    ulp_layout: FloatLayout | None = field(default=None, repr=False)  # the format max_ulp counts in

    def one_way(self) -> str | None:
        """How all but a few of many differing elements moved the same way, if they did: "B greater",
        "B smaller", "B larger in magnitude" or "B smaller in magnitude". Rounding noise is unbiased
        (as often up as down); a changed constant or scale is not."""
        n = self.finite_differing or 0
        if n < ONE_WAY_MIN:
            return None
        ways = ((self.b_greater, "B greater"), (self.b_smaller, "B smaller"),
                (self.b_greater_abs, "B larger in magnitude"), (self.b_smaller_abs, "B smaller in magnitude"))
        return next((way for count, way in ways if count >= ONE_WAY_FRACTION * n), None)

    def to_dict(self) -> dict:
        fraction = None if self.differing is None else (self.differing / self.total if self.total else 0.0)
        return {
            "elements_differing": self.differing, "elements_total": self.total, "fraction": fraction,
            "compared": self.compared, "first_indices": self.first_indices, "first_values": self.first_values,
            "first_words": self.first_words, "max_abs": self.max_abs, "max_rel": self.max_rel,
            "max_ulp": self.max_ulp, "max_ulp_rms": self.max_ulp_rms, "ulp_dtype": self.ulp_dtype,
            "bits": self.bits, "bit_fields": self.bit_fields,
            "bits_per_element_max": self.popcount_max, "heatmap": self.heatmap,
            "nan_a": self.nan_a, "nan_b": self.nan_b, "inf_a": self.inf_a, "inf_b": self.inf_b,
            "nonfinite_differing": self.nonfinite_differing, "finite_differing": self.finite_differing,
            "b_greater": self.b_greater, "b_smaller": self.b_smaller,
            "b_greater_abs": self.b_greater_abs, "b_smaller_abs": self.b_smaller_abs,
        }


def diff_none(total: int | None) -> Diff:
    return Diff(total=total or 0)


def diff_bitwise(a: torch.Tensor, b: torch.Tensor, first: int, grid: tuple[int, int]) -> Diff:
    """Compare two contiguous CPU tensors of one dtype and shape on their element words."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    lay = layout(a.dtype)
    nbits = a.element_size() * 8
    wa, wb = _words(a), _words(b)
    idx = (wa != wb).nonzero().squeeze(1)
    xa, xb = wa[idx], wb[idx]
    d = Diff(a.numel(), idx.numel(), "bitwise", nonfinite_differing=0, layout=lay, ulp_layout=lay)
    d.ulp_dtype = None if lay is None else lay.name
    d.heatmap = _heatmap(idx, list(a.shape), grid)
    d.first_indices = _unravel(idx[:first], list(a.shape))
    d.first_values = _values(a.reshape(-1)[idx[:first]], b.reshape(-1)[idx[:first]], lay is not None)
    d.first_words = [[_hex(x, nbits), _hex(y, nbits)] for x, y in zip(xa[:first].tolist(), xb[:first].tolist())]
    d.bits, d.popcount_max = _bit_counts(xa ^ xb, nbits)
    if lay is not None:
        d.bit_fields = {f: 0 for f in ("sign", "exponent", "mantissa") if f != "sign" or lay.signed}
        for p, c in d.bits.items():
            d.bit_fields[lay.field(int(p))] += c
        d.nan_a, d.inf_a = _nonfinite(a)
        d.nan_b, d.inf_b = _nonfinite(b)
    # a permutation: equal word sums first (cheap, necessary), then the sorted words
    if d.differing >= 2 and int(xa.sum(dtype=torch.int64)) == int(xb.sum(dtype=torch.int64)):
        d.permuted = torch.equal(torch.sort(xa).values, torch.sort(xb).values)
        if d.permuted and a.dim() >= 2 and a.shape[-1] > 1:
            d.rows_permuted = _rows_permuted(wa, wb, a.shape[-1])
    if d.differing:
        va, vb = a.reshape(-1)[idx].double(), b.reshape(-1)[idx].double()
        _magnitudes(d, va, vb)
        if lay is not None:
            d.max_ulp = _max_ulp(xa, xb, lay, va, vb)
            d.max_ulp_rms = _ulps_of_rms(d.max_abs, lay, a, b)
    return d


def diff_cast(a: torch.Tensor, b: torch.Tensor, first: int, grid: tuple[int, int]) -> Diff:
    """Compare two tensors of different dtypes (one shape) as float64 values (complex128 as real
    pairs); max_ulp counts in the narrower of two real float formats."""
    if a.is_complex() or b.is_complex():
        va, vb = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    else:
        va, vb = a.to(torch.float64), b.to(torch.float64)
    shape = list(va.shape)
    va, vb = va.reshape(-1), vb.reshape(-1)
    idx = ((va != vb) & ~(va.isnan() & vb.isnan())).nonzero().squeeze(1)
    d = Diff(total=va.numel(), differing=idx.numel(), compared="float64", nonfinite_differing=0)
    d.heatmap = _heatmap(idx, shape, grid)
    d.first_indices = _unravel(idx[:first], shape)
    d.first_values = _values(va[idx[:first]], vb[idx[:first]], True)
    d.nan_a, d.inf_a = _nonfinite(va)
    d.nan_b, d.inf_b = _nonfinite(vb)
    la, lb = layout(a.dtype), layout(b.dtype)
    if la is not None and lb is not None:
        d.ulp_layout = min((la, lb), key=lambda lay: (lay.mantissa, lay.exponent))  # A first on a tie
        d.ulp_dtype = d.ulp_layout.name
    if d.differing:
        _magnitudes(d, va[idx], vb[idx])
        if d.ulp_layout is not None:
            narrow = a.dtype if d.ulp_layout is la else b.dtype
            na, nb = a.reshape(-1)[idx].to(narrow), b.reshape(-1)[idx].to(narrow)
            d.max_ulp = _max_ulp(_words(na), _words(nb), d.ulp_layout, na.double(), nb.double())
            d.max_ulp_rms = _ulps_of_rms(d.max_abs, d.ulp_layout, va, vb)
    return d


def _words(t: torch.Tensor) -> torch.Tensor:
    """The flat element words of a contiguous tensor, as signed integers of the element's width."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def _comparable(va: torch.Tensor, vb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite on both sides, values that can be compared: finite on both or NaN on both)."""
    finite = va.isfinite() & vb.isfinite()
    return finite, finite | (va.isnan() & vb.isnan())


def _magnitudes(d: Diff, va: torch.Tensor, vb: torch.Tensor) -> None:
    """max_abs, max_rel and nonfinite_differing over the differing elements' float64 values."""
    finite, comparable = _comparable(va, vb)
    d.nonfinite_differing = int((~comparable).sum())
    if not bool(comparable.any()):
        return
    absd = torch.where(finite, (va - vb).abs(), 0.0)
    den = torch.maximum(va.abs(), vb.abs())
    rel = torch.where(finite & (den > 0), absd / torch.where(den > 0, den, 1.0), 0.0)
    d.max_abs = float(absd[comparable].max())
    d.max_rel = float(rel[comparable].max())
    d.finite_differing = int(finite.sum())
    d.b_greater, d.b_smaller = int((finite & (vb > va)).sum()), int((finite & (vb < va)).sum())
    d.b_greater_abs = int((finite & (vb.abs() > va.abs())).sum())
    d.b_smaller_abs = int((finite & (vb.abs() < va.abs())).sum())


def _ulps_of_rms(max_abs: float | None, lay: FloatLayout, a: torch.Tensor, b: torch.Tensor) -> float | None:
    """max_abs in ULPs (of format `lay`) of the RMS of both tensors' finite values, those within half the
    format's largest value (not `finfo.max` placeholders). A reduction's
    rounding scales with its inputs, not with a result that cancelled to near zero, and the
    tensor's typical magnitude stands in for the inputs this module never sees."""
    if max_abs is None:
        return None
    squares, count = 0.0, 0
    for t in (a, b):
        v = t.reshape(-1).double()
        finite = v.isfinite()
        if t.is_floating_point():  # (nor a sentinel near the format's largest value, which a mask writes for "none":
            finite &= v.abs() < torch.finfo(t.dtype).max / 2  # an RMS of 3e38 made a 0.2 change few_ulp, helper 79)
        squares += float(torch.where(finite, v, 0.0).square().sum())
        count += int(finite.sum())
    rms = math.sqrt(squares / count) if count else 0.0
    return max_abs / lay.ulp(rms) if rms > 0 else None


def _max_ulp(xa: torch.Tensor, xb: torch.Tensor, lay: FloatLayout, va: torch.Tensor, vb: torch.Tensor) -> int | None:
    """The largest ULP distance between the words xa and xb of one float format, over the elements
    whose values (va, vb) can be compared; None when there are none."""
    _, comparable = _comparable(va, vb)
    if not bool(comparable.any()):
        return None
    nbits = xa.element_size() * 8
    wa, wb = xa.to(torch.int64), xb.to(torch.int64)  # sign-extended: negative iff the top bit is set
    if not lay.signed:
        dist = ((wa & (2**nbits - 1)) - (wb & (2**nbits - 1))).abs().double()
    else:
        low = 2 ** (nbits - 1) - 1
        ma, mb = wa & low, wb & low  # magnitudes; the ordered integer is +mag or -mag (±0 both 0)
        same = (wa < 0) == (wb < 0)
        # one sign: the magnitudes' distance; opposite signs: their sum (in float64, as 64-bit
        # words can overflow int64; exact below 2^53, which is all a classification needs)
        dist = torch.where(same, (ma - mb).abs().double(), ma.double() + mb.double())
    nan_pair = va.isnan() & vb.isnan()
    return int(torch.where(nan_pair, 0.0, dist)[comparable].max())


_BYTE_BITS = torch.tensor([[(v >> j) & 1 for j in range(8)] for v in range(256)], dtype=torch.int64)  # [256, 8]
_BYTE_POPCOUNT = _BYTE_BITS.sum(1).to(torch.uint8)


def _bit_counts(xor: torch.Tensor, nbits: int) -> tuple[dict, int]:
    """({"position": count} of set bits over the XOR words, the most bits set in one word), from
    one 256-bin histogram per byte of the word (no pass per bit)."""
    if xor.numel() == 0:
        return {}, 0
    size = nbits // 8
    octets = xor.contiguous().view(torch.uint8).reshape(-1, size)
    if sys.byteorder == "big":
        octets = octets.flip(1)  # byte k holds bits 8k .. 8k+7
    counts = {}
    for k in range(size):
        per_bit = (torch.bincount(octets[:, k], minlength=256) @ _BYTE_BITS).tolist()
        counts.update({str(8 * k + j): c for j, c in enumerate(per_bit) if c})
    popcount = torch.zeros(octets.shape[0], dtype=torch.uint8)
    for k in range(size):  # a byte column at a time: the table lookup's index is int64
        popcount += _BYTE_POPCOUNT[octets[:, k].long()]
    return counts, int(popcount.max())


def _rows_permuted(wa: torch.Tensor, wb: torch.Tensor, cols: int) -> bool:
    """Whether the rows (last dimension) that differ hold the same multiset of whole rows."""
    ra, rb = wa.view(-1, cols), wb.view(-1, cols)
    rows = (ra != rb).any(1)
    ua, ca = torch.unique(ra[rows], dim=0, return_counts=True)
    ub, cb = torch.unique(rb[rows], dim=0, return_counts=True)
    return ua.shape == ub.shape and torch.equal(ua, ub) and torch.equal(ca, cb)


def _nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, infinity count); float8 and other narrow formats are checked as float32."""
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return int(t.isnan().sum()), int(t.isinf().sum())


def shape2d(shape: list[int]) -> list[int]:
    """The 2-D view a heat map draws: [prod(shape[:-1]), shape[-1]]; a vector or scalar is one row."""
    if not shape:
        return [1, 1]
    return [math.prod(shape[:-1]), shape[-1]]


def _heatmap(idx: torch.Tensor, shape: list[int], grid: tuple[int, int]) -> dict:
    """Counts of the differing flat indices `idx` in a grid of at most `grid` cells over the 2-D view."""
    rows, cols = shape2d(shape)
    if rows * cols == 0:
        return {"rows": 0, "cols": 0, "counts": [], "shape2d": [rows, cols], "bin_rows": 1, "bin_cols": 1}
    bin_rows, bin_cols = math.ceil(rows / max(1, grid[0])), math.ceil(cols / max(1, grid[1]))
    n_rows, n_cols = math.ceil(rows / bin_rows), math.ceil(cols / bin_cols)
    cell = (idx // cols // bin_rows) * n_cols + (idx % cols) // bin_cols
    counts = torch.bincount(cell, minlength=n_rows * n_cols).reshape(n_rows, n_cols)
    return {
        "rows": n_rows, "cols": n_cols, "counts": counts.tolist(), "shape2d": [rows, cols],
        "bin_rows": bin_rows, "bin_cols": bin_cols,
    }


def _unravel(flat: torch.Tensor, shape: list[int]) -> list[list[int]]:
    out = []
    for i in flat.tolist():
        index = []
        for size in reversed(shape):
            i, r = divmod(i, size)
            index.append(r)
        out.append(index[::-1])
    return out


def _values(va: torch.Tensor, vb: torch.Tensor, is_float: bool) -> list[list]:
    if not is_float:
        return [list(p) for p in zip(va.tolist(), vb.tolist())]
    return [[_json_float(x), _json_float(y)] for x, y in zip(va.double().tolist(), vb.double().tolist())]


def _json_float(x: float):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _hex(word: int, nbits: int) -> str:
    return f"{word & (2**nbits - 1):0{nbits // 4}x}"
