"""GEMM tile programs: C[M, N] = A[M, K] @ B, fp32 accumulation.

B is either (K, N) row-major (`trans_b=False`) or an (N, K) row-major weight (`trans_b=True`, what
`w.t()` of an `nn.Linear` weight points at). M is a dynamic dimension, so one compiled kernel
serves every M; N and K are compiled in. Tiles that run past M, N or K are predicated (the GPU
copies zero-fill out-of-range elements; the CPU program checks its bounds).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables.
import tilelang.cpu.language as TC
import tilelang.language as T

from .. import gpu_tiles
from ..common import ACCUM, bits
from ..cpu_tiles import accumulate, stage, store, zero
from . import stream_k as _stream_k


def gpu_program(N: int, K: int, dtype: str, out_dtype: str, trans_b: bool, *, split_k: int = 1,
                cluster_sum: int = 0, stream_k: int = 0, units: int = 132, **config):
    """The GPU tile program (wgmma on sm_90a, mma on older CUDA, MFMA/WMMA on HIP): the tile loop
    of `gpu_tiles.matmul`. With `split_k` > 1 the program takes a fourth argument, its fp32
    workspace (split_k, M, N), and sums it in a second kernel, unless `cluster_sum` sums the
    splits in their cluster. `stream_k` is the persistent program of `stream_k.py` on `units`
    CTAs (sm_90a), with its two workspaces."""
    if stream_k:
        return _stream_k.program(N, K, dtype, out_dtype, trans_b, ctas=units, **config)
    M = T.dynamic("m")
    b_shape = (N, K) if trans_b else (K, N)
    tiles = gpu_tiles.matmul(M, N, K, dtype, trans_b, split_k=split_k, cluster_sum=cluster_sum,
                             **config)

    if split_k == 1 or cluster_sum:
        @T.prim_func
        def gemm(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype),
                 C: T.Tensor((M, N), out_dtype)):
            tiles(A, B, C, C)

        return gemm

    @T.prim_func
    def gemm_split_k(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype),
                     C: T.Tensor((M, N), out_dtype),
                     partials: T.Tensor((split_k, M, N), ACCUM)):
        tiles(A, B, C, partials)
        gpu_tiles.sum_partials(partials, C, M, N, split_k)

    return gemm_split_k


def cpu_program(N: int, K: int, dtype: str, out_dtype: str, trans_b: bool, *, block_M: int,
                block_N: int, block_K: int):
    """The CPU form of the same tile program, for TileLang's C target.

    Each program instance owns a block_M x block_N tile of C: it stages zero-padded A and B tiles
    in local buffers (fp32), accumulates their product, and writes the in-range part back.
    """
    M = TC.dynamic("m")
    b_shape = (N, K) if trans_b else (K, N)

    @TC.prim_func
    def gemm(A: TC.Tensor((M, K), bits(dtype)), B: TC.Tensor(b_shape, bits(dtype)),
             C: TC.Tensor((M, N), bits(out_dtype))):
        with TC.Kernel(TC.ceildiv(N, block_N), TC.ceildiv(M, block_M)) as (bx, by):
            a = TC.alloc_local((block_M, block_K), ACCUM)
            b = TC.alloc_local((block_K, block_N), ACCUM)
            acc = TC.alloc_local((block_M, block_N), ACCUM)
            zero(acc)
            for ko in TC.serial(TC.ceildiv(K, block_K)):
                stage(a, A, M, K, by * block_M, ko * block_K, dtype, False)
                stage(b, B, K, N, ko * block_K, bx * block_N, dtype, trans_b)
                accumulate(acc, a, b)
            store(C, acc, M, N, by * block_M, bx * block_N, out_dtype)

    return gemm
