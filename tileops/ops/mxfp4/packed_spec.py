"""MXFP4 GEMM on a prepacked weight: `tileops.mxfp4_gemm(a, prepack_mxfp4(w_fp4, w_scale))`.

The same operator as `mxfp4_gemm` on the OCP tensors (problems, baseline, reference and roofline
are that spec's), with its own kernel family: the weight arrives in the register-decoding
kernel's order (prepack.py), so it is tuned, recorded and dispatched on its own.
"""

from __future__ import annotations

from typing import Any

import torch

from ...spec import Backend, Call, Config, Space, empty_call, refuse_grad
from ...target import Target
from ..host import (
    BitsAdapter,
    Once,
    check_decode_knobs,
    decode_split_k,
    dtype_name,
    gpu_adapter,
    smem_limit,
)
from . import packed_kernels
from .constants import ATOM_K, ATOM_ROWS, BLOCK
from .format import dequantize_mxfp4
from .prepack import LAYOUT, PrepackedMxfp4, prepack_mxfp4, unpack
from .spec import Mxfp4GemmSpec, Mxfp4Problem, _rows_for

SUPPORTED = ("bfloat16",)  # the decode builds bf16 pairs


class PackedArgs(Once):
    """A call's prepacked weight, and its dense form once the baseline has needed it."""

    __slots__ = ("packed",)

    def __init__(self, packed: PrepackedMxfp4):
        super().__init__()
        self.packed = packed

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.get(lambda: dequantize_mxfp4(*unpack(self.packed), dtype))


def _cpu_default(problem: Mxfp4Problem, target: Target, space: Space) -> Config:
    return {"block_M": _rows_for(problem.M, space["block_M"]), "block_N": 32, "block_K": 64}


def _cuda_default(problem: Mxfp4Problem, target: Target, space: Space) -> Config:
    """One consumer warpgroup (64 weight rows), the deepest K step up to 256 that divides K, in
    four stages, two CTAs per SM up to 32 tokens and the K splits (any divisor of the steps)
    that fill them; the tokens ride wgmma's N side, 8 of them up to M = 8 (half the activation
    stage of 16: 1-3% faster at M = 1 on an H100, benchmarks/NOTES.md)."""
    block_K = next(bk for bk in (256, 192, 128, ATOM_K) if problem.K % bk == 0)
    block_M = 8 if problem.M <= 8 else min(max(problem.M, 16), 64)
    ctas = 2 if block_M <= 32 else 1
    return {"block_M": block_M, "block_N": 64, "block_K": block_K, "num_stages": 4, "threads": 128,
            "ctas_per_sm": ctas, "cluster_sum": 0, "producer": 1,
            "split_k": decode_split_k(problem.N, problem.K, 64, block_K, target.units or 132,
                                      powers_of_two=False)}


def _check_cuda(problem: Mxfp4Problem, config: Config, target: Target) -> str | None:
    bm, bn, bk, threads = config["block_M"], config["block_N"], config["block_K"], config["threads"]
    if not target.is_hopper:
        return ("the prepacked kernel feeds wgmma from registers: sm_90 only (call "
                "mxfp4_gemm(a, w_fp4, w_scale) elsewhere)")
    if bk % ATOM_K or problem.K % bk:
        return f"block_K {bk} must be a multiple of {ATOM_K} dividing K = {problem.K}"
    if bk > 256:
        return f"block_K {bk}: {bk // 4} registers of decoded weight per thread (> 64)"
    if threads != 128:  # two warpgroups' A fragments are not laid out one atom row per warp
        return f"{threads} threads: the prepacked kernel has one consumer warpgroup (128)"
    group = threads // 32 * ATOM_ROWS  # weight rows per wgmma: an atom row per warp
    if bn not in (group, 2 * group) or problem.N % bn:
        return f"block_N {bn} must be {group} or {2 * group} and divide N = {problem.N}"
    split = config.get("split_k", 1)
    if config["cluster_sum"] and (not 1 < split <= 8 or bm % split):
        return (f"cluster_sum takes 2-8 K splits (a portable cluster) dividing the {bm} tokens, "
                f"not {split}")
    stages, ctas, producer = config["num_stages"], config["ctas_per_sm"], config["producer"]
    weight = bn * bk // 2 + bn * bk // BLOCK * 2  # a K step's words and scales
    staged = stages * (bm * bk * 2 + weight)
    # The output tile: beside the stages with the producer, over them without (the lowered code)
    smem = staged + bm * bn * 4 if producer else max(staged, bm * bn * 4)
    limit = smem_limit(target.arch)
    if ctas * (smem + 1024) > limit + 1024:  # an SM: the block limit + 1 KiB, 1 KiB per block
        return f"shared memory {ctas} x {smem // 1024} KiB > {limit // 1024} KiB"
    regs = packed_kernels.thread_regs(ctas, producer)  # fragment + accumulators + ~40 (SASS)
    if bk // 4 + bm * bn // 128 + 40 > regs:
        return (f"{ctas} CTAs per SM leave {regs} registers per thread, too few for a "
                f"{bk}-deep decoded fragment and {bm} tokens")
    knobs = {**config, "swap_ab": 1}
    return check_decode_knobs(problem.M, problem.K, knobs, target.arch, min_block_M=16)


BACKENDS = {"cpu": Backend(packed_kernels.cpu_packed_program, BitsAdapter, default=_cpu_default),
            "cuda": Backend(packed_kernels.packed_program, gpu_adapter, check=_check_cuda,
                            default=_cuda_default)}


class Mxfp4PackedSpec(Mxfp4GemmSpec):
    name = "mxfp4_gemm_packed"
    function = "tileops.mxfp4_gemm(a, tileops.prepack_mxfp4(w_fp4, w_scale))"
    problem_syntax = "MxNxK (weight N x K, N a multiple of 16, K of 64), e.g. 16x4096x4096"
    dtypes = {"cuda": SUPPORTED, "cpu": SUPPORTED}
    kernel_module = packed_kernels.__name__
    backends = BACKENDS

    def unsupported_reason(self, target: Target) -> str | None:
        if target.kind == "cuda" and not target.is_hopper:
            return (f"{self.name} feeds wgmma from registers: sm_90 only, not cuda "
                    f"{target.arch}; call mxfp4_gemm(a, w_fp4, w_scale) there")
        return super().unsupported_reason(target)

    def warm_recipe(self, args: tuple, call: Call, kernel: Any) -> None:
        """None: the prepacked weight is an object, which the native key cannot hold."""
        return None

    def prepare(self, a: torch.Tensor, packed: PrepackedMxfp4) -> Call:
        try:
            M, K = a.shape
            ok = (isinstance(packed, PrepackedMxfp4) and packed.layout == LAYOUT
                  and a.dtype is torch.bfloat16 and K == packed.K and M > 0
                  and a.device == packed.device
                  and not (a.requires_grad and torch.is_grad_enabled()))
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            self._validate_packed(a, packed)
            return empty_call(a.device, a.new_empty((0, packed.N)))  # M = 0, as torch
        if not a.is_contiguous():
            a = a.contiguous()
        problem = Mxfp4Problem(1 << (M - 1).bit_length(), packed.N, K, "bfloat16")
        return Call(a.device, problem, (a, PackedArgs(packed)))

    def _validate_packed(self, a: Any, packed: Any) -> None:
        """`_validate` for a prepacked weight: the clear error, or return where a has no row."""
        if not isinstance(packed, PrepackedMxfp4):
            raise TypeError("mxfp4_gemm(a, packed): packed must come from tileops.prepack_mxfp4, "
                            f"got {type(packed).__name__}")
        if packed.layout != LAYOUT:
            raise ValueError(f"mxfp4_gemm: the weight was prepacked as {packed.layout!r}; this "
                             f"build reads {LAYOUT!r}: prepack it again")
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"mxfp4_gemm: a must be a tensor, got {type(a).__name__}")
        if a.dim() != 2:
            raise ValueError(f"mxfp4_gemm expects a 2-D a (M, K); got shape {tuple(a.shape)}")
        if a.dtype is not torch.bfloat16:
            raise TypeError(f"mxfp4_gemm on a prepacked weight takes bfloat16 a; got "
                            f"{dtype_name(a.dtype)} (use the OCP tensors for float16)")
        if a.shape[1] != packed.K:
            raise ValueError(f"mxfp4_gemm: a is {tuple(a.shape)} but the weight holds K = "
                             f"{packed.K}")
        if a.device != packed.device:
            raise ValueError(f"mxfp4_gemm: a is on {a.device} but the weight is on "
                             f"{packed.device}")
        refuse_grad("mxfp4_gemm", a=a)
        if a.shape[0] == 0:
            return
        raise ValueError(f"mxfp4_gemm: unsupported inputs a {tuple(a.shape)} on {a.device}")

    def parse_exact(self, text: str, dtype: str) -> Mxfp4Problem:
        problem = super().parse_exact(text, dtype)
        if problem.N % ATOM_ROWS or problem.K % ATOM_K or dtype not in SUPPORTED:
            raise ValueError(f"bad prepacked MXFP4 problem {text!r} ({dtype}): N a multiple of "
                             f"{ATOM_ROWS}, K of {ATOM_K}, bfloat16")
        return problem

    def launch(self, kernel, args: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
        a, w = args
        c = out if out is not None else a.new_empty(a.shape[0], w.packed.N)
        kernel(a, w.packed.words, w.packed.scales, c)
        return c

    def make_inputs(self, problem: Mxfp4Problem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        a, w_fp4, w_scale = super().make_inputs(problem, device, seed, sizes)
        return a, prepack_mxfp4(w_fp4, w_scale)

    def reference(self, inputs: tuple) -> torch.Tensor:
        a, packed = inputs
        return super().reference((a, *unpack(packed)))

    def bytes_moved(self, problem: Mxfp4Problem) -> float:
        M, N, K = problem.M, problem.N, problem.K  # bf16 activations, scales as bf16
        return 2 * M * K + N * K // 2 + N * K // BLOCK * 2 + 2 * M * N


MXFP4_GEMM_PACKED = Mxfp4PackedSpec()
