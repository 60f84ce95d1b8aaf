"""MXFP4 weight GEMM on a CUDA GPU (marked `gpu`: skipped cleanly without one)."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.mxfp4 import MXFP4_GEMM, MXFP4_GEMM_PACKED
from tileops.target import target_of

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (1, 8192, 8192), (16, 8192, 8192), (7, 4097, 4096),
          (64, 6144, 4096), (100, 1000, 352), (257, 129, 96), (1000, 4096, 14336),
          (4096, 4096, 4096)]


def weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tileops.quantize_mxfp4(torch.randn(N, K, device="cuda", generator=gen))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES)
def test_mxfp4_gemm_cuda(M, N, K, dtype):
    w_fp4, w_scale = weight(N, K, M + N + K)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    ref = a.double() @ tileops.dequantize_mxfp4(w_fp4, w_scale, torch.float64).t()
    out = tileops.mxfp4_gemm(a, w_fp4, w_scale)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_error(out, ref) < 1e-2


def test_quantize_on_cuda_matches_cpu():
    w = torch.randn(256, 512, device="cuda") * 3
    fp4, scale = tileops.quantize_mxfp4(w)
    cpu = tileops.quantize_mxfp4(w.cpu())
    assert torch.equal(fp4.cpu(), cpu[0]) and torch.equal(scale.cpu(), cpu[1])
    assert torch.equal(tileops.dequantize_mxfp4(fp4, scale).cpu(),
                       tileops.dequantize_mxfp4(*cpu))


@pytest.mark.parametrize(("M", "block_M", "swap_ab", "dequant"), [
    (M, block_M, swap_ab, dequant)
    for M, block_M, swap_ab in [(1, 16, 1), (13, 32, 1), (13, 16, 0), (129, 64, 0)]
    for dequant in ["bits", "lut", "reg", "bf16x2", "global"]
    if swap_ab or dequant != "reg"  # "reg" decodes the A operand: swapped tiles only
])
def test_every_element_written_cuda(M, block_M, swap_ab, dequant):
    """Decode tiles (swapped, split-K from the default) and prefill tiles, at odd M, N, K."""
    target = target_of(CUDA)
    N, K = 333, 4064  # K: 127 scale blocks, not a multiple of block_K
    problem = MXFP4_GEMM.Problem(MXFP4_GEMM.parse_problem(f"{M}x{N}x{K}", "bfloat16").M, N, K,
                                 "bfloat16")
    config = {**MXFP4_GEMM.default_config(problem, target), "block_M": block_M,
              "dequant": dequant, "swap_ab": swap_ab}
    if dequant == "global":
        config["split_k"] = 1
    if block_M < 64:
        config["threads"] = 128
    kernel = dispatch.compile_kernel(MXFP4_GEMM, problem, config, target)
    user = MXFP4_GEMM.make_inputs(problem, CUDA, seed=3, sizes={"M": M})
    call = MXFP4_GEMM.prepare(*user)
    poisoned = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = MXFP4_GEMM.launch(kernel, call.args, out=poisoned)
    assert not torch.isnan(out).any()
    assert rel_error(out, MXFP4_GEMM.reference(user)) < 1e-2


def test_nan_scale_propagates_cuda():
    w_fp4, w_scale = weight(256, 512, 0)
    w_scale[7, 3] = 255
    out = tileops.mxfp4_gemm(torch.randn(16, 512, device="cuda", dtype=torch.bfloat16),
                             w_fp4, w_scale)
    assert torch.isnan(out[:, 7]).all() and torch.isnan(out).sum() == 16


def test_dynamic_m_does_not_recompile_cuda():
    w_fp4, w_scale = weight(2048, 4096, 1)
    tileops.mxfp4_gemm(torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16),
                       w_fp4, w_scale)
    before = len(dispatch._kernels)
    for M in (600, 999, 513, 1024):  # the same bucket (1024): no new kernel
        a = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        assert tileops.mxfp4_gemm(a, w_fp4, w_scale).shape == (M, 2048)
    assert len(dispatch._kernels) == before


def test_cuda_errors():
    w_fp4, w_scale = weight(64, 128, 2)
    with pytest.raises(ValueError, match="a is on cpu"):
        tileops.mxfp4_gemm(torch.randn(4, 128, dtype=torch.bfloat16), w_fp4, w_scale)
    with pytest.raises(TypeError, match="float32"):
        tileops.mxfp4_gemm(torch.randn(4, 128, device="cuda"), w_fp4, w_scale)


@pytest.mark.parametrize(("dequant", "ctas_per_sm"),
                         [("bits", 1), ("lut", 1), ("reg", 1), ("bf16x2", 1), ("bf16x2", 2)])
def test_every_code_under_every_scale_decodes_exactly_cuda(dequant, ctas_per_sm):
    """Row n of the weight holds the 16 codes under scale n (0: 2^-127, 255: NaN); one-hot rows
    of A pick single columns, so the product is the decoded weight itself, bit for bit.

    Where a row's codes decode past bf16's range (6 x 2^127 and up: inf) or its scale is NaN,
    the row's products hold 0 x inf or NaN, so IEEE arithmetic makes them NaN: what the format
    defines for the product is the float64 product of the decoded operands, cast to bf16."""
    target = target_of(CUDA)
    a, w_fp4, w_scale = every_code_under_every_scale()
    problem = MXFP4_GEMM.parse_problem(f"16x{w_fp4.shape[0]}x{a.shape[1]}", "bfloat16")
    config = {**MXFP4_GEMM.default_config(problem, target), "dequant": dequant, "split_k": 1,
              "block_K": 64, "ctas_per_sm": ctas_per_sm}
    kernel = dispatch.compile_kernel(MXFP4_GEMM, problem, config, target)
    out = MXFP4_GEMM.launch(kernel, MXFP4_GEMM.prepare(a, w_fp4, w_scale).args)
    assert_decoded_exactly(out, a, w_fp4, w_scale)


def every_code_under_every_scale(K: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, w_fp4, w_scale): row n of the 256 x K weight holds the 16 codes under scale n, a is
    16 one-hot rows."""
    N = 256
    codes = torch.arange(16, dtype=torch.uint8, device="cuda").repeat(N, K // 16)
    w_fp4 = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    w_scale = torch.arange(N, dtype=torch.uint8, device="cuda").unsqueeze(1).repeat(1, K // 32)
    return torch.eye(16, K, device="cuda", dtype=torch.bfloat16), w_fp4, w_scale


def assert_decoded_exactly(out: torch.Tensor, a: torch.Tensor, w_fp4: torch.Tensor,
                           w_scale: torch.Tensor) -> None:
    """out is the float64 product of the decoded operands cast to bf16, bit for bit, NaN where
    it is NaN (the overflowing rows and the NaN scale)."""
    dense = tileops.dequantize_mxfp4(w_fp4, w_scale, torch.bfloat16)
    want = (a.double() @ dense.double().t()).to(torch.bfloat16)
    assert not torch.isinf(want).any() and torch.isnan(want).any()  # overflowing rows: NaN
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


PACKED_CASES = [  # (M, N, K, config overrides): defaults (split-K), odd M, 64-deep steps,
    # CTAs sharing an SM (each thread's registers capped at its share of the file)
    (1, 4096, 4096, {}), (16, 8192, 8192, {}), (7, 6144, 4096, {"block_K": 128}),
    (64, 4096, 14336, {"block_M": 64}), (33, 2880, 2880, {"block_K": 64, "split_k": 1}),
    (300, 1024, 1024, {"block_M": 64, "split_k": 1}),
    (16, 8192, 8192, {"ctas_per_sm": 2, "split_k": 2}),
    (5, 4096, 14336, {"ctas_per_sm": 3, "block_K": 128, "num_stages": 3}),
    (32, 6144, 4096, {"ctas_per_sm": 3, "block_M": 32, "block_K": 64, "num_stages": 4}),
    (8, 2880, 2880, {}),  # gpt-oss: 192-deep steps split by 3
    # two 64-row groups sharing the activation tile
    (16, 8192, 8192, {"block_N": 128, "split_k": 2}),
    (7, 6144, 2880, {"block_N": 128, "block_K": 64, "split_k": 1}),
    (64, 4096, 14336, {"block_M": 64, "block_N": 128, "block_K": 128, "ctas_per_sm": 1}),
    # the K splits of a tile summed within their cluster
    (16, 8192, 8192, {"split_k": 2, "cluster_sum": 1}),
    (5, 4096, 14336, {"split_k": 8, "cluster_sum": 1, "block_K": 128}),
    (33, 6144, 4096, {"split_k": 4, "cluster_sum": 1, "block_N": 128, "block_K": 128,
                      "ctas_per_sm": 1}),
    # no producer warpgroup: the consumers load by cp.async, four to six CTAs an SM
    (16, 8192, 8192, {"producer": 0, "ctas_per_sm": 4, "num_stages": 3}),
    (7, 6144, 4096, {"producer": 0, "ctas_per_sm": 6, "block_K": 128, "split_k": 2,
                     "cluster_sum": 1}),
    (33, 4096, 14336, {"producer": 0, "ctas_per_sm": 4, "block_M": 32, "block_N": 128,
                       "block_K": 128, "num_stages": 3}),
    (64, 2880, 2880, {"producer": 0, "ctas_per_sm": 3, "block_M": 64, "block_K": 64,
                      "split_k": 1}),
    # 16 tokens where M <= 8 fits in 8 (the defaults above take 8 there)
    (16, 4096, 4096, {"block_M": 16}),
    (3, 8192, 8192, {"block_M": 8, "producer": 0, "ctas_per_sm": 4, "num_stages": 2,
                     "split_k": 2, "cluster_sum": 1})]


@pytest.mark.parametrize(("M", "N", "K", "overrides"), PACKED_CASES)
def test_prepacked_weight_cuda(M, N, K, overrides):
    """Every element written (NaN-poisoned output) and right, through a direct launch of the
    configuration and through `tileops.mxfp4_gemm(a, packed)`."""
    target = target_of(CUDA)
    w_fp4, w_scale = weight(N, K, M + N)
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = a.double() @ tileops.dequantize_mxfp4(w_fp4, w_scale, torch.float64).t()
    call = MXFP4_GEMM_PACKED.prepare(a, packed)
    config = {**MXFP4_GEMM_PACKED.default_config(call.problem, target), **overrides}
    assert MXFP4_GEMM_PACKED.check_config(call.problem, config, target) is None
    kernel = dispatch.compile_kernel(MXFP4_GEMM_PACKED, call.problem, config, target)
    poisoned = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = MXFP4_GEMM_PACKED.launch(kernel, call.args, out=poisoned)
    assert not torch.isnan(out).any() and rel_error(out, ref) < 1e-2
    assert not tileops.mxfp4_gemm(a, packed).isnan().any()
    assert torch.equal(packed.unpack()[0], w_fp4)


@pytest.mark.parametrize(("block_K", "block_N"), [(64, 64), (256, 64), (64, 128)])
def test_prepacked_every_code_under_every_scale_decodes_exactly_cuda(block_K, block_N):
    """As the OCP kernels' test above: the decoded weight, bit for bit (NaN where the format's
    product is NaN), the scales folded with the decode's 2^-126 and those beyond bf16 so."""
    target = target_of(CUDA)
    a, w_fp4, w_scale = every_code_under_every_scale(block_K)  # one step of block_K atoms
    call = MXFP4_GEMM_PACKED.prepare(a, tileops.prepack_mxfp4(w_fp4, w_scale))
    config = {**MXFP4_GEMM_PACKED.default_config(call.problem, target), "split_k": 1,
              "block_K": block_K, "block_N": block_N}
    kernel = dispatch.compile_kernel(MXFP4_GEMM_PACKED, call.problem, config, target)
    assert_decoded_exactly(MXFP4_GEMM_PACKED.launch(kernel, call.args), a, w_fp4, w_scale)
