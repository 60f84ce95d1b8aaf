"""MXFP4 weights (OCP Microscaling Formats v1.0): FP4 E2M1 elements sharing an E8M0 scale per 32.

A weight W of shape (N, K) is stored as
  w_fp4   (N, K/2)  uint8: element 2i in the low nibble of byte i, element 2i+1 in the high one;
                    a nibble is sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0):
                    magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
  w_scale (N, K/32) uint8: E8M0, value 2^(e - 127); e = 255 is NaN.

Quantisation follows the spec's conversion: the shared exponent of a block is
floor(log2(amax)) - 2 (2 being the largest E2M1 exponent), clamped to the E8M0 range, and each
element w / 2^shared is rounded to the nearest E2M1 value, ties to even, saturating at +-6.
Choices the spec leaves open: an all-zero block gets e = 0 (scale 2^-127, the smallest; any scale
decodes it to zeros); a block holding NaN or +-Inf gets the NaN scale (e = 255) and zero codes;
negative values that round to zero are stored as +0. The arithmetic is fp32 (fp64 for a float64
weight, whose exponents can exceed fp32's and are clamped to E8M0's instead of overflowing).

These are plain torch functions: vectorised, on whatever device the tensors live.
"""

from __future__ import annotations

import torch

from .constants import BLOCK, E2M1_EMAX, E2M1_VALUES, E8M0_BIAS, E8M0_NAN


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise an (N, K) floating-point weight, K a multiple of 32: (w_fp4, w_scale)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize_mxfp4 expects a tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"quantize_mxfp4 expects a 2-D (N, K) weight; got shape {tuple(w.shape)}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"quantize_mxfp4 expects a floating-point weight; got {w.dtype}")
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"quantize_mxfp4: K = {K} is not a multiple of {BLOCK} (the MX block)")
    x = (w.double() if w.dtype == torch.float64 else w.float()).reshape(N, K // BLOCK, BLOCK)
    finite = torch.isfinite(x).all(-1, keepdim=True)
    x = torch.where(finite, x, 0.0)
    amax = x.abs().amax(-1, keepdim=True)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = (exp - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    shared = torch.where(amax > 0, shared, -E8M0_BIAS)
    v = (x * torch.exp2(-shared.to(x.dtype))).abs().clamp_max(6.0)  # exact: a power of two
    # Round half to even on the grid: spacing 0.5 below 2, 1 below 4, 2 up to 6. The multiple
    # of the spacing has the parity of the code, so torch.round's ties-to-even is the spec's.
    step = torch.where(v < 2, 0.5, torch.where(v < 4, 1.0, 2.0))
    mag = torch.round(v / step) * step
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    code = code | torch.where((x < 0) & (code > 0), 8, 0).to(torch.uint8)
    code = code.reshape(N, K)
    w_fp4 = code[:, 0::2] | (code[:, 1::2] << 4)
    e = torch.where(finite, shared + E8M0_BIAS, E8M0_NAN).to(torch.uint8).reshape(N, K // BLOCK)
    return w_fp4.contiguous(), e


def dequantize_mxfp4(w_fp4: torch.Tensor, w_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode packed MXFP4 to an (N, K) tensor of `dtype`.

    Exact wherever `dtype` can hold the value: products of an E2M1 value and a power of two are
    formed in fp32 (fp64 for a float64 result, which is exact even for 6 * 2^127).
    """
    N, K = check_packed(w_fp4, w_scale, "dequantize_mxfp4")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantize_mxfp4: dtype must be a floating-point torch.dtype (e.g. "
                        f"torch.bfloat16), got {dtype!r}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = torch.stack((w_fp4 & 15, w_fp4 >> 4), dim=-1).reshape(N, K).long()
    table = torch.tensor(E2M1_VALUES, dtype=work, device=w_fp4.device)
    values = table[codes].reshape(N, K // BLOCK, BLOCK)
    scales = scale_values(w_scale).to(work).unsqueeze(-1)
    return (values * scales).reshape(N, K).to(dtype)


def scale_values(w_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes as float32 2^(e - 127), built from the bits (2^-127 is subnormal); 255: NaN."""
    e = w_scale.to(torch.int32)
    bits = torch.where(e == 0, 1 << 22, e << 23)
    bits = torch.where(e == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def check_packed(w_fp4: torch.Tensor, w_scale: torch.Tensor, who: str) -> tuple[int, int]:
    """Validate a packed weight and its scales; (N, K) of the weight they encode."""
    for name, t in (("w_fp4", w_fp4), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise TypeError(f"{who}: {name} must be uint8 (packed MXFP4), got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{who}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if w_fp4.device != w_scale.device:
        raise ValueError(f"{who}: w_fp4 is on {w_fp4.device} but w_scale is on {w_scale.device}")
    N, K = w_fp4.shape[0], 2 * w_fp4.shape[1]
    if K % BLOCK or tuple(w_scale.shape) != (N, K // BLOCK):
        raise ValueError(f"{who}: w_fp4 of shape {tuple(w_fp4.shape)} (N={N}, K={K}) needs "
                         f"K a multiple of {BLOCK} and w_scale of shape (N, K/32) = "
                         f"({N}, {K / BLOCK:g}); got w_scale of shape {tuple(w_scale.shape)}")
    return N, K
