"""GEMM: C = A @ B with fp32 accumulation.

Problem key: (M bucket, N, K, dtype, layout, out_dtype). `layout` is "kn" for a row-major (K, N)
B and "nk" for the transposed view of an (N, K) weight (`w.t()`), which is used without a copy.
M is bucketed by `pow2_bucket` (1, 2, 4, ..., 1024, 2048, ...): every M in (2^(i-1), 2^i] shares
the configuration tuned for 2^i and, the kernel being dynamic in M, the same compiled kernel.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from ...native import INPUT, INPUT_SWAPPED, OUTPUT, SCRATCH, Buffer, Recipe
from ...spec import Backend, Call, Config, OpSpec, Space, empty_call, refuse_grad
from ...target import Target
from ..host import DTYPE_NAMES as _NAMES
from ..host import DTYPE_SIZES as _SIZES
from ..host import (
    DTYPES,
    BitsAdapter,
    check_decode_knobs,
    gpu_adapter,
    smem_limit,
    units,
    warm_kernel,
)
from ..host import dtype_name as _name
from . import kernels

# What each device type's kernels take as inputs.
SUPPORTED = {"cuda": ("float16", "bfloat16"), "cpu": ("float32", "float16", "bfloat16")}
_ACCEPTED = {(DTYPES[name], kind == "cuda") for kind, names in SUPPORTED.items() for name in names}


class GemmProblem(NamedTuple):
    M: int
    N: int
    K: int
    dtype: str
    layout: str
    out_dtype: str


def _cpu_default(problem: GemmProblem, target: Target, space: Space) -> Config:
    """The smallest row tile of the space that holds M (up to 32)."""
    rows = [b for b in space["block_M"] if b <= 32]
    return {"block_M": min((b for b in rows if b >= problem.M), default=max(rows)),
            "block_N": 32, "block_K": 64}


# The decode defaults' schedule knobs, all off (a swapped tile has no use for them).
_PLAIN = {"full_row": 0, "staged_store": 0, "stream_k": 0, "cluster_sum": 0}


def _cuda_default(problem: GemmProblem, target: Target, space: Space) -> Config:
    """By M: decode tiles with the operands swapped, then tiles by waves."""
    M = problem.M
    if M <= 64:  # decode: bound by reading B; the weight fills the wgmma M side (swap_ab)
        # The H200 grid over the Llama weights (benchmarks/NOTES.md): at M <= 16 this point
        # is within 1.2% of each problem's best on geometric mean; no split-K won there, and
        # at M = 64 it won once in seven.
        return {"block_M": max(M, 16), "block_N": 64, "block_K": 256 if M <= 16 else 128,
                "num_stages": 4, "threads": 128, "swizzle": 0, "swap_ab": 1, "split_k": 1,
                **_PLAIN}
    return _wave_tile(problem, target, space)


def _wave_tile(problem: GemmProblem, target: Target, space: Space) -> Config:
    """A 128-row tile whose count fills the SMs' waves, with as many K steps in flight as fit.

    Each CTA's rate is set by its L2 bytes in flight, so the stages fill shared memory and a
    tile's time goes as the bytes it loads a K step, 128 + block_N; block_N minimises that times
    the waves its tile count takes, summed over the M the bucket serves: at 5000 x 576 the
    bucket's 8192 rows alone would pick 128 x 160 (256 tiles, two waves), where 5000 rows make
    160 of them (two waves, the second a fifth full) and 120 of 128 x 192 (one). Widths within 2%
    of the best sum are a tie, which the bucket's largest M breaks (then the wider tile): at
    1024 x 10240 x 8192, 256 sums 1% under 224 and loses by 10% at 1024 rows. Fewer tiles than
    half the SMs (N small) split K, as many ways as keep the CTAs within one wave: more only add
    fp32 partials to sum. Whole rows per warpgroup and the tile stored through shared memory.

    On an H100 (benchmarks/NOTES.md) the rule picked the grids' best block_N on all ten weights
    measured at M = 256-4096, and took the Llama-3 weights at M = 256 from 0.32-0.80x of cuBLAS
    to 0.99-1.06x; at M = 128, the splits it picks were the best on the three weights with
    fewer than 66 tiles (1536 x 7168 0.95x, 576 x 7168 1.07x).
    """
    sms = target.units or 132

    def tiles(bn: int) -> int:
        return _tiles(problem, 128, bn)

    def cost(bn: int, rows: list[tuple[int, int]]) -> int:
        cols = -(-problem.N // bn)
        return sum(n * -(-r * cols // sms) for r, n in rows) * (128 + bn)

    widths = [bn for bn in space["block_N"] if bn >= 64]
    rows = _row_counts(problem.M)
    over_bucket = {bn: cost(bn, rows) for bn in widths}
    best = min(over_bucket.values())
    near = [bn for bn in widths if over_bucket[bn] <= best * _TIE]
    bn = min(near, key=lambda bn: (cost(bn, [(-(-problem.M // 128), 1)]), -bn))

    def runs(**knobs: int) -> bool:
        return _check_gpu(problem, dict(config, **knobs), target) is None

    config = {"block_M": 128, "block_N": bn, "block_K": 64,
              "num_stages": min(space["num_stages"]), "threads": 256, "swizzle": 8,
              "split_k": 1, "swap_ab": 0, **_PLAIN, "full_row": 1, "staged_store": 1}
    config["num_stages"] = max(s for s in space["num_stages"] if runs(num_stages=s))
    if _few_tiles(problem, 128, bn, target):
        config["split_k"] = max((s for s in space["split_k"]
                                 if tiles(bn) * s <= sms and runs(split_k=s)), default=1)
    return config


# Sums of the waves rule's cost within this factor of each other are a tie (NOTES.md).
_TIE = 1.02


def _row_counts(bucket: int, block_M: int = 128) -> list[tuple[int, int]]:
    """(row tiles, how many M of the bucket make that many) over the bucket's M, (bucket/2,
    bucket]: its configuration serves every one of them."""
    lo, hi = bucket // 2 + 1, bucket
    return [(r, min(hi, r * block_M) - max(lo, (r - 1) * block_M + 1) + 1)
            for r in range(-(-lo // block_M), -(-hi // block_M) + 1)]


def _tiles(problem: GemmProblem, block_M: int, block_N: int) -> int:
    """Output tiles of an unswapped grid."""
    return -(-problem.M // block_M) * -(-problem.N // block_N)


def _few_tiles(problem: GemmProblem, block_M: int, block_N: int, target: Target) -> bool:
    """Whether the output tiles fill under half the SMs: where K is split, at any M."""
    return 2 * _tiles(problem, block_M, block_N) < (target.units or 132)


def _check_gpu(problem: GemmProblem, config: Config, target: Target) -> str | None:
    """Shared-memory budget, accumulator registers, wgmma tile shapes and the decode knobs."""
    bm, bn, bk = config["block_M"], config["block_N"], config["block_K"]
    threads, stages = config["threads"], config["num_stages"]
    esize = _SIZES[problem.dtype]
    smem = stages * (bm * bk + bk * bn) * esize
    if config.get("staged_store"):
        csize = 4 if config.get("split_k", 1) > 1 else _SIZES[problem.out_dtype]
        # The pipelined tile's staging reuses the stage buffers, free once its loop has ended;
        # the stream-K program's loads run on into its next tile, so it has a buffer of its own.
        smem = smem + bm * bn * csize if config.get("stream_k") else max(smem, bm * bn * csize)
    reason = _check_schedule(problem, config, target)
    if reason:
        return reason
    limit = smem_limit(target.arch)
    if smem > limit:
        return f"shared memory {smem // 1024} KiB > {limit // 1024} KiB"
    if bm * bn // threads > 128:
        return f"{bm * bn // threads} accumulators per thread (> 128 registers)"
    if target.is_hopper and not config.get("swap_ab") and bm % (64 * (threads // 128)):
        return f"wgmma needs block_M a multiple of 64 per warpgroup ({threads // 128})"
    if target.kind == "cuda":  # the decode knobs (swap_ab, split_k) are CUDA's
        reason = check_decode_knobs(problem.M, problem.K, config, target.arch, min_block_M=64,
                                    few_tiles=_few_tiles(problem, bm, bn, target))
        if reason:
            return reason
    if bm * bk * esize < threads * 16 // 2:
        return "A tile too small for the thread block"
    return None


def _check_schedule(problem: GemmProblem, config: Config, target: Target) -> str | None:
    """Why the schedule knobs (`full_row`, `staged_store`, `stream_k`, `cluster_sum`) cannot
    run, or would repeat another point of the space."""
    swap, split, bm = config.get("swap_ab"), config.get("split_k", 1), config["block_M"]
    if swap and (config.get("staged_store") or config.get("full_row")):
        return "staged_store and full_row are the unswapped tile's (a swapped one is staged and " \
               "spans block_N in each warp)"
    if config.get("full_row") and target.is_hopper and config["threads"] == 128:
        return "full_row with one warpgroup is the default split (it holds every row)"
    if config.get("cluster_sum") and (not target.is_hopper or not 1 < split <= 8 or bm % split):
        return (f"cluster_sum takes 2-8 K splits (a portable cluster, sm_90) dividing the {bm} "
                f"rows, not {split}")
    if config.get("cluster_sum") and config.get("swizzle"):
        # Its clusters run along the grid's z (the splits); TileLang rasterises clustered grids
        # along x only, and its code generator stops on the pair.
        return "cluster_sum with a rasterised grid (swizzle): TileLang's clusters must lie on x"
    if not config.get("stream_k"):
        return None
    if not target.arch.startswith("sm_90"):
        return "stream_k is written for sm_90a (wgmma, TMA)"
    if split > 1 or swap:
        return "stream_k splits K itself, unswapped"
    # Its operands come by TMA alone: rows must start on 16-byte boundaries.
    inner = (problem.K, problem.K if problem.layout == "nk" else problem.N)
    if any(n * _SIZES[problem.dtype] % 16 for n in inner):
        return "stream_k loads by TMA alone: rows of A and B must be multiples of 16 bytes"
    return None


# The kernels of each target kind. The hip and metal defaults are constant: configs/gemm.toml
# holds them beside their spaces.
_GPU = Backend(kernels.gpu_program, gpu_adapter, check=_check_gpu, derived=units)
BACKENDS = {"cpu": Backend(kernels.cpu_program, BitsAdapter, default=_cpu_default),
            "cuda": replace(_GPU, default=_cuda_default), "hip": _GPU, "metal": _GPU}


class GemmSpec(OpSpec):
    name = "gemm"
    function = "tileops.gemm(a, b, *, out_dtype=None)"
    problem_syntax = "MxNxK[:kn|:nk], e.g. 4096x4096x4096 (B is (K, N) with :kn, w.t() with :nk)"
    dtypes = SUPPORTED
    Problem = GemmProblem
    bucketed = ("M",)
    categorical = ("dtype", "layout", "out_dtype")
    baseline_name = "torch.matmul"
    kernel_module = kernels.__name__
    backends = BACKENDS

    # ---- problems -------------------------------------------------------------------------------
    def prepare(self, a: torch.Tensor, b: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> Call:
        # The warm path of every call: as few tensor attribute reads as possible. Anything off
        # goes to `_validate`, which finds the precise error (or an empty operand).
        try:
            (M, K), (K2, N) = a.shape, b.shape
            dtype = a.dtype
            ok = (dtype is b.dtype and K == K2 and M and N and K
                  and (dtype, a.is_cuda) in _ACCEPTED and a.device == b.device
                  and (out_dtype is None or out_dtype in _NAMES)
                  and not ((a.requires_grad or b.requires_grad) and torch.is_grad_enabled()))
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            self._validate(a, b, out_dtype)
            # Valid, with an empty size: as torch.matmul, an empty product, or zeros over K = 0.
            return empty_call(a.device, a.new_zeros((M, N), dtype=out_dtype or dtype))
        if not a.is_contiguous():
            a = a.contiguous()
        sb0, sb1 = b.stride()
        if sb1 == 1 and (sb0 == N or K == 1):
            layout = "kn"
        elif sb0 == 1 and (sb1 == K or N == 1):  # w.t() of an (N, K) weight: use the weight
            layout, b = "nk", b.t()
        else:
            layout, b = "kn", b.contiguous()
        out_dtype = out_dtype or dtype
        # pow2_bucket(M), inlined: this line runs on every call.
        problem = GemmProblem(1 << (M - 1).bit_length(), N, K, _NAMES[dtype], layout,
                              _NAMES[out_dtype])
        return Call(a.device, problem, (a, b, layout == "nk", out_dtype))

    def _validate(self, a: Any, b: Any, out_dtype: Any) -> None:
        """Raise the clear error for a call that `prepare`'s fast checks rejected; return only
        where the call is valid but a size is 0 (nothing to compute)."""
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            raise TypeError(f"gemm expects two tensors, got {type(a).__name__} and "
                            f"{type(b).__name__}")
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"gemm expects 2-D a (M, K) and b (K, N); got a of shape "
                             f"{tuple(a.shape)} and b of shape {tuple(b.shape)}")
        if a.device != b.device:
            raise ValueError(f"gemm: a is on {a.device} but b is on {b.device}")
        if a.dtype != b.dtype:
            raise TypeError(f"gemm: a is {_name(a.dtype)} but b is {_name(b.dtype)}; "
                            "both must have the same dtype")
        kind = "cuda" if a.is_cuda else "cpu"
        if _name(a.dtype) not in SUPPORTED[kind]:
            raise TypeError(f"gemm on {kind}: dtype {_name(a.dtype)} is not supported "
                            f"(allowed: {', '.join(SUPPORTED[kind])})")
        (M, K), (K2, N) = a.shape, b.shape
        if K != K2:
            raise ValueError(f"gemm: inner dimensions differ: a is {M}x{K}, b is {K2}x{N}")
        refuse_grad("gemm", a=a, b=b)
        allowed = ", ".join(f"torch.{name}" for name in DTYPES)
        if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"gemm: out_dtype must be a torch.dtype ({allowed}) or None; got "
                            f"{type(out_dtype).__name__} {out_dtype!r}")
        if out_dtype is not None and out_dtype not in _NAMES:
            raise TypeError(f"gemm: out_dtype {out_dtype} is not supported (allowed: {allowed})")
        if min(M, N, K) > 0:  # every fast check holds: prepare and this one disagree
            raise AssertionError(f"gemm: call refused for no reason found ({M}x{K} @ {K}x{N})")

    def parse_exact(self, text: str, dtype: str) -> GemmProblem:
        match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)(?::(kn|nk))?\s*", text)
        if not match:
            raise ValueError(f"bad GEMM shape {text!r}: expected MxNxK, optionally with :kn or "
                             ":nk for the layout of B (default nk, the transposed weight w.t())")
        if dtype not in DTYPES:
            raise ValueError(f"bad dtype {dtype!r} for gemm: expected one of {', '.join(DTYPES)}")
        M, N, K = (int(match.group(i)) for i in (1, 2, 3))
        if min(M, N, K) < 1:
            raise ValueError(f"bad GEMM shape {text!r}: sizes must be >= 1")
        return GemmProblem(M, N, K, dtype, match.group(4) or "nk", dtype)

    # ---- kernels --------------------------------------------------------------------------------
    def program_args(self, problem: GemmProblem) -> tuple:
        _, N, K, dtype, layout, out_dtype = problem
        return (N, K, dtype, out_dtype, layout == "nk")

    def launch(self, kernel, args: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
        a, b, trans_b, out_dtype = args
        # Sizes as separate arguments: torch parses them faster than a tuple (about 1 us a call).
        c = out if out is not None else torch.empty(
            a.shape[0], b.shape[0] if trans_b else b.shape[1], dtype=out_dtype, device=a.device)
        kernel(a, b, c)
        return c

    def warm_recipe(self, args: tuple, call: Call, kernel: Any) -> tuple[Any, Recipe] | None:
        """`launch` for the native warm path: a, b (or the weight of a `w.t()`), c, then any
        split-K scratch. None where `prepare` copied an operand: the copy is not replayed."""
        a, b = args[0], args[1]
        a2, b2, trans_b, out_dtype = call.args
        if a2 is not a or (b2 is not b and not trans_b):
            return None
        made = warm_kernel(kernel, a.shape[0])
        if made is None:
            return None
        fn, scratch = made
        M, N = a.shape[0], b.shape[1]
        buffers = (Buffer((M, N), out_dtype), *scratch)
        return fn, Recipe(((INPUT, 0), (INPUT_SWAPPED if trans_b else INPUT, 1), (OUTPUT, 0),
                           *((SCRATCH, j) for j in range(1, len(buffers)))), buffers)

    def launch_baseline(self, args: tuple) -> torch.Tensor:
        a, b, trans_b, out_dtype = args
        c = torch.matmul(a, b.t() if trans_b else b)
        return c if c.dtype == out_dtype else c.to(out_dtype)

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: GemmProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        M = (sizes or {}).get("M", problem.M)
        gen = torch.Generator(device=device).manual_seed(seed)  # on the device: fast
        dtype = DTYPES[problem.dtype]

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device).to(dtype)

        a = randn(M, problem.K)
        b = randn(problem.N, problem.K).t() if problem.layout == "nk" else randn(problem.K, problem.N)
        return (a, b, DTYPES[problem.out_dtype])

    def reference(self, inputs: tuple) -> torch.Tensor:
        a, b = inputs[0], inputs[1]
        return a.double() @ b.double()

    def flops(self, problem: GemmProblem) -> float:
        return 2.0 * problem.M * problem.N * problem.K

    def bytes_moved(self, problem: GemmProblem) -> float:
        M, N, K = problem.M, problem.N, problem.K
        return (M * K + K * N) * _SIZES[problem.dtype] + M * N * _SIZES[problem.out_dtype]

    def tolerance(self, problem: GemmProblem) -> float:
        low = {"float16", "bfloat16"}
        return 1e-2 if low & {problem.dtype, problem.out_dtype} else 1e-5


GEMM = GemmSpec()
