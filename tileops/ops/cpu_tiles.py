"""Tile steps shared by the CPU forms of the matmul-shaped programs (TileLang's C target).

The C target has no fragments or shared-memory pipelines: a program instance stages zero-padded
fp32 tiles in local buffers, multiplies them with scalar loops (which gcc -O3 vectorises), and
writes the in-range part of its output tile back element by element.
"""

# No `from __future__ import annotations`: TileLang evaluates the macro annotations.
import tilelang.cpu.language as TC

from .common import from_f32, to_f32


@TC.macro
def stage(tile, src, rows, cols, r0, c0, dtype, transposed):
    """tile[i, j] = src[r0 + i, c0 + j] (or src[c0 + j, r0 + i] when `transposed`) as fp32,
    zero outside the rows x cols extent of the logical (untransposed) matrix."""
    for i, j in TC.grid(*tile.shape):
        if transposed:
            tile[i, j] = TC.if_then_else(r0 + i < rows and c0 + j < cols,
                                         to_f32(src[c0 + j, r0 + i], dtype), 0.0)
        else:
            tile[i, j] = TC.if_then_else(r0 + i < rows and c0 + j < cols,
                                         to_f32(src[r0 + i, c0 + j], dtype), 0.0)


@TC.macro
def zero(tile):
    for i, j in TC.grid(*tile.shape):
        tile[i, j] = 0.0


@TC.macro
def accumulate(acc, a, b):
    """acc += a @ b on local fp32 tiles."""
    for i, kk, j in TC.grid(a.shape[0], a.shape[1], b.shape[1]):
        acc[i, j] += a[i, kk] * b[kk, j]


@TC.macro
def store(dst, acc, rows, cols, r0, c0, dtype):
    """dst[r0 + i, c0 + j] = acc[i, j] inside rows x cols, element by element: the C backend's
    vectorised fp16 cast is broken."""
    for i, j in TC.grid(*acc.shape):
        if r0 + i < rows and c0 + j < cols:
            dst[r0 + i, c0 + j] = from_f32(acc[i, j], dtype)
