"""Helpers the tile programs share: the accumulator dtype, the softmax constants, and the CPU
target's bf16 conversions.

TileLang's C target has no bfloat16 type: bf16 tensors enter and leave CPU programs as their
uint16 bit patterns (`host.BitsAdapter` reinterprets them at the call, without a copy) and the
programs convert with `to_f32` / `from_f32` (round to nearest even, NaN kept).

Only what the tile programs use belongs here: this module's code is part of every kernel's hash
(`OpSpec.kernel_hash`), so host-side helpers live in `host`.
"""

# No `from __future__ import annotations`: these helpers are called inside TileLang prim_funcs.
import tilelang.language as T

ACCUM = "float32"  # accumulator dtype of every tile program
# Online softmax runs in base 2 (exp2 is one instruction): scores are scaled by LOG2E, and a
# log2-sum-exp is turned into the natural log-sum-exp callers get by LN2.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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
