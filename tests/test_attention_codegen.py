"""The FlashAttention GPU tile program lowers for CUDA sm_90a without the hardware (wgmma for both
products, dynamic lengths) and compiles with nvcc where it is installed."""

from __future__ import annotations

import shutil

import pytest
from test_codegen import H200

from tileops.dispatch import lower
from tileops.ops.attention import ATTENTION
from tileops.target import Target


def test_attention_lowers_to_wgmma_on_sm90a():
    problem = ATTENTION.Problem(2, 1024, 1024, 32, 8, 128, False, "bfloat16")
    config = ATTENTION.default_config(problem, H200)
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    assert "wgmma" in src
    assert "tma_load" in src and "warpgroup_reg_alloc" in src  # TMA producer, wgmma consumers
    assert "seqlen_q" in src and "seqlen_kv" in src  # dynamic lengths


def test_attention_overlap_variant_lowers_on_sm90a():
    problem = ATTENTION.Problem(2, 1024, 1024, 32, 8, 128, True, "bfloat16")
    config = {**ATTENTION.default_config(problem, H200), "overlap": 1}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    assert "wgmma_ss" in src and "wgmma_rs" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_attention_compiles_with_nvcc():
    problem = ATTENTION.Problem(1, 4096, 4096, 32, 8, 128, True, "bfloat16")
    config = ATTENTION.default_config(problem, H200)
    lower(ATTENTION.build(problem, config, H200), H200, device_compile=True)


def test_softmax_kernels_compile_with_cuda_fast_math(monkeypatch):
    import tilelang

    from tileops import dispatch
    from tileops.ops import get_spec

    assert ATTENTION.fast_math and get_spec("mla_decode").fast_math
    assert not get_spec("gemm").fast_math and not get_spec("mxfp4_gemm").fast_math
    seen = []
    monkeypatch.setattr(tilelang, "compile", lambda func, **kw: seen.append(kw))
    dispatch._compile(None, H200, fast_math=True)
    dispatch._compile(None, Target("hip", "gfx942", "MI300X", 304), fast_math=True)
    dispatch._compile(None, H200, fast_math=False)
    fast = tilelang.PassConfigKey.TL_ENABLE_FAST_MATH
    assert [kw["pass_configs"] for kw in seen] == [{fast: True}, None, None]
