"""The backward of flash_attention: gradients against a float64 reference (GQA, causal with either
length longer, the lse's gradient, a softmax scale), autograd and torch.compile wiring, the
checks of bad arguments, and (marked `gpu`) the sm_90 kernel with NaN-filled outputs; and the
same for the backward of flash_attention_varlen, with a NaN in one packed sequence and a CUDA
graph of the packed backward."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from helpers import rel_error
from test_codegen import A100, H200
from test_target_matrix import source as matrix_source

import tileops
from tileops import dispatch
from tileops.dispatch import DISPATCHER, lower
from tileops.ops.attention import ATTENTION_BACKWARD, ATTENTION_VARLEN_BACKWARD
from tileops.ops.attention.backward import attention_grads
from tileops.ops.attention.varlen_backward import per_sequence_grads

CPU = torch.device("cpu")


def leaves(B, Sq, Skv, Hq, Hkv, D, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=gen, device=device).to(dtype).requires_grad_()
            for S, H in ((Sq, Hq), (Skv, Hkv), (Skv, Hkv))]


def grads_of(q, k, v, causal, scale=None, lse_weight=0.0, seed=1):
    """Autograd's (dq, dk, dv) of sum(out * g) + lse_weight * sum(lse * h), and the float64
    reference's, for random g and h."""
    out, lse = tileops.flash_attention(q, k, v, causal=causal, softmax_scale=scale,
                                       return_lse=True)
    gen = torch.Generator(device=q.device).manual_seed(seed)
    g = torch.randn(out.shape, generator=gen, device=q.device).to(out.dtype)
    h = torch.randn(lse.shape, generator=gen, device=q.device) * lse_weight
    h = h.masked_fill(torch.isinf(lse), 0.0)  # rows that see no key: lse -inf, unused
    loss = (out.float() * g.float()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * h).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    scale = q.shape[3] ** -0.5 if scale is None else scale
    ref = attention_grads(q.detach(), k.detach(), v.detach(), g, causal, scale, torch.float64,
                          h if lse_weight else None)
    return got, ref


CPU_CASES = [  # (batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim, causal)
    (2, 37, 45, 4, 2, 64, False),   # GQA, lengths that end inside a block
    (2, 37, 45, 4, 4, 64, True),    # chunked prefill: fewer queries than keys
    (1, 50, 20, 4, 1, 64, True),    # MQA, rows that see no key
    (1, 33, 33, 2, 2, 128, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "Sq", "Skv", "Hq", "Hkv", "D", "causal"), CPU_CASES)
def test_cpu_gradients_match_float64(B, Sq, Skv, Hq, Hkv, D, causal, dtype):
    got, ref = grads_of(*leaves(B, Sq, Skv, Hq, Hkv, D, dtype, CPU, seed=Sq), causal)
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert g.dtype is dtype and g.shape == r.shape
        assert rel_error(g, r) < tol, name


def test_lse_gradient_and_softmax_scale():
    q, k, v = leaves(2, 30, 41, 4, 2, 64, torch.float32, CPU)
    got, ref = grads_of(q, k, v, True, scale=0.3, lse_weight=1.0)
    for g, r in zip(got, ref, strict=True):
        assert rel_error(g, r) < 1e-5


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # float32: the kernels' widest dtype
def test_gradcheck():
    q, k, v = leaves(1, 9, 12, 2, 1, 64, torch.float32, CPU)
    # float32, so coarse finite differences
    assert torch.autograd.gradcheck(lambda q, k, v: tileops.flash_attention(q, k, v, causal=True),
                                    (q, k, v), eps=1e-2, atol=2e-2, rtol=2e-2, fast_mode=True)


def test_backward_runs_through_its_own_operator(monkeypatch):
    calls = []
    dispatch_call = type(DISPATCHER).__call__

    def counted(self, spec, *args):
        calls.append(spec.name)
        return dispatch_call(self, spec, *args)

    monkeypatch.setattr(type(DISPATCHER), "__call__", counted)
    q, k, v = leaves(1, 20, 20, 2, 2, 64, torch.float32, CPU)
    tileops.flash_attention(q, k, v).sum().backward()
    assert calls == ["attention", "attention_backward"]
    assert q.grad is not None and k.grad is not None and v.grad is not None
    calls.clear()
    with torch.no_grad():  # no graph: the forward goes straight to dispatch
        tileops.flash_attention(q, k, v)
    assert calls == ["attention"]


def test_gradients_under_torch_compile():
    q, k, v = leaves(1, 24, 24, 4, 2, 64, torch.float32, CPU)

    def layer(q, k, v):
        return (tileops.flash_attention(q, k, v, causal=True) * 2).sum()

    compiled = torch.compile(layer, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(layer(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
        assert rel_error(g, w) < 1e-6


def test_bad_arguments_are_refused():
    q, k, v = (t.detach() for t in leaves(1, 8, 8, 2, 2, 64, torch.float32, CPU))
    out, lse = tileops.flash_attention(q, k, v, return_lse=True)
    g = torch.randn_like(out)
    ok = (q, k, v, out, g, lse)
    with pytest.raises(ValueError, match="grad_out must be shaped like q"):
        ATTENTION_BACKWARD.prepare(q, k, v, out, g[:, :4], lse)
    with pytest.raises(TypeError, match="out has dtype"):
        ATTENTION_BACKWARD.prepare(q, k, v, out.double(), g, lse)
    with pytest.raises(ValueError, match=r"lse must be a float tensor \(batch, heads_q"):
        ATTENTION_BACKWARD.prepare(*ok[:5], lse.transpose(1, 2))
    with pytest.raises(TypeError, match="lse must be float32"):
        ATTENTION_BACKWARD.prepare(*ok[:5], lse.double())
    three = torch.randn(1, 8, 3, 64)
    with pytest.raises(ValueError, match="heads_q"):
        ATTENTION_BACKWARD.prepare(q, three, three, out, g, lse)
    with pytest.raises(RuntimeError, match="no double backward"):
        ATTENTION_BACKWARD.prepare(*ok[:4], g.requires_grad_(), lse)


def test_sm90a_codegen_reduces_dq_through_tma():
    problem = ATTENTION_BACKWARD.Problem(2, 1024, 1024, 32, 8, 128, True, "bfloat16")
    config = ATTENTION_BACKWARD.default_config(problem, H200)
    assert ATTENTION_BACKWARD.check_config(problem, config, H200) is None
    src = lower(ATTENTION_BACKWARD.build(problem, config, H200), H200).kernel_source
    assert src.count("__global__") >= 3  # Delta, the main kernel, dQ's conversion
    assert "wgmma_rs" in src and "wgmma_ss" in src  # P^T and dS^T from registers
    assert "tma_store_add" in src  # dQ's reduce-add
    assert "sm_90" in ATTENTION_BACKWARD.unsupported_reason(A100)


@pytest.mark.parametrize("heads_kv", [8, 32])  # the last step's dQ buffer: even and any count
def test_sm90a_codegen_hands_dq_to_the_producer(heads_kv):
    """overlap 2: the consumers write dQ's tile and fence it; the producer warp, a step behind,
    issues the reduce-add, also for the last step after the loop."""
    problem = ATTENTION_BACKWARD.Problem(2, 1024, 1024, 32, heads_kv, 128, True, "bfloat16")
    config = {**ATTENTION_BACKWARD.default_config(problem, H200), "overlap": 2}
    assert ATTENTION_BACKWARD.check_config(problem, config, H200) is None
    src = lower(ATTENTION_BACKWARD.build(problem, config, H200), H200).kernel_source
    main = src[src.index("attention_backward_kernel_1("):]
    main = main[main.index("{"):]
    producer = main[main.index("warpgroup_reg_dealloc<24>"):main.index("warpgroup_reg_alloc<240>")]
    consumers = main[main.index("warpgroup_reg_alloc<240>"):]
    assert producer.count("tma_store_add") == 2 and "tma_store_add" not in consumers
    assert "dq_full" in producer and "dq_empty" in consumers
    assert consumers.index("fence_proxy_async", consumers.index("dq_empty")) < consumers.index(
        "dq_full")


# ---- CUDA (sm_90) ---------------------------------------------------------------------------------

GPU_CASES = [  # (batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim, causal, dtype)
    (2, 1000, 1000, 16, 4, 128, True, torch.bfloat16),    # odd lengths, GQA
    (2, 1000, 1000, 16, 4, 128, False, torch.bfloat16),
    (1, 777, 1299, 8, 8, 64, True, torch.float16),        # chunked prefill
    (1, 1299, 777, 8, 2, 64, True, torch.bfloat16),       # rows that see no key
    (1, 515, 515, 8, 1, 64, True, torch.bfloat16),        # MQA
]


@pytest.mark.gpu
@pytest.mark.parametrize(("B", "Sq", "Skv", "Hq", "Hkv", "D", "causal", "dtype"), GPU_CASES)
def test_cuda_gradients_match_float64(B, Sq, Skv, Hq, Hkv, D, causal, dtype):
    cuda = torch.device("cuda")
    got, ref = grads_of(*leaves(B, Sq, Skv, Hq, Hkv, D, dtype, cuda, seed=Sq), causal,
                        lse_weight=0.5)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert rel_error(g, r) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"block_M": 64, "block_N": 128, "num_stages": 2, "threads": 256, "overlap": 0},
    {"block_M": 64, "block_N": 64, "num_stages": 1, "threads": 128, "overlap": 0},
    {"block_M": 64, "block_N": 128, "num_stages": 2, "threads": 256, "overlap": 1},
    {"block_M": 64, "block_N": 64, "num_stages": 2, "threads": 128, "overlap": 1},
    {"block_M": 64, "block_N": 128, "num_stages": 2, "threads": 256, "overlap": 2},
])
def test_cuda_configs_write_every_element(config):
    """Each configuration into NaN-filled outputs, against the reference."""
    problem = ATTENTION_BACKWARD.Problem(2, 1024, 1024, 16, 4, 128, True, "bfloat16")
    check_every_gradient_written(ATTENTION_BACKWARD, problem, config,
                                 {"seqlen_q": 1000, "seqlen_kv": 1000})


def check_every_gradient_written(spec, problem, config, sizes):
    """One configuration of a backward into NaN-filled gradients, against the reference: an
    element it never wrote would stay NaN."""
    cuda = torch.device("cuda")
    inputs = spec.make_inputs(problem, cuda, sizes=sizes)
    call = spec.prepare(*inputs)
    kernel = dispatch.compile_kernel(spec, call.problem, config, tileops.target_of(cuda))
    out = tuple(torch.full_like(t, float("nan")) for t in inputs[:3])
    spec.launch(kernel, call.args, out=out)
    for g, r in zip(out, spec.reference(inputs), strict=True):
        assert not g.isnan().any() and rel_error(g, r) < 2e-2


@pytest.mark.gpu
def test_cuda_head_dim_256_is_refused_clearly():
    q, k, v = leaves(1, 64, 64, 2, 2, 256, torch.bfloat16, torch.device("cuda"))
    out = tileops.flash_attention(q, k, v)
    with pytest.raises(NotImplementedError, match="head_dim 256 has no CUDA kernel"):
        out.sum().backward()


# ---- flash_attention_varlen ---------------------------------------------------------------------

def packed(lengths_q, lengths_kv, Hq, Hkv, D, dtype, device, spare_keys=0, seed=0):
    """Packed leaves, with `spare_keys` key rows after the last sequence (no sequence's)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(n, H, D, generator=gen, device=device).to(dtype).requires_grad_()
               for n, H in ((sum(lengths_q), Hq), (sum(lengths_kv) + spare_keys, Hkv),
                            (sum(lengths_kv) + spare_keys, Hkv)))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_kv))
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_kv)


VARLEN_CASES = [  # (query lengths, key lengths, heads_q, heads_kv, causal)
    ([37, 1, 70, 5], [37, 1, 70, 5], 4, 2, True),   # GQA, a one-token sequence
    ([3, 40], [50, 41], 2, 1, False),               # fewer queries than keys
    ([40, 9, 0], [10, 0, 3], 2, 2, True),           # rows that see no key, an empty sequence
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lq", "lkv", "Hq", "Hkv", "causal"), VARLEN_CASES)
def test_varlen_cpu_gradients_match_float64(lq, lkv, Hq, Hkv, causal, dtype):
    q, k, v, cu_q, cu_k, mq, mk = packed(lq, lkv, Hq, Hkv, 64, dtype, CPU, spare_keys=3,
                                         seed=sum(lq))
    out, lse = tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                              softmax_scale=0.2, return_lse=True)
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    h = torch.randn(lse.shape, generator=gen).masked_fill(torch.isinf(lse), 0.0)
    loss = (out.float() * g.float()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * h).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    ref = per_sequence_grads(q.detach(), k.detach(), v.detach(), cu_q, cu_k, g, causal, 0.2,
                             torch.float64, h)
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    for name, a, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype is dtype and rel_error(a, r) < tol, name
    assert not got[1][-3:].any() and not got[2][-3:].any()  # the spare keys: zero gradients


@pytest.mark.parametrize(("device", "dtype"), [
    ("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_varlen_gradients_under_torch_compile(device, dtype):
    q, k, v, cu_q, cu_k, mq, mk = packed([20, 130], [20, 130], 4, 2, 64, dtype,
                                         torch.device(device))

    def layer(q, k, v):
        return tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True).sum()

    got = torch.autograd.grad(torch.compile(layer, fullgraph=True)(q, k, v), (q, k, v))
    want = torch.autograd.grad(layer(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
        assert rel_error(g, w) < (1e-6 if dtype is torch.float32 else 1e-2)


def test_varlen_backward_refuses_bad_results():
    q, k, v, cu_q, cu_k, mq, mk = (t.detach() if torch.is_tensor(t) else t
                                   for t in packed([5, 7], [5, 7], 2, 2, 64, torch.float32, CPU))
    out, lse = tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True)
    args = (q, k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"lse must be shaped \(2, 12\)"):
        ATTENTION_VARLEN_BACKWARD.prepare(*args, out, out, lse.t())
    with pytest.raises(TypeError, match="out and grad_out must have q's dtype"):
        ATTENTION_VARLEN_BACKWARD.prepare(*args, out, out.double(), lse)


def varlen_grads(lq, lkv, Hq, Hkv, D, causal, dtype, device, spare_keys=0, lse_weight=0.0,
                 poison=None, host_offsets=False):
    """Autograd's (dq, dk, dv) of sum(out * g) + lse_weight * sum(lse * h) for packed leaves,
    and the float64 reference's. `poison`: a sequence whose q, k, v and g rows are set to NaN;
    `host_offsets`: the offsets passed on the CPU."""
    q, k, v, cu_q, cu_k, mq, mk = packed(lq, lkv, Hq, Hkv, D, dtype, device, spare_keys,
                                         seed=sum(lq))
    if host_offsets:
        cu_q, cu_k = cu_q.cpu(), cu_k.cpu()
    gen = torch.Generator(device=device).manual_seed(1)
    g = torch.randn(q.shape, generator=gen, device=device).to(dtype)
    if poison is not None:
        with torch.no_grad():
            rows_q = slice(*cu_q[poison:poison + 2].tolist())
            rows_k = slice(*cu_k[poison:poison + 2].tolist())
            for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k), (g, rows_q)):
                t[rows] = float("nan")
    out, lse = tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                              return_lse=True)
    h = torch.randn(lse.shape, generator=gen, device=device) * lse_weight
    h = h.masked_fill(torch.isinf(lse), 0.0)
    loss = (out.float() * g.float()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * h).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    ref = per_sequence_grads(q.detach(), k.detach(), v.detach(), cu_q, cu_k, g, causal,
                             D ** -0.5, torch.float64, h if lse_weight else None)
    return got, ref, (cu_q.tolist(), cu_k.tolist())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_varlen_nan_in_one_sequence_stays_there_backward(device):
    """A tile's rows past its sequence are the next sequence's: a NaN among them must not reach
    this sequence's gradients through a product with zero (0 * NaN)."""
    got, ref, (cu_q, cu_k) = varlen_grads([70, 150, 60], [70, 150, 60], 4, 2, 64, False,
                                          torch.bfloat16, torch.device(device), poison=1)
    for g, r, cu in zip(got, ref, (cu_q, cu_k, cu_k), strict=True):
        for a, b in ((cu[0], cu[1]), (cu[2], cu[3])):
            assert not g[a:b].isnan().any() and rel_error(g[a:b], r[a:b]) < 1e-2
        assert g[cu[1]:cu[2]].isnan().all()


# ---- flash_attention_varlen on CUDA (sm_90) -------------------------------------------------------

def test_sm90a_codegen_packed_backward():
    """The packed main kernel: the dense one's products and reduce-add, the rows past a sequence
    zeroed in K, Q and dO and in dQ's tile by the consumers, and dK, dV stored row by row; a
    fourth kernel zeroes the gradients of the keys after the last sequence. A sequence's
    statistics start at any row, and a TMA box whose start is not 16-byte aligned stops the H200
    with an illegal instruction: their loads start at the 4-aligned row below."""
    problem = ATTENTION_VARLEN_BACKWARD.parse_exact("8192x2048x32x8x128:causal", "bfloat16")
    config = ATTENTION_VARLEN_BACKWARD.default_config(problem, H200)
    assert "hand schedules" in ATTENTION_VARLEN_BACKWARD.check_config(
        problem, {**config, "overlap": 0}, H200)
    src = matrix_source("attention_varlen_backward", "sm_90a")  # the default config's
    kernels = src.split("extern \"C\" __global__")[5:]  # the four definitions
    assert len(kernels) == 4
    main = kernels[2]
    producer = main[main.index("warpgroup_reg_dealloc<24>"):main.index("warpgroup_reg_alloc<240>")]
    consumers = main[main.index("warpgroup_reg_alloc<240>"):]
    assert producer.count("tma_store_add") == 2 and "wgmma" not in producer
    assert consumers.count("wgmma_rs") and consumers.count("wgmma_ss")
    assert consumers.count("__sync_thread_partial(10, 256)") == 6  # K, Q, dO: two barriers each
    assert "tma_store" not in consumers and "dK + " in consumers  # row stores, not TMA
    # dq's rows past the sequence zeroed before its tile goes to the reduce-add (0 * a NaN key)
    zero_dq = re.search(r"\*\(float2\*\)\(dq \+ \(i_\d+ \* 2\)\) = make_float2", consumers)
    assert zero_dq and zero_dq.start() < consumers.index("*(float2*)(((float*)dQ_s)")
    stat_loads = [line for line in producer.splitlines()
                  if "tma_load(LSE2_desc" in line or "tma_load(Delta_desc" in line]
    assert stat_loads and all("& 3)" in line for line in stat_loads)
    assert "sm_90" in ATTENTION_VARLEN_BACKWARD.unsupported_reason(A100)


VARLEN_GPU_CASES = [  # (query lengths, key lengths, heads_q, heads_kv, head_dim, causal, dtype)
    ([1000, 1, 129, 4097, 37], [1000, 1, 129, 4097, 37], 16, 4, 128, True, torch.bfloat16),
    ([1000, 1, 129, 4097, 37], [1000, 1, 129, 4097, 37], 16, 4, 128, False, torch.float16),
    ([333, 64, 1], [1337, 64, 50], 8, 2, 64, True, torch.bfloat16),  # fewer queries than keys
    ([1337, 64, 0], [333, 0, 70], 8, 1, 128, True, torch.bfloat16),  # no key, no query: MQA
]


@pytest.mark.gpu
@pytest.mark.parametrize("host_offsets", [False, True])
@pytest.mark.parametrize(("lq", "lkv", "Hq", "Hkv", "D", "causal", "dtype"), VARLEN_GPU_CASES)
def test_varlen_cuda_gradients_match_float64(lq, lkv, Hq, Hkv, D, causal, dtype, host_offsets):
    """Offsets on the GPU (the KV-block list made there) or on the host (made there)."""
    got, ref, _ = varlen_grads(lq, lkv, Hq, Hkv, D, causal, dtype, torch.device("cuda"),
                               spare_keys=5, lse_weight=0.5, host_offsets=host_offsets)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert g.dtype is dtype and rel_error(g, r) < 2e-2, name
    assert not got[1][-5:].any() and not got[2][-5:].any()  # the spare keys: zero gradients


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"block_M": 64, "block_N": 128, "num_stages": 2, "threads": 256, "overlap": 2},
    {"block_M": 64, "block_N": 128, "num_stages": 1, "threads": 256, "overlap": 1},
    {"block_M": 64, "block_N": 64, "num_stages": 2, "threads": 128, "overlap": 2},
])
def test_varlen_cuda_configs_write_every_element(config):
    """Each configuration into NaN-filled gradients, against the reference."""
    problem = ATTENTION_VARLEN_BACKWARD.parse_exact("4096x2048x16x4x128:causal", "bfloat16")
    check_every_gradient_written(ATTENTION_VARLEN_BACKWARD, problem, config,
                                 {"tokens_q": 3001, "tokens_kv": 3001})


@pytest.mark.gpu
def test_varlen_cuda_backward_graph_replays_new_lengths():
    """The KV-block list is made on the device: a captured backward replays other lengths of
    the same token count."""
    cuda = torch.device("cuda")
    q, k, v, cu, _, _, _ = (t.detach() if torch.is_tensor(t) else t for t in
                            packed([1000, 24], [1000, 24], 8, 8, 128, torch.bfloat16, cuda))
    g = torch.randn_like(q)
    out, lse = tileops.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024, causal=True,
                                              return_lse=True)
    call = ATTENTION_VARLEN_BACKWARD.prepare(q, k, v, cu, cu, 1024, 1024, out, g, lse,
                                             causal=True)
    target = tileops.target_of(cuda)
    kernel = dispatch.compile_kernel(ATTENTION_VARLEN_BACKWARD, call.problem,
                                     ATTENTION_VARLEN_BACKWARD.default_config(call.problem,
                                                                              target), target)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = ATTENTION_VARLEN_BACKWARD.launch(kernel, call.args)
    cu.copy_(torch.tensor([0, 300, 1024], dtype=torch.int32))
    new_out, new_lse = tileops.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024, causal=True,
                                                      return_lse=True)
    out.copy_(new_out)
    lse.copy_(new_lse)
    graph.replay()
    ref = per_sequence_grads(q, k, v, cu, cu, g, True, 128 ** -0.5, torch.float64)
    for name, a, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert rel_error(a, r) < 2e-2, name


@pytest.mark.gpu
def test_varlen_cuda_backward_matches_flash_attn_baseline():
    cuda = torch.device("cuda")
    problem = ATTENTION_VARLEN_BACKWARD.parse_exact("8192x2048x32x8x128:causal", "bfloat16")
    inputs = ATTENTION_VARLEN_BACKWARD.make_inputs(problem, cuda, seed=1)
    call = ATTENTION_VARLEN_BACKWARD.prepare(*inputs)
    got = DISPATCHER(ATTENTION_VARLEN_BACKWARD, *inputs)
    for g, b in zip(got, ATTENTION_VARLEN_BACKWARD.launch_baseline(call.args), strict=True):
        assert rel_error(g, b) < 2e-2


@pytest.mark.gpu
def test_varlen_cuda_head_dim_256_backward_is_refused_clearly():
    q, k, v, cu_q, cu_k, mq, mk = packed([50, 14], [50, 14], 2, 2, 256, torch.bfloat16,
                                         torch.device("cuda"))
    out = tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(NotImplementedError, match="head_dim 256 has no CUDA kernel"):
        out.sum().backward()
