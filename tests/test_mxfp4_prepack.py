"""The prepacked MXFP4 weight: its layout round-trips bit for bit, the CPU kernel reading it agrees
with the OCP path exactly, bad input is refused, and the sm_90a kernel lowers and compiles."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_codegen import A100, H200

import tileops
from tileops.dispatch import lower
from tileops.ops.mxfp4 import MXFP4_GEMM, MXFP4_GEMM_PACKED, PrepackedMxfp4
from tileops.ops.mxfp4.prepack import LAYOUT


def random_ocp(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen),
            torch.randint(0, 256, (N, K // 32), dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize(("N", "K"), [(16, 64), (48, 192), (256, 512)])
def test_prepack_round_trips_every_bit(N, K):
    w_fp4, w_scale = random_ocp(N, K, N + K)
    w_scale[0, 0], w_scale[-1, -1] = 0, 255  # the subnormal and the NaN scale
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    assert packed.words.shape == (N // 16, K // 64 * 128) and packed.words.dtype == torch.int32
    assert packed.scales.shape == (N // 16, K // 64 * 32) and packed.scales.dtype == torch.int16
    back = packed.unpack()
    assert torch.equal(back[0], w_fp4) and torch.equal(back[1], w_scale)


def test_a_lane_reads_its_fragment_from_one_word():
    """Lane 13's word 3 of atom (1, 2): fragment element 5 (pair 2: row l // 4, column
    8 + 2 (l % 4) + 1 of k-step 3) lies in the word's upper half, its magnitude at bits 22..24
    and its sign at 31, where a bf16 pair keeps them: the decode's one mask."""
    w_fp4, w_scale = random_ocp(48, 192, 5)
    codes = torch.stack((w_fp4 & 15, w_fp4 >> 4), dim=-1).view(48, 192)
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    lane, word = 13, 3
    row, col = 16 + lane // 4, 128 + 16 * word + 8 + 2 * (lane % 4) + 1
    bits = int(packed.words[1, 128 * 2 + 4 * lane + word]) & 0xFFFFFFFF
    assert ((bits >> 22) & 7) | ((bits >> 31) << 3) == int(codes[row, col])


@pytest.mark.parametrize(("M", "N", "K"), [(1, 32, 64), (5, 48, 192), (33, 64, 128)])
def test_cpu_kernel_on_the_prepacked_weight_equals_the_ocp_path(M, N, K):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(M))
    w_fp4, w_scale = tileops.quantize_mxfp4(w)
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    # One-hot rows read every decoded element alone (exact, whatever the summation order) ...
    eye = torch.eye(K, dtype=torch.bfloat16)
    assert torch.equal(tileops.mxfp4_gemm(eye, packed), tileops.mxfp4_gemm(eye, w_fp4, w_scale))
    # ... and dense rows agree to the last bit of an fp32 sum rounded to bf16.
    a = torch.randn(M, K, generator=torch.Generator().manual_seed(K)).bfloat16()
    torch.testing.assert_close(tileops.mxfp4_gemm(a, packed), tileops.mxfp4_gemm(a, w_fp4, w_scale),
                               rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("e", [0, 1, 126, 127, 128, 129, 200, 252, 255])
def test_cpu_kernel_decodes_every_code_under_a_scale(e):
    """Each code under the scale 2^(e - 127), folded with the decode's 2^-126 (e <= 128), beyond
    bf16 once folded (129 ... 254: stored negative), or NaN (255). (From e = 253 the largest
    codes overflow, and a one-hot row's 0 x inf is NaN.)"""
    K = 64
    codes = torch.arange(16, dtype=torch.uint8).repeat(K // 16)
    w_fp4 = (codes[0::2] | (codes[1::2] << 4)).view(1, K // 2).repeat(16, 1)
    w_scale = torch.full((16, K // 32), e, dtype=torch.uint8)
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    got = tileops.mxfp4_gemm(torch.eye(K, dtype=torch.bfloat16), packed)
    want = tileops.dequantize_mxfp4(w_fp4, w_scale, torch.float32).t().bfloat16()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_bad_input_is_refused():
    w_fp4, w_scale = random_ocp(48, 192)
    with pytest.raises(ValueError, match="16x64 atoms"):
        tileops.prepack_mxfp4(w_fp4[:40], w_scale[:40])
    with pytest.raises(ValueError, match="16x64 atoms"):
        tileops.prepack_mxfp4(w_fp4[:, :48], w_scale[:, :3])
    with pytest.raises(TypeError, match="uint8"):
        tileops.prepack_mxfp4(w_fp4.int(), w_scale)
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    a = torch.randn(3, 192).bfloat16()
    with pytest.raises(TypeError, match="bfloat16 a"):
        tileops.mxfp4_gemm(a.half(), packed)
    with pytest.raises(ValueError, match="K = 192"):
        tileops.mxfp4_gemm(a[:, :128], packed)
    with pytest.raises(TypeError, match="no w_scale"):
        tileops.mxfp4_gemm(a, packed, w_scale)
    with pytest.raises(TypeError, match="w_scale is missing"):
        tileops.mxfp4_gemm(a, w_fp4)
    old = PrepackedMxfp4(packed.words, packed.scales, 48, 192, layout="something-else")
    with pytest.raises(ValueError, match=LAYOUT):
        tileops.mxfp4_gemm(a, old)


def source(M: int, N: int, K: int, **config) -> str:
    problem = MXFP4_GEMM_PACKED.parse_problem(f"{M}x{N}x{K}", "bfloat16")
    config = {**MXFP4_GEMM_PACKED.default_config(problem, H200), **config}
    assert MXFP4_GEMM_PACKED.check_config(problem, config, H200) is None
    return lower(MXFP4_GEMM_PACKED.build(problem, config, H200), H200).kernel_source


def test_the_decoded_weight_feeds_wgmma_from_registers():
    src = source(16, 4096, 4096)
    assert "tileops_mxfp4_rs_decode(" in src and "wgmma_rs" in src
    assert "partials" in src  # the default splits K for 4096 x 4096 (64 tiles on 132 SMs)


def test_two_row_groups_share_the_activation_tile():
    """block_N 128: each warp decodes its atom row of both 64-row groups into the one fragment,
    each group's product into its own accumulator, the activation stage waited for once."""
    src = source(16, 8192, 8192, block_N=128, split_k=2)
    loop = src[src.index("for (int k_1"):src.index("__sync_thread_partial")]
    assert loop.count("tileops_mxfp4_rs_decode(") == 2 and loop.count("wgmma_rs") == 2
    assert "C_f + 0" in loop and "C_g + 0" in loop
    problem = MXFP4_GEMM_PACKED.parse_problem("16x2880x2880", "bfloat16")
    config = {**MXFP4_GEMM_PACKED.default_config(problem, H200), "block_N": 128}
    assert "divide N" in MXFP4_GEMM_PACKED.check_config(problem, config, H200)


def test_cluster_sum_adds_the_splits_in_one_kernel():
    """cluster_sum 1: the splits of a tile are one cluster, each CTA sums its share of the rows
    from every CTA's shared memory between two cluster barriers; no workspace, no second kernel."""
    src = source(16, 8192, 8192, split_k=4, cluster_sum=1)
    assert "partials" not in src and "_kernel_1" not in src  # no second kernel
    assert src.count("tileops_cluster_sync();") == 2
    assert src.count("tileops_cluster_load(") == 4 + 1  # four ranks, and the definition
    problem = MXFP4_GEMM_PACKED.parse_problem("8x2880x2880", "bfloat16")  # 15 steps split by 3
    config = {**MXFP4_GEMM_PACKED.default_config(problem, H200), "cluster_sum": 1}
    assert "dividing the 8 tokens" in MXFP4_GEMM_PACKED.check_config(problem, config, H200)
    assert MXFP4_GEMM_PACKED.check_config(problem, {**config, "cluster_sum": 0}, H200) is None


def test_shared_sms_cap_registers_without_setmaxnreg():
    """Two CTAs per SM: the launch bound caps registers, and no consumer waits on setmaxnreg for
    registers a producer may never hold (a hang where ptxas allots fewer than the cap)."""
    src = source(16, 4096, 4096)  # the default: two CTAs up to 32 tokens
    assert "__launch_bounds__(256, 2)" in src and "reg_alloc" not in src
    problem = MXFP4_GEMM_PACKED.parse_problem("16x8192x8192", "bfloat16")
    config = {**MXFP4_GEMM_PACKED.default_config(problem, H200), "ctas_per_sm": 3}
    assert "registers" in MXFP4_GEMM_PACKED.check_config(problem, config, H200)  # 256-deep


def test_without_a_producer_four_ctas_of_one_warpgroup_share_an_sm():
    """producer 0: no TMA producer warpgroup (TileLang warp-specialises only TMA pipelines), the
    consumers load each stage by cp.async, and a CTA's 128 threads get 128 registers at four
    CTAs an SM, where a producer's warpgroup would halve them."""
    src = source(16, 8192, 8192, producer=0, ctas_per_sm=4, num_stages=3)
    assert "__launch_bounds__(128, 4)" in src and "reg_alloc" not in src
    loop = src[src.index("for (int k"):]
    assert "cp_async_gs" in loop and "tma_load" not in src
    problem = MXFP4_GEMM_PACKED.parse_problem("16x8192x8192", "bfloat16")
    config = {**MXFP4_GEMM_PACKED.default_config(problem, H200), "ctas_per_sm": 4,
              "num_stages": 3}
    assert "registers" in MXFP4_GEMM_PACKED.check_config(problem, config, H200)  # a producer
    assert MXFP4_GEMM_PACKED.check_config(problem, {**config, "producer": 0}, H200) is None


def test_default_splits_k_by_any_divisor_of_its_steps():
    """gpt-oss's K = 2880 is 15 steps of 192: split by 3, not walked in 45 steps of 64."""
    problem = MXFP4_GEMM_PACKED.parse_problem("1x5760x2880", "bfloat16")
    config = MXFP4_GEMM_PACKED.default_config(problem, H200)
    assert (config["block_K"], config["split_k"]) == (192, 3)
    assert MXFP4_GEMM_PACKED.check_config(problem, config, H200) is None


def test_only_hopper_takes_the_prepacked_kernel():
    problem = MXFP4_GEMM_PACKED.parse_problem("16x4096x4096", "bfloat16")
    config = MXFP4_GEMM_PACKED.default_config(problem, H200)
    assert "sm_90" in MXFP4_GEMM_PACKED.check_config(problem, config, A100)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_compiles_with_nvcc():
    problem = MXFP4_GEMM_PACKED.parse_problem("16x4096x4096", "bfloat16")
    config = MXFP4_GEMM_PACKED.default_config(problem, H200)
    lower(MXFP4_GEMM_PACKED.build(problem, config, H200), H200, device_compile=True)


@pytest.mark.parametrize("prepacked", [True, False], ids=["prepacked", "ocp"])
def test_dispatch_never_runs_the_baseline_of_an_mxfp4_weight(monkeypatch, prepacked):
    """A record may say cuBLAS on the dense weight wins (timed on a weight decoded once); a call
    holds only the packed weight, so dispatch runs the record's tile kernel rather than decode
    the weight at every call."""
    from tileops import dispatch
    from tileops.db.layers import Choice

    w_fp4, w_scale = random_ocp(32, 64)
    weight = (tileops.prepack_mxfp4(w_fp4, w_scale),) if prepacked else (w_fp4, w_scale)
    spec = MXFP4_GEMM_PACKED if prepacked else MXFP4_GEMM
    a = torch.randn(2, 64).bfloat16()
    dispatch.reset()
    want = tileops.mxfp4_gemm(a, *weight)
    real = dispatch.DISPATCHER.choice

    def baseline_wins(spec, target, problem):
        choice = real(spec, target, problem)
        return Choice(choice.config, "user", True, True, None)

    monkeypatch.setattr(dispatch.DISPATCHER, "choice", baseline_wins)
    monkeypatch.setattr(spec, "launch_baseline", lambda args: pytest.fail("ran the baseline"))
    try:
        dispatch.reset()
        assert torch.equal(tileops.mxfp4_gemm(a, *weight), want)
    finally:
        dispatch.reset()
