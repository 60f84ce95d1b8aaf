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


def _backward(ctx, grad: torch.Tensor):
    """dA = dC B^T and dB = A^T dC, each through `gemm` itself. B^T of a `w.t()` view is the
    weight itself (no copy); when B is such a view, dB is computed as dW = dC^T A and returned
    transposed, in B's own layout."""
    a, b = ctx.saved_tensors
    grad = grad.to(a.dtype if a is not None else b.dtype)
    da = gemm(grad, b.t()) if ctx.needs_input_grad[0] else None
    db = None
    if ctx.needs_input_grad[1]:
        db = gemm(grad.t(), a).t() if ctx.b_is_transposed else gemm(a.t(), grad)
    return da, db, None


def _setup(ctx, inputs, output) -> None:
    a, b, _ = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None,
                          b if ctx.needs_input_grad[0] else None)
    ctx.b_is_transposed = b.stride(0) == 1 and b.shape[1] > 1  # w.t() of an (N, K) weight


_op = register(GEMM, "(Tensor a, Tensor b, ScalarType? out_dtype=None) -> Tensor", _fake,
               autograd=(_setup, _backward))


def gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """`a @ b` with fp32 accumulation, through the best known TileLang kernel for the target.

    a: (M, K); b: (K, N), row-major or the transposed view `w.t()` of an (N, K) weight (used
    without a copy). CUDA takes float16 and bfloat16, the CPU also float32. The output has a's
    dtype unless `out_dtype` is given. Differentiable: with an input that requires grad (grad
    mode on) the call goes through the custom op, whose backward runs `gemm` again (gradients in
    the inputs' dtype).
    """
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled()  # getattr: not tensors at all is prepare's error to give
            and (getattr(a, "requires_grad", False) or getattr(b, "requires_grad", False))):
        return _op(a, b, out_dtype)
    return DISPATCHER(GEMM, a, b, out_dtype)


__all__ = ["GEMM", "GemmProblem", "GemmSpec", "gemm"]
