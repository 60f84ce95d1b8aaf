"""MXFP4 weight GEMM: `tileops.mxfp4_gemm(a, w_fp4, w_scale)`, and the format's converters."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from ...spec import refuse_grad
from .format import dequantize_mxfp4, quantize_mxfp4
from .packed_spec import MXFP4_GEMM_PACKED
from .prepack import PrepackedMxfp4, prepack_mxfp4
from .spec import MXFP4_GEMM, Mxfp4GemmSpec, Mxfp4Problem


def _fake(a: torch.Tensor, w_fp4: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    torch._check(a.dim() == 2 and w_fp4.dim() == 2, lambda: "mxfp4_gemm expects 2-D a and w_fp4")
    torch._check(a.shape[1] == 2 * w_fp4.shape[1], lambda: "mxfp4_gemm: K of a and w differ")
    return a.new_empty(a.shape[0], w_fp4.shape[0])


_op = register(MXFP4_GEMM, "(Tensor a, Tensor w_fp4, Tensor w_scale) -> Tensor", _fake)


def _fake_packed(a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, N: int, K: int
                 ) -> torch.Tensor:
    torch._check(a.dim() == 2 and a.shape[1] == K, lambda: "mxfp4_gemm: K of a and w differ")
    return a.new_empty(a.shape[0], N)


def _packed_impl(a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, N: int, K: int
                 ) -> torch.Tensor:
    return DISPATCHER(MXFP4_GEMM_PACKED, a, PrepackedMxfp4(words, scales, N, K))


_packed_op = register(MXFP4_GEMM_PACKED, "(Tensor a, Tensor words, Tensor scales, int N, int K) "
                      "-> Tensor", _fake_packed, impl=_packed_impl)


def mxfp4_gemm(a: torch.Tensor, w_fp4: torch.Tensor | PrepackedMxfp4,
               w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ W.t()` for an (N, K) MXFP4 weight W = (w_fp4, w_scale) from `quantize_mxfp4`, or
    W = `prepack_mxfp4(w_fp4, w_scale)` (made once at model load): the fast path, whose kernel
    decodes the weight in the registers that feed the matrix units (bf16 a, N a multiple of 16,
    K of 64; sm_90 on CUDA).

    a: (M, K) bfloat16 or float16, K a multiple of 32. The weight is decoded inside the kernel
    (never materialised in memory); accumulation is fp32; the output (M, N) has a's dtype.
    The GPU kernel decodes to a's dtype for the matrix units: bf16 holds every MXFP4 value
    but +-6 * 2^127; fp16 only weights within its range (|w| <= 65504, larger scales overflow).
    """
    if isinstance(w_fp4, PrepackedMxfp4):
        if w_scale is not None:
            raise TypeError("mxfp4_gemm(a, packed) takes no w_scale: the prepacked weight holds "
                            "its scales")
        if torch.compiler.is_compiling():
            return _packed_op(a, w_fp4.words, w_fp4.scales, w_fp4.N, w_fp4.K)
        return DISPATCHER(MXFP4_GEMM_PACKED, a, w_fp4)
    if w_scale is None:
        raise TypeError("mxfp4_gemm(a, w_fp4, w_scale): w_scale is missing (or pass the weight "
                        "from prepack_mxfp4)")
    if torch.compiler.is_compiling():
        return _op(a, w_fp4, w_scale)
    refuse_grad("mxfp4_gemm", a=a)  # before dispatch: the native warm path's key does not see it
    return DISPATCHER(MXFP4_GEMM, a, w_fp4, w_scale)


__all__ = ["MXFP4_GEMM", "MXFP4_GEMM_PACKED", "Mxfp4GemmSpec", "Mxfp4Problem", "PrepackedMxfp4",
           "dequantize_mxfp4", "mxfp4_gemm", "prepack_mxfp4", "quantize_mxfp4"]
