"""Tile steps shared by the GPU forms of the matmul-shaped programs (GEMM, MXFP4 GEMM).

Both knobs below serve decode shapes, where M is a handful of tokens and the time is spent
reading the weight:
- `swap_ab` multiplies the tile as (B_tile @ A_tile^T)^T, so that the weight's rows fill the
  tensor-core instruction's M side (64 per warpgroup on wgmma) and the few tokens its N side
  (8 to 256) instead of padding 16 tokens to 64 rows. The accumulator then holds the tile
  transposed, (block_N, block_M).
- `split_k` > 1 gives each of `split_k` CTAs per output tile a contiguous slice of the K steps,
  so that enough CTAs stream the weight at once. They write fp32 partials to a workspace
  (split_k, M, N), the program's last parameter `partials`, and `sum_partials` adds them into C
  in a second kernel (`host.gpu_adapter` allocates the workspace at each call). On Hopper the
  splits may instead form a thread-block cluster and sum in distributed shared memory
  (`cluster_sum`, summed by `sum_in_cluster`): no workspace, no second kernel.

`matmul` is the whole tile loop of C = A @ B with these knobs; the GEMM is that loop, the MXFP4
GEMM's "global" strategy runs it on the weight it dequantised first.
"""

# No `from __future__ import annotations`: TileLang evaluates the macro annotations.
import functools
import operator

import tilelang.language as T

from .common import ACCUM

REDUCE_N = 256  # output columns per CTA of the split-K sum

# A cluster's barrier (every thread of every CTA; release / acquire order shared memory) and a
# load of the shared memory of the cluster's CTA `rank` at the address `p` has in this one.
CLUSTER_SOURCE = r"""
__device__ __forceinline__ void tileops_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}
__device__ __forceinline__ float tileops_cluster_load(const float* p, int rank) {
  const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
  unsigned int remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
"""


def matmul(M, N: int, K: int, dtype: str, trans_b: bool, *, block_M: int, block_N: int,
           block_K: int, num_stages: int, threads: int, swizzle: int, split_k: int = 1,
           swap_ab: int = 0, k_pack: int = 1, full_row: int = 0, staged_store: int = 0,
           cluster_sum: int = 0):
    """The T.macro (A, B, C, partials): C (or, with split_k > 1, the workspace `partials`) =
    A (M, K) @ B, with B (N, K) when `trans_b` else (K, N); M is the program's dynamic size.

    One CTA per (block_M, block_N) output tile and K slice; A and B tiles are pipelined into
    shared memory over `num_stages` buffers (TMA and a producer warpgroup on sm_90a).
    `k_pack` packs K for AMD's MFMA (ignored elsewhere). `full_row` gives each warp (group)
    whole rows of the tile: on sm_90a one wgmma spans block_N, so A is read from shared memory
    once per K step of 16 instead of once per 128 columns. `staged_store` writes the unswapped
    tile through shared memory (the stage buffers, free by then) with TMA stores: full 32-byte
    sectors, where a fragment's own stores fill half of each. `cluster_sum` (sm_90a, 2-8
    splits) sums a tile's splits in the cluster they launch as (`sum_in_cluster`): no
    workspace, no second kernel, and `partials` unused.
    """
    annotations = {"k_pack": k_pack} if k_pack != 1 else None
    policy = T.GemmWarpPolicy.FullRow if full_row else T.GemmWarpPolicy.Square
    b_tile = (block_N, block_K) if trans_b else (block_K, block_N)
    k_steps = -(-K // block_K) // split_k  # check_config: split_k divides the K steps
    partial = split_k > 1
    cluster = partial and cluster_sum == 1
    launch = {"cluster_dims": (1, 1, split_k)} if cluster else {}

    @T.macro
    def tiles(A, B, C, partials):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k,
                      threads=threads, **launch) as (bx, by, bz):
            if cluster:
                T.import_source(CLUSTER_SOURCE)
            A_s = T.alloc_shared((block_M, block_K), dtype)
            B_s = T.alloc_shared(b_tile, dtype)
            C_f = accumulator(block_M, block_N, swap_ab)
            if swizzle:
                T.use_swizzle(panel_size=swizzle)
            T.clear(C_f)
            for k in T.Pipelined(k_steps, num_stages=num_stages):
                ko = bz * k_steps + k
                T.copy(A[by * block_M, ko * block_K], A_s)
                if trans_b:
                    T.copy(B[bx * block_N, ko * block_K], B_s)
                else:
                    T.copy(B[ko * block_K, bx * block_N], B_s)
                mma(A_s, B_s, C_f, swap_ab, trans_b, annotations, policy)
            store(C_f, C, partials, by * block_M, bx * block_N, bz, swap_ab, partial,
                  staged_store, (M, split_k) if cluster else None)

    return tiles


def accumulator(block_M: int, block_N: int, swap_ab: int):
    """The fp32 accumulator fragment of a (block_M, block_N) output tile."""
    return T.alloc_fragment((block_N, block_M) if swap_ab else (block_M, block_N), ACCUM)


@T.macro
def mma(A_s, B_s, C_f, swap_ab, trans_b, annotations, policy=T.GemmWarpPolicy.Square):
    """C_f += A_s @ B_s (B_s is (block_N, block_K) when `trans_b`), swapped when `swap_ab`;
    `policy` splits the unswapped tile among the warps."""
    if swap_ab:
        T.gemm(B_s, A_s, C_f, transpose_A=not trans_b, transpose_B=True,
               annotations=annotations)
    else:
        T.gemm(A_s, B_s, C_f, transpose_B=trans_b, policy=policy, annotations=annotations)


@T.macro
def transpose(C_f, C_s, n0):
    """C_s[:, n0:] = the swapped accumulator C_f (block_N, block_M) transposed, in shared memory:
    what `write_tile` and `sum_in_cluster` write from."""
    for j, i in T.Parallel(C_f.shape[0], C_f.shape[1]):
        C_s[i, n0 + j] = C_f[j, i]


@T.macro
def store(C_f, C, partials, m0, n0, split, swap_ab, partial, staged=0, cluster=None):
    """Write the accumulator of the output tile at (m0, n0): into C, or into the split's slice of
    the workspace when `partial` (split-K), or, `cluster` (m, split_k), summed with the other
    splits' across their cluster into C (`sum_in_cluster`). Rows past M and columns past N are
    dropped.

    A swapped accumulator is transposed through shared memory: written straight from the
    fragment, each thread's elements would land a row of C apart, one 32-byte sector per element.
    An unswapped one goes through shared memory too when `staged` or summed in the cluster.
    """
    if swap_ab or staged or cluster:
        rows, cols = (C_f.shape[1], C_f.shape[0]) if swap_ab else C_f.shape
        C_s = T.alloc_shared((rows, cols), ACCUM if partial else C.dtype)
        if swap_ab:
            transpose(C_f, C_s, 0)
        else:
            T.copy(C_f, C_s)
        if cluster:
            sum_in_cluster(C_s, C, cluster[0], m0, n0, split, cluster[1])
        else:
            write_tile(C_s, C, partials, m0, n0, split, partial)
    else:
        write_tile(C_f, C, partials, m0, n0, split, partial)


@T.macro
def write_tile(tile, C, partials, m0, n0, split, partial):
    """A tile (fragment or shared memory, unswapped) into C at (m0, n0), or into the split's
    slice of the workspace when `partial`; rows past M and columns past N are dropped."""
    if partial:
        T.copy(tile, partials[split, m0, n0])
    else:
        T.copy(tile, C[m0, n0])


@T.macro
def sum_in_cluster(C_s, C, m, m0, n0, rank, split_k):
    """C[m0:, n0:] = the sum of C_s (fp32, rows x cols) over a cluster's `split_k` CTAs, CTA
    `rank` summing and writing its rows / split_k rows (rows past m dropped, and columns past
    C's where the tiles do not divide them). The first barrier makes every C_s whole before any
    is read, the second keeps each CTA (and its shared memory) alive until the others have read
    it. The kernel imports `CLUSTER_SOURCE`."""
    rows, cols = C_s.shape
    part = rows // split_k  # the caller checks that split_k divides the rows
    n = C.shape[1]
    T.call_extern("handle", "tileops_cluster_sync")
    for i, j in T.Parallel(part, cols):
        row = rank * part + i
        loads = [T.call_extern(ACCUM, "tileops_cluster_load", T.address_of(C_s[row, j]), s)
                 for s in range(split_k)]
        inside = m0 + row < m
        if n % cols:
            inside = T.And(inside, n0 + j < n)
        if inside:
            C[m0 + row, n0 + j] = functools.reduce(operator.add, loads)
    T.call_extern("handle", "tileops_cluster_sync")


@T.macro
def sum_partials(partials, C, m, n, split_k):
    """The split-K second kernel: C = the sum over splits of partials (split_k, m, n).
    (Lower-case sizes: a macro's parameter names become the kernel's.)"""
    with T.Kernel(T.ceildiv(n, REDUCE_N), m, threads=128) as (bx, by):
        acc = T.alloc_fragment((REDUCE_N,), ACCUM)
        T.clear(acc)
        for s in T.serial(split_k):
            for j in T.Parallel(REDUCE_N):
                col = bx * REDUCE_N + j
                acc[j] += T.if_then_else(col < n, partials[s, by, T.min(col, n - 1)], 0)
        for j in T.Parallel(REDUCE_N):
            if bx * REDUCE_N + j < n:
                C[by, bx * REDUCE_N + j] = acc[j]
