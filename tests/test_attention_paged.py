"""flash_attention_with_kvcache: a paged cache (pages shuffled, unused rows NaN) against a float64
reference, the checks of bad lengths and page ids, and (marked `gpu`) the sm_90 kernel with its
configurations, CUDA graphs and the dense kernel on the same data. The sm_90a code generation is
checked with the platform matrix (test_target_matrix.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_attention, rel_error

import tileops
from tileops import dispatch
from tileops.ops.attention import ATTENTION_PAGED
from tileops.ops.attention.paged import gather, paged_cache

CPU = torch.device("cpu")


def inputs(B, Sq, lengths, Hq, Hkv, D, page, dtype, device, seed=0, width=None):
    """q and a paged cache holding `lengths` keys per sequence (the table `width` pages wide,
    default what the longest needs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    S = max(max(lengths), 1) if width is None else width * page
    q, k, v = (torch.randn(B, n, H, D, generator=gen, device=device).to(dtype)
               for n, H in ((Sq, Hq), (S, Hkv), (S, Hkv)))
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return (q, *paged_cache(k, v, lens, page, seed))


def check(inp, causal, out, lse, tol):
    q = inp[0]
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_attention(out, lse, ATTENTION_PAGED.reference((*inp, causal)), tol)


CPU_CASES = [  # (batch, seqlen_q, cache lengths, heads_q, heads_kv, head_dim, page, causal)
    (3, 17, [70, 17, 33], 4, 2, 64, 16, True),    # chunked prefill, GQA, pages of 16
    (2, 5, [40, 9], 2, 2, 64, 8, False),
    (2, 40, [10, 0], 2, 1, 64, 16, True),         # rows that see no key; an empty cache
    (1, 1, [100], 4, 4, 64, 32, True),            # decode: one query
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "Sq", "lengths", "Hq", "Hkv", "D", "page", "causal"), CPU_CASES)
def test_paged_cpu_matches_reference(B, Sq, lengths, Hq, Hkv, D, page, causal, dtype):
    inp = inputs(B, Sq, lengths, Hq, Hkv, D, page, dtype, CPU, seed=Sq)
    out, lse = tileops.flash_attention_with_kvcache(*inp, causal=causal, return_lse=True)
    check(inp, causal, out, lse, 1e-5 if dtype is torch.float32 else 1e-2)


def test_paged_matches_dense_attention_on_the_gathered_cache():
    q, kc, vc, lens, table = inp = inputs(2, 9, [30, 30], 4, 2, 64, 8, torch.float32, CPU)
    k, v = gather(kc, table, 30), gather(vc, table, 30)
    assert not torch.isnan(k).any()
    paged = tileops.flash_attention_with_kvcache(*inp, softmax_scale=0.2)
    dense = tileops.flash_attention(q, k, v, causal=True, softmax_scale=0.2)
    assert rel_error(paged, dense) < 1e-5


def test_paged_under_torch_compile():
    q, kc, vc, lens, table = inputs(2, 5, [20, 9], 4, 2, 64, 8, torch.float32, CPU)

    def layer(q):
        return tileops.flash_attention_with_kvcache(q, kc, vc, lens, table) * 2

    ref = ATTENTION_PAGED.reference((q, kc, vc, lens, table, True))[0] * 2
    assert rel_error(torch.compile(layer, fullgraph=True)(q), ref) < 1e-5


def test_paged_problem_syntax_and_key():
    problem = ATTENTION_PAGED.parse_exact("4x2048x16384x32x8x128x256:causal", "bfloat16")
    assert problem == ATTENTION_PAGED.Problem(4, 2048, 16384, 32, 8, 128, 256, True, "bfloat16")
    assert ATTENTION_PAGED.parse_problem("1x1000x3000x8x8x64x64", "float16")[1:3] == (1024, 4096)
    inp = inputs(2, 3, [5, 20], 2, 2, 64, 8, torch.float32, CPU, width=5)
    key = ATTENTION_PAGED.prepare(*inp).problem  # keyed by what the table addresses: 5 x 8
    assert key == ATTENTION_PAGED.Problem(2, 4, 64, 2, 2, 64, 8, True, "float32")


@pytest.mark.parametrize(("lengths", "table", "message"), [
    ([20, 33], None, r"cache_seqlens\[1\] = 33 is outside \[0, 32\]"),
    ([20, -1], None, r"cache_seqlens\[1\] = -1"),
    ([20, 8], [[0, 1, 2, 3], [99, 4, 5, 6]], r"block_table\[1, 0\] = 99 is not a page"),
    ([20, 8], [[0, 1, -3, 3], [7, 4, 5, 6]], r"block_table\[0, 2\] = -3"),
])
def test_paged_refuses_bad_lengths_and_pages(lengths, table, message):
    q, kc, vc, _, good = inputs(2, 3, [20, 20], 2, 2, 64, 8, torch.float32, CPU, width=4)
    table = good if table is None else torch.tensor(table, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        tileops.flash_attention_with_kvcache(q, kc, vc, torch.tensor(lengths, dtype=torch.int32),
                                             table)


def test_paged_unused_bad_page_ids_are_accepted():
    """Table entries past a sequence's length are never read: any value is allowed there."""
    q, kc, vc, lens, table = inputs(2, 3, [9, 20], 2, 2, 64, 8, torch.float32, CPU, width=4)
    table[0, 2:] = -7  # sequence 0 uses pages 0 and 1 only
    out = tileops.flash_attention_with_kvcache(q, kc, vc, lens, table)
    check((q, kc, vc, lens, table), True, out,
          tileops.flash_attention_with_kvcache(q, kc, vc, lens, table, return_lse=True)[1], 1e-5)


def test_paged_refuses_bad_arguments():
    q, kc, vc, lens, table = inputs(2, 3, [20, 20], 2, 2, 64, 8, torch.float32, CPU)
    with pytest.raises(ValueError, match="int32 of shape"):
        tileops.flash_attention_with_kvcache(q, kc, vc, lens.long(), table)
    with pytest.raises(ValueError, match="block_table must be int32"):
        tileops.flash_attention_with_kvcache(q, kc, vc, lens, table[:1])
    with pytest.raises(ValueError, match="of one shape"):
        tileops.flash_attention_with_kvcache(q, kc, vc[:, :4], lens, table)
    with pytest.raises(ValueError, match="must be contiguous"):
        tileops.flash_attention_with_kvcache(q, kc.transpose(0, 1).contiguous().transpose(0, 1),
                                             vc, lens, table)
    with pytest.raises(TypeError, match="must match"):
        tileops.flash_attention_with_kvcache(q.double(), kc, vc, lens, table)
    with pytest.raises(ValueError, match="both on it or on the CPU"):
        tileops.flash_attention_with_kvcache(q, kc, vc, lens, table.to("meta"))
    with pytest.raises(RuntimeError, match="has no backward"):
        tileops.flash_attention_with_kvcache(q.requires_grad_(), kc, vc, lens, table)


def test_paged_bad_table_unvalidated_stays_inside_the_tensors():
    """validate=False: the kernel clamps lengths and page ids; nothing outside is read."""
    q, kc, vc, _, table = inputs(2, 3, [20, 20], 2, 2, 64, 8, torch.float32, CPU)
    kc.nan_to_num_(0.0)
    vc.nan_to_num_(0.0)
    bad_lens = torch.tensor([1000, -5], dtype=torch.int32)
    table[1] = torch.tensor([-100, 10**6, 2, 3], dtype=torch.int32)[:table.shape[1]]
    out = tileops.flash_attention_with_kvcache(q, kc, vc, bad_lens, table, validate=False)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.gpu
def test_paged_cuda_refuses_small_pages():
    cuda = torch.device("cuda")
    inp = inputs(1, 4, [40], 2, 2, 64, 16, torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="multiple of 64"):
        tileops.flash_attention_with_kvcache(*inp)


# ---- CUDA (sm_90) ---------------------------------------------------------------------------------

GPU_CASES = [  # (batch, seqlen_q, cache lengths, heads_q, heads_kv, head_dim, page, causal, dtype)
    (3, 1000, [4097, 1000, 1337], 32, 8, 128, 256, True, torch.bfloat16),   # odd lengths
    (3, 1000, [4097, 1000, 1337], 32, 8, 128, 256, False, torch.bfloat16),
    (2, 129, [129, 3000], 16, 4, 128, 64, True, torch.float16),               # pages of 64
    (2, 1337, [333, 0], 16, 1, 64, 128, True, torch.bfloat16),  # rows that see no key, MQA
    (4, 1, [1, 517, 64, 8191], 8, 8, 128, 256, True, torch.bfloat16),       # decode
    (2, 517, [2000, 517], 8, 8, 256, 64, True, torch.bfloat16),             # head_dim 256
]


@pytest.mark.gpu
@pytest.mark.parametrize(("B", "Sq", "lengths", "Hq", "Hkv", "D", "page", "causal", "dtype"),
                         GPU_CASES)
def test_paged_cuda_matches_reference(B, Sq, lengths, Hq, Hkv, D, page, causal, dtype):
    """The cache's unused rows are NaN: a kernel that let them reach P V would give NaN."""
    inp = inputs(B, Sq, lengths, Hq, Hkv, D, page, dtype, torch.device("cuda"), seed=Sq)
    out, lse = tileops.flash_attention_with_kvcache(*inp, causal=causal, return_lse=True)
    check(inp, causal, out, lse, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"block_M": 64, "block_N": 64, "num_stages": 2, "threads": 128},
    {"block_M": 128, "block_N": 128, "num_stages": 2, "threads": 256},
])
def test_paged_cuda_configs_write_every_element(config):
    """Each configuration against the reference, into NaN-filled outputs."""
    cuda = torch.device("cuda")
    inp = inputs(3, 700, [700, 3, 2049], 16, 4, 128, 256, torch.bfloat16, cuda)
    target = tileops.target_of(cuda)
    call = ATTENTION_PAGED.prepare(*inp)
    kernel = dispatch.compile_kernel(ATTENTION_PAGED, call.problem, config, target)
    out = (torch.full_like(inp[0], float("nan")),
           torch.full((3, 16, 700), float("nan"), device=cuda))
    ATTENTION_PAGED.launch(kernel, call.args, out)
    check(inp, True, *out, 1e-2)


@pytest.mark.gpu
def test_paged_cuda_graph_replays_new_lengths_and_pages():
    """Captured with validate=False, a graph replays other lengths and another page order."""
    cuda = torch.device("cuda")
    q, kc, vc, lens, table = inputs(2, 64, [1000, 300], 8, 8, 128, 256, torch.bfloat16, cuda)
    tileops.flash_attention_with_kvcache(q, kc, vc, lens, table)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.flash_attention_with_kvcache(q, kc, vc, lens, table, validate=False)
    lens.copy_(torch.tensor([300, 1000], dtype=torch.int32))
    table.copy_(table.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tileops.flash_attention_with_kvcache(q, kc, vc, lens, table))
    with pytest.raises(RuntimeError, match="CUDA-graph capture forbids"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        tileops.flash_attention_with_kvcache(q, kc, vc, lens, table)


@pytest.mark.gpu
def test_paged_cuda_lengths_and_table_on_the_host_need_no_read_back():
    """cache_seqlens and block_table on the CPU: checked there, copied over without waiting for
    the GPU (torch's sync debug mode raises on any wait), the same output; refused in capture."""
    cuda = torch.device("cuda")
    q, kc, vc, lens, table = inputs(3, 500, [4097, 1000, 700], 16, 4, 128, 256, torch.bfloat16,
                                    cuda)
    want = tileops.flash_attention_with_kvcache(q, kc, vc, lens, table)
    host = (lens.cpu(), table.cpu().pin_memory())
    tileops.flash_attention_with_kvcache(q, kc, vc, *host)  # warm: the record, the kernel
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = tileops.flash_attention_with_kvcache(q, kc, vc, *host)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    bad = host[1].clone()
    bad[2, 0] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[2, 0\]"):
        tileops.flash_attention_with_kvcache(q, kc, vc, host[0], bad)
    with pytest.raises(RuntimeError, match="cannot be captured"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        tileops.flash_attention_with_kvcache(q, kc, vc, *host, validate=False)


@pytest.mark.gpu
def test_paged_cuda_matches_the_dense_kernel():
    cuda = torch.device("cuda")
    problem = ATTENTION_PAGED.parse_exact("2x1024x4096x32x8x128x256:causal", "bfloat16")
    inp = ATTENTION_PAGED.make_inputs(problem, cuda, seed=1)
    call = ATTENTION_PAGED.prepare(*inp)
    out, lse = tileops.flash_attention_with_kvcache(*inp[:5], causal=inp[5], return_lse=True)
    base_out, base_lse = ATTENTION_PAGED.launch_baseline(call.args)
    assert rel_error(out, base_out) < 1e-2
    assert (lse - base_lse).abs().max() < 2e-2
