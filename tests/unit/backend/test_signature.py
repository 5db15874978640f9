"""The numeric diff and fault signature (backend/signature.py) on constructed tensor pairs: each
kind from a pair built to show it, the measurements against a plain reference on the same pair,
and load_bytes against the bytes the recorder writes."""

from __future__ import annotations

import json
import math
import struct
import warnings

import pytest
import torch

from bitguard.backend.signature import load_bytes, signature
from bitguard.cuda.tensor_bytes import tensor_bytes
from bitguard.errors import BadInput

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flip(t: torch.Tensor, flat: int, *bits: int) -> torch.Tensor:
    """A copy of `t` with the given bits of element `flat` (row-major) flipped."""
    out = t.clone()
    words = out.view(-1).view(_INT[t.element_size()])
    for bit in bits:
        words[flat] ^= torch.tensor(1, dtype=words.dtype) << bit
    return out


def _ulps(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`t` moved k ULP away from zero, element by element (k >= 0 word steps, same sign)."""
    out = t.clone()
    words = out.view(-1).view(_INT[t.element_size()])
    words += k.to(words.dtype).reshape(-1)
    return out


def _randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _json(sig: dict) -> dict:
    """The signature goes into a JSON document: strict JSON (no NaN or Infinity) must round-trip."""
    return json.loads(json.dumps(sig, allow_nan=False))


@pytest.mark.parametrize(("bit", "field"), [(3, "mantissa"), (22, "mantissa"), (27, "exponent"), (31, "sign")])
def test_one_flipped_bit_float32(bit, field):
    x = _randn(8, 64)
    s = _json(signature(x, _flip(x, 100, bit)))
    assert s["kind"] == "bit_flip", s["reading"]
    assert s["elements_differing"] == 1 and s["elements_total"] == 512
    assert s["fraction"] == 1 / 512
    assert s["first_indices"] == [[1, 36]]
    assert s["bits"] == {str(bit): 1}
    assert s["bit_fields"][field] == 1 and sum(s["bit_fields"].values()) == 1
    assert f"({field} bit {bit})" in s["reading"] and "SDC" in s["reading"]
    assert s["first_words"][0][0] == f"{x.view(-1).view(torch.int32)[100].item() & 0xFFFFFFFF:08x}"


def test_double_flip_in_two_elements_is_a_bit_flip_in_two():
    x = _randn(16, 32)
    y = _flip(_flip(x, 7, 12), 300, 29)
    s = signature(x, y)
    assert s["kind"] == "bit_flip", s["reading"]
    assert s["elements_differing"] == 2
    assert s["bits"] == {"12": 1, "29": 1}
    assert s["first_indices"] == [[0, 7], [9, 12]]
    assert "each of 2 elements" in s["reading"]


def test_lowest_bit_flip_says_it_is_also_one_ulp():
    x = _randn(1000)
    s = signature(x, _flip(x, 5, 0))
    assert s["kind"] == "bit_flip" and s["max_ulp"] == 1
    assert "mantissa bit 0, 1 ULP" in s["reading"] and "rounding difference" in s["reading"]
    assert "rounding" not in signature(x, _flip(x, 5, 2))["reading"]  # 4 ULP: no longer rounding-sized


def test_the_same_bit_in_every_element_is_a_logic_change_not_a_flip():
    x = _randn(4, 32)
    s = signature(x, -x)  # every element differs in its sign bit only
    assert s["bits"] == {"31": 128} and s["bits_per_element_max"] == 1
    assert s["kind"] == "large", s["reading"]


def test_a_flip_is_few_elements_of_the_tensor():
    x = _randn(100)
    assert signature(x, _flip(_flip(x, 1, 25), 2, 25))["kind"] == "bit_flip"  # 2 of 100
    x = _randn(16)
    s = signature(x, _flip(_flip(x, 1, 31), 2, 31))  # 2 of 16: over FEW_FRACTION
    assert s["kind"] == "large", s["reading"]


def test_a_few_bits_in_one_element_is_a_multi_bit_flip():
    x = _randn(32, 32)
    s = signature(x, _flip(x, 513, 20, 21, 22))
    assert s["kind"] == "multi_bit_flip", s["reading"]
    assert s["bits"] == {"20": 1, "21": 1, "22": 1} and s["bits_per_element_max"] == 3
    assert s["max_ulp"] > 64


def test_rows_swapped_are_a_permutation_of_rows():
    x = _randn(6, 16)
    y = x[[0, 4, 2, 3, 1, 5]].contiguous()
    s = signature(x, y)
    assert s["kind"] == "permutation", s["reading"]
    assert s["elements_differing"] == 32
    assert "whole rows" in s["reading"]
    assert [i[0] for i in s["first_indices"]] == [1] * 8


def test_a_shuffled_vector_is_a_permutation():
    x = _randn(500)
    y = x[torch.randperm(500, generator=torch.Generator().manual_seed(1))]
    s = signature(x, y)
    assert s["kind"] == "permutation", s["reading"]
    assert "whole rows" not in s["reading"]


def test_two_swapped_neighbours_one_bit_apart_read_as_permutation():
    x = _randn(300)
    x[1] = x[0]
    x = _flip(x, 1, 0)  # x[1] is x[0] with its lowest bit flipped
    y = x.clone()
    y[0], y[1] = x[1], x[0]
    assert signature(x, y)["kind"] == "permutation"


def test_few_ulp_noise_over_many_elements():
    x = _randn(64, 64)
    k = torch.randint(0, 4, x.shape, generator=torch.Generator().manual_seed(2))
    s = signature(x, _ulps(x, k))
    assert s["kind"] == "few_ulp", s["reading"]
    assert s["max_ulp"] == 3
    assert s["elements_differing"] == int((k > 0).sum())
    assert s["max_rel"] < 4 * 2.0**-23


def test_a_sum_in_another_order_is_few_ulp():
    x = _randn(256, 1024, seed=3)
    forward = x.sum(1)
    backward = torch.zeros(256)
    for chunk in reversed(x.split(16, dim=1)):  # the same sum, accumulated from the other end
        backward += chunk.sum(1)
    s = signature(forward, backward)
    assert s["elements_differing"] > 25, "the two orders should round differently in many rows"
    assert s["kind"] == "few_ulp", s["reading"]
    assert s["max_ulp"] > 64, "some rows cancel to near zero: many of their own ULPs apart"
    assert 0 < s["max_ulp_rms"] <= 64
    assert "reduction order" in s["reading"] and "RMS" in s["reading"]


def test_float32_against_its_bfloat16_is_a_precision_change():
    x = _randn(32, 48)
    s = _json(signature(x, x.to(torch.bfloat16)))
    assert s["kind"] == "dtype"
    assert (s["dtype_a"], s["dtype_b"]) == ("float32", "bfloat16")
    assert s["ulp_dtype"] == "bfloat16" and s["max_ulp"] == 0
    assert s["elements_differing"] == int((x != x.to(torch.bfloat16).float()).sum())
    assert s["max_abs"] == pytest.approx(float((x.double() - x.to(torch.bfloat16).double()).abs().max()))
    assert "precision change" in s["reading"]
    assert s["bits"] is None  # the words have different widths: no XOR


def test_a_dtype_change_with_other_values_says_more_than_precision():
    x = _randn(32, 48)
    s = signature(x, (x * 1.5).to(torch.float16))
    assert s["kind"] == "dtype" and s["ulp_dtype"] == "float16"
    assert "more than a precision change" in s["reading"]


def test_integer_against_float_dtype():
    i = torch.arange(20)
    s = signature(i, i.float())
    assert s["kind"] == "dtype" and s["elements_differing"] == 0 and s["max_ulp"] is None
    assert "only the dtype changed" in s["reading"]


def test_a_transposed_tensor_is_a_shape_change_and_a_flat_permutation():
    x = _randn(4, 8)
    s = signature(x, x.t().contiguous())
    assert s["kind"] == "shape" and s["flat_kind"] == "permutation"
    assert (s["shape_a"], s["shape_b"]) == ([4, 8], [8, 4])
    assert s["elements_total"] == 32


def test_shapes_with_other_element_counts():
    s = _json(signature(torch.zeros(4, 8), torch.zeros(4, 9)))
    assert s["kind"] == "shape" and s["elements_differing"] is None and s["heatmap"] is None
    assert "32 against 36 elements" in s["reading"]


def test_a_logic_change_is_large():
    x = _randn(16, 16) + 0.1
    s = signature(x, x * 1.5)
    assert s["kind"] == "large", s["reading"]
    assert s["max_abs"] == pytest.approx(float((x.double() * 0.5).abs().max()), rel=1e-6)
    assert s["max_rel"] == pytest.approx(1 / 3, rel=1e-6)
    assert "logic change" in s["reading"] and "lower-precision" not in s["reading"]


def test_a_logic_change_beside_largest_value_placeholders_is_large():
    """Helper 79 (pytorch-metric-learning fills the pairs a miner leaves out with finfo.max): their RMS, about
    3e38, made a 0.2 change of values near 1 "few_ulp: 9.86e-33 ULP of the tensor's RMS value"."""
    x = _randn(32, 32).abs() + 0.5
    x[:, ::2] = torch.finfo(torch.float32).max
    y = x.clone()
    y[:, 1::4] += 0.2
    s = signature(x, y)
    assert s["kind"] == "large", s["reading"]


def test_identical():
    x = _randn(3, 5, 7)
    s = _json(signature(x, x.clone()))
    assert s["kind"] == "identical" and s["elements_differing"] == 0 and s["first_indices"] == []
    assert s["bits"] == {} and s["max_abs"] is None
    assert sum(map(sum, s["heatmap"]["counts"])) == 0


@pytest.mark.parametrize("side", ["a", "b"])
def test_one_side_missing_is_structure(side):
    x = _randn(4, 4)
    s = _json(signature(None, x) if side == "a" else signature(x, None))
    assert s["kind"] == "structure"
    assert s["elements_differing"] is None and s["elements_total"] == 16
    present = "B" if side == "a" else "A"
    assert f"only run {present} has this tensor" in s["reading"]
    assert s[f"shape_{side}"] is None and s[f"dtype_{side}"] is None


def test_bfloat16_exponent_flip_and_float16_ulps():
    x = _randn(256, dtype=torch.bfloat16)
    s = signature(x, _flip(x, 9, 14))
    assert s["kind"] == "bit_flip" and s["bits"] == {"14": 1} and s["bit_fields"]["exponent"] == 1
    h = _randn(256, dtype=torch.float16)
    s = signature(h, _ulps(h, torch.randint(0, 3, (256,), generator=torch.Generator().manual_seed(4))))
    assert s["kind"] == "few_ulp" and s["max_ulp"] == 2 and s["ulp_dtype"] == "float16"


def test_bfloat16_few_ulp_limit_is_tighter_than_float32s():
    x = _randn(256, dtype=torch.bfloat16)
    assert signature(x, _ulps(x, torch.full((256,), 8)))["kind"] == "few_ulp"
    assert signature(x, _ulps(x, torch.full((256,), 20)))["kind"] == "large"
    f = _randn(256)
    assert signature(f, _ulps(f, torch.full((256,), 20)))["kind"] == "few_ulp"


def test_int64_values():
    i = torch.arange(1000, dtype=torch.int64)
    s = signature(i, _flip(i, 10, 40))
    assert s["kind"] == "bit_flip" and s["bits"] == {"40": 1} and s["max_ulp"] is None
    assert s["max_abs"] == 2.0**40 and s["bit_fields"] is None
    s = _json(signature(i, i + 7))
    assert s["kind"] == "large" and s["max_abs"] == 7 and s["max_ulp"] is None and s["nan_a"] is None
    assert s["first_values"][0] == [0, 7]


def test_bool_values():
    m = torch.arange(200) % 3 == 0
    n = m.clone()
    n[5] = ~n[5]
    s = _json(signature(m, n))
    assert s["kind"] == "bit_flip" and s["bits"] == {"0": 1} and s["first_values"] == [[False, True]]


def test_an_exponent_flip_to_infinity_is_still_a_bit_flip():
    x = torch.ones(64)
    s = _json(signature(x, _flip(x, 3, 30)))  # 1.0 = 0x3f800000; bit 30 set: 0x7f800000 = inf
    assert s["kind"] == "bit_flip"
    assert (s["inf_a"], s["inf_b"]) == (0, 1) and s["nonfinite_differing"] == 1
    assert s["max_abs"] is None and s["first_values"] == [[1.0, "inf"]]


def test_nan_on_one_side_is_large_and_json_safe():
    x = _randn(10, 10)
    y = x.clone()
    y[2] = float("nan")
    y[0, 0] += 1.0
    s = _json(signature(x, y))
    assert s["kind"] == "large", s["reading"]
    assert s["nan_b"] == 10 and s["nan_a"] == 0 and s["nonfinite_differing"] == 10
    assert s["max_abs"] == pytest.approx(1.0, abs=1e-6)
    assert "non-finite on one side only" in s["reading"]


def test_non_finite_values_in_the_same_places_are_identical():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    s = signature(x, x.clone())
    assert s["kind"] == "identical" and (s["nan_a"], s["inf_a"], s["nan_b"], s["inf_b"]) == (1, 2, 1, 2)


def test_signed_zeros_differ_but_are_zero_ulp():
    z = torch.zeros(100)
    s = signature(z, -z)
    assert s["elements_differing"] == 100 and s["max_ulp"] == 0 and s["max_abs"] == 0.0
    assert s["kind"] == "few_ulp" and "signed zeros" in s["reading"] and "one way" not in s["reading"]
    assert (s["b_greater"], s["b_smaller"], s["finite_differing"]) == (0, 0, 100)


def test_ulp_distance_across_zero_and_in_float64():
    tiny = torch.tensor([1.4e-45, 0.0])  # the smallest float32 subnormal
    assert signature(tiny, -tiny)["max_ulp"] == 2  # +1 ULP to -1 ULP through zero
    big = torch.tensor([1e300, 1.0], dtype=torch.float64)
    other = torch.tensor([-1e300, 1.0], dtype=torch.float64)
    word = struct.unpack("<q", struct.pack("<d", 1e300))[0]
    assert signature(big, other)["max_ulp"] == pytest.approx(2 * word, rel=1e-12)


def test_relative_difference_has_no_zero_division():
    a = torch.tensor([0.0, 0.0, 2.0, -0.0])
    b = torch.tensor([0.0, 1.0, 2.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = _json(signature(a, b))
    assert s["max_rel"] == 1.0 and s["max_abs"] == 1.0


def test_heatmap_counts_every_differing_element_in_its_cell():
    x = _randn(3, 7, 50)
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) < 0.3
    y = torch.where(mask, x + 1.0, x)
    s = signature(x, y)
    h = s["heatmap"]
    assert h["shape2d"] == [21, 50] and (h["bin_rows"], h["bin_cols"]) == (2, 2)
    assert (h["rows"], h["cols"]) == (11, 25)
    assert sum(map(sum, h["counts"])) == s["elements_differing"] == int(mask.sum())
    m2 = mask.reshape(21, 50)
    expected = [[int(m2[r * 2:(r + 1) * 2, c * 2:(c + 1) * 2].sum()) for c in range(25)] for r in range(11)]
    assert h["counts"] == expected


def test_heatmap_of_a_vector_and_a_scalar():
    v = _randn(1000)
    h = signature(v, _flip(v, 999, 2))["heatmap"]
    assert h["shape2d"] == [1, 1000] and (h["rows"], h["cols"]) == (1, 32) and h["counts"][0][31] == 1
    s = signature(torch.tensor(1.0), torch.tensor(2.0))
    assert s["heatmap"]["counts"] == [[1]] and s["first_indices"] == [[]]


def test_first_indices_are_the_first_differing_in_row_major_order():
    x = _randn(5, 6, 7)
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(6)) < 0.2
    s = signature(x, torch.where(mask, x * 3, x), first=5)
    assert s["first_indices"] == mask.nonzero()[:5].tolist()
    assert len(s["first_values"]) == 5


def test_complex_is_compared_as_real_pairs():
    c = torch.complex(_randn(8), _randn(8, seed=1))
    d = c.clone()
    torch.view_as_real(d)[3, 1] *= -1
    s = signature(c, d)
    assert s["kind"] == "bit_flip" and s["first_indices"] == [[3, 1]] and s["bits"] == {"31": 1}


@pytest.mark.parametrize(
    "t",
    [
        _randn(3, 5),
        _randn(4, 6).t(),  # not contiguous: tensor_bytes writes it in logical order
        _randn(7, dtype=torch.bfloat16),
        _randn(2, 3, dtype=torch.float16),
        _randn(9).to(torch.float8_e4m3fn),
        torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5),
        torch.arange(6) % 2 == 0,
        torch.complex(_randn(4), _randn(4)),
        torch.zeros(0, 3),
    ],
    ids=["float32", "transposed", "bfloat16", "float16", "float8", "int64", "bool", "complex64", "empty"],
)
def test_load_bytes_round_trips_the_recorders_bytes(tmp_path, t):
    path = tmp_path / "t.bin"
    path.write_bytes(tensor_bytes(t).numpy().tobytes())
    dtype = str(t.dtype).removeprefix("torch.")
    back = load_bytes(path, dtype, list(t.shape))
    assert back.dtype == t.dtype and list(back.shape) == list(t.shape)
    assert signature(t, back)["kind"] == "identical"
    assert torch.equal(tensor_bytes(back), tensor_bytes(t))


def test_load_bytes_refuses_bad_input(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 12)
    with pytest.raises(BadInput, match="holds 12 bytes, but float32 \\[4\\] needs 16"):
        load_bytes(path, "float32", [4])
    with pytest.raises(BadInput, match="unknown dtype 'floaty'"):
        load_bytes(path, "floaty", [3])
    with pytest.raises(BadInput, match="cannot read tensor bytes"):
        load_bytes(tmp_path / "missing.bin", "float32", [3])
    assert load_bytes(path, "float32", [3]).tolist() == [0.0, 0.0, 0.0]


def test_not_a_tensor_is_refused():
    with pytest.raises(BadInput, match="got list"):
        signature([1.0], torch.ones(1))


def test_a_small_change_all_one_way_is_few_ulp_read_as_a_changed_constant():
    x = _randn(32, 32) * 8
    a = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm with its eps changed
    b = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    s = signature(a, b)
    assert s["kind"] == "few_ulp", s["reading"]
    assert s["b_greater_abs"] == 0 and s["finite_differing"] == s["elements_differing"] > 16
    assert "B smaller in magnitude" in s["reading"] and "changed constant" in s["reading"]
    noise = signature(a, _ulps(a, torch.randint(0, 2, a.shape, generator=torch.Generator().manual_seed(7))))
    assert "one way" in noise["reading"], "moved away from zero only: one way too"
    y = _randn(64, 64, seed=8)
    k = torch.randint(-2, 3, y.shape, generator=torch.Generator().manual_seed(9))
    both = y.clone()
    both.view(torch.int32).add_(k.to(torch.int32))  # words up and down: magnitudes up and down
    s = signature(y, both)
    assert s["kind"] == "few_ulp" and "one way" not in s["reading"] and "reduction order" in s["reading"]


def test_a_lower_precision_kernel_is_large_with_a_note():
    x = _randn(64, 64)
    y = x * (1 + 2.0**-11)  # about the error of a TF32 product: thousands of float32 ULP
    s = signature(x, y)
    assert s["kind"] == "large" and "lower-precision kernel" in s["reading"], s["reading"]


def test_a_medium_tensor_is_vectorized():
    """Every element of a 4 MiB tensor differs: one pass of tensor operations, no per-element Python."""
    x = _randn(1024, 1024)
    s = signature(x, x * 1.5, first=3)
    assert s["elements_differing"] == 1024 * 1024 - int((x == 0).sum())
    assert len(s["first_indices"]) == 3 and math.isclose(s["max_rel"], 1 / 3, rel_tol=1e-6)


def test_shape_and_dtype_both_changed_compare_flat_as_float64():
    x = _randn(4, 6)
    s = signature(x, x.reshape(6, 4).to(torch.float64))
    assert s["kind"] == "shape" and s["compared"] == "float64" and s["elements_differing"] == 0
    assert "reshape or view change" in s["reading"]


def test_every_kind_has_every_key_and_is_strict_json():
    x = _randn(16, 16)
    pairs = {
        "identical": (x, x.clone()), "bit_flip": (x, _flip(x, 3, 9)), "multi_bit_flip": (x, _flip(x, 3, 9, 10)),
        "few_ulp": (x, _ulps(x, torch.ones(256))), "permutation": (x, x.flip(0)), "large": (x, x * 1.5),
        "dtype": (x, x.half()), "shape": (x, x.reshape(-1)), "structure": (x, None),
    }
    keys = None
    for kind, (a, b) in pairs.items():
        s = _json(signature(a, b))
        assert s["kind"] == kind, s["reading"]
        assert isinstance(s["reading"], str) and "\n" not in s["reading"]
        keys = keys or set(s)
        assert set(s) == keys, f"{kind}: {set(s) ^ keys}"
