"""The GPU tile programs lower for CUDA sm_90a without the hardware (and compile with nvcc)."""

from __future__ import annotations

import re
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


def _wgmma_shapes(src: str) -> set[str]:
    """The (M, N, K) of every wgmma the kernel source issues."""
    return set(re.findall(r"kFloat32, (\d+, \d+, \d+)", src))


def _smem_offsets(src: str) -> dict[str, str]:
    """Each shared buffer's offset in the kernel's dynamic shared memory."""
    return dict(re.findall(r"(\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)", src))


@pytest.mark.parametrize(("shape", "knobs", "wgmma", "tma_store"), [
    ((4096, 4096, 4096), {"full_row": 1}, "64, 256, 16", False),  # one wgmma spans block_N
    ((4096, 4096, 4096), {"staged_store": 1}, "64, 128, 16", True),
    ((4096, 4097, 4095), {"staged_store": 1, "full_row": 1}, "64, 256, 16", False),  # odd rows
    ((256, 4096, 4096), {"staged_store": 1, "split_k": 4, "block_M": 64, "block_N": 128,
                         "threads": 128, "num_stages": 4}, "64, 128, 16", True),  # fp32 partials
])
def test_gemm_prefill_knobs_lower(shape, knobs, wgmma, tma_store):
    problem = GEMM.Problem(*shape, "bfloat16", "nk", "bfloat16")
    # each knob over the plain 128 x 256 tile (the default above M = 128 has both on)
    config = {**GEMM.default_config(problem, H200), "block_N": 256, "num_stages": 3,
              "full_row": 0, "staged_store": 0, **knobs}
    assert GEMM.check_config(problem, config, H200) is None
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert _wgmma_shapes(src) == {wgmma}
    assert ("tma_store(" in src) == tma_store  # TMA needs rows of a multiple of 16 bytes
    # The staged tile reuses the stage buffers: it starts where they do.
    offsets = _smem_offsets(src)
    assert offsets.get("C_s", "0") == "0" and len(offsets) == 2 + ("C_s" in offsets)
    assert ("C_s" in offsets) == bool(knobs.get("staged_store"))


def test_gemm_default_above_m_256_stores_whole_rows_through_shared_memory():
    problem = GEMM.Problem(4096, 4096, 4096, "bfloat16", "nk", "bfloat16")
    config = GEMM.default_config(problem, H200)
    assert config["full_row"] == config["staged_store"] == 1
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert _wgmma_shapes(src) == {"64, 256, 16"} and "tma_store(" in src


@pytest.mark.parametrize(("M", "N", "K", "block_N", "num_stages"), [
    # the best block_N and depth of the H100 grids on each weight (benchmarks/NOTES.md)
    (256, 6144, 4096, 96, 8), (256, 4096, 4096, 64, 8), (256, 10240, 8192, 160, 6),
    (256, 8192, 8192, 128, 6), (256, 28672, 4096, 224, 4), (256, 4096, 14336, 64, 8),
    (1024, 6144, 4096, 192, 4), (4096, 28672, 4096, 256, 4),
])
def test_gemm_default_fills_the_waves_with_the_deepest_pipeline(M, N, K, block_N, num_stages):
    problem = GEMM.Problem(M, N, K, "bfloat16", "nk", "bfloat16")
    config = GEMM.default_config(problem, H200)
    assert (config["block_M"], config["block_N"], config["num_stages"]) == (128, block_N,
                                                                            num_stages)
    assert GEMM.check_config(problem, config, H200) is None
    if num_stages < 8:  # the space's deepest
        deeper = {4: 6, 6: 8}[num_stages]
        assert "shared memory" in GEMM.check_config(problem, dict(config, num_stages=deeper), H200)


@pytest.mark.parametrize(("M", "N", "K", "block_N"), [
    (8192, 576, 7168, 192),   # 4097-8192 rows: 3 column tiles, one wave up to 5632 rows
    (512, 18944, 3584, 224),  # 257-512 rows: 3 or 4 row tiles, 255 or 340 tiles of 128 x 224
    (512, 3584, 3584, 128),   # one wave at 3 and 4 row tiles; 128 x 96 takes two at 4
    (1024, 10240, 8192, 224),  # 224 and 256 tie over 513-1024 rows; 1024 rows decide (H100: 0.96
                               # against 0.87 of cuBLAS)
])
def test_gemm_default_fills_the_waves_of_every_m_its_bucket_serves(M, N, K, block_N):
    config = GEMM.default_config(GEMM.Problem(M, N, K, "bfloat16", "nk", "bfloat16"), H200)
    assert config["block_N"] == block_N


@pytest.mark.parametrize(("M", "N", "K", "split_k"), [
    (128, 576, 7168, 8), (128, 1536, 7168, 4), (128, 3584, 3584, 2),  # H100, M = 128
    (128, 18944, 3584, 1), (512, 576, 7168, 2), (1024, 576, 7168, 1),
])
def test_gemm_default_splits_k_where_the_tiles_leave_most_sms_idle(M, N, K, split_k):
    problem = GEMM.Problem(M, N, K, "bfloat16", "nk", "bfloat16")
    config = GEMM.default_config(problem, H200)
    assert config["split_k"] == split_k and GEMM.check_config(problem, config, H200) is None
    assert -(-M // 128) * -(-N // config["block_N"]) * split_k <= 132  # one wave
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert ("float* __restrict__ partials" in src) == (split_k > 1)


def test_gemm_prefill_knobs_refused_where_they_change_nothing():
    problem = GEMM.Problem(16, 4096, 4096, "bfloat16", "nk", "bfloat16")
    swapped = GEMM.default_config(problem, H200)
    assert "swapped" in GEMM.check_config(problem, dict(swapped, staged_store=1), H200)
    assert "swapped" in GEMM.check_config(problem, dict(swapped, full_row=1), H200)
    one_group = dict(swapped, swap_ab=0, block_M=64, threads=128, full_row=1)
    assert "one warpgroup" in GEMM.check_config(problem, one_group, H200)


@pytest.mark.parametrize(("layout", "staged"), [("nk", 0), ("kn", 0), ("nk", 1)])
def test_gemm_stream_k_lowers(layout, staged):
    problem = GEMM.Problem(256, 10240, 8192, "bfloat16", layout, "bfloat16")
    config = dict(GEMM.default_config(problem, H200), block_M=128, block_N=256, threads=256,
                  num_stages=4 - staged, full_row=1, stream_k=1, staged_store=staged)
    assert GEMM.check_config(problem, config, H200) is None
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert _wgmma_shapes(src) == {"64, 256, 16"}
    assert "wait_wgmma<1>" in src  # one K step's product in flight
    # the partials' hand-over: the flags, raised and awaited
    assert "int* __restrict__ flags" in src and "float* __restrict__ partials" in src
    assert "tileops_flag_raise(" in src and "tileops_flag_wait(" in src
    # Staged, the tile has a buffer of its own: the producer is filling the stages meanwhile.
    offsets = _smem_offsets(src)
    assert ("tma_store(" in src) == ("C_s" in offsets) == bool(staged)
    if staged:
        assert sorted(map(int, offsets.values())) == [0, 3 * 32768, 3 * 32768 + 65536]
        four_stages = dict(config, num_stages=4)  # 4 x 48 KB + 64 KB: over the 227 KB
        assert "shared memory" in GEMM.check_config(problem, four_stages, H200)


@pytest.mark.parametrize(("shape", "layout", "refused"), [
    ((256, 4096, 4095), "nk", "16 bytes"),  # A's rows unaligned for TMA
    ((256, 4095, 4096), "kn", "16 bytes"),  # B's rows
    ((256, 4095, 4096), "nk", None),  # N is free with w.t()
])
def test_gemm_stream_k_needs_rows_tma_can_load(shape, layout, refused):
    problem = GEMM.Problem(*shape, "bfloat16", layout, "bfloat16")
    config = dict(GEMM.default_config(problem, H200), stream_k=1)
    reason = GEMM.check_config(problem, config, H200)
    assert (reason is None) if refused is None else (refused in reason)
    assert "sm_90a" in GEMM.check_config(problem, config, A100)


@pytest.mark.parametrize(("swap_ab", "block_M", "split_k"), [(1, 16, 2), (1, 16, 8), (0, 64, 4)])
def test_gemm_split_k_summed_in_the_cluster(swap_ab, block_M, split_k):
    """cluster_sum: the splits of a tile sum each other's fp32 tiles through the cluster's
    shared memory, each CTA its share of the rows: no workspace, no second kernel."""
    problem = GEMM.Problem(block_M, 4097, 4096, "bfloat16", "nk", "bfloat16")
    config = dict(GEMM.default_config(problem, H200), swap_ab=swap_ab, block_M=block_M,
                  block_N=64, block_K=128, threads=128, split_k=split_k, cluster_sum=1)
    assert GEMM.check_config(problem, config, H200) is None
    src = lower(GEMM.build(problem, config, H200), H200).kernel_source
    assert "partials" not in src and "gemm_split_k" not in src
    assert src.count("tileops_cluster_sync();") == 2
    assert src.count("tileops_cluster_load(") == split_k + 1  # every rank, and the definition
    assert "< 4097" in src  # the last column tile is cut at N


@pytest.mark.parametrize(("knobs", "target"), [
    ({"split_k": 1}, H200),  # nothing to sum
    ({"split_k": 16}, H200),  # beyond a portable cluster
    ({"split_k": 2, "num_stages": 2}, A100),  # no clusters before sm_90
    ({"split_k": 2, "swizzle": 8}, H200),  # clusters along z, rasterised along x
])
def test_gemm_cluster_sum_refused_where_it_cannot_run(knobs, target):
    problem = GEMM.Problem(16, 4096, 4096, "bfloat16", "nk", "bfloat16")
    config = {**GEMM.default_config(problem, target), "block_M": 16, "block_N": 64,
              "block_K": 128, "swap_ab": 1, "cluster_sum": 1, **knobs}
    assert GEMM.check_config(problem, {**config, "cluster_sum": 0}, target) is None
    assert "cluster_sum" in GEMM.check_config(problem, config, target)


def test_gemm_odd_sizes_lower():
    problem = GEMM.Problem(8, 4097, 4095, "float16", "nk", "float16")
    src = lower(GEMM.build(problem, GEMM.default_config(problem, H200), H200), H200).kernel_source
    assert "wgmma" in src and "4097" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_gemm_compiles_with_nvcc():
    problem = GEMM.Problem(4096, 4096, 4096, "bfloat16", "nk", "bfloat16")
    lower(GEMM.build(problem, GEMM.default_config(problem, H200), H200), H200,
          device_compile=True)
