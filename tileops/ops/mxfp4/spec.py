"""MXFP4 weight GEMM: C = A @ dequantize(w_fp4, w_scale)^T with fp32 accumulation.

A is (M, K) bf16 or fp16; the weight is an (N, K) MXFP4 weight packed by `quantize_mxfp4`; C has
A's dtype. Problem key: (M bucket, N, K, dtype), M bucketed by `pow2_bucket` and dynamic in the
kernel, as for GEMM.

The baseline is what a user without this kernel runs: a bf16/fp16 GEMM (`torch.matmul`, cuBLAS on
CUDA) on the weight dequantised once and kept. A call's arguments carry that dense weight, made on
the baseline's first launch, so the tuner times the GEMM alone; dispatch calling the baseline
(when a record says it won) dequantises on every call.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from ...native import INPUT, INPUT_WORDS, OUTPUT, SCRATCH, Buffer, Recipe
from ...spec import Backend, Call, Config, OpSpec, Space, empty_call, refuse_grad
from ...target import Target
from ..host import (
    DTYPE_SIZES,
    DTYPES,
    BitsAdapter,
    check_decode_knobs,
    decode_split_k,
    dtype_name,
    gpu_adapter,
    smem_limit,
    warm_kernel,
)
from . import kernels
from .constants import BLOCK
from .format import check_packed, dequantize_mxfp4, quantize_mxfp4

SUPPORTED = ("bfloat16", "float16")  # A and C, on every device
_ACCEPTED = {DTYPES[name] for name in SUPPORTED}


class Mxfp4Problem(NamedTuple):
    M: int
    N: int
    K: int
    dtype: str


class PackedWeight:
    """The packed weight of one call, and its dense form once the baseline has needed it."""

    __slots__ = ("fp4", "scale", "_dense")

    def __init__(self, fp4: torch.Tensor, scale: torch.Tensor):
        self.fp4, self.scale, self._dense = fp4, scale, None

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dense is None:
            self._dense = dequantize_mxfp4(self.fp4, self.scale, dtype)
        return self._dense


def _rows_for(M: int, allowed: list[int]) -> int:
    """The smallest token tile of the space that covers M (else the largest)."""
    return min((b for b in allowed if b >= M), default=max(allowed))


def _cpu_default(problem: Mxfp4Problem, target: Target, space: Space) -> Config:
    return {"block_M": _rows_for(problem.M, space["block_M"]), "block_N": 32, "block_K": 64,
            "dequant": "bits"}


def _hip_default(problem: Mxfp4Problem, target: Target, space: Space) -> Config:
    """Four wavefronts, within 64 KiB of LDS for two stages."""
    return {"block_M": 32 if problem.M <= 32 else 64, "block_N": 128, "block_K": 64,
            "num_stages": 2, "threads": 256, "dequant": "bits", "k_pack": 1}


def _cuda_default(problem: Mxfp4Problem, target: Target, space: Space) -> Config:
    """By M: decode tiles with the operands swapped and split K, mid-size fused tiles, then the
    weight decoded once ("global") for a plain GEMM."""
    M, N, K = problem.M, problem.N, problem.K
    units = target.units or 132
    plain = {"split_k": 1, "swap_ab": 0, "ctas_per_sm": 1}
    if M <= 64:  # decode: bound by reading W; the weight fills the wgmma M side (swap_ab)
        block_K = 256 if M <= 32 else 128  # three stages within sm_80's shared memory
        return {"block_M": max(M, 16), "block_N": 64, "block_K": block_K, "num_stages": 3,
                "threads": 128, "dequant": "bits", "swizzle": 0, "swap_ab": 1,
                "ctas_per_sm": 1, "split_k": decode_split_k(N, K, 64, block_K, units)}
    if M <= 256:  # two stages: 113 KiB, within sm_80's shared memory too
        return {"block_M": 64, "block_N": 128, "block_K": 128, "num_stages": 2,
                "threads": 128, "dequant": "bits", "swizzle": 0, **plain}
    # Each weight tile feeds M / block_M CTAs: decode the weight once, then a bf16 GEMM.
    return {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256,
            "dequant": "global", "swizzle": 8, **plain}


def _check_gpu(problem: Mxfp4Problem, config: Config, target: Target) -> str | None:
    """Shared memory, registers of the decode, accumulators, wgmma and mma tile shapes and, on
    CUDA, the decode knobs."""
    bm, bn, bk = config["block_M"], config["block_N"], config["block_K"]
    threads, stages = config["threads"], config["num_stages"]
    esize = DTYPE_SIZES[problem.dtype]
    if config["dequant"] == "global":  # A and dequantised B tiles per stage
        if config.get("split_k", 1) != 1:
            return "the global dequantisation is for large M: split_k 1 only"
        smem = max(stages, 1) * (bm + bn) * bk * esize
    else:  # the fused kernels: see `_fused_smem`
        smem = _fused_smem(problem, config, target)[0]
        if config["dequant"] == "bf16x2":
            if target.kind != "cuda" or problem.dtype != "bfloat16":
                return "dequant 'bf16x2' is CUDA code for bf16 activations"
            if bn * bk // 8 % threads:
                return f"{threads} threads do not divide the tile's {bn * bk // 8} words"
        if config["dequant"] == "reg":
            if not config.get("swap_ab"):
                return "dequant 'reg' feeds the weight as the A operand: swap_ab only"
            if bn * bk * esize // 4 // threads > 128:
                return f"{bn * bk * esize // 4 // threads} registers per thread of decoded tile"
        elif bn * bk // 8 // threads > 64:  # a step's packed words, held in registers
            return f"{bn * bk // 8 // threads} packed words per thread (> 64 registers)"
    limit = smem_limit(target.arch)
    ctas = config.get("ctas_per_sm", 1)
    if ctas > 1 and (target.kind != "cuda" or config["dequant"] == "global"):
        return "ctas_per_sm caps registers of the fused CUDA kernels only"
    if ctas * (smem + 1024) > limit + 1024:  # an SM: the block limit + 1 KiB, 1 KiB per block
        return f"shared memory {ctas} x {smem // 1024} KiB > {limit // 1024} KiB"
    if bm * bn // threads > 128:
        return f"{bm * bn // threads} accumulators per thread (> 128 registers)"
    if not config.get("swap_ab"):
        if target.is_hopper and bm >= 64 and bm % (64 * (threads // 128)):
            return f"wgmma needs block_M a multiple of 64 per warpgroup ({threads // 128})"
        if target.kind == "cuda" and bm < 64 and threads != 128:
            return f"block_M {bm} (mma tiles) takes 128 threads"
    return None


def _check_cuda(problem: Mxfp4Problem, config: Config, target: Target) -> str | None:
    return (_check_gpu(problem, config, target)
            or check_decode_knobs(problem.M, problem.K, config, target.arch, min_block_M=16))


def _scales_once(problem: Mxfp4Problem, config: Config, target: Target) -> Config:
    """Whether the fused kernels load the scales of every K step before the loop (`_fused_smem`)."""
    return {"scales_once": config["dequant"] != "global" and _fused_smem(problem, config, target)[1]}


# The kernels of each target kind. The metal default is constant: configs/mxfp4_gemm.toml holds it
# beside its space.
_GPU = Backend(kernels.gpu_program, gpu_adapter, check=_check_gpu, derived=_scales_once)
BACKENDS = {"cpu": Backend(kernels.cpu_program, BitsAdapter, default=_cpu_default),
            "cuda": replace(_GPU, check=_check_cuda, default=_cuda_default),
            "hip": replace(_GPU, default=_hip_default), "metal": _GPU}


class Mxfp4GemmSpec(OpSpec):
    name = "mxfp4_gemm"
    function = "tileops.mxfp4_gemm(a, w_fp4, w_scale)"
    problem_syntax = "MxNxK (weight N x K, K a multiple of 32), e.g. 16x4096x4096"
    dtypes = {"cuda": SUPPORTED, "cpu": SUPPORTED}
    Problem = Mxfp4Problem
    bucketed = ("M",)
    categorical = ("dtype",)
    baseline_name = "torch.matmul on the dequantised weight"
    kernel_module = kernels.__name__
    backends = BACKENDS

    # ---- problems -------------------------------------------------------------------------------
    def dispatches_baseline(self, problem: tuple, target: Target) -> bool:
        """Never: a call holds the packed weight only, and the baseline would decode it at every
        call, which its timing (one dense weight, decoded once) does not see."""
        return False

    def prepare(self, a: torch.Tensor, w_fp4: torch.Tensor, w_scale: torch.Tensor) -> Call:
        # Warm path: few attribute reads; anything off goes to `_validate` for the precise error
        # (or an empty a).
        try:
            (M, K), (N, K2), (N2, KS) = a.shape, w_fp4.shape, w_scale.shape
            ok = (a.dtype in _ACCEPTED and w_fp4.dtype is torch.uint8
                  and w_scale.dtype is torch.uint8 and K == 2 * K2 and K % BLOCK == 0
                  and N == N2 and KS * BLOCK == K and M and N and K
                  and a.device == w_fp4.device == w_scale.device
                  and not (a.requires_grad and torch.is_grad_enabled()))
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            self._validate(a, w_fp4, w_scale)
            return empty_call(a.device, a.new_empty((0, w_fp4.shape[0])))  # M = 0, as torch
        if not a.is_contiguous():
            a = a.contiguous()
        if not (w_fp4.is_contiguous() and w_scale.is_contiguous()):
            w_fp4, w_scale = w_fp4.contiguous(), w_scale.contiguous()
        if w_fp4.data_ptr() % 16:  # the kernels read 32-bit words (and GPUs load 16-byte rows)
            w_fp4 = w_fp4.clone()
        if w_scale.data_ptr() % 16:  # scales loaded once per CTA come by TMA: 16-byte aligned
            w_scale = w_scale.clone()
        problem = Mxfp4Problem(1 << (M - 1).bit_length(), N, K, dtype_name(a.dtype))
        return Call(a.device, problem, (a, PackedWeight(w_fp4, w_scale)))

    def _validate(self, a: Any, w_fp4: Any, w_scale: Any) -> None:
        """Raise the clear error for a call that `prepare`'s fast checks rejected; return only
        where the call is valid but a holds no row (M = 0: an MoE expert no token was routed
        to)."""
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"mxfp4_gemm: a must be a tensor, got {type(a).__name__}")
        N, k_weight = check_packed(w_fp4, w_scale, "mxfp4_gemm")
        if a.dim() != 2:
            raise ValueError(f"mxfp4_gemm expects a 2-D a (M, K); got shape {tuple(a.shape)}")
        if a.dtype not in _ACCEPTED:
            raise TypeError(f"mxfp4_gemm: a is {dtype_name(a.dtype)}; allowed: "
                            f"{', '.join(SUPPORTED)}")
        if a.device != w_fp4.device:
            raise ValueError(f"mxfp4_gemm: a is on {a.device} but the weight is on "
                             f"{w_fp4.device}")
        M, K = a.shape
        if k_weight != K:
            raise ValueError(f"mxfp4_gemm: a is {M}x{K} but the packed weight {tuple(w_fp4.shape)} "
                             f"holds K = {k_weight} (2 elements per byte)")
        if min(N, K) == 0:
            raise ValueError(f"mxfp4_gemm: the weight is empty (N={N}, K={K}); its sizes must "
                             "be >= 1")
        refuse_grad("mxfp4_gemm", a=a)
        if M == 0:
            return
        raise ValueError(f"mxfp4_gemm: unsupported inputs a {tuple(a.shape)} on {a.device}")

    def parse_exact(self, text: str, dtype: str) -> Mxfp4Problem:
        match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", text)
        if not match:
            raise ValueError(f"bad MXFP4 GEMM shape {text!r}: expected MxNxK (weight N x K)")
        if dtype not in SUPPORTED:
            raise ValueError(f"bad dtype {dtype!r} for mxfp4_gemm: expected one of "
                             f"{', '.join(SUPPORTED)}")
        M, N, K = (int(match.group(i)) for i in (1, 2, 3))
        if min(M, N, K) < 1 or K % BLOCK:
            raise ValueError(f"bad MXFP4 GEMM shape {text!r}: sizes must be >= 1 and K a "
                             f"multiple of {BLOCK}")
        return Mxfp4Problem(M, N, K, dtype)

    # ---- configuration --------------------------------------------------------------------------
    def check_config(self, problem: Mxfp4Problem, config: Config, target: Target) -> str | None:
        bk = config["block_K"]
        if bk % BLOCK:
            return f"block_K {bk} is not a multiple of the scale block ({BLOCK})"
        return super().check_config(problem, config, target)

    # ---- kernels --------------------------------------------------------------------------------
    def launch(self, kernel, args: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
        a, w = args
        c = out if out is not None else a.new_empty(a.shape[0], w.fp4.shape[0])
        kernel(a, w.fp4.view(torch.int32), w.scale, c)  # the kernels read words (kernels.py)
        return c

    def warm_recipe(self, args: tuple, call: Call, kernel: Any) -> tuple[Any, Recipe] | None:
        """`launch` for the native warm path: a, the fp4 bytes as int32 words, the scales, c,
        then any workspace. None where `prepare` copied an operand: the copy is not replayed."""
        a, w_fp4, w_scale = args
        a2, w = call.args
        if a2 is not a or w.fp4 is not w_fp4 or w.scale is not w_scale:
            return None
        made = warm_kernel(kernel, a.shape[0])
        if made is None:
            return None
        fn, scratch = made
        buffers = (Buffer((a.shape[0], w_fp4.shape[0]), a.dtype), *scratch)
        return fn, Recipe(((INPUT, 0), (INPUT_WORDS, 1), (INPUT, 2), (OUTPUT, 0),
                           *((SCRATCH, j) for j in range(1, len(buffers)))), buffers)

    def launch_baseline(self, args: tuple) -> torch.Tensor:
        a, w = args
        return torch.matmul(a, w.dense(a.dtype).t())

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: Mxfp4Problem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        M = (sizes or {}).get("M", problem.M)
        gen = torch.Generator(device=device).manual_seed(seed)  # on the device: fast
        a = torch.randn(M, problem.K, generator=gen, device=device).to(DTYPES[problem.dtype])
        w = torch.randn(problem.N, problem.K, generator=gen, device=device)
        return (a, *quantize_mxfp4(w))

    def reference(self, inputs: tuple) -> torch.Tensor:
        a, w_fp4, w_scale = inputs
        return a.double() @ dequantize_mxfp4(w_fp4, w_scale, torch.float64).t()

    def flops(self, problem: Mxfp4Problem) -> float:
        return 2.0 * problem.M * problem.N * problem.K

    def bytes_moved(self, problem: Mxfp4Problem) -> float:
        M, N, K = problem.M, problem.N, problem.K
        esize = DTYPE_SIZES[problem.dtype]
        return M * K * esize + N * K // 2 + N * K // BLOCK + M * N * esize


MXFP4_GEMM = Mxfp4GemmSpec()


def _fused_smem(problem: Mxfp4Problem, config: Config, target: Target) -> tuple[int, bool]:
    """Shared memory of the fused kernels (bytes), and whether it holds the scales of every K
    step (loaded once, off the loop's critical path) rather than one step's per stage: the former
    wherever it fits. TileLang's Metal code has no 16-byte uint8 vectors, which a scale row needs.

    The sum follows the buffers TileLang allocates (checked against the lowered kernels by
    tests/test_mxfp4_codegen.py), each rounded up to the 1 KiB it aligns them to."""
    bm, bn, bk = config["block_M"], config["block_N"], config["block_K"]
    stages = max(config["num_stages"], 1)
    esize = DTYPE_SIZES[problem.dtype]
    # The decoded B tile: none in registers; one per stage where the Hopper (TMA, warp-specialised)
    # pipeline sees the decode write it inside the loop; one elsewhere (bf16x2 writes it through
    # a call the pipeline cannot see into).
    tiles = {"reg": 0, "bf16x2": 1}.get(config["dequant"],
                                        stages if target.is_hopper else 1)
    base = (_kib(stages * bm * bk * esize) + _kib(stages * bn * bk // 2)
            + _kib(tiles * bn * bk * esize) + 64)
    if config["dequant"] == "lut":
        base += 1024  # the E2M1 value table
    if config["dequant"] == "bf16x2":
        base += _kib(bn * bk // BLOCK * 4)  # a step's scales as bf16 pairs
    steps = -(-problem.K // bk) // config.get("split_k", 1)
    every_step = base + _kib(bn * kernels.scale_columns(bk // BLOCK * steps))
    if target.kind != "metal" and every_step <= smem_limit(target.arch):
        return every_step, True
    return base + _kib(stages * bn * bk // BLOCK), False


def _kib(nbytes: int) -> int:
    return -(-nbytes // 1024) * 1024
