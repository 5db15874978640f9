"""How two tensors differ, and what kind of fault that suggests: the drill's numeric diff.

`signature(a, b)` takes the same tensor (a boundary's or an op's output) from run A and run B and
measures the difference on raw element words, so it agrees with the digests: an element differs
when its bytes differ (+0 against -0 differs, two NaN with the same bits do not). It reports how
many elements differ and where (`first_indices`, a coarse `heatmap`), how much (`max_abs`,
`max_rel`, `max_ulp`), which bits (`bits`: bit position -> count over the XOR of the differing
elements' words, 0 = the least significant bit of the element's integer word) and a `kind` with a
one-line `reading`. `load_bytes` turns a drill's raw bytes file back into a tensor.

Definitions (`backend/numeric_diff.py` computes them, this module classifies):
- `max_abs` = max |a - b| and `max_rel` = max |a - b| / max(|a|, |b|) (symmetric: neither run
  is the reference; 0 where both are zero, so never a division by zero, at most 2), both in
  float64 over the differing elements whose values can be compared: finite on both sides (two NaN
  count as equal values). An element that is non-finite on one side only is counted in
  `nonfinite_differing` instead; `nan_a`, `inf_a` ... count non-finite values over the whole tensor.
- `max_ulp` (floats only) = the distance in units in the last place, the count of representable
  values between a and b, through the ordered-integer trick (the sign-magnitude word mapped to a
  monotone integer; +0 and -0 are 0 apart), over the same elements. Integers and bool have none.
  `max_ulp_rms` = max_abs in ULPs of the RMS of both tensors' finite values: a reduction's
  rounding scales with its inputs, so an element that cancelled to near zero can be thousands of
  its own ULPs off after a mere reordering while staying a few ULPs of the tensor's typical value.

Kinds, the first that applies (thresholds at the top of the code; `elements` = differing ones):
- `structure`       one side has no tensor (the caller passes None);
- `shape`           the shapes differ; with as many elements, the two are also compared in
                    row-major order (`flat_kind` names what that comparison would be);
- `dtype`           the dtypes differ; compared as float64, and `max_ulp` counted in the
                    narrower float dtype (`ulp_dtype`), so 0 there means one side is the other
                    rounded: a precision change;
- `identical`       every element word is equal;
- `permutation`     the differing elements hold the same multiset of words in another order
                    (the reading says when whole rows of the last dimension moved);
- `bit_flip`        every differing element differs in exactly one bit, and they are few: at most
                    FEW_ELEMENTS (4) and at most FEW_FRACTION (10%) of the tensor (one element
                    always counts). A flip of a float's lowest two mantissa bits (at most 2
                    ULP) is also what a rounding difference looks like; the reading says so;
- `few_ulp`         floats, nothing non-finite on one side only, and max_ulp or max_ulp_rms <=
                    FEW_ULP[dtype] (64 for float32/float64, 16 float16, 8 bfloat16, 2 float8), in
                    any number of elements;
- `multi_bit_flip`  few elements (as for bit_flip), each differing in at most FEW_BITS (4) bits,
                    and not ULP-close;
- `large`           anything else: a logic change (the reading adds when the relative difference
                    stays at the level of a lower-precision kernel, TF32 or bfloat16).
Readings of few_ulp and large add when nearly every differing element moved one way (B greater,
or larger in magnitude, in >= 95% of at least 16): rounding noise goes both ways, a changed
constant or scale does not (`finite_differing`, `b_greater`, `b_smaller`, `b_greater_abs` and
`b_smaller_abs` hold the counts).

Why those numbers: a float32 reduction summed in another order typically lands 1 to 16 ULP away
(of the tensor's RMS value; thousands of its own ULPs where a sum cancels to near zero: a
measured case in the tests); 64 ULP is still 2^-17 relative, while a logic change such as x * 1.5 is
millions of ULP. Narrow dtypes are rounded from float32 accumulators, so their reorder noise is 1
or 2 of their (much larger) ULPs; 8 bfloat16 ULP is already 6% relative. Hardware faults flip one
bit (sometimes a few adjacent ones) in one word or a handful, independently of the tensor's size;
the same bit in every element of a tensor (x against -x) is a logic change, hence the caps (the
fraction one for small tensors: 2 of 8 elements with their sign flipped is no hardware fault).

Besides the contract's fields: `compared` ("bitwise", "float64" or None), `first_values` and
`first_words` ([a, b] at first_indices; non-finite values as "nan", "inf", "-inf", so the dict is
strict JSON), `bit_fields` (bits per sign/exponent/mantissa), `bits_per_element_max`,
`max_ulp_rms`, `ulp_dtype`, `nonfinite_differing`, `flat_kind`, and the heat map's `bin_rows` and
`bin_cols` (tensor rows and columns per cell; the 2-D view is [prod(shape[:-1]), shape[-1]], a
vector or scalar one row). Every key is always present, None where it does not apply.

What it does not know: which side is right, what the tensor means, or anything about the code
that made it. Complex tensors are compared as their real view (a trailing dimension of 2, real
and imaginary). Tensors are moved to the CPU; the drill's are bounded in size.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bitguard.backend.numeric_diff import Diff, FloatLayout, diff_bitwise, diff_cast, diff_none
from bitguard.errors import BadInput, NotSupported

FEW_ELEMENTS = 4  # bit_flip / multi_bit_flip: at most this many differing elements ...
FEW_FRACTION = 0.1  # ... and at most this fraction of the tensor (a single element always counts)
FEW_BITS = 4  # multi_bit_flip: at most this many differing bits in each element
FEW_ULP = {64: 64, 32: 64, 16: 16, 8: 2}  # few_ulp: max ULP distance by the float's width in bits ...
FEW_ULP_BFLOAT16 = 8  # ... (bfloat16 has float16's width and 3 fewer mantissa bits)
LOW_PRECISION_REL = 2.0**-7  # large: relative differences below this read as a lower-precision kernel too

_WHY = {
    "bit_flip": "a hardware SDC or memory fault is likely",
    "multi_bit_flip": "memory corruption or a hardware fault in a few words is likely",
    "few_ulp": "reduction order, a nondeterministic kernel or a precision change",
    "permutation": "a permutation or indexing change",
    "large": "a logic change",
}


def load_bytes(path: str | Path, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor whose logical row-major bytes `path` holds (as bitguard.cuda.tensor_bytes wrote
    them), of `dtype` named as bitguard records it ("float32", "bfloat16", "int64", "bool" ...)."""
    dt = getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype):
        raise BadInput(
            f"{path}: unknown dtype {dtype!r}; expected a torch dtype name as bitguard records it "
            "(float32, bfloat16, int64, bool ...)"
        )
    shape = [int(s) for s in shape]
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        why = exc.strerror or exc
        raise BadInput(f"cannot read tensor bytes {path}: {why}; re-run the drill to write them again") from exc
    itemsize = torch.empty(0, dtype=dt).element_size()
    need = math.prod(shape) * itemsize
    if len(data) != need:
        raise BadInput(
            f"{path} holds {len(data)} bytes, but {dtype} {shape} needs {need}: the file is truncated "
            "or the trace's dtype or shape is wrong; re-run the drill"
        )
    if need == 0:
        return torch.empty(shape, dtype=dt)
    try:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)
    except RuntimeError as exc:
        raise NotSupported(
            f"{path}: cannot rebuild a {dtype} tensor from raw bytes ({exc}); compare its digests only"
        ) from exc


def signature(
    a: torch.Tensor | None, b: torch.Tensor | None, *, first: int = 8, heatmap: tuple[int, int] = (16, 32)
) -> dict:
    """The numeric diff and fault signature of run A's tensor `a` against run B's `b` (None: that
    side has no such tensor). `first` differing elements are listed; the heat map has at most
    `heatmap` = (rows, cols) cells. Every key is always present (None where it does not apply)."""
    a, b = (None if t is None else _plain(t) for t in (a, b))
    first = max(0, int(first))
    meta = {
        "dtype_a": _dtype(a), "dtype_b": _dtype(b),
        "shape_a": None if a is None else list(a.shape), "shape_b": None if b is None else list(b.shape),
    }
    if a is None or b is None:
        present = a if b is None else b
        d = diff_none(None if present is None else present.numel())
        return _result("structure", _reading_structure(a, b), d, meta)
    if a.shape != b.shape:
        if a.numel() != b.numel():
            d = diff_none(max(a.numel(), b.numel()))
            reading = (
                f"shapes differ (A {meta['shape_a']}, B {meta['shape_b']}: {a.numel()} against {b.numel()} "
                "elements); no element-wise comparison"
            )
            return _result("shape", reading, d, meta)
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        measure = diff_bitwise if a.dtype == b.dtype else diff_cast
        d = measure(flat_a, flat_b, first, heatmap)
        inner = _classify(d) if a.dtype == b.dtype else ("identical" if d.differing == 0 else "dtype")
        what = "the elements are equal: a reshape or view change" if inner == "identical" else _what(inner, d)
        if inner in _WHY:
            what += f": {_WHY[inner]}"
        head = f"shapes differ (A {meta['shape_a']}, B {meta['shape_b']}, {d.total} elements each)"
        reading = f"{head}; in row-major order {what}"
        return _result("shape", reading, d, meta, flat_kind=inner)
    if a.dtype != b.dtype:
        d = diff_cast(a, b, first, heatmap)
        return _result("dtype", _reading_dtype(d, meta), d, meta)
    d = diff_bitwise(a, b, first, heatmap)
    kind = _classify(d)
    if kind == "identical":
        return _result(kind, f"identical: all {d.total} elements are bitwise equal", d, meta)
    why = _WHY[kind]
    if kind == "large" and d.nonfinite_differing:
        why = "a logic change or an overflow"
    if kind == "bit_flip" and _rounding_sized(d):
        why = "a rounding difference (reduction order, another kernel) is as likely as a hardware SDC"
    if kind == "large" and d.nonfinite_differing == 0 and d.max_rel is not None and d.max_rel < LOW_PRECISION_REL \
            and d.layout is not None:
        why = "a logic change, or a lower-precision kernel"  # (the reading says why: below 2^-7 relative)
    if kind == "few_ulp" and d.one_way():
        why = "a changed constant or scale, or a precision change (reduction-order noise goes both ways)"
    return _result(kind, f"{_what(kind, d)}: {why}", d, meta)


def few_ulp_limit(lay: FloatLayout) -> int:
    """The largest ULP distance `few_ulp` accepts in this float format."""
    if lay.name == "bfloat16":
        return FEW_ULP_BFLOAT16
    return FEW_ULP.get(lay.bits, 2 if lay.bits < 16 else 64)


def _classify(d: Diff) -> str:
    """The kind of a same-dtype, same-shape (or flattened) difference; see the module docstring."""
    if d.differing == 0:
        return "identical"
    if d.permuted:
        return "permutation"
    few = d.differing == 1 or (d.differing <= FEW_ELEMENTS and d.differing <= FEW_FRACTION * d.total)
    if few and d.popcount_max == 1:
        return "bit_flip"
    lay = d.layout
    if lay is not None and d.nonfinite_differing == 0 and _ulp_close(d, lay):
        return "few_ulp"
    if few and d.popcount_max <= FEW_BITS:
        return "multi_bit_flip"
    return "large"


def _rounding_sized(d: Diff) -> bool:
    """A float difference only in the lowest two mantissa bits and at most 2 ULP: what a
    rounding difference looks like as much as a flipped bit."""
    return d.layout is not None and all(int(p) < 2 for p in d.bits) and d.max_ulp is not None and d.max_ulp <= 2


def _ulp_close(d: Diff, lay: FloatLayout) -> bool:
    """max_ulp, or the difference in ULPs of the tensors' RMS value, within few_ulp's limit."""
    limit = few_ulp_limit(lay)
    return any(u is not None and u <= limit for u in (d.max_ulp, d.max_ulp_rms))


def _what(kind: str, d: Diff) -> str:
    """What differs, for the reading (without the why)."""
    where = f"{d.differing} of {d.total} elements"
    if kind == "permutation":
        moved = "; whole rows of the last dimension moved" if d.rows_permuted else ""
        return f"the same values in another order ({where} moved{moved})"
    if kind == "bit_flip":
        each = "one element" if d.differing == 1 else f"each of {d.differing} elements"
        ulp = f", {d.max_ulp} ULP" if _rounding_sized(d) else ""
        return f"one bit differs in {each} of {d.total} ({_bit_list(d)}{ulp})"
    if kind == "multi_bit_flip":
        ulp = f", {d.max_ulp} ULP" if d.max_ulp is not None else ""
        each = "differs in" if d.differing == 1 else "differ in up to"
        bits = f"{d.popcount_max} bits{'' if d.differing == 1 else ' each'}"
        return f"{where} {each} {bits} ({_bit_list(d)}; not ULP-close{ulp})"
    if kind == "few_ulp":
        if d.max_ulp == 0:
            return f"{where} differ by 0 ULP: only signed zeros or NaN payloads differ"
        if d.max_ulp is not None and d.max_ulp <= few_ulp_limit(d.layout):
            text = f"{where} differ by at most {d.max_ulp} ULP (max rel {_g(d.max_rel)})"
        else:
            text = (
                f"{where} differ by at most {_g(d.max_ulp_rms)} ULP of the tensor's RMS value "
                f"({d.max_ulp} ULP element-wise, where values cancelled to near zero; max abs {_g(d.max_abs)})"
            )
        if d.one_way():
            text += f"; nearly all one way ({d.one_way()})"
        return text
    if kind == "dtype":
        return f"{where} differ (max abs {_g(d.max_abs)}, max rel {_g(d.max_rel)})"
    # large
    parts = [f"{where} differ"]
    if d.max_abs is not None:
        ulp = f", {d.max_ulp} ULP" if d.max_ulp is not None else ""
        parts.append(f"up to {_g(d.max_abs)} (max rel {_g(d.max_rel)}{ulp})")
    if d.nonfinite_differing:
        parts.append(f"{d.nonfinite_differing} non-finite on one side only")
    if d.one_way():
        parts.append(f"nearly all one way ({d.one_way()})")
    text = ", ".join(parts)
    if d.layout is not None and d.nonfinite_differing == 0 and d.max_rel is not None and d.max_rel < LOW_PRECISION_REL:
        text += "; relative differences stay below 2^-7, as a lower-precision kernel (TF32, bfloat16 autocast)"
        text += " gives them"
    return text


def _reading_dtype(d: Diff, meta: dict) -> str:
    head = f"dtypes differ (A {meta['dtype_a']}, B {meta['dtype_b']})"
    if d.differing == 0:
        return f"{head}; all {d.total} values are equal as float64: only the dtype changed"
    text = f"{head}; as float64, {_what('dtype', d)}"
    if d.ulp_dtype is None or d.max_ulp is None:
        return text + ": a dtype change, and with it the values"
    if d.max_ulp == 0:
        return text + f"; rounded to {d.ulp_dtype} both sides are equal: a precision change"
    ulps = f"{d.max_ulp} ULP ({_g(d.max_ulp_rms)} of the RMS value)"
    if d.nonfinite_differing == 0 and _ulp_close(d, d.ulp_layout):
        return f"{text}; rounded to {d.ulp_dtype} within {ulps}: a precision change (and rounding order)"
    return f"{text}; rounded to {d.ulp_dtype} still {ulps} apart: more than a precision change (a logic change too)"


def _reading_structure(a, b) -> str:
    if a is None and b is None:
        return "neither run has this tensor"
    side, other = ("A", "B") if b is None else ("B", "A")
    return f"only run {side} has this tensor (run {other} has none here): an op or tensor added or removed"


def _bit_list(d: Diff) -> str:
    """The differing bit positions, by float field: "exponent bit 30", "mantissa bits 0, 1; sign bit 31"."""
    positions = sorted(int(p) for p in d.bits)
    groups: dict[str, list[int]] = {}
    for p in positions[:8]:
        groups.setdefault("" if d.layout is None else d.layout.field(p) + " ", []).append(p)
    text = "; ".join(f"{name}bit{'s' if len(ps) > 1 else ''} {', '.join(map(str, ps))}" for name, ps in groups.items())
    return text + (f" and {len(positions) - 8} more" if len(positions) > 8 else "")


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _result(kind: str, reading: str, d: Diff, meta: dict, flat_kind: str | None = None) -> dict:
    out = {"kind": kind, "reading": reading}
    out.update(d.to_dict())
    out.update(meta)
    out["flat_kind"] = flat_kind
    return out


def _dtype(t) -> str | None:
    return None if t is None else str(t.dtype).removeprefix("torch.")


def _plain(t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BadInput(f"signature compares tensors (or None for a missing one), got {type(t).__name__}")
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise NotSupported(
            f"signature compares dense strided tensors, got a {t.layout} one; "
            "pass its dense form (to_dense(), int_repr())"
        )
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.cpu().contiguous()


