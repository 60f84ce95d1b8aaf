"""The GPU tile programs lower for CUDA sm_90a without the hardware (and compile with nvcc)."""

from __future__ import annotations

import shutil

import pytest

from tileops.dispatch import lower
from tileops.ops.gemm import GEMM
from tileops.target import Target

H200 = Target("cuda", "sm_90a", "codegen", 132)
A100 = Target("cuda", "sm_80", "codegen", 108)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("M", [16, 4096])
def test_gemm_lowers_to_wgmma_on_sm90a(M, layout):
    problem = GEMM.Problem(M, 4096, 4096, "bfloat16", layout, "bfloat16")
    config = GEMM.default_config(problem, H200)
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert "wgmma" in src
    assert "int m" in src  # M is a dynamic dimension of the kernel


@pytest.mark.parametrize(("swap_ab", "split_k"), [(1, 1), (1, 4), (0, 4)])
def test_gemm_decode_variants_lower(swap_ab, split_k):
    problem = GEMM.Problem(16, 4096, 4096, "bfloat16", "nk", "bfloat16")
    config = dict(GEMM.default_config(problem, H200), swap_ab=swap_ab, split_k=split_k,
                  block_M=16 if swap_ab else 64, block_K=128)
    assert GEMM.check_config(problem, config, H200) is None
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert "wgmma" in src
    # split-K: the tile kernel writes fp32 partials and a second kernel sums them
    assert ("float* __restrict__ partials" in src) == (split_k > 1)
    assert ("gemm_split_k_kernel_1" in src) == (split_k > 1)


@pytest.mark.parametrize(("block_N", "threads", "lowers"), [
    (64, 256, True), (32, 128, True),
    (32, 256, False),  # 8 warps cannot tile a 32x16 mma tile in 16x8 blocks
])
def test_swapped_mma_tiles_refused_where_no_warp_layout_covers_them(block_N, threads, lowers):
    problem = GEMM.Problem(16, 4096, 4096, "bfloat16", "nk", "bfloat16")
    config = dict(GEMM.default_config(problem, A100), block_M=16, block_N=block_N, block_K=128,
                  num_stages=2, threads=threads, swap_ab=1, split_k=1)
    assert (GEMM.check_config(problem, config, A100) is None) == lowers
    if lowers:
        assert "mma" in lower(GEMM.build(problem, config, A100), A100).kernel_source


def test_gemm_odd_sizes_lower():
    problem = GEMM.Problem(8, 4097, 4095, "float16", "nk", "float16")
    src = lower(GEMM.build(problem, GEMM.default_config(problem, H200), H200), H200).kernel_source
    assert "wgmma" in src and "4097" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_gemm_compiles_with_nvcc():
    problem = GEMM.Problem(4096, 4096, 4096, "bfloat16", "nk", "bfloat16")
    lower(GEMM.build(problem, GEMM.default_config(problem, H200), H200), H200,
          device_compile=True)
