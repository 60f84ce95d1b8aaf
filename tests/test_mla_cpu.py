"""MLA decode on the CPU target: real TileLang kernels against a float64 reference.

Few distinct kernels (each CPU compile costs seconds): a kernel depends only on (h_q, s_q, dtype)
and the configuration, so every batch and length below with the same three shares one.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.mla import MLA_DECODE, reference
from tileops.target import target_of

CPU = torch.device("cpu")


def paged(seqlens: list[int], h_q: int, s_q: int, dtype=torch.float32, seed: int = 0,
          spare: int = 1):
    """Inputs with the given lengths: pages shuffled over the cache, unused entries -1."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // 64) for n in seqlens]
    width = max(counts) + spare
    num_blocks = sum(counts) + 2
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(seqlens), width), -1, dtype=torch.int32)
    at = 0
    for b, c in enumerate(counts):
        table[b, :c] = perm[at:at + c]
        at += c
    q = torch.randn(len(seqlens), s_q, h_q, 576, generator=gen).to(dtype)
    kv = torch.randn(num_blocks, 64, 1, 576, generator=gen).to(dtype)
    return q, kv, table, torch.tensor(seqlens, dtype=torch.int32)


def check(out, lse, ref, tol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref[0]) < tol
    assert (lse.double() - ref[1]).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("seqlens", "s_q", "dtype", "tol"),
    [
        ([1, 65, 200, 64], 1, torch.float32, 1e-5),   # seqlen 1, odd lengths, a full page
        ([2, 129, 77], 2, torch.float32, 1e-5),       # s_q = 2: causal within the new tokens
        ([300, 3], 1, torch.bfloat16, 1e-2),
        ([190, 64], 2, torch.float16, 1e-2),
    ],
)
def test_matches_float64_reference(seqlens, s_q, dtype, tol):
    inputs = paged(seqlens, 16, s_q, dtype, seed=len(seqlens))
    out, lse = tileops.mla_decode(*inputs)
    assert out.shape == (len(seqlens), s_q, 16, 512) and out.dtype == dtype
    assert lse.shape == (len(seqlens), 16, s_q) and lse.dtype == torch.float32
    check(out, lse, reference(*inputs), tol)


def test_causal_rule_for_two_tokens():
    # Token 0 of s_q = 2 must not see the last key: make that key dominate and compare.
    q, kv, table, seqlens = paged([70], 16, 2)
    last = kv[table[0, 1], 5, 0]  # key 69
    last.copy_(q[0, 1, 0] * 3)
    out, lse = tileops.mla_decode(q, kv, table, seqlens)
    check(out, lse, reference(q, kv, table, seqlens), 1e-5)
    assert (lse[0, 0, 1] - lse[0, 0, 0]) > 1  # token 1 sees the dominant key, token 0 does not


def test_softmax_scale():
    inputs = paged([100, 33], 16, 1, seed=3)
    out, lse = tileops.mla_decode(*inputs, softmax_scale=0.1)
    check(out, lse, reference(*inputs, softmax_scale=0.1), 1e-5)
    default = tileops.mla_decode(*inputs)
    check(*default, reference(*inputs, softmax_scale=576 ** -0.5), 1e-5)


def test_splits_combine_every_element_written_and_stale_rows_ignored():
    # A split-KV kernel called directly on NaN-filled (out, lse) buffers, with NaN in every cache
    # row past the lengths: every output written, nothing stale read into the result. Seqlen 2
    # with 3 splits leaves splits without keys.
    target = target_of(CPU)
    problem = MLA_DECODE.Problem(3, 256, 16, 2, "float32")
    config = {"block_H": 32, "block_N": 16, "num_splits": 3}
    kernel = dispatch.compile_kernel(MLA_DECODE, problem, config, target)
    q, kv, table, seqlens = paged([2, 200, 150], 16, 2, seed=5)
    for b, n in enumerate(seqlens.tolist()):
        kv[table[b, n // 64], n % 64:] = float("nan")
    call = MLA_DECODE.prepare(q, kv, table, seqlens)
    assert call.problem == problem
    out = (torch.full((3, 2, 16, 512), float("nan")), torch.full((3, 16, 2), float("nan")))
    got = MLA_DECODE.launch(kernel, call.args, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    check(*out, reference(q, kv, table, seqlens), 1e-5)


def test_one_kernel_for_batches_and_lengths():
    for seqlens in ([40], [33, 64, 17], [60, 1]):  # one bucket (64), three batch sizes
        inputs = paged(seqlens, 16, 1, seed=len(seqlens))
        check(*tileops.mla_decode(*inputs), reference(*inputs), 1e-5)
    kernels = [k for k in dispatch._kernels if k[0] == "mla_decode" and k[2] == (16, 1, "float32")]
    assert len(kernels) == 1
    keys = {p for (op, _, p) in dispatch.DISPATCHER.choices if op == "mla_decode"}
    assert {p.seqlen for p in keys} == {64} and {p.batch for p in keys} == {1, 2, 3}


def test_baseline_matches_reference():
    inputs = paged([130, 5], 16, 2, seed=9)
    out, lse = MLA_DECODE.launch_baseline(MLA_DECODE.prepare(*inputs).args)
    check(out, lse, reference(*inputs), 1e-5)


def test_make_inputs_builds_a_shuffled_paged_problem():
    problem = MLA_DECODE.parse_problem("B3xS1000xH16xQ2", "bfloat16")
    assert problem == MLA_DECODE.Problem(3, 1024, 16, 2, "bfloat16")
    q, kv, table, seqlens = MLA_DECODE.make_inputs(problem, CPU, seed=1, sizes={"seqlen": 513})
    assert int(seqlens.max()) == 513 and int(seqlens.min()) >= 450
    assert MLA_DECODE.prepare(q, kv, table, seqlens).problem.seqlen == 1024
    used = table[table >= 0]
    assert len(used.unique()) == len(used) and not torch.equal(used, used.sort().values)


def test_parse_problem_errors():
    assert MLA_DECODE.parse_problem("b64xs4096xh128", "bfloat16").s_q == 1
    for text in ("64x4096x128", "B1xS4096xH24", "B1xS4096xH16xQ3", "B1xS1xH16xQ2"):
        with pytest.raises(ValueError, match="bad MLA decode problem"):
            MLA_DECODE.parse_problem(text, "bfloat16")


def test_suite_loads():
    from tileops.tuner import suites

    suite = suites.load("mla_decode")
    assert suite.op == "mla_decode" and len(suite.problems) == 32
    assert {p.dtype for p in suite.problems} == {"bfloat16"}


def _bad(**change):
    q, kv, table, seqlens = paged([100, 70], 16, 1)
    args = {"q": q, "kv_cache": kv, "block_table": table, "cache_seqlens": seqlens}
    args.update({k: v(args[k]) if callable(v) else v for k, v in change.items()})
    return args


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"q": lambda q: q[..., :512]}, ValueError, "q must be"),
        ({"q": lambda q: q[:, :, :5]}, ValueError, "h_q = 5"),
        ({"q": lambda q: torch.cat([q] * 3, dim=1)}, ValueError, "s_q 3|s_q = 3"),
        ({"kv_cache": lambda kv: kv.view(-1, 32, 1, 576)}, ValueError, "kv_cache must be"),
        ({"kv_cache": lambda kv: kv.half()}, TypeError, "same dtype"),
        ({"q": lambda q: q.double(), "kv_cache": lambda kv: kv.double()}, TypeError, "float64"),
        ({"block_table": lambda t: t.long()}, TypeError, "block_table must be int32"),
        ({"cache_seqlens": lambda s: s.long()}, TypeError, "cache_seqlens must be int32"),
        ({"block_table": lambda t: t[:1]}, ValueError, "block_table must be"),
        ({"cache_seqlens": lambda s: s[:1]}, ValueError, "cache_seqlens must be"),
        ({"cache_seqlens": lambda s: torch.tensor([100, 0], dtype=torch.int32)}, ValueError,
         "at least s_q"),
        ({"cache_seqlens": lambda s: torch.tensor([100, 200], dtype=torch.int32)}, ValueError,
         "block_table has 3 pages"),
        ({"block_table": lambda t: t.masked_fill(t == t[1, 1], 99)}, ValueError, "entry 99"),
        ({"block_table": lambda t: t.masked_fill(t == t[0, 0], -1)}, ValueError, "entry -1"),
        ({"kv_cache": lambda kv: kv.transpose(0, 1).contiguous().transpose(0, 1)}, ValueError,
         "contiguous"),
        ({"cache_seqlens": lambda s: s.to("meta")}, ValueError, "different devices"),
        ({"q": [[1.0]]}, TypeError, "q must be a tensor"),
        ({"softmax_scale": -0.1}, ValueError, "softmax_scale must be positive"),
        ({"softmax_scale": 0.0}, ValueError, "softmax_scale must be positive"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
        ({"softmax_scale": float("inf")}, ValueError, "softmax_scale must be finite"),
        ({"softmax_scale": "x"}, TypeError, "softmax_scale must be a number"),
        ({name: (lambda t: t.to("meta")) for name in ("q", "kv_cache", "block_table",
                                                      "cache_seqlens")},
         ValueError, "CUDA and CPU tensors, not meta"),
    ],
)
def test_bad_input_is_refused_clearly(change, exc, match):
    with pytest.raises(exc, match=match):
        tileops.mla_decode(**_bad(**change))


def test_unused_table_entries_are_not_checked():
    q, kv, table, seqlens = paged([100, 10], 16, 1)
    table[1, 1:] = 10_000  # past sequence 1's pages: never read, so not an error
    check(*tileops.mla_decode(q, kv, table, seqlens), reference(q, kv, table, seqlens), 1e-5)


def test_validate_false_skips_the_table_check():
    call = MLA_DECODE.prepare(*_bad(block_table=lambda t: t.masked_fill(t == t[1, 1], 99))
                              .values(), validate=False)
    assert call.problem.seqlen == 128
    assert math.isclose(call.args.scale_log2, 576 ** -0.5 / math.log(2))


def test_under_torch_compile():
    inputs = paged([90, 20], 16, 1, seed=11)

    def layer(q):
        out, lse = tileops.mla_decode(q, *inputs[1:])
        return out * 2, lse

    compiled = torch.compile(layer, fullgraph=True)
    out, lse = compiled(inputs[0])
    ref = reference(*inputs)
    assert rel_error(out, 2 * ref[0]) < 1e-5 and rel_error(lse, ref[1]) < 1e-6


def test_custom_op_is_registered():
    inputs = paged([50], 16, 1, seed=12)
    check(*torch.ops.tileops.mla_decode(*inputs), reference(*inputs), 1e-5)


def test_a_row_that_sees_no_key_gets_zeros_and_minus_inf_as_in_attention():
    # Unvalidated calls may ask for sequences shorter than s_q: an empty sequence, and with
    # s_q = 2 a length of 1 leaves token 0 no key. Such rows used to come out NaN from the
    # combine (-inf - -inf); flash_attention gives zeros and a log-sum-exp of -inf.
    cases = [(1, [0, 70], {"block_H": 16, "block_N": 32, "num_splits": 1}, 16),
             (2, [0, 1, 150], {"block_H": 32, "block_N": 16, "num_splits": 3}, 2 * 16 + 16)]
    for s_q, seqlens, config, rows_without_keys in cases:
        q, kv, table, lens = paged([max(n, 1) for n in seqlens], 16, s_q, seed=s_q)
        lens = torch.tensor(seqlens, dtype=torch.int32)
        problem = MLA_DECODE.prepare(q, kv, table, lens, validate=False).problem
        kernel = dispatch.compile_kernel(MLA_DECODE, problem, config, target_of(CPU))
        call = MLA_DECODE.prepare(q, kv, table, lens, validate=False)
        out, lse = MLA_DECODE.launch(kernel, call.args)
        ref_out, ref_lse = reference(q, kv, table, lens)
        unseen = torch.isneginf(ref_lse).transpose(1, 2)  # (batch, s_q, h_q)
        assert unseen[0].all() and unseen[-1].sum() == 0 and unseen.sum() == rows_without_keys
        assert (out[unseen] == 0).all() and not out.isnan().any()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        check(out, lse.nan_to_num(neginf=0), (ref_out, ref_lse.nan_to_num(neginf=0)), 1e-5)


def test_nan_in_the_cache_propagates():
    q, kv, table, lens = paged([70, 40], 16, 1, seed=9)
    kv[table[0, 1], 3, 0, 100] = float("nan")  # key 67 of sequence 0
    out, lse = tileops.mla_decode(q, kv, table, lens)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert not out[1].isnan().any() and not lse[1].isnan().any()
