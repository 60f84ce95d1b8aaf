"""MXFP4 weight GEMM: `tileops.mxfp4_gemm(a, w_fp4, w_scale)`, and the format's converters."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from .format import dequantize_mxfp4, quantize_mxfp4
from .spec import MXFP4_GEMM, Mxfp4GemmSpec, Mxfp4Problem


def _fake(a: torch.Tensor, w_fp4: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    torch._check(a.dim() == 2 and w_fp4.dim() == 2, lambda: "mxfp4_gemm expects 2-D a and w_fp4")
    torch._check(a.shape[1] == 2 * w_fp4.shape[1], lambda: "mxfp4_gemm: K of a and w differ")
    return a.new_empty((a.shape[0], w_fp4.shape[0]))


_op = register(MXFP4_GEMM, "(Tensor a, Tensor w_fp4, Tensor w_scale) -> Tensor", _fake)


def mxfp4_gemm(a: torch.Tensor, w_fp4: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`a @ W.t()` for an (N, K) MXFP4 weight W = (w_fp4, w_scale) from `quantize_mxfp4`.

    a: (M, K) bfloat16 or float16, K a multiple of 32. The weight is decoded inside the kernel
    (never materialised in memory); accumulation is fp32; the output (M, N) has a's dtype.
    The GPU kernel decodes to a's dtype for the matrix units: bf16 holds every MXFP4 value
    but +-6 * 2^127; fp16 only weights within its range (|w| <= 65504, larger scales overflow).
    """
    if torch.compiler.is_compiling():
        return _op(a, w_fp4, w_scale)
    return DISPATCHER(MXFP4_GEMM, a, w_fp4, w_scale)


__all__ = ["MXFP4_GEMM", "Mxfp4GemmSpec", "Mxfp4Problem", "dequantize_mxfp4", "mxfp4_gemm",
           "quantize_mxfp4"]
