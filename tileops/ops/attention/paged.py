"""FlashAttention forward over a paged KV cache, as flash-attn's `flash_attn_with_kvcache` with a
`block_table`: `tileops.flash_attention_with_kvcache`.

q (batch, seqlen_q, heads_q, head_dim) attends, for each sequence b, to the first
cache_seqlens[b] keys of a paged cache: k_cache and v_cache (num_pages, page_size, heads_kv,
head_dim), key j of sequence b at row j % page_size of page block_table[b, j // page_size].
Outputs: O like q, LSE (batch, heads_q, seqlen_q) fp32. GQA, the bottom-right causal alignment
(query i sees keys j <= i + cache_seqlens[b] - seqlen_q: the queries are the last seqlen_q keys,
as chunked prefill appends them), rows that see no key and the scale are as in
`flash_attention`; the kernel is its warp-specialised schedule (`kernels.paged_program`).

Problem key: (batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim, page_size, causal, dtype)
where seqlen_kv is what the block table can address (its width times page_size), so that a call
needs no read of the lengths to be keyed; both lengths bucketed by `pow2_bucket` and, with batch,
dynamic in the compiled kernel. On CUDA a page holds whole KV blocks: page_size a multiple of 64
(of 128 for the 128-key tiles).

Command-line syntax: `BxSQxSKVxHQxHKVxDxPAGE[:causal]`, e.g. `4x2048x16384x32x8x128x256:causal`
(chunked prefill: 2048 new queries over 16384 cached keys). Its inputs put every sequence at
seqlen_kv keys in pages shuffled across the cache, the rows past the lengths NaN (what stale
cache rows may hold).

The baseline is `tileops.flash_attention` as dispatched (its tile kernels, or cuDNN where their
records say cuDNN wins) on the same keys gathered into contiguous K and V, gathered once per
call: the cost of the paging itself.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np
import torch

from ... import autotune
from ...spec import Backend, Call, Config, OpSpec, Space, check_scale, pow2_bucket, refuse_grad
from ...target import Target
from ..host import DTYPE_NAMES, DTYPE_SIZES, DTYPES, BitsAdapter, Once, dtype_name, index_to
from . import kernels
from .spec import ATTENTION, HEAD_DIMS, _attention, _check_gpu, _visible_pairs

SUPPORTED = {"cuda": ("float16", "bfloat16"), "cpu": ("float32", "float16", "bfloat16")}
_ACCEPTED = {(DTYPES[name], kind == "cuda") for kind, names in SUPPORTED.items() for name in names}
CUDA_PAGE = 64  # on CUDA a page holds whole KV blocks, the smallest of which is 64 keys
_WHO = "flash_attention_with_kvcache"


class PagedProblem(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    causal: bool
    dtype: str


class DenseKV(Once):
    """The cache's keys and values gathered into contiguous (batch, seqlen, heads, dim) K and V
    for the baseline, made at most once per call (a benchmark times the baseline again and again
    on one call's arguments). Every sequence must have the same length: the dense batch's."""

    __slots__ = ()

    def of(self, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
           table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            length = int(lengths[0])
            if not bool((lengths == length).all()):
                raise ValueError("the paged baseline (the dense kernel) needs every cache "
                                 "sequence at one length")
            return gather(k_cache, table, length), gather(v_cache, table, length)

        return self.get(make)


def gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of every sequence of a paged cache as a dense (batch, length,
    heads, dim) tensor."""
    rows = torch.arange(length, device=cache.device)
    pages = table[:, rows // cache.shape[1]].long()
    return cache[pages, rows % cache.shape[1]]


class PagedArgs(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor
    causal: bool
    dense: DenseKV


def _cuda_default(problem: PagedProblem, target: Target, space: Space) -> Config:
    """The H200 records' winner in 12 of 13 problems: 128 x 128 tiles in two stages, where the
    page holds 128-key blocks (else 64-key blocks) and head_dim is at most 128 (at 256, 64-key
    blocks in one stage, what fits in shared memory)."""
    if problem.head_dim > 128:
        return {"block_M": 128, "block_N": 64, "num_stages": 1, "threads": 256}
    block_N = 128 if problem.page_size % 128 == 0 else 64
    return {"block_M": 128, "block_N": block_N, "num_stages": 2, "threads": 256}


def _check_cuda(problem: PagedProblem, config: Config, target: Target) -> str | None:
    if problem.page_size % config["block_N"]:
        return (f"a KV block of {config['block_N']} keys must sit in one page "
                f"({problem.page_size} rows)")
    return _check_gpu(problem, {**config, "overlap": 2, "pingpong": 0}, target)


BACKENDS = {"cpu": Backend(kernels.cpu_paged_program, BitsAdapter),
            "cuda": Backend(kernels.paged_program, check=_check_cuda, default=_cuda_default)}

_NOT_HOPPER = (f"{_WHO} runs the warp-specialised schedule of sm_90 (TMA and asynchronous "
               "wgmma), which this GPU's arch does not take")


def _check_cache(lengths: torch.Tensor, table: torch.Tensor, page_size: int, pages: int) -> None:
    """The strict check of `validate`, with one read of the lengths and the table back to the
    host (none when the caller gives them there): every length within what its table row
    addresses, every page a sequence uses inside the cache."""
    if autotune.capturing(lengths.device):
        raise RuntimeError(f"{_WHO}: validate=True reads cache_seqlens and block_table back to "
                           "the host, which CUDA-graph capture forbids; validate outside the "
                           "graph, or capture with validate=False (the kernel clamps every length "
                           "and page id, so a bad one reads and writes nothing outside the "
                           "tensors)")
    batch, width = table.shape
    read = torch.cat([lengths, table.flatten()]).cpu().numpy()
    lens, ids = read[:batch], read[batch:].reshape(batch, width)
    bad = np.flatnonzero((lens < 0) | (lens > width * page_size))
    if len(bad):
        raise ValueError(f"{_WHO}: cache_seqlens[{bad[0]}] = {lens[bad[0]]} is outside [0, "
                         f"{width * page_size}] (block_table's {width} pages of {page_size})")
    used = np.arange(width)[None, :] * page_size < lens[:, None]
    bad = np.argwhere(used & ((ids < 0) | (ids >= pages)))
    if len(bad):
        b, slot = bad[0]
        raise ValueError(f"{_WHO}: block_table[{b}, {slot}] = {ids[b, slot]} is not a page of "
                         f"the cache (it has {pages}); sequence {b} uses it")


class AttentionPagedSpec(OpSpec):
    name = "attention_paged"
    aliases = ("flash_attention_with_kvcache",)
    function = ("tileops.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, "
                "block_table, *, causal=True, softmax_scale=None, return_lse=False, "
                "validate=True)")
    problem_syntax = ("BxSQxSKVxHQxHKVxDxPAGE[:causal], e.g. 4x2048x16384x32x8x128x256:causal")
    dtypes = SUPPORTED
    Problem = PagedProblem
    bucketed = ("seqlen_q", "seqlen_kv")
    dynamic = ("batch", "seqlen_q", "seqlen_kv")
    categorical = ("heads_q", "heads_kv", "head_dim", "page_size", "causal", "dtype")
    baseline_name = ("tileops.flash_attention as dispatched (its tile kernels, or cuDNN where their "
                     "records say it wins) on the gathered cache")
    kernel_module = kernels.__name__
    backends = BACKENDS
    unsupported = {"metal": f"{_WHO} has no Metal kernel",
                   "hip": f"{_WHO} has no HIP kernel yet: its schedule is sm_90's",
                   **{f"cuda:sm_{major}": _NOT_HOPPER for major in (5, 6, 7, 8, 1)}}

    # ---- problems -------------------------------------------------------------------------------
    def prepare(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor, causal: bool = True,
                softmax_scale: float | None = None, validate: bool = True) -> Call:
        self._check_call(q, k_cache, v_cache, cache_seqlens, block_table)
        (B, Sq, Hq, D), (pages, page, Hkv, _) = q.shape, k_cache.shape
        block_table = block_table if block_table.is_contiguous() else block_table.contiguous()
        if validate:
            _check_cache(cache_seqlens, block_table, page, pages)
        cache_seqlens, block_table = index_to(q.device, _WHO, cache_seqlens=cache_seqlens,
                                              block_table=block_table)
        q = q if q.is_contiguous() else q.contiguous()
        if softmax_scale is not None and softmax_scale != D ** -0.5:
            q = q * (check_scale(softmax_scale, _WHO) * D ** 0.5)
        problem = PagedProblem(B, pow2_bucket(Sq), pow2_bucket(block_table.shape[1] * page), Hq,
                               Hkv, D, page, bool(causal), DTYPE_NAMES[q.dtype])
        return Call(q.device, problem, PagedArgs(q, k_cache, v_cache, cache_seqlens, block_table,
                                                 bool(causal), DenseKV()))

    def _check_call(self, q: Any, k_cache: Any, v_cache: Any, lengths: Any, table: Any) -> None:
        """Clear errors for what the tensors' shapes, dtypes and devices say is wrong."""
        tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": lengths,
                   "block_table": table}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{_WHO}: {name} must be a tensor, got {type(t).__name__}")
        shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache " \
                 f"{tuple(v_cache.shape)}"
        if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError(f"{_WHO} expects q (batch, seqlen_q, heads_q, head_dim) and k_cache, "
                             "v_cache of one shape (num_pages, page_size, heads_kv, head_dim); "
                             f"got {shapes}")
        (B, Sq, Hq, D), (pages, page, Hkv, Dk) = q.shape, k_cache.shape
        if Dk != D or D not in HEAD_DIMS:
            raise ValueError(f"{_WHO}: head_dim must match and be one of "
                             f"{', '.join(map(str, HEAD_DIMS))} ({shapes})")
        if min(B, Sq, Hq, pages, page, Hkv) == 0 or Hq % Hkv:
            raise ValueError(f"{_WHO}: {shapes}: sizes must be >= 1 and heads_q a multiple of "
                             "heads_kv")
        if not q.dtype == k_cache.dtype == v_cache.dtype:
            raise TypeError(f"{_WHO}: q, k_cache, v_cache have dtypes {dtype_name(q.dtype)}, "
                            f"{dtype_name(k_cache.dtype)}, {dtype_name(v_cache.dtype)}; they "
                            "must match")
        if q.device.type not in ("cuda", "cpu") or (q.dtype, q.is_cuda) not in _ACCEPTED:
            raise TypeError(f"{_WHO}: {dtype_name(q.dtype)} on {q.device.type} is not supported "
                            f"(CUDA: {', '.join(SUPPORTED['cuda'])}; CPU: "
                            f"{', '.join(SUPPORTED['cpu'])})")
        if not (q.device == k_cache.device == v_cache.device and lengths.device == table.device
                and lengths.device in (q.device, torch.device("cpu"))):
            raise ValueError(f"{_WHO}: q and the caches must be on one device, cache_seqlens and "
                             "block_table both on it or on the CPU; got "
                             + ", ".join(str(t.device) for t in tensors.values()))
        if q.is_cuda and page % CUDA_PAGE:
            raise ValueError(f"{_WHO}: on CUDA page_size must be a multiple of {CUDA_PAGE} (a "
                             f"page holds whole KV blocks); k_cache has pages of {page}")
        if lengths.dtype != torch.int32 or lengths.shape != (B,):
            raise ValueError(f"{_WHO}: cache_seqlens must be int32 of shape ({B},), got "
                             f"{dtype_name(lengths.dtype)} {tuple(lengths.shape)}")
        if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != B or \
                table.shape[1] == 0:
            raise ValueError(f"{_WHO}: block_table must be int32 of shape ({B}, pages per "
                             f"sequence >= 1), got {dtype_name(table.dtype)} {tuple(table.shape)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"{_WHO}: k_cache and v_cache must be contiguous (a copy of a whole "
                             "cache per call would cost more than the attention)")
        if q.stride(3) != 1:
            raise ValueError(f"{_WHO}: the last dimension (head_dim) of q must be contiguous")
        refuse_grad(_WHO, q=q, k_cache=k_cache, v_cache=v_cache)

    def parse_exact(self, text: str, dtype: str) -> PagedProblem:
        match = re.fullmatch(r"\s*(\d+(?:x\d+){6})(:causal)?\s*", text)
        if not match or dtype not in DTYPES:
            raise ValueError(f"bad attention_paged problem {text!r} ({dtype}): expected "
                             f"{self.problem_syntax} and a dtype of {', '.join(DTYPES)}")
        B, Sq, Skv, Hq, Hkv, D, page = (int(x) for x in match.group(1).split("x"))
        if min(B, Sq, Skv, Hq, Hkv, page) < 1 or Hq % Hkv or D not in HEAD_DIMS:
            raise ValueError(f"bad attention_paged problem {text!r}: sizes must be >= 1, heads_q "
                             f"a multiple of heads_kv and head_dim one of {HEAD_DIMS}")
        return PagedProblem(B, Sq, Skv, Hq, Hkv, D, page, match.group(2) is not None, dtype)

    def launch(self, kernel: Any, args: PagedArgs,
               out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the kernel; `out`, when given, is the pair (O, LSE) of buffers to write."""
        q = args.q
        if out is None:
            B, Sq, Hq, _ = q.shape
            out = (torch.empty_like(q),
                   torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device))
        kernel(q, args.k_cache, args.v_cache, args.cache_seqlens, args.block_table, *out)
        return out

    def dispatches_baseline(self, problem: PagedProblem, target: Target) -> bool:
        """Never: the dense kernel needs the cache gathered, a copy a call would make every
        time; the tile kernel serves."""
        return False

    def launch_baseline(self, args: PagedArgs) -> tuple[torch.Tensor, torch.Tensor]:
        from ...dispatch import DISPATCHER

        k, v = args.dense.of(args.k_cache, args.v_cache, args.cache_seqlens, args.block_table)
        return DISPATCHER(ATTENTION, args.q, k, v, args.causal, None)

    def reported_beside(self, args: PagedArgs) -> dict[str, Any]:
        """The call with validate=False: no read of the lengths and the table (what a CUDA
        graph replays); and validated with them on the host (checked there, no read back)."""
        from ...dispatch import DISPATCHER

        host = (args.cache_seqlens.cpu(), args.block_table.cpu())
        return {"validate=False": lambda: DISPATCHER(self, args.q, args.k_cache, args.v_cache,
                                                     args.cache_seqlens, args.block_table,
                                                     args.causal, None, False),
                "host lengths": lambda: DISPATCHER(self, args.q, args.k_cache, args.v_cache,
                                                   *host, args.causal)}

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: PagedProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        problem = problem._replace(**(sizes or {}))
        B, Sq, Skv, Hq, Hkv, D, page = problem[:7]
        dtype = DTYPES[problem.dtype]
        gen = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (torch.randn(B, S, H, D, generator=gen, device=device).to(dtype)
                   for S, H in ((Sq, Hq), (Skv, Hkv), (Skv, Hkv)))
        lengths = torch.full((B,), Skv, dtype=torch.int32, device=device)
        return (q, *paged_cache(k, v, lengths, page, seed), problem.causal)

    def reference(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(O, LSE) in float64, sequence by sequence over its gathered keys."""
        q, k_cache, v_cache, lengths, table, causal = inputs[:6]
        scale = inputs[6] if len(inputs) > 6 and inputs[6] is not None else q.shape[3] ** -0.5
        B, Sq, Hq, _ = q.shape
        out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)
        for b, n in enumerate(lengths.tolist()):
            if n > 0:
                k, v = (gather(c, table[b:b + 1], n) for c in (k_cache, v_cache))
                o, s = _attention(q[b:b + 1], k, v, causal, scale, torch.float64)
                out[b], lse[b] = o[0], s[0].float()
        return out, lse

    def flops(self, problem: PagedProblem) -> float:
        B, Sq, Skv, Hq, _, D, _, causal, _ = problem
        return 4.0 * B * Hq * D * _visible_pairs(Sq, Skv, causal)

    def bytes_moved(self, problem: PagedProblem) -> float:
        B, Sq, Skv, Hq, Hkv, D, _, _, dtype = problem
        return (2 * B * Sq * Hq * D + 2 * B * Skv * Hkv * D) * DTYPE_SIZES[dtype] + 4 * B * Hq * Sq

    def tolerance(self, problem: PagedProblem) -> float:
        return 1e-5 if problem.dtype == "float32" else 1e-2

    def check_sizes(self, problem: PagedProblem) -> list[dict[str, int]]:
        """Also unequal lengths both ways within the buckets, as the dense spec checks: the last
        KV block part past the length (its rows NaN in the cache), rows that see no key."""
        sizes = super().check_sizes(problem)
        if problem.seqlen_kv > 2:
            sizes.append({"seqlen_kv": problem.seqlen_kv // 2 + 1})
        if problem.seqlen_q > 2:
            sizes.append({"seqlen_q": problem.seqlen_q // 2 + 1})
        return sizes


def paged_cache(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, page_size: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense (batch, seqlen, heads, dim) keys and values as a paged cache: (k_cache, v_cache,
    cache_seqlens, block_table). Sequence b's first lengths[b] rows go to pages in a seeded
    random order, with one page more than the table uses; every other row is NaN, as stale cache
    rows may be."""
    B, S = k.shape[:2]
    width = -(-S // page_size)
    pages = B * width + 1
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    table = order[:B * width].reshape(B, width).to(torch.int32).to(k.device)
    caches = []
    for dense in (k, v):
        cache = torch.full((pages, page_size, *dense.shape[2:]), float("nan"), dtype=dense.dtype,
                           device=dense.device)
        for b, n in enumerate(lengths.tolist()):
            rows = torch.arange(n, device=dense.device)
            cache[table[b, rows // page_size].long(), rows % page_size] = dense[b, :n]
        caches.append(cache)
    return (*caches, lengths, table)


ATTENTION_PAGED = AttentionPagedSpec()
