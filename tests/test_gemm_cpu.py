"""GEMM end to end on the CPU target: real TileLang kernels against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.gemm import GEMM
from tileops.target import target_of

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("M", "N", "K", "dtype", "layout"),
    [
        (1, 1, 1, "float32", "kn"),
        (37, 70, 33, "float32", "kn"),
        (64, 48, 96, "float32", "nk"),
        (5, 129, 65, "float16", "nk"),
        (33, 17, 100, "bfloat16", "nk"),
        (2, 31, 7, "bfloat16", "kn"),
    ],
)
def test_gemm_matches_float64_reference(M, N, K, dtype, layout):
    problem = GEMM.Problem(M, N, K, dtype, layout, dtype)
    a, b, _ = GEMM.make_inputs(problem, CPU, seed=M * 1000 + N)
    out = tileops.gemm(a, b)
    assert out.shape == (M, N) and out.dtype == a.dtype
    assert rel_error(out, GEMM.reference((a, b))) < GEMM.tolerance(problem)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_out_dtype(out_dtype):
    a, b = torch.randn(9, 20, dtype=torch.float16), torch.randn(20, 11, dtype=torch.float16)
    out = tileops.gemm(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert rel_error(out, a.double() @ b.double()) < 1e-2


def test_every_element_written_after_nan_poisoning():
    # Call the compiled kernel directly on a NaN-filled output: every element must be overwritten.
    target = target_of(CPU)
    for M, N, K, layout in [(13, 45, 70, "kn"), (1, 33, 17, "nk")]:
        problem = GEMM.Problem(M, N, K, "float32", layout, "float32")
        config = {"block_M": 8, "block_N": 16, "block_K": 16}
        kernel = dispatch.compile_kernel(GEMM, problem, config, target)
        a, b, _ = GEMM.make_inputs(problem, CPU, seed=7)
        bk = b.t() if layout == "nk" else b  # the kernel takes the (N, K) weight itself
        c = torch.full((M, N), float("nan"))
        kernel(a, bk, c)
        assert not torch.isnan(c).any()
        assert rel_error(c, GEMM.reference((a, b))) < 1e-5


def test_transposed_weight_is_used_without_copy(monkeypatch):
    w = torch.randn(24, 40)
    seen = []
    original = GEMM.launch
    monkeypatch.setattr(GEMM, "launch", lambda k, args: seen.append(args[1]) or original(k, args))
    out = tileops.gemm(torch.randn(3, 40), w.t())
    assert seen[0].data_ptr() == w.data_ptr() and seen[0].shape == w.shape
    assert out.shape == (3, 24)


def test_non_contiguous_inputs_are_handled():
    a = torch.randn(40, 12)[:, ::2]  # strided: copied, not misread
    b = torch.randn(6, 50)[:, ::3]
    assert rel_error(tileops.gemm(a, b), a.double() @ b.double()) < 1e-5


def test_dynamic_m_one_kernel_per_bucket():
    w = torch.randn(32, 48)
    before = len(dispatch._kernels)
    for M in (33, 40, 64, 50):  # one bucket (64): one configuration, one compiled kernel
        out = tileops.gemm(torch.randn(M, 48), w.t())
        assert out.shape == (M, 32)
    assert len(dispatch._kernels) == before + 1
    problems = {p for (_, _, p) in dispatch.DISPATCHER.choices}
    assert {p.M for p in problems} == {64}


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((torch.randn(4, 5), torch.randn(6, 3)), ValueError, "inner dimensions"),
        ((torch.randn(4, 5, 1), torch.randn(5, 3)), ValueError, "2-D"),
        ((torch.randn(5), torch.randn(5, 3)), ValueError, "2-D"),
        ((torch.randn(4, 5), torch.randn(5, 3).half()), TypeError, "same dtype"),
        ((torch.randn(4, 5).double(), torch.randn(5, 3).double()), TypeError, "float64"),
        ((torch.ones(4, 5, dtype=torch.int32),) * 2, TypeError, "int32"),
        ((torch.randn(4, 5), torch.randn(5, 3, device="meta")), ValueError, "meta"),
        ((torch.randn(4, 5), [[1.0]]), TypeError, "two tensors"),
    ],
)
def test_bad_input_is_refused_clearly(args, exc, match):
    with pytest.raises(exc, match=match):
        tileops.gemm(*args)


@pytest.mark.parametrize(("M", "K", "N"), [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)])
def test_empty_operands_give_torchs_result(M, K, N):
    """An empty product as torch.matmul gives it (zeros over K = 0), in either layout of b, with
    gradients (an MoE expert no token was routed to)."""
    a, w = torch.randn(M, K, requires_grad=True), torch.randn(N, K, requires_grad=True)
    for b in (w.t(), w.detach().t().contiguous()):
        out = tileops.gemm(a.detach(), b.detach(), out_dtype=torch.float16)
        assert out.dtype == torch.float16 and torch.equal(out, (a @ b).half())
    tileops.gemm(a, w.t()).sum().backward()
    assert torch.equal(a.grad, torch.ones(M, N) @ w) and torch.equal(w.grad, torch.ones(N, M) @ a)


def test_bad_out_dtype():
    with pytest.raises(TypeError, match="out_dtype"):
        tileops.gemm(torch.randn(2, 3), torch.randn(3, 4), out_dtype=torch.int8)


def test_under_torch_compile():
    w = torch.randn(16, 24)

    def layer(x):
        return torch.relu(tileops.gemm(x, w.t())) * 2

    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(5, 24)
    assert rel_error(compiled(x), layer(x)) < 1e-6
    assert rel_error(compiled(x), torch.relu(x.double() @ w.double().t()) * 2) < 1e-5


def test_custom_op_is_registered():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert rel_error(torch.ops.tileops.gemm(a, b), a.double() @ b.double()) < 1e-5
