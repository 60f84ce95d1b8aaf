"""`tileops.gemm` is differentiable: its backward runs `gemm` itself, `w.t()` weights included."""

from __future__ import annotations

import pytest
import torch

import tileops
from tileops.dispatch import DISPATCHER


def reference_grads(a, b, grad):
    """dA = dC B^T and dB = A^T dC in float64."""
    a64, b64, g64 = a.detach().double(), b.detach().double(), grad.double()
    return g64 @ b64.t(), a64.t() @ g64


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("weight_view", [True, False], ids=["w.t()", "row-major"])
def test_gradients_match_float64(weight_view):
    torch.manual_seed(0)
    a = torch.randn(9, 48, requires_grad=True)
    w = torch.randn(40, 48, requires_grad=True)
    b = w.t() if weight_view else torch.randn(48, 40, requires_grad=True)
    out = tileops.gemm(a, b)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_a, ref_b = reference_grads(a, b, grad)
    assert rel(a.grad, ref_a) < 1e-5
    leaf, ref_leaf = (w, ref_b.t()) if weight_view else (b, ref_b)
    assert leaf.grad.shape == leaf.shape and rel(leaf.grad, ref_leaf) < 1e-5


def test_gradcheck():
    a = torch.randn(5, 16, requires_grad=True)
    b = torch.randn(16, 8, requires_grad=True)
    # float32 (the CPU kernels' widest dtype), so the finite differences need a coarse step
    assert torch.autograd.gradcheck(lambda a, b: tileops.gemm(a, b), (a, b), eps=1e-2,
                                    atol=1e-2, rtol=1e-2, fast_mode=True)


def test_the_backward_runs_through_gemm(monkeypatch):
    calls = []
    dispatch = type(DISPATCHER).__call__

    def counted(self, spec, *args):
        calls.append(spec.name)
        return dispatch(self, spec, *args)

    monkeypatch.setattr(type(DISPATCHER), "__call__", counted)
    a, w = torch.randn(4, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)
    tileops.gemm(a, w.t()).sum().backward()
    assert calls == ["gemm"] * 3  # the forward, dA and dW
    only_a = torch.randn(4, 32, requires_grad=True)
    calls.clear()
    tileops.gemm(only_a, w.detach().t()).sum().backward()
    assert calls == ["gemm"] * 2  # no gradient asked of the weight: none computed


def test_backward_under_torch_compile():
    a, w = torch.randn(6, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    compiled = torch.compile(lambda a, w: tileops.gemm(a, w.t()).square().sum(), fullgraph=True)
    compiled(a, w).backward()
    out = a.detach() @ w.detach().t()
    torch.testing.assert_close(a.grad, 2 * out @ w.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, 2 * out.t() @ a.detach(), rtol=1e-4, atol=1e-4)


def test_no_grad_and_inference_take_the_fast_path():
    a, w = torch.randn(4, 32), torch.randn(24, 32, requires_grad=True)
    with torch.no_grad():
        assert not tileops.gemm(a, w.t()).requires_grad
    with torch.inference_mode():
        assert not tileops.gemm(a, w.t()).requires_grad
