"""flash_attention_varlen: packed sequences against a float64 reference, the tile list, the checks
of bad offsets, and (marked `gpu`) the sm_90 kernel with its configurations and CUDA graphs. The
sm_90a code generation is checked with the platform matrix (test_target_matrix.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import check_attention, rel_error

import tileops
from tileops import dispatch
from tileops.ops.attention import ATTENTION_VARLEN
from tileops.ops.attention.varlen import host_tile_list, ragged_lengths, tile_list

CPU = torch.device("cpu")


def inputs(lengths_q, lengths_kv, Hq, Hkv, D, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(sum(n), H, D, generator=gen, device=device).to(dtype)
               for n, H in ((lengths_q, Hq), (lengths_kv, Hkv), (lengths_kv, Hkv)))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_kv))
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_kv)


def check(inp, causal, out, lse, tol):
    assert out.shape == inp[0].shape and lse.shape == (inp[0].shape[1], inp[0].shape[0])
    check_attention(out, lse, ATTENTION_VARLEN.reference((*inp, causal)), tol)


CPU_CASES = [  # (query lengths, key lengths, heads_q, heads_kv, head_dim, causal)
    ([37, 1, 70, 5], [37, 1, 70, 5], 4, 2, 64, True),      # GQA, a one-token sequence
    ([37, 1, 70, 5], [37, 1, 70, 5], 2, 2, 64, False),
    ([3, 40], [50, 41], 2, 1, 64, True),                   # chunked prefill: fewer queries
    ([40, 9], [10, 0], 2, 2, 64, True),                    # rows that see no key; no keys at all
    ([0, 17, 0], [0, 17, 4], 2, 2, 64, False),             # empty sequences
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lq", "lkv", "Hq", "Hkv", "D", "causal"), CPU_CASES)
def test_varlen_cpu_matches_reference(lq, lkv, Hq, Hkv, D, causal, dtype):
    inp = inputs(lq, lkv, Hq, Hkv, D, dtype, CPU, seed=sum(lq))
    out, lse = tileops.flash_attention_varlen(*inp, causal=causal, return_lse=True)
    check(inp, causal, out, lse, 1e-5 if dtype is torch.float32 else 1e-2)


def test_varlen_softmax_scale_and_strided_inputs():
    q, k, v, cu_q, cu_k, mq, mk = inputs([20, 13], [20, 13], 2, 2, 64, torch.float32, CPU)
    out = tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3)
    ref, _ = ATTENTION_VARLEN.reference((q, k, v, cu_q, cu_k, mq, mk, False, 0.3))
    assert rel_error(out, ref) < 1e-5
    wide = torch.randn(33, 2, 128)[:, :, :64]  # head_dim contiguous, rows strided
    wide.copy_(q)
    assert torch.equal(tileops.flash_attention_varlen(wide, k, v, cu_q, cu_k, mq, mk),
                       tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk))


def test_varlen_under_torch_compile():
    q, k, v, cu_q, cu_k, mq, mk = inputs([20, 13], [20, 13], 4, 2, 64, torch.float32, CPU)

    def layer(q):
        return tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True) * 2

    ref = ATTENTION_VARLEN.reference((q, k, v, cu_q, cu_k, mq, mk, True))[0] * 2
    assert rel_error(torch.compile(layer, fullgraph=True)(q), ref) < 1e-5


def test_tile_list_covers_every_block_once_heaviest_first():
    lengths = [300, 1, 129, 0, 1000]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    for causal in (False, True):
        tiles = tile_list(cu, cu, sum(lengths), 128, 64, causal).tolist()
        real = [(s, b) for s, b in tiles if b * 128 < lengths[s]]
        assert sorted(real) == [(s, b) for s, n in enumerate(lengths)
                                for b in range(-(-n // 128))]
        assert len(tiles) == (sum(lengths) + len(lengths) * 127) // 128
        assert tiles[:len(real)] == [t for t in tiles if tuple(t) in real]  # padding last
        first = real[0]
        assert first[0] == 4 and (not causal or first[1] == 7)  # the longest, its last block
        host = host_tile_list(cu.tolist(), cu.tolist(), 128, 64, causal).tolist()
        assert host == tiles[:len(real)]  # the same order, without the spare entries


def test_key_tile_list_keeps_each_sequence_together_longest_queries_first():
    """The backward's list: every KV block once, a sequence's blocks adjacent and in order, the
    sequences with the most query blocks first."""
    len_q, len_kv = [300, 1, 129, 0, 1000], [40, 200, 129, 70, 1000]
    cu_q, cu_kv = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                   for n in (len_q, len_kv))
    tiles = tile_list(cu_q, cu_kv, sum(len_kv) + 5, 128, 64, True, keys=True).tolist()
    real = [(s, b) for s, b in tiles if b * 64 < len_kv[s]]
    assert len(tiles) == (sum(len_kv) + 5 + len(len_q) * 63) // 64
    assert tiles[:len(real)] == [list(t) for t in real]  # the spare entries last
    want = [(s, b) for s in (4, 0, 2, 1, 3) for b in range(-(-len_kv[s] // 64))]
    assert real == want
    host = host_tile_list(cu_q.tolist(), cu_kv.tolist(), 128, 64, True, keys=True).tolist()
    assert host == [list(t) for t in want]


def test_ragged_lengths_sum_and_bound():
    for tokens, longest in ((32768, 16384), (1000, 7), (5, 100)):
        lengths = ragged_lengths(tokens, longest, seed=3)
        assert sum(lengths) == tokens and max(lengths) == min(longest, tokens)
        assert min(lengths) >= 1
    problem = ATTENTION_VARLEN.parse_exact("32768x16384x32x8x128:causal", "bfloat16")
    assert problem == ATTENTION_VARLEN.Problem(32768, 32768, 16384, 16384, 32, 8, 128, True,
                                               "bfloat16")
    assert ATTENTION_VARLEN.parse_problem("3000x3000x1000x1000x4x4x64", "float16")[:4] == (
        4096, 4096, 1024, 1024)


@pytest.mark.parametrize(("cu_q", "cu_k", "message"), [
    ([0, 10, 5, 20], [0, 10, 15, 20], "must not decrease"),
    ([1, 10, 20], [0, 10, 20], "must start at 0"),
    ([0, 10, 19], [0, 10, 20], "ends at 19, but q has 20 rows"),
    ([0, 10, 20], [0, 10, 21], "ends at 21, but k and v have 20 rows"),
    ([0, 2, 20], [0, 2, 20], "more than max_seqlen 16"),
])
def test_varlen_refuses_bad_offsets(cu_q, cu_k, message):
    q, k, v, *_ = inputs([10, 10], [10, 10], 2, 2, 64, torch.float32, CPU)
    with pytest.raises(ValueError, match=message):
        tileops.flash_attention_varlen(q, k, v, torch.tensor(cu_q, dtype=torch.int32),
                                       torch.tensor(cu_k, dtype=torch.int32), 16, 20)


def test_varlen_refuses_bad_arguments():
    q, k, v, cu_q, cu_k, mq, mk = inputs([10, 10], [10, 10], 2, 2, 64, torch.float32, CPU)
    with pytest.raises(ValueError, match="1-D int32"):
        tileops.flash_attention_varlen(q, k, v, cu_q.long(), cu_k, mq, mk)
    with pytest.raises(ValueError, match="give 2 and 1 sequences"):
        tileops.flash_attention_varlen(q, k, v, cu_q, cu_k[:2], mq, mk)
    with pytest.raises(ValueError, match="3-D q"):
        tileops.flash_attention_varlen(q[None], k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int"):
        tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, 0, mk)
    with pytest.raises(ValueError, match="both offsets on it or on the CPU"):
        tileops.flash_attention_varlen(q, k, v, cu_q, cu_k.to("meta"), mq, mk)


def test_varlen_bad_offsets_unvalidated_stay_inside_the_tensors():
    """validate=False: the kernel clamps the offsets; nothing outside the outputs is written."""
    q, k, v, *_ = inputs([10, 10], [10, 10], 2, 2, 64, torch.float32, CPU)
    bad = torch.tensor([0, 50, 7], dtype=torch.int32)  # past the end, then decreasing
    out, lse = tileops.flash_attention_varlen(q, k, v, bad, bad, 64, 64, validate=False,
                                              return_lse=True)
    assert out.shape == q.shape and torch.isfinite(out).all()


# ---- CUDA (sm_90) ---------------------------------------------------------------------------------

ODD = [1000, 1, 129, 4097, 37]
GPU_CASES = [  # (query lengths, key lengths, heads_q, heads_kv, head_dim, causal, dtype)
    (ODD, ODD, 32, 8, 128, True, torch.bfloat16),
    (ODD, ODD, 32, 8, 128, False, torch.bfloat16),
    (ODD, ODD, 32, 8, 128, True, torch.float16),
    ([333, 64, 1], [1337, 64, 50], 16, 4, 128, True, torch.bfloat16),  # fewer queries than keys
    ([1337, 64], [333, 0], 16, 1, 64, True, torch.bfloat16),  # rows that see no key, MQA
    ([517, 2000], [517, 2000], 8, 8, 256, True, torch.bfloat16),  # head_dim 256
]


@pytest.mark.gpu
@pytest.mark.parametrize(("lq", "lkv", "Hq", "Hkv", "D", "causal", "dtype"), GPU_CASES)
def test_varlen_cuda_matches_reference(lq, lkv, Hq, Hkv, D, causal, dtype):
    cuda = torch.device("cuda")
    inp = inputs(lq, lkv, Hq, Hkv, D, dtype, cuda, seed=sum(lq))
    out, lse = tileops.flash_attention_varlen(*inp, causal=causal, return_lse=True)
    check(inp, causal, out, lse, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"block_M": 64, "block_N": 64, "num_stages": 2, "threads": 128, "persistent": 0},
    {"block_M": 128, "block_N": 64, "num_stages": 2, "threads": 256, "persistent": 0},
    {"block_M": 128, "block_N": 128, "num_stages": 2, "threads": 256, "persistent": 1},
])
def test_varlen_cuda_configs_write_every_element(config):
    """Each configuration against the reference, into NaN-filled outputs: a row it never wrote
    would stay NaN."""
    cuda = torch.device("cuda")
    inp = inputs([700, 3, 2049], [700, 3, 2049], 16, 4, 128, torch.bfloat16, cuda)
    target = tileops.target_of(cuda)
    problem = ATTENTION_VARLEN.prepare(*inp, causal=True).problem
    kernel = dispatch.compile_kernel(ATTENTION_VARLEN, problem, config, target)
    out = (torch.full_like(inp[0], float("nan")),
           torch.full((16, inp[0].shape[0]), float("nan"), device=cuda))
    args = ATTENTION_VARLEN.prepare(*inp, causal=True).args
    ATTENTION_VARLEN.launch(kernel, args, out)
    check(inp, True, *out, 1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_varlen_nan_in_one_sequence_stays_there(device):
    """The last KV block of a sequence takes the next sequence's rows, masked out of the scores;
    a NaN among their values must not reach this sequence's rows through P V (0 * NaN)."""
    inp = inputs([300, 200], [300, 200], 8, 8, 128, torch.bfloat16, torch.device(device))
    clean = tileops.flash_attention_varlen(*inp, causal=True)
    inp[2][300:] = float("nan")  # the second sequence's values
    out = tileops.flash_attention_varlen(*inp, causal=True)
    assert torch.equal(out[:300], clean[:300]) and torch.isnan(out[300:]).all()


@pytest.mark.gpu
def test_varlen_cuda_graph_replays_new_lengths():
    """Captured with validate=False, a graph replays other lengths of the same token count (the
    tile list is made on the device), and agrees with the eager call."""
    cuda = torch.device("cuda")
    q, k, v, cu, _, _, _ = inputs([1000, 24], [1000, 24], 8, 8, 128, torch.bfloat16, cuda)
    tileops.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024, causal=True)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024, causal=True,
                                             validate=False)
    cu.copy_(torch.tensor([0, 300, 1024], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tileops.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024,
                                                           causal=True))
    with pytest.raises(RuntimeError, match="CUDA-graph capture forbids"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        tileops.flash_attention_varlen(q, k, v, cu, cu, 1024, 1024)


@pytest.mark.gpu
def test_varlen_cuda_offsets_on_the_host_need_no_read_back():
    """Offsets on the CPU: validated there, the tile list made there, both copied over without
    waiting for the GPU (torch's sync debug mode raises on any wait); the same output; refused
    in capture."""
    cuda = torch.device("cuda")
    q, k, v, cu_q, cu_k, mq, mk = inputs(ODD, ODD, 16, 4, 128, torch.bfloat16, cuda)
    want = tileops.flash_attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    host = (cu_q.cpu().pin_memory(), cu_k.cpu())
    tileops.flash_attention_varlen(q, k, v, *host, mq, mk, causal=True)  # warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = tileops.flash_attention_varlen(q, k, v, *host, mq, mk, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    bad = host[0].clone()
    bad[1] = bad[2] + 1
    with pytest.raises(ValueError, match="must not decrease"):
        tileops.flash_attention_varlen(q, k, v, bad, host[1], mq, mk)
    with pytest.raises(RuntimeError, match="cannot be captured"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        tileops.flash_attention_varlen(q, k, v, *host, mq, mk, validate=False)


@pytest.mark.gpu
def test_varlen_cuda_matches_flash_attn_baseline():
    cuda = torch.device("cuda")
    problem = ATTENTION_VARLEN.parse_exact("8192x4096x32x8x128:causal", "bfloat16")
    inp = ATTENTION_VARLEN.make_inputs(problem, cuda, seed=1)
    call = ATTENTION_VARLEN.prepare(*inp[:7], causal=True)
    out, lse = tileops.flash_attention_varlen(*inp[:7], causal=True, return_lse=True)
    base_out, base_lse = ATTENTION_VARLEN.launch_baseline(call.args)
    assert rel_error(out, base_out) < 1e-2
    assert (lse - base_lse.reshape(lse.shape)).abs().max() < 2e-2
