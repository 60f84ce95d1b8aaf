"""The MXFP4 GEMM's GPU tile program lowers without the hardware: CUDA sm_90a (and nvcc), HIP,
Metal."""

from __future__ import annotations

import re
import shutil

import pytest
from test_codegen import A100, H200

from tileops.dispatch import lower
from tileops.ops.mxfp4 import MXFP4_GEMM
from tileops.ops.mxfp4.spec import _fused_smem
from tileops.target import Target


def source(M: int, N: int, K: int, target: Target = H200, **config) -> str:
    problem = MXFP4_GEMM.Problem(M, N, K, "bfloat16")
    config = {**MXFP4_GEMM.default_config(problem, target), **config}
    assert MXFP4_GEMM.check_config(problem, config, target) is None
    return lower(MXFP4_GEMM.build(problem, config, target), target).kernel_source


@pytest.mark.parametrize("dequant", ["bits", "lut"])
def test_prefill_tiles_use_wgmma(dequant):
    src = source(4096, 4096, 4096, dequant=dequant)
    assert "wgmma" in src
    assert "int m" in src  # M is a dynamic dimension of the kernel
    assert "uchar" in src  # the packed weight and scales are read as bytes...
    assert str(1 << 22) in src and str(0x7FC00000) in src  # ...E8M0 2^-127 and NaN decoded
    if dequant == "bits":
        assert str(0x3F000000) in src  # the E2M1 subnormal 0.5, assembled from bits


def test_decode_tiles_swap_onto_wgmma_and_split_k():
    src = source(16, 4096, 4096)  # the default: weight rows on the wgmma M side, split-K
    assert "wgmma" in src
    assert "float* __restrict__ partials" in src and "mxfp4_gemm_split_k_kernel_1" in src


def test_register_decode_feeds_wgmma_from_registers():
    src = source(16, 4096, 4096, dequant="reg")
    assert "wgmma_rs" in src  # A operand (the decoded weight) from registers


def test_unswapped_decode_tiles_use_mma():
    src = source(16, 4096, 4096, swap_ab=0, split_k=1)  # block_M = 16 rows: mma.sync
    assert "mma" in src and "wgmma" not in src and "partials" not in src


def test_large_m_dequantises_globally_then_runs_the_gemm_loop():
    src = source(4096, 4096, 4096)  # the default at large M: "global"
    assert "wgmma" in src
    # the decode kernel writes the bf16 workspace that the GEMM kernel reads with TMA
    assert "bfloat16_t* __restrict__ dequantized" in src and "dequantized_desc" in src


def test_odd_n_lowers():
    src = source(8, 4097, 4096, dequant="lut")
    assert "4097" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("M", [16, 4096])
def test_compiles_with_nvcc(M):
    problem = MXFP4_GEMM.Problem(M, 4096, 4096, "bfloat16")
    lower(MXFP4_GEMM.build(problem, MXFP4_GEMM.default_config(problem, H200), H200), H200,
          device_compile=True)


@pytest.mark.parametrize(("target", "marker"), [(Target("hip", "gfx942", "codegen", 304), "mfma"),
                                                (Target("metal", "", "codegen", 0), "simdgroup")])
def test_first_point_of_each_space_lowers(target, marker):
    problem = MXFP4_GEMM.Problem(64, 4096, 4096, "bfloat16")
    config = next(MXFP4_GEMM.configs(problem, target))
    assert marker in lower(MXFP4_GEMM.build(problem, config, target), target).kernel_source


def test_bf16x2_decode_calls_the_integer_decoder_between_barriers():
    src = source(16, 4096, 4096, dequant="bf16x2")
    assert "wgmma" in src and "tileops_e2m1x8_bf16(" in src
    loop = src[src.index("tileops_e2m1x8_bf16(", src.index("__global__")):]
    # the consumers' barrier sits between the decode and the matrix units reading the tile
    assert loop.index("__sync_thread_partial") < loop.index("wgmma")


def test_bf16x2_decode_is_bf16_and_cuda_only():
    fp16 = MXFP4_GEMM.parse_problem("16x4096x4096", "float16")
    config = {**MXFP4_GEMM.default_config(fp16, H200), "dequant": "bf16x2"}
    assert "bf16" in MXFP4_GEMM.check_config(fp16, config, H200)


def test_scale_rows_longer_than_a_tma_box_still_load_once():
    # 8192x28672 split in two: 448 scales per row and CTA, over TMA's 256-element box.
    src = source(1, 8192, 28672, dequant="bf16x2", block_N=128, split_k=2)
    assert src.count("tma_load(S_desc") >= 1 and "mbarrier" in src


@pytest.mark.parametrize(("target", "shape", "config"), [
    (H200, (16, 8192, 8192), {}),  # bits: the decoded tile is one per stage on Hopper
    (H200, (128, 8192, 28672), {}),  # every step's scales do not fit: one step's per stage
    (H200, (128, 8192, 28672), {"dequant": "lut", "block_M": 32, "block_K": 128,
                                "num_stages": 4, "split_k": 2}),
    (H200, (64, 4096, 14336), {"block_M": 32, "block_N": 32, "block_K": 512, "split_k": 4,
                               "swap_ab": 0}),  # the scale tile rounded up to 1 KiB
    (H200, (16, 200, 96), {"dequant": "bf16x2", "block_K": 128, "num_stages": 2, "swap_ab": 0,
                           "split_k": 1}),
    (A100, (16, 8192, 8192), {}),  # one decoded tile off Hopper
    (A100, (128, 8192, 28672), {"dequant": "reg", "block_N": 32, "block_K": 512,
                                "swap_ab": 1}),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_shared_memory_estimate_covers_what_tilelang_allocates(target, shape, config):
    # check_config refuses by this estimate, and build decides where the scales go by it: an
    # estimate under the allocation lets through kernels the GPU refuses to launch.
    problem = MXFP4_GEMM.Problem(*shape, "bfloat16")
    config = {**MXFP4_GEMM.default_config(problem, target), **config}
    assert MXFP4_GEMM.check_config(problem, config, target) is None
    estimate, _ = _fused_smem(problem, config, target)
    script = lower(MXFP4_GEMM.build(problem, config, target), target).device_mod.script()
    allocated = max(int(v) for v in re.findall(r'"dyn_shared_memory_buf": (\d+)', script))
    assert allocated <= estimate <= allocated + 2048
