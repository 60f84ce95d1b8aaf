"""FlashAttention forward on a CUDA GPU (marked `gpu`: skipped cleanly without one)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import check_attention, rel_error

import tileops
from tileops import dispatch
from tileops.ops.attention import ATTENTION
from tileops.target import target_of

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def check(out, lse, ref, tol=1e-2):
    check_attention(out, lse, ref, tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    ("B", "Sq", "Skv", "Hq", "Hkv", "D", "causal"),
    [
        (2, 1024, 1024, 32, 32, 128, False),
        (2, 1024, 1024, 32, 32, 128, True),
        (2, 1024, 1024, 32, 8, 128, True),      # GQA 32/8
        (2, 1024, 1024, 32, 8, 64, False),
        (1, 1000, 1000, 32, 8, 128, True),      # odd lengths
        (2, 333, 1337, 16, 4, 128, True),       # seqlen_q < seqlen_kv, bottom-right causal
        (1, 1337, 333, 16, 1, 64, True),        # seqlen_q > seqlen_kv (masked rows), MQA
        (2, 1000, 1000, 32, 8, 64, True),       # head_dim 64 causal <= 1024: 128 rows, persistent
        (3, 1, 4097, 32, 8, 128, False),        # decode-like
        (1, 517, 517, 8, 8, 256, True),         # head_dim 256
    ],
)
def test_attention_cuda(B, Sq, Skv, Hq, Hkv, D, causal, dtype):
    problem = ATTENTION.Problem(B, Sq, Skv, Hq, Hkv, D, causal, dtype)
    q, k, v, _ = ATTENTION.make_inputs(problem, CUDA, seed=Sq + Skv + D)
    out, lse = tileops.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    check(out, lse, ATTENTION.reference((q, k, v, causal)))


# Knobs over the default (on sm_90: `overlap` 2, persistent at this causal problem).
PLAIN = {"overlap": 0, "persistent": 0}
SCHEDULES = pytest.mark.parametrize("schedule", [
    {}, PLAIN, {**PLAIN, "pingpong": 1}, {"overlap": 1, "persistent": 0},
    {"overlap": 2, "persistent": 0}, {"overlap": 2, "persistent": 1},
    {"overlap": 2, "block_M": 128, "block_N": 176, "num_stages": 1, "threads": 256,
     "persistent": 0},
    {"overlap": 2, "pingpong": 1, "persistent": 0}, {"overlap": 2, "pingpong": 1, "persistent": 1},
], ids=["default", "plain", "pingpong", "overlap", "ws_overlap", "persistent", "ws_overlap_176",
        "ws_pingpong", "persistent_pingpong"])


def compiled(problem, schedule):
    """The default configuration's kernel with a schedule's knobs set."""
    target = target_of(CUDA)
    config = {**ATTENTION.default_config(problem, target), **schedule}
    return dispatch.compile_kernel(ATTENTION, problem, config, target)


def check_every_element_written(problem, schedule):
    """Outputs and LSE filled with NaN first, at odd lengths: each element the kernel leaves
    unwritten fails the check."""
    kernel = compiled(problem, schedule)
    B, Hq, D = problem.batch, problem.heads_q, problem.head_dim
    # (300, 17000): persistent causal tiles in sections of 3 KV heads (`kernels._tile`), the
    # last of the 16 (batch, KV head) pairs alone in its section
    for Sq, Skv in [(1000, 999), (129, 1000), (1000, 129), (300, 17000)]:
        inputs = ATTENTION.make_inputs(problem, CUDA, seed=Sq, sizes={"seqlen_q": Sq,
                                                                      "seqlen_kv": Skv})
        call = ATTENTION.prepare(*inputs)
        out = (torch.full((B, Sq, Hq, D), math.nan, device=CUDA, dtype=torch.bfloat16),
               torch.full((B, Hq, Sq), math.nan, device=CUDA))
        ATTENTION.launch(kernel, call.args, out=out)
        check(*out, ATTENTION.reference(inputs))


@SCHEDULES
def test_every_element_written_cuda(schedule):
    check_every_element_written(ATTENTION.Problem(2, 1024, 1024, 32, 8, 128, True, "bfloat16"),
                                schedule)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", [PLAIN, {"overlap": 2, "persistent": 0},
                                      {"overlap": 2, "persistent": 1}],
                         ids=["auto", "ws_overlap", "persistent"])
def test_three_consumer_warpgroups_write_every_element_cuda(schedule, causal):
    # 192 queries a CTA at head_dim 64, a warpgroup of 64 each (160 registers a thread)
    check_every_element_written(
        ATTENTION.Problem(2, 1024, 1024, 32, 8, 64, causal, "bfloat16"),
        {"block_M": 192, "block_N": 128, "num_stages": 2, "threads": 384, **schedule})


def test_baseline_matches_reference_cuda():
    # cuDNN; then the memory-efficient kernel's bottom-right masks (queries that see no key at
    # 700 x 300), grouped heads and head_dim 64 among them
    for Sq, Skv, causal, D in [(1024, 1024, True, 128), (512, 256, False, 128),
                               (300, 700, True, 128), (700, 300, True, 128),
                               (333, 2000, True, 64)]:
        problem = ATTENTION.Problem(1, Sq, Skv, 32, 8, D, causal, "bfloat16")
        inputs = ATTENTION.make_inputs(problem, CUDA, seed=5)
        out, lse = ATTENTION.launch_baseline(ATTENTION.prepare(*inputs).args)
        check(out, lse, ATTENTION.reference(inputs))


def test_paths_reported_beside_the_baseline_match_the_reference_cuda():
    for causal, heads_kv in [(False, 32), (True, 8)]:
        problem = ATTENTION.Problem(2, 1024, 1024, 32, heads_kv, 128, causal, "bfloat16")
        inputs = ATTENTION.make_inputs(problem, CUDA, seed=11)
        (flash,) = ATTENTION.reported_beside(ATTENTION.prepare(*inputs).args).values()
        out = flash().transpose(1, 2)
        assert rel_error(out, ATTENTION.reference(inputs)[0]) < 1e-2


def test_dynamic_lengths_do_not_recompile_cuda():
    def run(B, S):
        q = torch.randn(B, S, 32, 128, device=CUDA, dtype=torch.bfloat16)
        k = torch.randn(B, S, 8, 128, device=CUDA, dtype=torch.bfloat16)
        return tileops.flash_attention(q, k, k, causal=True)

    run(2, 1000)
    before = len(dispatch._kernels)
    for B, S in [(2, 600), (2, 1024), (1, 999)]:
        assert run(B, S).shape == (B, S, 32, 128)
    assert len(dispatch._kernels) == before


@SCHEDULES
def test_nan_propagates_and_rows_without_keys_get_zeros_cuda(schedule):
    # One NaN in k poisons exactly the outputs that see it (as SDPA and the float64 reference);
    # queries that see no key (seqlen_q > seqlen_kv, causal) still get zeros and -inf.
    problem = ATTENTION.Problem(1, 1024, 512, 8, 2, 128, True, "bfloat16")
    kernel = compiled(problem, schedule)
    q, k, v, _ = ATTENTION.make_inputs(problem, CUDA, seed=4, sizes={"seqlen_q": 700,
                                                                     "seqlen_kv": 300})
    k[0, 5, 1, 7] = float("nan")  # key 5 of KV head 1 (query heads 4-7)
    out, lse = ATTENTION.launch(kernel, ATTENTION.prepare(q, k, v, True).args)
    ref_out, ref_lse = ATTENTION.reference((q, k, v, True))
    assert torch.equal(out.isnan(), ref_out.isnan()) and out.isnan().any()
    assert torch.equal(lse.isnan(), ref_lse.isnan())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    unseen = torch.isneginf(ref_lse).transpose(1, 2)  # (batch, seqlen_q, heads_q)
    assert unseen.any() and (out[unseen] == 0).all()
    finite = ~ref_out.isnan()
    assert rel_error(out[finite], ref_out[finite]) < 1e-2
