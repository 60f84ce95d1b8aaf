"""Helpers shared by operators: dtype tables and the CPU target's bf16 calling convention.

TileLang's C target has no bfloat16 type: bf16 tensors enter and leave CPU programs as their
uint16 bit patterns (`BitsAdapter` reinterprets them at the call, without a copy) and the programs
convert with `to_f32` / `from_f32` (round to nearest even, NaN kept).
"""

# No `from __future__ import annotations`: these helpers are called inside TileLang prim_funcs.
from typing import Any

import tilelang.language as T
import torch

ACCUM = "float32"  # accumulator dtype of every tile program
# Online softmax runs in base 2 (exp2 is one instruction): scores are scaled by LOG2E, and a
# log2-sum-exp is turned into the natural log-sum-exp callers get by LN2.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Shared memory (LDS on AMD, threadgroup memory on Apple) one thread block may use, by arch (bytes).
SMEM_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
              "gfx950": 160 * 1024, "apple": 32 * 1024}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16, and a readable name for dtypes outside the table."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def smem_limit(arch: str) -> int:
    """Shared memory (bytes) one thread block may use on an arch (`sm_90a`, `gfx942`, `apple`)."""
    if arch.startswith("sm_"):
        return SMEM_LIMIT.get(arch.rstrip("a"), 99 * 1024)
    return SMEM_LIMIT.get(arch, 64 * 1024)  # 64 KiB of LDS on CDNA and RDNA


def bits(dtype: str) -> str:
    """The C type a CPU program declares for a tensor of `dtype`."""
    return "uint16" if dtype == "bfloat16" else dtype


def to_f32(x, dtype: str):
    """Widen an element of a CPU program's `dtype` tensor (bf16: its uint16 bits) to fp32."""
    if dtype == "bfloat16":
        return T.reinterpret(T.shift_left(T.cast(x, "uint32"), T.uint32(16)), "float32")
    return T.cast(x, "float32")


def from_f32(v, dtype: str):
    """Narrow an fp32 value to a CPU program's `dtype` (bf16: round to nearest even bits)."""
    if dtype != "bfloat16":
        return T.cast(v, dtype)
    u = T.reinterpret(v, "uint32")
    rounded = T.shift_right(u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)),
                                                                  T.uint32(1)), T.uint32(16))
    return T.cast(T.if_then_else(T.isnan(v), T.uint32(0x7FC0), rounded), "uint16")


def softmax_offset(m, scale=None):
    """What a row's exp2 exponents subtract: its running max m (times `scale` when scores are
    scaled here), or 0 while no key is visible (m = -inf), where m - m would give NaN."""
    return T.if_then_else(m == -T.infinity(ACCUM), T.float32(0), m if scale is None else m * scale)


class BitsAdapter:
    """Calls a CPU kernel with bf16 tensors viewed as their uint16 bit patterns."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.kernel(*(t.view(torch.uint16) if t.dtype is torch.bfloat16 else t for t in tensors))
