"""GEMM: `tileops.gemm(a, b)`."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from .spec import GEMM, GemmProblem, GemmSpec


def _fake(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "gemm expects 2-D a and b")
    torch._check(a.shape[1] == b.shape[0], lambda: "gemm: inner dimensions differ")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)


_op = register(GEMM, "(Tensor a, Tensor b, ScalarType? out_dtype=None) -> Tensor", _fake)


def gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """`a @ b` with fp32 accumulation, through the best known TileLang kernel for the target.

    a: (M, K); b: (K, N), row-major or the transposed view `w.t()` of an (N, K) weight (used
    without a copy). CUDA takes float16 and bfloat16, the CPU also float32. The output has a's
    dtype unless `out_dtype` is given.
    """
    if torch.compiler.is_compiling():
        return _op(a, b, out_dtype)
    return DISPATCHER(GEMM, a, b, out_dtype)


__all__ = ["GEMM", "GemmProblem", "GemmSpec", "gemm"]
