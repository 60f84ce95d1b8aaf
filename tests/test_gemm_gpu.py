"""GEMM on a CUDA GPU (marked `gpu`: skipped cleanly without one)."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.gemm import GEMM
from tileops.target import target_of

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1, 1), (1, 4096, 4096), (7, 4097, 4095), (16, 6144, 4096), (100, 1000, 333),
          (200, 6144, 4096), (257, 129, 65), (300, 576, 7168), (1000, 4096, 14336),
          (4096, 4096, 4096), (5000, 576, 7168), (8192, 8192, 8192)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES)
def test_gemm_cuda(M, N, K, dtype):
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen)
    ref = a.double() @ w.double().t()
    out = tileops.gemm(a, w.t())
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_error(out, ref) < 1e-2
    b = w.t().contiguous()  # (K, N) row-major
    assert rel_error(tileops.gemm(a, b), ref) < 1e-2


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_every_element_written_cuda(layout):
    target = target_of(torch.device("cuda"))
    for M, N, K in [(1, 333, 4095), (129, 4097, 256)]:
        problem = GEMM.Problem(M, N, K, "bfloat16", layout, "bfloat16")
        kernel = dispatch.compile_kernel(GEMM, problem, GEMM.default_config(problem, target),
                                         target)
        a, b, _ = GEMM.make_inputs(problem, torch.device("cuda"), seed=3)
        c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel(a, b.t() if layout == "nk" else b, c)
        assert not torch.isnan(c).any()
        assert rel_error(c, GEMM.reference((a, b))) < 1e-2


def _writes_every_element(config: dict, layout: str, shapes: list, bucket, calls: int = 1):
    """The kernel of `config` for each (M, N, K) of `shapes` (its problem's M `bucket(M)`) fills
    a NaN-poisoned output with the product, at each of `calls` calls."""
    target = target_of(torch.device("cuda"))
    for M, N, K in shapes:
        problem = GEMM.Problem(bucket(M), N, K, "bfloat16", layout, "bfloat16")
        assert GEMM.check_config(problem, config, target) is None
        kernel = dispatch.compile_kernel(GEMM, problem, config, target)
        a, b, _ = GEMM.make_inputs(problem, torch.device("cuda"), seed=M, sizes={"M": M})
        for _ in range(calls):
            c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            kernel(a, b.t() if layout == "nk" else b, c)
            assert not torch.isnan(c).any()
            assert rel_error(c, GEMM.reference((a, b))) < 1e-2


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize(("block_M", "swap_ab", "split_k", "cluster_sum"),
                         [(16, 1, 1, 0), (32, 1, 4, 0), (64, 0, 2, 0), (64, 1, 8, 0),
                          (16, 1, 2, 1), (32, 1, 8, 1), (64, 0, 4, 1)])
def test_decode_variants_cuda(layout, block_M, swap_ab, split_k, cluster_sum):
    """Swapped tiles and split-K (summed by a second kernel or in the cluster) at odd M and N,
    every element written."""
    config = {"block_M": block_M, "block_N": 64, "block_K": 128, "num_stages": 4, "threads": 128,
              "swizzle": 0, "swap_ab": swap_ab, "split_k": split_k, "cluster_sum": cluster_sum}
    _writes_every_element(config, layout,
                          [(1, 333, 4096), (13, 4097, 2048), (block_M, 256, 1024 * split_k)],
                          lambda M: 64)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize(("full_row", "staged_store", "split_k", "cluster_sum", "block_N"),
                         [(1, 0, 1, 0, 256), (0, 1, 1, 0, 256), (1, 1, 1, 0, 256),
                          (0, 1, 2, 0, 256), (1, 1, 2, 1, 192), (1, 1, 4, 1, 256)])
def test_prefill_knobs_cuda(layout, full_row, staged_store, split_k, cluster_sum, block_N):
    """Whole-row warpgroups and the staged store at odd sizes (rows TMA cannot store among
    them), split-K summed by a second kernel or in the cluster, every element written."""
    config = {"block_M": 128, "block_N": block_N, "block_K": 64, "num_stages": 3,
              "threads": 256, "swizzle": 0 if cluster_sum else 8, "swap_ab": 0,
              "split_k": split_k, "full_row": full_row, "staged_store": staged_store,
              "cluster_sum": cluster_sum}
    _writes_every_element(config, layout, [(257, 4097, 4095), (1000, 512, 1024), (129, 384, 512)],
                          lambda M: 256 if split_k > 1 else 1024)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize(("full_row", "staged_store"), [(0, 0), (1, 0), (1, 1)])
def test_stream_k_cuda(layout, full_row, staged_store):
    """The stream-K program where tiles are cut between CTAs in every way (one iteration per
    CTA, a tile over many CTAs, data-parallel rounds then streamed waves), every element
    written, twice (its flags start at zero at every call). A lost flag would hang: run it
    under a timeout."""
    config = {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 4 - staged_store,
              "threads": 256, "swizzle": 8, "swap_ab": 0, "split_k": 1, "full_row": full_row,
              "staged_store": staged_store, "stream_k": 1}
    _writes_every_element(config, layout,
                          [(1, 256, 64), (5, 1000, 512), (257, 4104, 4096), (256, 10240, 8192),
                           (1000, 512, 1024), (2900, 6144, 512)],
                          lambda M: max(128, 1 << (M - 1).bit_length()), calls=2)


def test_dynamic_m_does_not_recompile_cuda():
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    tileops.gemm(torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16), w.t())
    before = len(dispatch._kernels)
    for M in (600, 999, 513, 1024):  # the same bucket (1024): no new kernel
        out = tileops.gemm(torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16), w.t())
        assert out.shape == (M, 2048)
    assert len(dispatch._kernels) == before


def test_out_dtype_float32_cuda():
    a = torch.randn(64, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    out = tileops.gemm(a, w.t(), out_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_error(out, a.double() @ w.double().t()) < 1e-3


def test_cuda_errors():
    a = torch.randn(4, 8, device="cuda", dtype=torch.float32)
    with pytest.raises(TypeError, match="float32 is not supported"):
        tileops.gemm(a, a.t())
    with pytest.raises(ValueError, match="cuda"):
        tileops.gemm(a.half(), torch.randn(8, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_match_torch_cuda(dtype):
    # dA = dC W and dW = dC^T A through tileops.gemm itself, odd sizes, the w.t() layout.
    a = torch.randn(33, 1000, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(777, 1000, device="cuda", dtype=dtype, requires_grad=True)
    out = tileops.gemm(a, w.t())
    grad = torch.randn_like(out)
    out.backward(grad)
    g, a64, w64 = grad.double(), a.detach().double(), w.detach().double()
    assert rel_error(a.grad, g @ w64) < 1e-2 and rel_error(w.grad, g.t() @ a64) < 1e-2
    assert not a.grad.isnan().any() and not w.grad.isnan().any()
