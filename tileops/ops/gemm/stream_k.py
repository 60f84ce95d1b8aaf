"""The stream-K GEMM program (sm_90a): a persistent CTA per SM, each walking an equal share of
the problem's (tile, K step) iterations, so that no SM idles in a last, partial wave.

Where the tiles alone cannot fill the machine (M = 256 at N = 4096: 32 tiles of 128 x 256 for
132 SMs) or leave a partial last wave (1.2 waves at 160 tiles), a CTA's share of the K steps
crosses tile boundaries. A tile cut between CTAs is finished by the CTA holding its first K
step: the others (each holding a later part, always their first segment) write fp32 partials
to a workspace slot of their own and raise a flag; the finisher waits for the flags, adds the
partials in CTA order (deterministic for a given SM count) and stores the tile. A CTA's
segment that starts a tile without finishing it is always its last, and a segment that
continues one is always its first, so no CTA waits on a CTA that waits, and every flag is
raised: with one CTA per SM at once, and also where fewer SMs are free (another stream's
kernels, an MPS share), since the CTAs a finisher waits for come after it and raise their flags
before any wait of their own; only a single free SM could stall (a finisher waiting for a CTA
that cannot start).

From two waves of tiles up, all whole waves but one run data-parallel first (tile i * ctas +
cta), in panels of row tiles as the pipelined tile rasterises them, and only the last one to
two waves' worth of tiles stream (CUTLASS's hybrid): fewer partials, and the L2 locality of
neighbouring tiles.

The main loop is warp-specialised by hand: a producer warp issues each stage's TMA loads, the
consumer warpgroups keep one K step's wgmma in flight and release the previous step's stage
(`T.wait_wgmma(1)`), and the stage ring runs on across tiles and segments. With `staged_store`
a finished tile goes through a shared buffer of its own to TMA stores, which one thread waits
to have read it while the others start the next tile.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from .. import gpu_tiles
from ..common import ACCUM

# The flag a partial's writer raises once its stores are visible (every consumer thread's, by
# the named barrier before it), and the finisher's wait, which takes it down again.
FLAG_SOURCE = r"""
__device__ __forceinline__ void tileops_flag_raise(int* flag) {
  asm volatile("fence.acq_rel.gpu;\n\tst.relaxed.gpu.global.b32 [%0], %1;"
               :: "l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ void tileops_flag_wait(int* flag) {
  int v = 0;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  } while (v == 0);
}
"""

# The consumers' named barrier around a partial's hand-over (TileLang's own take the low ids).
_PARTIALS_BARRIER = 8


def grid(tiles, ctas: int, S: int):
    """CTAs launched: one per SM (`ctas`), fewer where there are fewer iterations, so that
    every CTA holds at least one (a tile's finisher waits for each CTA after it)."""
    return T.min(ctas, tiles * S)


def schedule(tiles, cta, G, S: int, keep=lambda slot, value: value) -> tuple:
    """CTA `cta`'s share (of `G`, `grid`) of `tiles` tiles of `S` K steps each: (data-parallel
    tiles in all, streamed iterations in all, this CTA's streamed iterations [start, end), the
    streamed tile of `start`, data-parallel rounds, pieces of work). Expressions (the kernel's M
    is dynamic), which the tests evaluate for integers; each passes through `keep(slot, value)`,
    with which the kernel stores it and reads it back, so that no later one repeats its
    arithmetic (64-bit divisions among it)."""
    dp = keep(0, T.if_then_else(tiles >= 2 * G, (tiles // G - 1) * G, 0))
    work = keep(1, (tiles - dp) * S)
    start = keep(2, T.Cast("int32", T.Cast("int64", work) * cta // G))
    end = keep(3, T.Cast("int32", T.Cast("int64", work) * (cta + 1) // G))
    first = keep(4, start // S)
    rounds = keep(5, dp // G)
    pieces = keep(6, rounds + (end - 1) // S - first + 1)  # G <= work: end > start
    return dp, work, start, end, first, rounds, pieces


def piece(i, cta, dp, start, end, first, rounds, G, S: int) -> tuple:
    """The CTA's i-th piece of work: (tile, first K step, end K step, position in the CTA's
    sequence of K steps of its first step). The rounds' whole tiles, then the streamed range
    cut at tile boundaries."""
    streamed = first + i - rounds  # among the streamed tiles
    whole = i < rounds
    return (T.if_then_else(whole, i * G + cta, dp + streamed),
            T.if_then_else(whole, 0, T.max(start - streamed * S, 0)),
            T.if_then_else(whole, S, T.min(end - streamed * S, S)),
            T.if_then_else(whole, i * S, rounds * S + T.max(streamed * S, start) - start))


def last_cta(tile, dp, work, G, S: int):
    """The CTA whose streamed range holds the last K step of streamed tile `tile`: the
    tile's CTAs are the one holding its first step through this one."""
    return T.Cast("int32", (T.Cast("int64", (tile - dp + 1) * S) * G - 1) // work)


def keep(buf, slot: int, value):
    """Store `value` in buf[slot] (in the statement being built) and read it back."""
    T.buffer_store(buf, value, [slot])
    return buf[slot]


def program(N: int, K: int, dtype: str, out_dtype: str, trans_b: bool, *, block_M: int,
            block_N: int, block_K: int, num_stages: int, threads: int, swizzle: int,
            full_row: int = 0, staged_store: int = 0, ctas: int = 132, **_):
    """C[M, N] = A[M, K] @ B (B (N, K) when `trans_b`), M dynamic, on `ctas` persistent CTAs
    of `threads` consumer threads and one producer warpgroup. Workspaces: `partials`
    (ctas, block_M, block_N) fp32, uninitialised, and `flags` (ctas,) int32, zero. The other
    knobs as in `gpu_tiles.matmul`."""
    M = T.dynamic("m")
    b_shape = (N, K) if trans_b else (K, N)
    b_tile = (block_N, block_K) if trans_b else (block_K, block_N)
    stages = num_stages
    groups = threads // 128  # consumer warpgroups
    warps = 4 * groups
    S = -(-K // block_K)  # K steps of a tile
    nx = -(-N // block_N)
    panel = max(swizzle, 1)
    policy = T.GemmWarpPolicy.FullRow if full_row else T.GemmWarpPolicy.Square

    @T.macro
    def locate(i, cta, plan, at, ny):
        """at[0:4] = `piece` i of CTA `cta` (`plan` holds its `schedule`), at[4],
        at[5] = the tile's row and column tile: column-major in panels of `panel` row tiles,
        the pipelined tile's panels (without its reversal of every other panel)."""
        made = piece(i, cta, plan[0], plan[2], plan[3], plan[4], plan[5], plan[7], S)
        at[0] = made[0]
        at[1] = made[1]
        at[2] = made[2]
        at[3] = made[3]
        band = at[0] // (panel * nx) * panel
        rows = T.min(panel, ny - band)
        at[4] = band + (at[0] - band * nx) % rows
        at[5] = (at[0] - band * nx) // rows

    @T.prim_func
    def gemm_stream_k(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype),
                      C: T.Tensor((M, N), out_dtype),
                      partials: T.Tensor((ctas, block_M, block_N), ACCUM),
                      flags: T.Tensor((ctas,), "int32")):
        G = grid(T.ceildiv(M, block_M) * nx, ctas, S)
        with T.Kernel(G, threads=threads + 128) as cta:
            A_s = T.alloc_shared((stages, block_M, block_K), dtype)
            B_s = T.alloc_shared((stages,) + b_tile, dtype)
            full = T.alloc_barrier([2] * stages)
            empty = T.alloc_barrier([warps] * stages)
            C_f = T.alloc_fragment((block_M, block_N), ACCUM)
            plan = T.alloc_local((8,), "int32")  # this CTA's `schedule`, then the grid
            at = T.alloc_local((6,), "int32")
            T.import_source(FLAG_SOURCE)
            ny = T.ceildiv(M, block_M)
            plan[7] = G
            _ = schedule(ny * nx, cta, plan[7], S, lambda slot, value: keep(plan, slot, value))
            tx = T.get_thread_binding()
            if tx < threads:
                T.set_max_nreg(240, 1)
                for i in T.serial(plan[6]):
                    locate(i, cta, plan, at, ny)
                    T.clear(C_f)
                    for k in T.serial(at[2] - at[1]):
                        g = at[3] + k
                        T.mbarrier_wait_parity(full[g % stages], (g // stages) % 2)
                        T.wgmma_gemm(A_s[g % stages, :, :], B_s[g % stages, :, :], C_f,
                                     transpose_B=trans_b, policy=policy)
                        T.wait_wgmma(1)
                        if k > 0 and tx % 32 == 0:  # the previous step's product is done
                            T.mbarrier_arrive(empty[(g + stages - 1) % stages])
                    T.wait_wgmma(0)
                    if tx % 32 == 0:
                        T.mbarrier_arrive(empty[(at[3] + at[2] - at[1] - 1) % stages])
                    if at[1] > 0:  # a later part of a tile: hand it to the tile's first CTA
                        T.copy(C_f, partials[cta, :, :])
                        T.sync_threads(_PARTIALS_BARRIER, threads)
                        if tx == 0:
                            T.call_extern("handle", "tileops_flag_raise",
                                          T.address_of(flags[cta]))
                    else:
                        if at[2] < S:  # the tile's first part: add the later ones, CTA order
                            # the CTA holding the tile's last iteration
                            last = last_cta(at[0], plan[0], plan[1], plan[7], S)
                            for c in T.serial(last - cta):
                                if tx == 0:
                                    T.call_extern("handle", "tileops_flag_wait",
                                                  T.address_of(flags[cta + 1 + c]))
                                T.sync_threads(_PARTIALS_BARRIER, threads)
                                for r, j in T.Parallel(block_M, block_N):
                                    C_f[r, j] += partials[cta + 1 + c, r, j]
                        gpu_tiles.store(C_f, C, None, at[4] * block_M, at[5] * block_N, 0, 0,
                                        False, staged_store)
            else:
                T.set_max_nreg(24, 0)
                if tx < threads + 32:
                    for i in T.serial(plan[6]):
                        locate(i, cta, plan, at, ny)
                        for k in T.serial(at[2] - at[1]):
                            g = at[3] + k
                            ko = at[1] + k
                            T.mbarrier_wait_parity(empty[g % stages], ((g // stages) % 2) ^ 1)
                            if trans_b:
                                T.tma_copy(B[at[5] * block_N:(at[5] + 1) * block_N,
                                             ko * block_K:(ko + 1) * block_K],
                                           B_s[g % stages, :, :], barrier=full[g % stages],
                                           leader_scope_threads=32,
                                           annotations={"emit_arrive": 1})
                            else:
                                T.tma_copy(B[ko * block_K:(ko + 1) * block_K,
                                             at[5] * block_N:(at[5] + 1) * block_N],
                                           B_s[g % stages, :, :], barrier=full[g % stages],
                                           leader_scope_threads=32,
                                           annotations={"emit_arrive": 1})
                            T.tma_copy(A[at[4] * block_M:(at[4] + 1) * block_M,
                                         ko * block_K:(ko + 1) * block_K],
                                       A_s[g % stages, :, :], barrier=full[g % stages],
                                       leader_scope_threads=32, annotations={"emit_arrive": 1})

    return gemm_stream_k
