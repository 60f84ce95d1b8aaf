"""The FlashAttention GPU tile program lowers for CUDA sm_90a without the hardware (wgmma for both
products, dynamic lengths) and compiles with nvcc where it is installed."""

from __future__ import annotations

import re
import shutil

import pytest
from test_codegen import A100, H200

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


@pytest.mark.parametrize(("head_dim", "causal", "seqlen", "tile", "persistent", "stages"), [
    (128, False, 4096, (128, 256), 0, 2), (128, False, 2048, (128, 256), 1, 2),
    (128, True, 8192, (128, 256), 1, 2), (64, False, 4096, (192, 384), 0, 1),
    (64, False, 2048, (192, 384), 0, 1), (64, False, 1024, (128, 256), 1, 2),
    (64, True, 4096, (192, 384), 0, 1), (64, True, 1024, (128, 256), 1, 2),
])
def test_attention_default_on_sm90a_is_warp_specialised(head_dim, causal, seqlen, tile,
                                                        persistent, stages):
    problem = ATTENTION.Problem(2, seqlen, seqlen, 32, 8, head_dim, causal, "bfloat16")
    config = ATTENTION.default_config(problem, H200)
    assert (config["block_M"], config["threads"]) == tile
    assert (config["overlap"], config["persistent"], config["num_stages"]) == (2, persistent,
                                                                               stages)
    assert ATTENTION.check_config(problem, config, H200) is None
    a100 = ATTENTION.default_config(problem, A100)  # no TMA producer below sm_90
    assert (a100["overlap"], a100["persistent"], a100["threads"]) == (0, 0, 256)


def test_attention_overlap_variant_lowers_on_sm90a():
    problem = ATTENTION.Problem(2, 1024, 1024, 32, 8, 128, True, "bfloat16")
    config = {**ATTENTION.default_config(problem, H200), "overlap": 1, "persistent": 0}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    assert "wgmma_ss" in src and "wgmma_rs" in src


@pytest.mark.parametrize(("causal", "head_dim", "threads"), [(False, 128, 256), (True, 64, 128)])
def test_attention_warp_specialised_overlap_lowers_on_sm90a(causal, head_dim, threads):
    problem = ATTENTION.Problem(2, 1024, 1024, 32, 8, head_dim, causal, "bfloat16")
    config = {**ATTENTION.default_config(problem, H200), "overlap": 2, "threads": threads,
              "block_M": threads // 2}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    consumer = src[src.index("warpgroup_reg_alloc<240>"):]
    assert "warpgroup_reg_dealloc<24>" in src  # the producer warp gives its registers up
    # Q K^T (shared operands) of a block, P V (P in registers) of the one before it, and the
    # softmax after waiting for the first only
    assert consumer.index("wgmma_ss") < consumer.index("wgmma_rs") < consumer.index(
        "wait_wgmma<1>")
    assert ATTENTION.check_config(problem, config, A100).startswith("overlap 2")


@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ctas_walk_the_tiles_with_running_barrier_phases(causal):
    problem = ATTENTION.Problem(8, 4096, 4096, 32, 8, 128, causal, "bfloat16")
    config = {"block_M": 128, "block_N": 128, "num_stages": 1, "threads": 256, "overlap": 2,
              "pingpong": 0, "persistent": 1}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    assert "for (int t = 0;" in src and "% 132" in src  # one CTA per SM, striding by 132
    if causal:  # a tile's KV block count varies: the phases count every block gone by
        assert "k_phase" in src
    assert "persistent" in ATTENTION.check_config(problem, {**config, "overlap": 0}, H200)


def test_warp_specialised_overlap_allows_fa3_tiles_of_its_240_register_consumers():
    # FA3's 128 x 176 tile at head_dim 128: 196 accumulator registers per consumer thread
    problem = ATTENTION.Problem(8, 4096, 4096, 32, 8, 128, False, "bfloat16")
    config = {"block_M": 128, "block_N": 176, "num_stages": 1, "threads": 256, "pingpong": 0}
    assert ATTENTION.check_config(problem, {**config, "overlap": 2}, H200) is None
    assert "196 accumulator registers" in ATTENTION.check_config(problem, {**config,
                                                                          "overlap": 0}, H200)


@pytest.mark.parametrize("overlap", [0, 2])
def test_three_consumer_warpgroups_share_the_registers_at_head_dim_64(overlap):
    # FA3's 192-query tile at head_dim 64: 24 registers for the producer, 160 for each of three
    # consumer warpgroups (64 rows each), 128 of them accumulators; 160 spill at head_dim 128
    problem = ATTENTION.Problem(16, 2048, 2048, 32, 32, 64, False, "bfloat16")
    config = {"block_M": 192, "block_N": 128, "num_stages": 2, "threads": 384,
              "overlap": overlap, "pingpong": 0, "persistent": 0}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    assert "warpgroup_reg_alloc<160>" in src and "warpgroup_reg_dealloc<24>" in src
    assert "warpgroup_reg_alloc<240>" not in src
    wide = problem._replace(head_dim=128)
    assert "(> 128)" in ATTENTION.check_config(wide, {**config, "num_stages": 1}, H200)
    assert "multiple of 64 per warpgroup" in ATTENTION.check_config(
        problem, {**config, "block_M": 128}, H200)


def test_attention_pingpong_hands_over_between_the_two_consumer_warpgroups():
    problem = ATTENTION.Problem(2, 1024, 1024, 32, 8, 128, False, "bfloat16")
    config = {**ATTENTION.default_config(problem, H200), "overlap": 0, "persistent": 0,
              "pingpong": 1}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    loop = src[src.index("warpgroup_reg_alloc"):]
    # per block: wait for my turn, product, hand over; twice (Q K^T, P V)
    assert loop.count("__named_barrier_arrive((10 -") == 2
    assert loop.count("__sync_thread_partial(((((int)threadIdx.x) >> 7) + 7), 256)") == 1
    # the P V turn's barrier id depends on the row sums, which keeps the softmax before it
    assert "__sync_thread_partial((((((int)threadIdx.x) >> 7) + after[0]) + 7), 256)" in loop
    # the second warpgroup's first hand-over lets the first one start
    assert "(kb_1 == 0) && ((((int)threadIdx.x) >> 7) == 2)" in loop
    overlapped = {**config, "overlap": 1}
    assert "pingpong" in ATTENTION.check_config(problem, overlapped, H200)


@pytest.mark.parametrize("persistent", [0, 1])
def test_warp_specialised_pingpong_takes_turns_around_both_products(persistent):
    problem = ATTENTION.Problem(8, 4096, 4096, 32, 8, 128, True, "bfloat16")
    config = {"block_M": 128, "block_N": 128, "num_stages": 2, "threads": 256, "overlap": 2,
              "pingpong": 1, "persistent": persistent}
    assert ATTENTION.check_config(problem, config, H200) is None
    src = lower(ATTENTION.build(problem, config, H200), H200).kernel_source
    consumer = src[src.index("warpgroup_reg_alloc<240>"):]
    # warpgroup 1 (threads 256-383) lets warpgroup 0 go first, once: not folded away
    assert consumer.count("__named_barrier_arrive(8, 256)") == 1
    assert consumer.index("__named_barrier_arrive(8, 256)") < consumer.index("wgmma_ss")
    loop = consumer[consumer.index("for (int kb_1 = 1;"):]
    # in the steady state: my turn, Q K^T of this block, P V of the last, hand over, then the
    # softmax's wait for Q K^T alone
    turn = loop.index("__sync_thread_partial(((((int)threadIdx.x) >> 7) + 7), 256)")
    hand_over = loop.index("__named_barrier_arrive((10 - (((int)threadIdx.x) >> 7)), 256)")
    assert turn < loop.index("wgmma_ss") < loop.index("wgmma_rs") < hand_over < loop.index(
        "wait_wgmma<1>")
    assert "pingpong" in ATTENTION.check_config(problem, {**config, "threads": 128,
                                                          "block_M": 64}, H200)


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


@pytest.mark.parametrize(("config", "lowers"), [
    ({"block_M": 128, "block_N": 64, "num_stages": 1, "threads": 256}, True),
    ({"block_M": 64, "block_N": 64, "num_stages": 2, "threads": 128, "overlap": 1}, True),
    ({"block_M": 128, "block_N": 64, "num_stages": 2, "threads": 256}, False),  # the planner
    ({"block_M": 64, "block_N": 64, "num_stages": 1, "threads": 256}, False),  # 8 rows per warp
])
def test_sm80_configurations_refused_where_tilelang_cannot_lower_them(config, lowers):
    # Refused before compiling: a tuning trial on an A100 costs no compile for them.
    problem = ATTENTION.Problem(2, 1024, 1024, 32, 8, 64, True, "bfloat16")
    config = {**ATTENTION.default_config(problem, A100), **config}
    reason = ATTENTION.check_config(problem, config, A100)
    assert (reason is None) == lowers
    if lowers:
        assert "mma" in lower(ATTENTION.build(problem, config, A100), A100).kernel_source


def test_persistent_packed_kernel_counts_barrier_phases_at_run_time():
    """Tiles of a packed batch differ in KV block count, read from memory: a phase linearised as
    t * n_blocks + kb would be wrong at the second tile (the CTAs hung)."""
    from tileops.ops.attention import ATTENTION_VARLEN

    problem = ATTENTION_VARLEN.parse_problem("4096x1024x8x8x64:causal", "bfloat16")
    config = {"block_M": 64, "block_N": 64, "num_stages": 1, "threads": 128, "persistent": 1}
    assert ATTENTION_VARLEN.check_config(problem, config, H200) is None
    src = lower(ATTENTION_VARLEN.build(problem, config, H200), H200).kernel_source
    assert "k_phase" in src and "v_phase" in src
    # and the bound stays visibly positive: a first KV block under `if (0 < ...)` made ptxas
    # serialise every wgmma (C7515)
    assert re.search(r"if \(0 < \(\w+ \+ \(t_\d+ >> 31\)\)\)", src) is None
    assert re.search(r"kb < max\(\(\w+ \+ \(t >> 31\)\), 1\)", src)


@pytest.mark.parametrize(("batch", "seqlen", "heads_q", "heads_kv", "head_dim"), [
    (4, 1024, 32, 32, 128),  # two sections of 64 heads
    (2, 16384, 32, 8, 128),  # four KV heads (16 query heads) a section
    (3, 3000, 12, 4, 64),  # a last section narrower than the others
    (1, 1 << 17, 4, 2, 128),  # one KV head's K and V over the budget: a section is one KV head
])
def test_causal_persistent_tiles_run_heaviest_first_in_sections_that_fit_l2(
        batch, seqlen, heads_q, heads_kv, head_dim):
    import tvm
    from tvm import tirx

    from tileops.ops.attention import kernels

    analyzer, imm = tvm.arith.Analyzer(), lambda v: tirx.IntImm("int32", v)
    n_q, group = -(-seqlen // 128), heads_q // heads_kv
    tiles = [tuple(int(analyzer.simplify(e)) for e in kernels._tile(
        imm(t), imm(n_q), heads_q, group, imm(batch), imm(seqlen), head_dim, True, [0] * 5))
        for t in range(n_q * heads_q * batch)]
    assert sorted(tiles) == [(bx, h, b) for bx in range(n_q) for h in range(heads_q)
                             for b in range(batch)]  # every tile once
    kv_head_bytes = seqlen * 4 * head_dim
    fit = max(kernels.L2_KV_BYTES // kv_head_bytes, 1)
    for start in range(0, len(tiles), 132):  # the tiles 132 persistent CTAs start together
        wave = tiles[start:start + 132]
        kv_heads = {(b, h // group) for _, h, b in wave}
        # within budget, or straddling two sections
        assert len(kv_heads) <= 2 * fit
    pair = [b * heads_q + h for _, h, b in tiles]
    section = [p // (fit * group) for p in pair]
    assert section == sorted(section)  # one section after another
    for s in set(section):  # inside one, query block 0 (the heaviest, counted down) first
        blocks = [bx for (bx, _, _), x in zip(tiles, section, strict=True) if x == s]
        assert blocks == sorted(blocks)
