"""MXFP4 format (OCP Microscaling v1.0): decoding, quantisation rounding and scales, packing."""

from __future__ import annotations

import itertools

import pytest
import torch

from tileops import dequantize_mxfp4, quantize_mxfp4
from tileops.ops.mxfp4.format import E2M1_VALUES

GRID = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)


def pack(codes: list[int]) -> torch.Tensor:
    """One row of packed codes (element 2i in the low nibble), as the format stores them."""
    c = torch.tensor(codes, dtype=torch.uint8)
    return (c[0::2] | (c[1::2] << 4)).reshape(1, -1)


def block(values: list[float]) -> torch.Tensor:
    """A 1 x 32 weight: the values, then zeros."""
    return torch.tensor([values + [0.0] * (32 - len(values))], dtype=torch.float64)


def nearest_even(v: float) -> float:
    """Brute force: the E2M1 magnitude nearest |v| (saturating), ties to the even code."""
    d = (GRID - min(abs(v), 6.0)).abs()
    best = [i for i in range(8) if d[i] == d.min()]
    return float(GRID[min(best, key=lambda i: i % 2)])


def test_every_code_decodes():
    codes = list(range(16)) * 2
    out = dequantize_mxfp4(pack(codes), torch.tensor([[127]], dtype=torch.uint8), torch.float32)
    assert out[0].tolist() == [E2M1_VALUES[c] for c in codes]
    assert out[0, :8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.equal(out[0, 8:16], -out[0, :8])
    assert torch.signbit(out[0, 8])  # code 8 is -0


@pytest.mark.parametrize(("e", "value"), [(0, 2.0**-127), (1, 2.0**-126), (126, 0.5),
                                          (127, 1.0), (128, 2.0), (254, 2.0**127)])
def test_extreme_scales(e, value):
    scale = torch.tensor([[e]], dtype=torch.uint8)
    out = dequantize_mxfp4(pack(list(range(16)) * 2), scale, torch.float64)
    assert out[0, :16].tolist() == [v * value for v in E2M1_VALUES]  # exact, 6 * 2^127 included
    out32 = dequantize_mxfp4(pack([2, 1] * 16), scale, torch.float32)
    assert out32[0, 0].item() == value and out32[0, 1].item() == value / 2
    assert dequantize_mxfp4(pack([2] * 32), scale, torch.bfloat16)[0, 0].item() == value


def test_nan_scale():
    out = dequantize_mxfp4(pack(list(range(16)) * 2), torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(out).all()


@pytest.mark.parametrize("shift", [-3, 0, 5])
def test_round_to_nearest_even_relative_to_the_scale(shift):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    s = 2.0**shift
    w = block([6.0 * s] + [t * s for t in ties] + [-t * s for t in ties])
    fp4, scale = quantize_mxfp4(w)
    assert scale.item() == 127 + shift  # amax 6 * 2^shift: shared exponent 2 + shift - 2
    out = dequantize_mxfp4(fp4, scale, torch.float64)[0]
    assert out[1:8].tolist() == [x * s for x in expected]
    assert out[8:15].tolist() == [-x * s for x in expected]


def test_saturation_at_six():
    w = block([7.9, -7.5, 6.5, 6.0])  # amax < 8: shared exponent 0, so 7.9 -> 6, not 8
    fp4, scale = quantize_mxfp4(w)
    assert scale.item() == 127
    assert dequantize_mxfp4(fp4, scale, torch.float64)[0, :4].tolist() == [6.0, -6.0, 6.0, 6.0]


def test_shared_exponent_is_floor_log2_amax_minus_two():
    for amax, e in [(1.0, 125), (1.9, 125), (2.0, 126), (6.0, 127), (7.99, 127), (8.0, 128),
                    (2.0**-100, 25)]:
        assert quantize_mxfp4(block([amax, amax / 3]))[1].item() == e


def test_scale_clamped_to_e8m0_range():
    tiny = quantize_mxfp4(block([1e-40]).float())  # fp32 subnormal: exponent below -127
    assert tiny[1].item() == 0
    huge_fp4, huge_scale = quantize_mxfp4(block([2.0**200, -(2.0**200)]))
    assert huge_scale.item() == 254
    assert dequantize_mxfp4(huge_fp4, huge_scale, torch.float64)[0, :2].tolist() == [
        6 * 2.0**127, -6 * 2.0**127]


def test_zero_and_non_finite_blocks():
    w = torch.zeros(3, 64)
    w[1, 3], w[2, 40] = float("nan"), float("inf")
    fp4, scale = quantize_mxfp4(w)
    assert scale.tolist() == [[0, 0], [255, 0], [0, 255]]  # all-zero block: e = 0 (2^-127)
    out = dequantize_mxfp4(fp4, scale, torch.float32)
    assert (out[0] == 0).all() and torch.isnan(out[1, :32]).all() and (out[1, 32:] == 0).all()
    assert torch.isnan(out[2, 32:]).all()


def test_nibble_order():
    fp4, scale = quantize_mxfp4(block([1.0, 6.0, -0.5, 3.0]))  # codes 2, 7, 9, 5
    assert scale.item() == 127
    assert fp4.shape == (1, 16) and fp4.dtype == torch.uint8
    assert fp4[0, :2].tolist() == [0x72, 0x59]


def test_round_trip_matches_brute_force_nearest():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=gen, dtype=torch.float64)
    w *= torch.exp2(torch.randint(-20, 20, (8, 8, 1), generator=gen).double()).repeat_interleave(
        32, 1).reshape(8, 256)
    fp4, scale = quantize_mxfp4(w)
    assert fp4.shape == (8, 128) and scale.shape == (8, 8)
    out = dequantize_mxfp4(fp4, scale, torch.float64)
    s = torch.exp2(scale.double() - 127).repeat_interleave(32, 1)
    for i, j in itertools.product(range(8), range(0, 256, 7)):
        v = w[i, j].item() / s[i, j].item()
        assert out[i, j].item() == pytest.approx(
            nearest_even(v) * s[i, j].item() * (1 if v >= 0 else -1), rel=0, abs=0)
    # The format's error bound: half a grid step at the element's magnitude, or the saturation.
    v = (w / s).abs()
    step = torch.where(v < 2, 0.5, torch.where(v < 4, 1.0, 2.0))
    bound = torch.where(v <= 6, step / 2, v - 6) * s
    assert ((out - w).abs() <= bound).all()
    assert ((out - w).norm() / w.norm()).item() < 0.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_input_dtypes(dtype):
    w = torch.randn(4, 64).to(dtype)
    fp4, scale = quantize_mxfp4(w)
    ref = quantize_mxfp4(w.double())
    assert torch.equal(fp4, ref[0]) and torch.equal(scale, ref[1])


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: quantize_mxfp4(torch.randn(4, 48)), ValueError, "multiple of 32"),
        (lambda: quantize_mxfp4(torch.randn(64)), ValueError, "2-D"),
        (lambda: quantize_mxfp4(torch.ones(4, 32, dtype=torch.int32)), TypeError, "floating"),
        (lambda: quantize_mxfp4([[1.0]]), TypeError, "tensor"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(4, 2, dtype=torch.uint8)), ValueError, r"\(4, 1\)"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(4, 1)), TypeError, "w_scale must be uint8"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.int8),
                                  torch.zeros(4, 1, dtype=torch.uint8)), TypeError, "w_fp4"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 8, dtype=torch.uint8),
                                  torch.zeros(4, 1, dtype=torch.uint8)), ValueError, "K=16"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8),
                                  torch.zeros(4, 1, dtype=torch.uint8, device="meta")),
         ValueError, "meta"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
