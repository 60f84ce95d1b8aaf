"""What serving engines need on a CUDA GPU: CUDA-graph capture and replay, torch's current stream,
and `torch.compile(mode="reduce-overhead")` (marked `gpu`: skipped cleanly without one).

MLA decode is captured with its per-step metadata (`tileops.mla_metadata`), which makes its
problem key from the host alone, and without it (the key from the table width).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_error

import tileops
from tileops.ops import get_spec
from tileops.ops.mla import MLA_DECODE

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")

# (operator, problem text, dtype, the call on make_inputs' tensors)
CASES = [
    ("gemm", "16x4096x4096", "bfloat16", lambda a, b, out_dtype: tileops.gemm(a, b)),
    ("gemm", "1000x1024x512", "float16", lambda a, b, out_dtype: tileops.gemm(a, b)),
    ("attention", "2x1000x1000x16x4x128:causal", "bfloat16",
     lambda q, k, v, causal: tileops.flash_attention(q, k, v, causal=causal)),
    ("mxfp4_gemm", "16x4096x4096", "bfloat16", lambda a, w, s: tileops.mxfp4_gemm(a, w, s)),
]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize(("op", "text", "dtype", "call"), CASES, ids=[c[0] + "-" + c[2]
                                                                     for c in CASES])
def test_captured_in_a_cuda_graph_and_replayed_on_new_data(op, text, dtype, call):
    spec = get_spec(op)
    problem = spec.parse_problem(text, dtype)
    inputs = spec.make_inputs(problem, CUDA, seed=1)
    call(*inputs)  # warm-up: resolve and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*inputs)
    for seed in (2, 3):
        fresh = spec.make_inputs(problem, CUDA, seed=seed)
        for mine, new in zip(inputs, fresh, strict=True):
            if isinstance(mine, torch.Tensor):
                mine.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = _first(spec.reference(fresh))
        assert rel_error(_first(out), ref) < spec.tolerance(problem)


def _mla_step(problem, seed, seqlens):
    """make_inputs' tensors for a decode step, with these lengths (within the table's width)."""
    q, kv, table, _ = MLA_DECODE.make_inputs(problem, CUDA, seed=seed)
    return q, kv, table, torch.tensor(seqlens, dtype=torch.int32, device=CUDA)


def _mla_replays(graph, problem, inputs, steps):
    """Each later step's tensors copied into the captured ones and the graph replayed: yields
    the step's fresh tensors after its replay."""
    for seed, seqlens in enumerate(steps[1:], start=2):
        fresh = _mla_step(problem, seed, seqlens)
        for mine, new in zip(inputs, fresh, strict=True):
            mine.copy_(new)
        graph.replay()
        yield fresh


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("with_metadata", [True, False])
def test_mla_decode_captured_and_replayed_on_new_lengths(s_q, with_metadata):
    # One graph per bucket, replayed on steps with new q, cache contents, tables and lengths (the
    # same bucket): each replay gives what the eager call on that step's tensors gives.
    problem = MLA_DECODE.Problem(4, 4096, 128, s_q, "bfloat16")
    steps = [[4096, 3000, 2100, 4001], [2500, 4096, 3333, 2049], [4000, 4000, 2222, 3500]]
    inputs = _mla_step(problem, 1, steps[0])
    md = tileops.mla_metadata(inputs[3], 128, s_q) if with_metadata else None
    tileops.mla_decode(*inputs, metadata=md)  # warm-up: resolve and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = tileops.mla_decode(*inputs, metadata=md)
    for fresh in _mla_replays(graph, problem, inputs, steps):
        eager = tileops.mla_decode(*fresh, metadata=md)
        torch.cuda.synchronize()
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
        assert rel_error(out, MLA_DECODE.reference(fresh)[0]) < MLA_DECODE.tolerance(problem)


def test_mla_decode_plans_inside_the_graph_from_the_steps_lengths():
    # The step's metadata made inside the capture (max_seqlen given: no read back): each replay
    # re-plans from the lengths then in cache_seqlens, a ragged mix among them.
    problem = MLA_DECODE.Problem(6, 4096, 16, 1, "bfloat16")
    steps = [[4096, 3000, 2100, 4001, 64, 1], [100, 4096, 333, 2049, 3900, 0],
             [4000, 4000, 4000, 4000, 4000, 4000]]
    inputs = _mla_step(problem, 1, steps[0])
    tileops.mla_decode(*inputs, metadata=tileops.mla_metadata(inputs[3], 16, max_seqlen=4096))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        md = tileops.mla_metadata(inputs[3], 16, max_seqlen=4096)
        out, lse = tileops.mla_decode(*inputs, metadata=md)
    for fresh in _mla_replays(graph, problem, inputs, steps):
        eager = tileops.mla_decode(*fresh, metadata=tileops.mla_metadata(fresh[3], 16))
        torch.cuda.synchronize()
        assert torch.equal(md.plan.seqs, tileops.mla_metadata(fresh[3], 16).plan.seqs)  # re-planned
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
        ref = MLA_DECODE.reference(fresh)
        seen = fresh[3] > 0
        assert rel_error(out[seen], ref[0][seen]) < MLA_DECODE.tolerance(problem)


def test_mla_decode_strict_mode_is_refused_inside_capture():
    problem = MLA_DECODE.Problem(2, 1024, 16, 1, "bfloat16")
    inputs = MLA_DECODE.make_inputs(problem, CUDA, seed=1)
    md = tileops.mla_metadata(inputs[3], 16)
    tileops.mla_decode(*inputs, metadata=md)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="validate=True"), torch.cuda.graph(graph):
        tileops.mla_decode(*inputs, metadata=md, validate=True)


def test_empty_operands_eagerly_and_inside_capture():
    """A step in which an MoE expert gets no token, or a query sees no key: torch's result with
    no kernel of ours, eagerly and inside a captured graph (where it is made at capture)."""
    x = torch.randn(0, 512, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(256, 512, device=CUDA, dtype=torch.bfloat16)
    w_fp4, w_scale = tileops.quantize_mxfp4(w.float())
    packed = tileops.prepack_mxfp4(w_fp4, w_scale)
    q = torch.randn(2, 8, 4, 128, device=CUDA, dtype=torch.bfloat16)
    kv = q[:, :0]
    calls = [lambda: tileops.gemm(x, w.t()), lambda: tileops.gemm(w[:, :0], w[:16, :0].t()),
             lambda: tileops.mxfp4_gemm(x, w_fp4, w_scale), lambda: tileops.mxfp4_gemm(x, packed),
             lambda: tileops.flash_attention(q, kv, kv, return_lse=True)[1]]
    shapes = [(0, 256), (256, 16), (0, 256), (0, 256), (2, 4, 8)]
    for out, shape in zip([call() for call in calls], shapes, strict=True):
        assert out.shape == shape and out.device.type == "cuda"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    graph.replay()
    torch.cuda.synchronize()
    assert [tuple(o.shape) for o in outs] == shapes
    assert bool((outs[-1] == -torch.inf).all())  # no key: the log-sum-exp of nothing
    out, lse = tileops.flash_attention(q, kv, kv, return_lse=True)
    assert not out.any() and bool((lse == -torch.inf).all())


def test_launches_go_on_the_current_stream():
    # The inputs are written on a side stream right before the call there; a launch on another
    # stream would read them half-written.
    a = torch.empty(64, 4096, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    tileops.gemm(a.normal_(), w.t())  # warm-up
    side = torch.cuda.Stream()
    for _ in range(5):
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # keeps the side stream busy
            a.normal_()
            out = tileops.gemm(a, w.t())
            ref = a.double() @ w.double().t()
        side.synchronize()
        assert rel_error(out, ref) < 1e-2


def test_reduce_overhead_compile_of_a_small_model():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512, bias=False, device=CUDA,
                                       dtype=torch.bfloat16)

        def forward(self, x):
            q, k, v = tileops.gemm(x.flatten(0, 1), self.qkv.weight.t()).view(
                *x.shape[:2], 3, 4, 128).unbind(2)
            return tileops.flash_attention(q, k, v, causal=True).flatten(2)

    model = Block()
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(2, 256, 512, device=CUDA, dtype=torch.bfloat16,
                            generator=torch.Generator(CUDA).manual_seed(seed))
            got = compiled(x)
            q, k, v = (x.flatten(0, 1) @ model.qkv.weight.t()).view(2, 256, 3, 4, 128).unbind(2)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True).transpose(1, 2).flatten(2)
            assert rel_error(got, want) < 2e-2
