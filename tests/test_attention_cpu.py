"""FlashAttention forward on the CPU target: real TileLang kernels against a float64 reference.

Few distinct kernels (each CPU compile costs seconds): the kernel is dynamic in batch and both
sequence lengths, so every shape below with the same heads, head_dim, causal flag and dtype
shares one compiled kernel.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.attention import ATTENTION
from tileops.target import Target, target_of
from tileops.tuner.evaluate import relative_error

CPU = torch.device("cpu")


def check(out: torch.Tensor, lse: torch.Tensor, ref: tuple, tol: float) -> None:
    ref_out, ref_lse = ref
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref_out) < tol
    masked = torch.isinf(ref_lse)  # queries that see no key: lse -inf, output 0
    assert torch.equal(torch.isneginf(lse), masked)
    assert (out.transpose(1, 2)[masked] == 0).all()
    if (~masked).any():
        assert (lse[~masked].double() - ref_lse[~masked]).abs().max() < 10 * tol


@pytest.mark.parametrize(
    ("B", "Sq", "Skv", "Hq", "Hkv", "D", "causal", "dtype"),
    [
        (2, 37, 70, 4, 2, 64, False, "float32"),   # odd lengths, seqlen_q < seqlen_kv, GQA
        (1, 70, 37, 4, 2, 64, False, "float32"),   # seqlen_q > seqlen_kv
        (2, 37, 70, 4, 2, 64, True, "float32"),    # causal, bottom-right aligned
        (1, 70, 37, 4, 2, 64, True, "float32"),    # causal: the first 33 queries see nothing
        (3, 1, 1, 4, 2, 64, True, "float32"),      # seqlen 1
        (1, 1, 50, 4, 2, 64, True, "float32"),     # one query (decode) sees every key
        (2, 33, 33, 4, 1, 64, True, "bfloat16"),   # MQA
        (1, 20, 45, 2, 2, 128, False, "float16"),  # head_dim 128, MHA
    ],
)
def test_matches_float64_reference(B, Sq, Skv, Hq, Hkv, D, causal, dtype):
    problem = ATTENTION.Problem(B, Sq, Skv, Hq, Hkv, D, causal, dtype)
    q, k, v, _ = ATTENTION.make_inputs(problem, CPU, seed=Sq * 100 + Skv)
    out, lse = tileops.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    check(out, lse, ATTENTION.reference((q, k, v, causal)), ATTENTION.tolerance(problem))


def test_softmax_scale_and_plain_output():
    q, k, v = torch.randn(1, 9, 4, 64), torch.randn(1, 12, 2, 64), torch.randn(1, 12, 2, 64)
    out = tileops.flash_attention(q, k, v, softmax_scale=0.3)
    assert isinstance(out, torch.Tensor)
    ref_out, _ = ATTENTION.reference((q, k, v, False, 0.3))
    assert rel_error(out, ref_out) < 1e-5


def test_every_element_written_after_nan_poisoning():
    # spec.launch takes `out` as the pair (O, LSE): both are NaN-filled and must be overwritten.
    target = target_of(CPU)
    problem = ATTENTION.Problem(2, 64, 64, 4, 2, 64, True, "float32")
    kernel = dispatch.compile_kernel(ATTENTION, problem, {"block_M": 16, "block_N": 32}, target)
    for Sq, Skv in [(45, 19), (17, 64), (64, 33)]:
        inputs = ATTENTION.make_inputs(problem, CPU, seed=Sq, sizes={"seqlen_q": Sq,
                                                                     "seqlen_kv": Skv})
        call = ATTENTION.prepare(*inputs)
        out = (torch.full((2, Sq, 4, 64), math.nan), torch.full((2, 4, Sq), math.nan))
        result = ATTENTION.launch(kernel, call.args, out=out)
        assert result[0] is out[0] and result[1] is out[1]
        check(*out, ATTENTION.reference(inputs), 1e-5)
        # The tuner's check takes the pair too, masked rows' -inf lse included.
        assert relative_error(out, ATTENTION.reference(inputs)) < 1e-5


def test_dynamic_lengths_one_kernel():
    before = len(dispatch._kernels)
    for B, Sq, Skv in [(1, 5, 7), (2, 40, 9), (3, 100, 129)]:  # several buckets, one kernel
        q, k, v = torch.randn(B, Sq, 4, 64), torch.randn(B, Skv, 2, 64), torch.randn(B, Skv, 2, 64)
        out = tileops.flash_attention(q, k, v)
        assert rel_error(out, ATTENTION.reference((q, k, v, False))[0]) < 1e-5
    assert len(dispatch._kernels) <= before + 1
    problems = {p for (name, _, p) in dispatch.DISPATCHER.choices if name == "attention"}
    assert {(p.seqlen_q, p.seqlen_kv) for p in problems} >= {(8, 8), (64, 16), (128, 256)}


def test_non_contiguous_heads_are_copied():
    base = torch.randn(1, 4, 11, 64)  # (b, h, s, d) memory: the (b, s, h, d) view is strided
    q = k = v = base.transpose(1, 2)
    out = tileops.flash_attention(q, k, v)
    assert rel_error(out, ATTENTION.reference((q, k, v, False))[0]) < 1e-5


def test_baseline_matches_reference():
    problem = ATTENTION.Problem(1, 16, 24, 4, 2, 64, True, "float32")
    inputs = ATTENTION.make_inputs(problem, CPU, seed=1, sizes={"seqlen_q": 13, "seqlen_kv": 9})
    out, lse = ATTENTION.launch_baseline(ATTENTION.prepare(*inputs).args)
    check(out, lse, ATTENTION.reference(inputs), 1e-5)


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((_t(1, 4, 2, 64), _t(1, 4, 2, 128), _t(1, 4, 2, 128)), ValueError, "head dims"),
        ((_t(1, 4, 3, 64), _t(1, 4, 2, 64), _t(1, 4, 2, 64)), ValueError, "multiple of heads_kv"),
        ((_t(1, 4, 2, 64), _t(1, 4, 2, 64, dtype=torch.float16), _t(1, 4, 2, 64)), TypeError,
         "must match"),
        ((_t(1, 4, 2, 64, dtype=torch.float64),) * 3, TypeError, "float64"),
        ((_t(4, 2, 64),) * 3, ValueError, "4-D"),
        ((_t(1, 4, 2, 96),) * 3, ValueError, "head_dim 96"),
        ((_t(1, 4, 2, 64), _t(1, 5, 2, 64), _t(1, 6, 2, 64)), ValueError, "k and v shapes"),
        ((_t(1, 4, 2, 64), _t(2, 4, 2, 64), _t(2, 4, 2, 64)), ValueError, "batch sizes"),
        ((_t(1, 4, 2, 64), _t(1, 4, 0, 64), _t(1, 4, 0, 64)), ValueError, "heads_kv"),
        ((_t(1, 4, 2, 64), _t(1, 4, 2, 64, device="meta"), _t(1, 4, 2, 64)), ValueError,
         "different devices"),
        ((_t(1, 4, 2, 128)[..., ::2],) * 3, ValueError, "contiguous"),
        ((_t(1, 4, 2, 64), [[1.0]], _t(1, 4, 2, 64)), TypeError, "tensors"),
    ],
)
def test_bad_input_is_refused_clearly(args, exc, match):
    with pytest.raises(exc, match=match):
        tileops.flash_attention(*args)


@pytest.mark.parametrize(("q", "kv"), [
    ((0, 16, 2, 64), (0, 16, 2, 64)),   # no sequence
    ((1, 0, 2, 64), (1, 16, 2, 64)),    # no query
    ((1, 8, 2, 64), (1, 0, 2, 64)),     # no key: every query sees none
    ((1, 8, 0, 64), (1, 8, 2, 64)),     # no query head
])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_sizes_give_the_result_of_nothing_to_attend(q, kv, causal):
    """As torch allows empty tensors: empty outputs, and queries that see no key get what such a
    query gets in a full call (zeros, a log-sum-exp of -inf); gradients are zeros."""
    q, k, v = (_t(*shape).requires_grad_() for shape in (q, kv, kv))
    out, lse = tileops.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert not out.any() and bool((lse == -math.inf).all())
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


def test_metal_is_refused():
    metal = Target("metal", "", "Apple M2")
    assert "Metal" in ATTENTION.unsupported_reason(metal)
    with pytest.raises(ValueError, match="Metal"):
        ATTENTION.space(metal)


def test_parse_problem():
    p = ATTENTION.parse_problem("8x4096x4096x32x8x128:causal", "bfloat16")
    assert p == ATTENTION.Problem(8, 4096, 4096, 32, 8, 128, True, "bfloat16")
    assert ATTENTION.parse_problem("2x1000x64x128", "float16") == ATTENTION.Problem(
        2, 1024, 1024, 64, 64, 128, False, "float16")
    for bad in ("8x4096x32x8x128", "2x16x16x3x2x64", "2x16x16x4x2x96", "2x16x16x4x2x64:c"):
        with pytest.raises(ValueError, match="attention shape"):
            ATTENTION.parse_problem(bad, "bfloat16")
    exact = ATTENTION.parse_exact("2x3000x1000x32x8x128:causal", "bfloat16")
    assert exact == ATTENTION.Problem(2, 3000, 1000, 32, 8, 128, True, "bfloat16")
    assert ATTENTION.bucket(exact) == ATTENTION.parse_problem("2x3000x1000x32x8x128:causal",
                                                              "bfloat16")


def test_harness_times_the_lengths_a_suite_names(tmp_path):
    """benchmarks/harness.py runs a suite's cases at their own lengths (100 and 120: one bucket,
    one kernel), not at the bucket's 128."""
    loaded = importlib.util.spec_from_file_location(
        "harness", Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py")
    harness = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(harness)
    suite, out = tmp_path / "odd.toml", tmp_path / "out.json"
    suite.write_text('op = "attention"\ndtypes = ["float32"]\n'
                     'problems = ["1x100x100x4x2x64:causal", "1x120x120x4x2x64:causal"]\n')
    assert harness.main(["--suite", str(suite), "--device", "cpu", "--jobs", "0",
                         "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["problem"]["seqlen_q"], c["problem"]["seqlen_kv"]) for c in cases] == [
        (100, 100), (120, 120)]


def test_flops_and_bytes():
    p = ATTENTION.Problem(2, 1024, 1024, 32, 8, 128, False, "bfloat16")
    assert ATTENTION.flops(p) == 4 * 2 * 32 * 1024 * 1024 * 128
    causal = ATTENTION.flops(p._replace(causal=True))
    assert causal == 4 * 2 * 32 * 128 * 1024 * 1025 / 2
    # seqlen_q < seqlen_kv: query i sees i + 1 + (Skv - Sq) keys
    assert ATTENTION.flops(p._replace(seqlen_q=2, seqlen_kv=4, causal=True)) == \
        4 * 2 * 32 * 128 * (3 + 4)
    assert ATTENTION.flops(p._replace(seqlen_q=4, seqlen_kv=2, causal=True)) == \
        4 * 2 * 32 * 128 * (1 + 2)
    assert ATTENTION.bytes_moved(p) == 2 * (2 * 2 * 1024 * 32 * 128 + 2 * 2 * 1024 * 8 * 128) + \
        4 * 2 * 32 * 1024


def test_under_torch_compile_and_custom_op():
    k, v = torch.randn(1, 10, 2, 64), torch.randn(1, 10, 2, 64)

    def layer(q):
        return tileops.flash_attention(q, k, v, causal=True) * 2

    q = torch.randn(1, 10, 4, 64)
    compiled = torch.compile(layer, fullgraph=True)
    ref = ATTENTION.reference((q, k, v, True))[0] * 2
    assert rel_error(compiled(q), ref) < 1e-5
    out, lse = torch.ops.tileops.attention(q, k, v, True)
    assert rel_error(out * 2, ref) < 1e-5 and lse.shape == (1, 4, 10)


def test_flash_backend_is_reported_beside_the_baseline_on_cuda_only():
    problem = ATTENTION.Problem(1, 64, 64, 4, 2, 64, True, "float32")
    call = ATTENTION.prepare(*ATTENTION.make_inputs(problem, CPU, seed=1))
    assert ATTENTION.reported_beside(call.args) == {}


def test_nan_inputs_propagate_and_only_rows_without_keys_get_zeros():
    # One NaN in k made every output of its head zero with a log-sum-exp of -inf; SDPA and the
    # reference give NaN. Queries that see no key still get zeros and -inf.
    q, k, v = torch.randn(1, 70, 4, 64), torch.randn(1, 37, 2, 64), torch.randn(1, 37, 2, 64)
    k[0, 5, 1, 7] = float("nan")  # key 5 of KV head 1 (query heads 2 and 3)
    q[0, 50, 0] = float("nan")  # a NaN query row
    for causal in (False, True):
        out, lse = tileops.flash_attention(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse = ATTENTION.reference((q, k, v, causal))
        assert torch.equal(out.isnan(), ref_out.isnan()) and out.isnan().any()
        assert torch.equal(lse.isnan(), ref_lse.isnan())
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
        if not causal:
            assert torch.equal(out.isnan(), sdpa.transpose(1, 2).isnan())
        else:  # queries 0..32 see no key, 33..37 only keys before the NaN one
            assert (out[0, :33] == 0).all() and torch.isneginf(lse[0, :, :33]).all()
            assert not out[0, 33:38].isnan().any() and out[0, 38:, 2:].isnan().all()
        finite = ~ref_out.isnan()
        assert rel_error(out[finite], ref_out[finite]) < 1e-5


@pytest.mark.parametrize(("scale", "exc", "match"), [
    (float("nan"), ValueError, "finite"), (float("inf"), ValueError, "finite"),
    (-float("inf"), ValueError, "finite"), ("x", TypeError, "must be a number"),
    (True, TypeError, "must be a number"),
])
def test_bad_softmax_scale_is_refused(scale, exc, match):
    q = torch.randn(1, 4, 2, 64)
    with pytest.raises(exc, match=match):
        tileops.flash_attention(q, q, q, softmax_scale=scale)


def test_dispatch_never_runs_a_baseline_on_repeated_heads():
    """The memory-efficient kernel (chunked prefill's baseline on CUDA) takes grouped K/V heads
    repeated to the query heads; its timing repeats them once, a call would at every call. So on
    CUDA a record saying it wins a grouped chunked problem runs the record's tile kernel. cuDNN
    (equal lengths) takes grouped heads natively, as the CPU's SDPA does: both dispatch."""
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132)
    cpu = target_of(CPU)
    chunked = ATTENTION.parse_problem("4x2048x8192x32x8x128:causal", "bfloat16")
    assert not ATTENTION.dispatches_baseline(chunked, h200)
    assert ATTENTION.dispatches_baseline(chunked, cpu)
    for text in ("32x1024x1024x32x8x128:causal", "32x1024x1024x32x32x128",
                 "4x2048x8192x32x32x128:causal", "4x2048x8192x32x8x128"):
        assert ATTENTION.dispatches_baseline(ATTENTION.parse_problem(text, "bfloat16"), h200)


def test_chunked_prefill_borrows_no_verdict_from_equal_lengths():
    """Records tuned at equal lengths compared cuDNN with the tile; a chunked call runs another
    baseline (memory-efficient, 3.2-3.6x slower than the tile on the H200): not comparable."""
    def p(text):
        return ATTENTION.parse_problem(text, "bfloat16")

    chunked = p("4x2048x8192x32x8x128:causal")
    assert ATTENTION.distance(chunked, p("4x2048x2048x32x8x128:causal")) is None
    assert ATTENTION.distance(chunked, p("4x1024x8192x32x8x128:causal")) == 1
    assert ATTENTION.distance(p("4x2048x8192x32x8x128"), p("4x2048x2048x32x8x128")) == 2
