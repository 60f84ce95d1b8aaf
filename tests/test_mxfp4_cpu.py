"""MXFP4 weight GEMM end to end on the CPU target: real TileLang kernels against float64."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.mxfp4 import MXFP4_GEMM
from tileops.target import Target, target_of

CPU = torch.device("cpu")


def inputs(M: int, N: int, K: int, dtype: str = "bfloat16", seed: int = 0) -> tuple:
    return MXFP4_GEMM.make_inputs(MXFP4_GEMM.Problem(M, N, K, dtype), CPU, seed=seed)


@pytest.mark.parametrize(("M", "N", "K", "dtype"), [(1, 33, 64, "bfloat16"),
                                                    (7, 45, 96, "bfloat16"),
                                                    (33, 17, 160, "float16")])
def test_matches_float64_reference_through_dispatch(M, N, K, dtype):
    a, w_fp4, w_scale = inputs(M, N, K, dtype, seed=M + N)
    out = tileops.mxfp4_gemm(a, w_fp4, w_scale)
    assert out.shape == (M, N) and out.dtype == a.dtype
    ref = a.double() @ tileops.dequantize_mxfp4(w_fp4, w_scale, torch.float32).double().t()
    assert rel_error(out, ref) < 1e-2
    assert torch.equal(ref, MXFP4_GEMM.reference((a, w_fp4, w_scale)))


@pytest.mark.parametrize("which", [1, 2])
def test_weight_or_scales_at_an_odd_address(which):
    # The kernels read the packed weight as 32-bit words, and GPU kernels load scales by TMA
    # (16-byte aligned): views starting at an odd byte are copied to aligned buffers, not misread.
    args = list(inputs(3, 8, 64))
    buffer = torch.empty(args[which].numel() + 1, dtype=torch.uint8)
    shifted = buffer[1:].view(args[which].shape)
    shifted.copy_(args[which])
    assert shifted.data_ptr() % 4 and shifted.is_contiguous()
    moved = [shifted if i == which else x for i, x in enumerate(args)]
    weight = MXFP4_GEMM.prepare(*moved).args[1]
    assert weight.fp4.data_ptr() % 16 == weight.scale.data_ptr() % 16 == 0
    assert torch.equal(tileops.mxfp4_gemm(*moved), tileops.mxfp4_gemm(*args))


@pytest.mark.parametrize("dequant", ["bits", "lut"])
def test_every_element_written_after_nan_poisoning(dequant):
    # Tiles that divide none of M, N, K (K = 96 with block_K = 64: a partial scale block tile).
    M, N, K = 13, 45, 96
    problem = MXFP4_GEMM.Problem(16, N, K, "bfloat16")
    config = {"block_M": 4, "block_N": 16, "block_K": 64, "dequant": dequant}
    kernel = dispatch.compile_kernel(MXFP4_GEMM, problem, config, target_of(CPU))
    user = inputs(M, N, K, seed=5)
    call = MXFP4_GEMM.prepare(*user)
    assert call.problem == problem
    poisoned = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    out = MXFP4_GEMM.launch(kernel, call.args, out=poisoned)
    assert out is poisoned and not torch.isnan(out).any()
    assert rel_error(out, MXFP4_GEMM.reference(user)) < 1e-2


def test_scales_reach_the_kernel():
    # Blocks of very different scales: a decoder ignoring or misplacing scales fails this.
    a = torch.randn(3, 128, dtype=torch.bfloat16)
    w = torch.randn(5, 128) * torch.tensor([2.0**-20, 1.0, 2.0**10, 2.0**-3]).repeat_interleave(32)
    w_fp4, w_scale = tileops.quantize_mxfp4(w)
    assert len(set(w_scale.flatten().tolist())) >= 4
    ref = a.double() @ tileops.dequantize_mxfp4(w_fp4, w_scale, torch.float64).t()
    assert rel_error(tileops.mxfp4_gemm(a, w_fp4, w_scale), ref) < 1e-2


def test_nan_scale_propagates():
    a = torch.randn(2, 64, dtype=torch.bfloat16)
    w_fp4, w_scale = tileops.quantize_mxfp4(torch.randn(3, 64))
    w_scale[1, 0] = 255
    out = tileops.mxfp4_gemm(a, w_fp4, w_scale)
    assert torch.isnan(out[:, 1]).all() and not torch.isnan(out[:, [0, 2]]).any()


def test_dynamic_m_one_kernel_per_bucket():
    _, w_fp4, w_scale = inputs(1, 24, 64)
    before = len(dispatch._kernels)
    for M in (33, 40, 64, 50):  # one bucket (64): one configuration, one compiled kernel
        out = tileops.mxfp4_gemm(torch.randn(M, 64, dtype=torch.bfloat16), w_fp4, w_scale)
        assert out.shape == (M, 24)
    assert len(dispatch._kernels) == before + 1


def test_baseline_is_bf16_matmul_on_the_weight_dequantised_once():
    user = inputs(9, 40, 64)
    call = MXFP4_GEMM.prepare(*user)
    out = MXFP4_GEMM.launch_baseline(call.args)
    assert out.dtype == torch.bfloat16 and rel_error(out, MXFP4_GEMM.reference(user)) < 1e-2
    w = call.args[1]
    dense = w.dense(torch.bfloat16)
    assert dense is w.dense(torch.bfloat16)  # kept for the following launches
    assert torch.equal(dense, tileops.dequantize_mxfp4(user[1], user[2]))


def test_problem_parsing_and_model():
    problem = MXFP4_GEMM.parse_problem("16x256x512", "bfloat16")
    assert problem == MXFP4_GEMM.Problem(16, 256, 512, "bfloat16")
    assert MXFP4_GEMM.parse_problem("100x8x64", "float16").M == 128
    assert MXFP4_GEMM.flops(problem) == 2 * 16 * 256 * 512
    assert MXFP4_GEMM.bytes_moved(problem) == 16 * 512 * 2 + 256 * 256 + 256 * 16 + 16 * 256 * 2
    for text, dtype in [("16x256x100", "bfloat16"), ("16x256", "bfloat16"),
                        ("16x256x256", "float32")]:
        with pytest.raises(ValueError, match="bad"):
            MXFP4_GEMM.parse_problem(text, dtype)


def test_default_configs_are_in_the_spaces_and_valid():
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132)
    for target in (h200, target_of(CPU)):
        space = MXFP4_GEMM.space(target)
        for M in (1, 16, 64, 256, 4096):
            for N, K in [(4096, 4096), (28672, 4096), (8192, 28672)]:
                problem = MXFP4_GEMM.Problem(M, N, K, "bfloat16")
                config = MXFP4_GEMM.default_config(problem, target)
                assert all(config[k] in space[k] for k in space), (target.kind, config)
                assert MXFP4_GEMM.check_config(problem, config, target) is None
        assert next(MXFP4_GEMM.configs(MXFP4_GEMM.Problem(16, 4096, 4096, "bfloat16"), target))


def test_under_torch_compile():
    w_fp4, w_scale = tileops.quantize_mxfp4(torch.randn(16, 64))

    def layer(x):
        return torch.relu(tileops.mxfp4_gemm(x, w_fp4, w_scale)) * 2

    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(compiled(x), layer(x))


def test_custom_op_is_registered():
    a, w_fp4, w_scale = inputs(3, 8, 32)
    out = torch.ops.tileops.mxfp4_gemm(a, w_fp4, w_scale)
    assert rel_error(out, MXFP4_GEMM.reference((a, w_fp4, w_scale))) < 1e-2


def _packed(N: int = 8, K: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return tileops.quantize_mxfp4(torch.randn(N, K))


A = torch.randn(4, 64, dtype=torch.bfloat16)
W, S = _packed()


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((A.float(), W, S), TypeError, "a is float32; allowed: bfloat16, float16"),
        ((A.to(torch.int8), W, S), TypeError, "int8"),
        ((A, W, S.float()), TypeError, "w_scale must be uint8.*float32"),
        ((A, W.to(torch.int8), S), TypeError, "w_fp4 must be uint8"),
        ((A[:, :32], W, S), ValueError, "a is 4x32 but the packed weight .* K = 64"),
        ((A, W[:, :8], S), ValueError, r"w_scale of shape \(N, K/32\) = \(8, 0.5\)"),
        ((A, W, S[:4]), ValueError, r"w_scale of shape \(4, 2\)"),
        ((A, W, S[:, :1]), ValueError, r"needs K a multiple of 32 .* \(8, 2\)"),
        ((A[0], W, S), ValueError, "2-D a"),
        ((A, W[None], S), ValueError, "w_fp4 must be 2-D"),
        ((A, W, S.to("meta")), ValueError, "meta"),
        ((A.to("meta"), W, S), ValueError, "a is on meta"),
        ((A[:, :0], W[:, :0], S[:, :0]), ValueError, "the weight is empty"),
        (([[1.0]], W, S), TypeError, "a must be a tensor"),
    ],
)
def test_bad_input_is_refused_clearly(args, exc, match):
    with pytest.raises(exc, match=match):
        tileops.mxfp4_gemm(*args)


def test_no_rows_give_an_empty_result():
    """M = 0 (an MoE expert no token was routed to) is torch's empty product, on the OCP tensors
    and on the prepacked weight."""
    w, s = _packed(16, 64)  # the prepacked layout's 16 x 64 atoms
    for weight in ((w, s), (tileops.prepack_mxfp4(w, s),)):
        out = tileops.mxfp4_gemm(A[:0], *weight)
        assert out.shape == (0, 16) and out.dtype == A.dtype
