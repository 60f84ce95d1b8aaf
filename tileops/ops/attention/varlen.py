"""FlashAttention forward over a packed batch of sequences of different lengths, as flash-attn's
`flash_attn_varlen_func`: `tileops.flash_attention_varlen`.

q (tokens_q, heads_q, head_dim) holds the sequences one after another, sequence i at rows
cu_seqlens_q[i]:cu_seqlens_q[i + 1]; k and v (tokens_kv, heads_kv, head_dim) likewise by
cu_seqlens_k. Outputs: O like q, LSE (heads_q, tokens_q) fp32. GQA, the bottom-right causal
alignment, rows that see no key and the scale are as in `flash_attention`; the kernel is its
warp-specialised schedule (`kernels.ragged_program`).

Problem key: (tokens_q, tokens_kv, max_seqlen_q, max_seqlen_kv, heads_q, heads_kv, head_dim,
causal, dtype), the four sizes bucketed by `pow2_bucket` and dynamic in the compiled kernel. The
kernel reads the offsets on the device and clamps them to the tensors, so the longest lengths
only choose the configuration. The query blocks run in the order of a tile list made for each
call, on the host from validated offsets (`host_tile_list`), else on the device (`tile_list`):
the heaviest first, so that the long sequences' blocks do not start last and leave the tail of
the grid to them.

Command-line syntax: `TQxTKVxMQxMKVxHQxHKVxD[:causal]`, or `TxMxHQxHKVxD[:causal]` where the keys
are the queries (self-attention prefill): T tokens in sequences of at most M, e.g.
`32768x16384x32x8x128:causal`. Its lengths (`ragged_lengths`) are drawn log-uniformly between 1
and M, one of them M, from a generator seeded by the problem: a problem is one batch.

The baseline is flash-attn 2's varlen forward as torch ships it (`aten._flash_attention_forward`
with cumulative lengths; SDPA's flash backend) on CUDA, and per-sequence SDPA on the CPU.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, NamedTuple

import numpy as np
import torch

from ... import autotune
from ...spec import Backend, Call, Config, OpSpec, Space, check_scale, pow2_bucket, refuse_grad
from ...target import Target
from ..host import DTYPE_NAMES, DTYPE_SIZES, DTYPES, BitsAdapter, dtype_name, index_to, units
from . import kernels
from .spec import HEAD_DIMS, _attention, _check_gpu, _visible_pairs

SUPPORTED = {"cuda": ("float16", "bfloat16"), "cpu": ("float32", "float16", "bfloat16")}
_ACCEPTED = {(DTYPES[name], kind == "cuda") for kind, names in SUPPORTED.items() for name in names}
_PAST = 1 << 20  # the block index of a tile-list entry past its sequence (writes nothing)
CPU = torch.device("cpu")


class VarlenProblem(NamedTuple):
    tokens_q: int
    tokens_kv: int
    max_seqlen_q: int
    max_seqlen_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str


class VarlenArgs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    offsets: tuple[list[int], list[int]] | None  # the offsets on the host, where validated


def tile_list(cu_q: torch.Tensor, cu_kv: torch.Tensor, tokens: int, block_M: int,
              block_N: int, causal: bool, keys: bool = False) -> torch.Tensor:
    """(entries, 2) int32 (sequence, block) pairs in the order the packed kernels run them, made
    on the offsets' device with no read back to the host (CUDA-graph capture may record it).

    The forward's list (`kernels.ragged_program`) holds query blocks, the heaviest (most KV
    blocks) first; `tokens` is tokens_q. With `keys` it is the backward's
    (`backward_kernels.ragged_gpu_program`): KV blocks of tokens_kv = `tokens` rows, the
    sequences with the most query blocks first and each one's KV blocks together in order, since
    they all read the same query rows (L2) and under the causal mask the first is the heaviest.

    The host does not know the lengths, so the list has room for the most blocks any lengths
    summing to `tokens` could need: (tokens + batch * (block - 1)) // block. The entries no
    sequence takes point past their sequence's end (`_PAST`) and write nothing."""
    batch = cu_q.numel() - 1
    len_q = (cu_q[1:].long() - cu_q[:-1].long()).clamp(min=0)
    len_kv = (cu_kv[1:].long() - cu_kv[:-1].long()).clamp(min=0)
    block = block_N if keys else block_M
    blocks = -(-(len_kv if keys else len_q) // block)
    ends = torch.cumsum(blocks, 0)
    t = torch.arange((tokens + batch * (block - 1)) // block, device=cu_q.device)
    seq = torch.searchsorted(ends, t, right=True)
    past = seq >= batch
    seq = seq.clamp(max=batch - 1)
    index = t - (ends[seq] - blocks[seq])
    work = _work(index, len_q[seq], len_kv[seq], block_M, block_N, causal, keys, torch)
    order = torch.argsort(torch.where(past, -1, work), descending=True, stable=True)
    return torch.stack([seq, torch.where(past, _PAST, index)], 1)[order].to(torch.int32)


def host_tile_list(offsets_q: list[int], offsets_kv: list[int], block_M: int, block_N: int,
                   causal: bool, keys: bool = False) -> torch.Tensor:
    """`tile_list` from offsets the host holds (validated ones): the same order, made on the
    CPU (numpy: a few microseconds where a Python loop over the tiles took hundreds) and without
    the entries no sequence takes."""
    len_q = np.diff(np.asarray(offsets_q, dtype=np.int64))
    len_kv = np.diff(np.asarray(offsets_kv, dtype=np.int64))
    block = block_N if keys else block_M
    blocks = -(-(len_kv if keys else len_q) // block)
    seq = np.repeat(np.arange(len(blocks)), blocks)
    index = np.arange(len(seq)) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    work = _work(index, len_q[seq], len_kv[seq], block_M, block_N, causal, keys, np)
    order = np.argsort(-work, kind="stable")
    tiles = np.stack([seq, index], 1)[order] if len(seq) else np.array([[0, _PAST]])
    return torch.from_numpy(tiles.astype(np.int32))


def _work(index: Any, len_q: Any, len_kv: Any, block_M: int, block_N: int, causal: bool,
          keys: bool, xp: Any) -> Any:
    """The sort key of a list's entries (`xp`: torch or numpy, elementwise). Query blocks: the KV
    blocks each visits. KV blocks: their sequence's query blocks, the same for all of a
    sequence's entries, so that a stable sort keeps them together and in order."""
    if keys:
        return -(-len_q // block_M)
    kv_blocks = -(-len_kv // block_N)
    if causal:  # the block's last query sees keys below (index + 1) * block_M + len_kv - len_q
        last = xp.clip((index + 1) * block_M + len_kv - len_q, 0, None)
        kv_blocks = xp.minimum(kv_blocks, -(-last // block_N))
    return kv_blocks


class TiledKernel:
    """A compiled ragged kernel with its tile sizes (the tile list depends on them), which its
    program carries as attributes (`_tiled`)."""

    def __init__(self, kernel: Any, call: Any = None):
        attrs = kernel.prim_func.attrs
        self.block_M, self.block_N = int(attrs["tileops.block_M"]), int(attrs["tileops.block_N"])
        self.call = call or kernel

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.call(*tensors)


def _tiled(func: Any, block_M: int, block_N: int) -> Any:
    return func.with_attr("tileops.block_M", block_M).with_attr("tileops.block_N", block_N)


def _gpu_program(*key: Any, block_M: int, block_N: int, persistent: int, units: int,
                 **config: Any) -> Any:
    return _tiled(kernels.ragged_program(*key, block_M=block_M, block_N=block_N,
                                         ctas=units if persistent else 0, **config),
                  block_M, block_N)


def _cpu_program(*key: Any, block_M: int, block_N: int) -> Any:
    return _tiled(kernels.cpu_ragged_program(*key, block_M=block_M, block_N=block_N),
                  block_M, block_N)


def _cuda_default(problem: VarlenProblem, target: Target, space: Space) -> Config:
    """The dense records' most common winner: 128 x 128 tiles, one stage (64-key blocks at
    head_dim 256, where two 128-key stages do not fit); persistent where no sequence is longer
    than 2048 queries: its CTAs start a tile while the last one's output is stored, 7-27% over
    a CTA a tile on the suite's shorter batches, within 9% either way at 16k (an H100,
    benchmarks/NOTES.md)."""
    return {"block_M": 128, "block_N": 128 if problem.head_dim <= 128 else 64, "num_stages": 1,
            "threads": 256, "persistent": int(problem.max_seqlen_q <= 2048)}


def _check_cuda(problem: VarlenProblem, config: Config, target: Target) -> str | None:
    return _check_gpu(problem, {**config, "overlap": 2, "pingpong": 0}, target)


BACKENDS = {"cpu": Backend(_cpu_program, lambda k: TiledKernel(k, BitsAdapter(k))),
            "cuda": Backend(_gpu_program, TiledKernel, check=_check_cuda, default=_cuda_default,
                            derived=units)}

_NOT_HOPPER = ("flash_attention_varlen runs the warp-specialised schedule of sm_90 (TMA and "
               "asynchronous wgmma), which this GPU's arch does not take")


def ragged_lengths(tokens: int, longest: int, seed: int) -> list[int]:
    """Sequence lengths summing to `tokens`, each at most `longest` and one of them `longest`
    (when tokens allow): the rest log-uniform in [1, longest], as prompts of a serving batch
    spread over orders of magnitude; shuffled."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [min(longest, tokens)]
    total = lengths[0]
    while total < tokens:
        draw = math.exp(torch.rand((), generator=gen).item() * math.log(longest))
        lengths.append(min(max(1, round(draw)), tokens - total))
        total += lengths[-1]
    order = torch.randperm(len(lengths), generator=gen).tolist()
    return [lengths[i] for i in order]


def _spread(lengths: list[int], tokens: int, longest: int) -> list[int]:
    """Key lengths for query lengths: `tokens` shared in proportion to them, each at most
    `longest`."""
    if len(lengths) * longest < tokens:
        raise ValueError(f"{tokens} keys do not fit in {len(lengths)} sequences of at most "
                         f"{longest}")
    total = sum(lengths)
    out = [min(longest, n * tokens // total) for n in lengths]
    i = 0
    while sum(out) < tokens:  # the rounding's remainder, one key at a time where there is room
        if out[i % len(out)] < longest:
            out[i % len(out)] += 1
        i += 1
    return out


def problem_lengths(problem: VarlenProblem) -> tuple[list[int], list[int]]:
    """The query and key lengths of an exact problem's batch (the same for every seed)."""
    q = ragged_lengths(problem.tokens_q, problem.max_seqlen_q,
                       problem.tokens_q * 1_000_003 + problem.max_seqlen_q)
    if (problem.tokens_kv, problem.max_seqlen_kv) == (problem.tokens_q, problem.max_seqlen_q):
        return q, q
    return q, _spread(q, problem.tokens_kv, problem.max_seqlen_kv)


def _offsets(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _check_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens_q: int, tokens_kv: int,
                   max_q: int, max_k: int) -> tuple[list[int], list[int]]:
    """The strict check of `validate`: one read of both offset tensors back to the host (none
    when the caller gives them there); the offsets read."""
    if autotune.capturing(cu_q.device):
        raise RuntimeError("flash_attention_varlen: validate=True reads cu_seqlens back to the "
                           "host, which CUDA-graph capture forbids; validate outside the graph, "
                           "or capture with validate=False (the kernel clamps every offset to "
                           "the tensors, so bad offsets read and write nothing outside them)")
    read = torch.cat([cu_q, cu_k]).tolist()
    both = read[:cu_q.numel()], read[cu_q.numel():]
    for name, offsets, tokens, longest, rows in (
            ("cu_seqlens_q", both[0], tokens_q, max_q, "q"),
            ("cu_seqlens_k", both[1], tokens_kv, max_k, "k and v")):
        if offsets[0] != 0:
            raise ValueError(f"flash_attention_varlen: {name} must start at 0, got {offsets[0]}")
        steps = [b - a for a, b in itertools.pairwise(offsets)]
        if min(steps) < 0:
            i = steps.index(min(steps))
            raise ValueError(f"flash_attention_varlen: {name} must not decrease; "
                             f"{name}[{i}] = {offsets[i]} > {name}[{i + 1}] = {offsets[i + 1]}")
        if max(steps) > longest:
            raise ValueError(f"flash_attention_varlen: sequence {steps.index(max(steps))} has "
                             f"{max(steps)} rows in {name}, more than max_seqlen "
                             f"{longest}")
        if (offsets[-1] != tokens) if rows == "q" else (offsets[-1] > tokens):
            raise ValueError(f"flash_attention_varlen: {name} ends at {offsets[-1]}, but {rows} "
                             f"{'has' if rows == 'q' else 'have'} {tokens} rows"
                             + (" (every query row must belong to a sequence)"
                                if rows == "q" else ""))
    return both


class AttentionVarlenSpec(OpSpec):
    name = "attention_varlen"
    aliases = ("flash_attention_varlen",)
    function = ("tileops.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, "
                "max_seqlen_q, max_seqlen_k, *, causal=False, softmax_scale=None, "
                "return_lse=False, validate=True)")
    problem_syntax = ("TQxTKVxMQxMKVxHQxHKVxD[:causal] or TxMxHQxHKVxD[:causal] (T tokens in "
                      "sequences of at most M), e.g. 32768x16384x32x8x128:causal")
    dtypes = SUPPORTED
    Problem = VarlenProblem
    bucketed = ("tokens_q", "tokens_kv", "max_seqlen_q", "max_seqlen_kv")
    categorical = ("heads_q", "heads_kv", "head_dim", "causal", "dtype")
    baseline_name = "flash-attn 2 varlen forward (torch's SDPA flash backend)"
    kernel_module = kernels.__name__
    backends = BACKENDS
    unsupported = {"metal": "flash_attention_varlen has no Metal kernel",
                   "hip": "flash_attention_varlen has no HIP kernel yet: its schedule is sm_90's",
                   **{f"cuda:sm_{major}": _NOT_HOPPER for major in (5, 6, 7, 8, 1)}}

    # ---- problems -------------------------------------------------------------------------------
    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                max_seqlen_k: int, causal: bool = False, softmax_scale: float | None = None,
                validate: bool = True) -> Call:
        self._check_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        (Tq, Hq, D), (Tk, Hkv, _) = q.shape, k.shape
        offsets = (_check_offsets(cu_seqlens_q, cu_seqlens_k, Tq, Tk, max_seqlen_q, max_seqlen_k)
                   if validate else None)
        cu_seqlens_q, cu_seqlens_k = index_to(q.device, "flash_attention_varlen",
                                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
        if softmax_scale is not None and softmax_scale != D ** -0.5:
            q = q * (check_scale(softmax_scale, "flash_attention_varlen") * D ** 0.5)
        problem = VarlenProblem(pow2_bucket(Tq), pow2_bucket(Tk), pow2_bucket(max_seqlen_q),
                                pow2_bucket(max_seqlen_k), Hq, Hkv, D, bool(causal),
                                DTYPE_NAMES[q.dtype])
        return Call(q.device, problem, VarlenArgs(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, bool(causal),
                                                  offsets))

    def _check_call(self, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: Any,
                    max_k: Any) -> None:
        """Clear errors for what the tensors' shapes, dtypes and devices say is wrong."""
        who = "flash_attention_varlen"
        tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{who}: {name} must be a tensor, got {type(t).__name__}")
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(f"{who} expects 3-D q (tokens_q, heads_q, head_dim) and k, v "
                             f"(tokens_kv, heads_kv, head_dim); got {shapes}")
        if k.shape != v.shape or q.shape[2] != k.shape[2]:
            raise ValueError(f"{who}: k and v must have one shape, and q their head_dim "
                             f"({shapes})")
        (Tq, Hq, D), (Tk, Hkv, _) = q.shape, k.shape
        if D not in HEAD_DIMS:
            raise ValueError(f"{who}: head_dim {D} is not supported (allowed: "
                             f"{', '.join(map(str, HEAD_DIMS))})")
        if min(Tq, Tk, Hq, Hkv) == 0 or Hq % Hkv:
            raise ValueError(f"{who}: {shapes}: sizes must be >= 1 and heads_q a multiple of "
                             "heads_kv")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"{who}: q, k, v have dtypes {dtype_name(q.dtype)}, "
                            f"{dtype_name(k.dtype)}, {dtype_name(v.dtype)}; they must match")
        if q.device.type not in ("cuda", "cpu") or (q.dtype, q.is_cuda) not in _ACCEPTED:
            kind = q.device.type
            raise TypeError(f"{who}: {dtype_name(q.dtype)} on {kind} is not supported (CUDA: "
                            f"{', '.join(SUPPORTED['cuda'])}; CPU: {', '.join(SUPPORTED['cpu'])})")
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(f"{who}: {name} must be a 1-D int32 tensor of batch + 1 >= 2 "
                                 f"offsets, got {dtype_name(cu.dtype)} {tuple(cu.shape)}")
        if cu_q.numel() != cu_k.numel():
            raise ValueError(f"{who}: cu_seqlens_q and cu_seqlens_k give {cu_q.numel() - 1} and "
                             f"{cu_k.numel() - 1} sequences")
        if not (q.device == k.device == v.device and cu_q.device == cu_k.device
                and cu_q.device in (q.device, CPU)):
            raise ValueError(f"{who}: q, k and v must be on one device, both offsets on it or on "
                             "the CPU; got " + ", ".join(str(t.device) for t in tensors.values()))
        for name, n in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{who}: {name} must be an int >= 1, got {n!r}")
        if any(t.stride(2) != 1 for t in (q, k, v)):
            raise ValueError(f"{who}: the last dimension (head_dim) of q, k and v must be "
                             "contiguous (stride 1)")
        refuse_grad(f"{who} on {q.device.type}", q=q, k=k, v=v)  # (a graph on the CPU)

    def parse_exact(self, text: str, dtype: str) -> VarlenProblem:
        match = re.fullmatch(r"\s*(\d+(?:x\d+){4}|\d+(?:x\d+){6})(:causal)?\s*", text)
        if not match or dtype not in DTYPES:
            raise ValueError(f"bad attention_varlen problem {text!r} ({dtype}): expected "
                             f"{self.problem_syntax} and a dtype of {', '.join(DTYPES)}")
        sizes = [int(x) for x in match.group(1).split("x")]
        if len(sizes) == 5:
            T, M, *rest = sizes
            sizes = [T, T, M, M, *rest]
        Tq, Tk, Mq, Mk, Hq, Hkv, D = sizes
        if min(sizes) < 1 or Hq % Hkv or D not in HEAD_DIMS or Mq > Tq or Mk > Tk:
            raise ValueError(f"bad attention_varlen problem {text!r}: sizes must be >= 1, the "
                             f"longest sequence at most the tokens, heads_q a multiple of "
                             f"heads_kv and head_dim one of {HEAD_DIMS}")
        return VarlenProblem(Tq, Tk, Mq, Mk, Hq, Hkv, D, match.group(2) is not None, dtype)

    def launch(self, kernel: TiledKernel, args: VarlenArgs,
               out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the kernel on a tile list made for its tile sizes (on the host from validated
        offsets, else on the device); `out`, when given, is the pair (O, LSE) of buffers to
        write."""
        q, k, v, cu_q, cu_k, _, _, causal, offsets = args
        if out is None:
            out = (torch.empty_like(q),
                   torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device))
        if offsets is not None:
            tiles = host_tile_list(*offsets, kernel.block_M, kernel.block_N, causal).to(
                q.device, non_blocking=True)
        else:
            tiles = tile_list(cu_q, cu_k, q.shape[0], kernel.block_M, kernel.block_N, causal)
        kernel(q, k, v, cu_q, cu_k, tiles, out[0], out[1])
        return out

    def launch_baseline(self, args: VarlenArgs) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, cu_q, cu_k, max_q, max_k, causal, _ = args
        if q.is_cuda:
            out, lse = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)[:2]
            return out, lse
        return _per_sequence(q, k, v, cu_q, cu_k, causal, q.dtype)

    def reported_beside(self, args: VarlenArgs) -> dict[str, Any]:
        """The call with validate=False: no read of the offsets, the tile list made on the
        device (what a CUDA graph replays); and validated with the offsets on the host (checked
        and the tile list made there, no read back)."""
        from ...dispatch import DISPATCHER

        q, k, v, cu_q, cu_k, max_q, max_k, causal, _ = args
        host = (cu_q.cpu(), cu_k.cpu())
        return {"validate=False": lambda: DISPATCHER(self, q, k, v, cu_q, cu_k, max_q, max_k,
                                                     causal, None, False),
                "host offsets": lambda: DISPATCHER(self, q, k, v, *host, max_q, max_k, causal)}

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: VarlenProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        problem = problem._replace(**(sizes or {}))
        len_q, len_kv = problem_lengths(problem)
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = DTYPES[problem.dtype]
        q, k, v = (torch.randn(T, H, problem.head_dim, generator=gen, device=device).to(dtype)
                   for T, H in ((problem.tokens_q, problem.heads_q),
                                (problem.tokens_kv, problem.heads_kv),
                                (problem.tokens_kv, problem.heads_kv)))
        return (q, k, v, _offsets(len_q, device), _offsets(len_kv, device), max(len_q),
                max(len_kv), problem.causal)

    def reference(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(O, LSE) in float64, sequence by sequence."""
        q, k, v, cu_q, cu_k, _, _, causal = inputs[:8]
        scale = inputs[8] if len(inputs) > 8 and inputs[8] is not None else None
        return _per_sequence(q, k, v, cu_q, cu_k, causal, torch.float64, scale)

    products = 2  # as `AttentionSpec.products`

    def flops(self, problem: VarlenProblem) -> float:
        len_q, len_kv = problem_lengths(problem)
        pairs = sum(_visible_pairs(a, b, problem.causal) for a, b in zip(len_q, len_kv, strict=True))
        return 2.0 * self.products * problem.heads_q * problem.head_dim * pairs

    def bytes_moved(self, problem: VarlenProblem) -> float:
        Tq, Tk, _, _, Hq, Hkv, D, _, dtype = problem
        return (2 * Tq * Hq * D + 2 * Tk * Hkv * D) * DTYPE_SIZES[dtype] + 4 * Hq * Tq

    def tolerance(self, problem: VarlenProblem) -> float:
        return 1e-5 if problem.dtype == "float32" else 1e-2


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, causal: bool, dtype: torch.dtype,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention (`spec._attention`) of each sequence in `dtype`: (O, LSE (heads, tokens))."""
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for (a, b), (c, d) in zip(itertools.pairwise(cu_q.tolist()),
                              itertools.pairwise(cu_k.tolist()), strict=True):
        if b == a or d == c:  # no query, or no key: zeros and -inf, as the kernels give
            continue
        o, s = _attention(q[None, a:b], k[None, c:d], v[None, c:d], causal, scale, dtype)
        out[a:b], lse[:, a:b] = o[0], s[0].float()
    return out, lse


ATTENTION_VARLEN = AttentionVarlenSpec()
