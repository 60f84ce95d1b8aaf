"""The prepacked MXFP4 weight's tile programs (prepack.py has the layout): C[M, N] = A[M, K] @
W^T with W decoded in registers as wgmma's A operand on Hopper, and the CPU form that checks the
layout's index arithmetic in CI."""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from .. import gpu_tiles
from ..common import ACCUM
from .constants import ATOM_K, ATOM_ROWS, BLOCK
from .kernels import code_value_bits, cpu_tiles

# The prepacked weight's decode (prepack.py has the layout): a lane's words and scales for one
# 64-deep atom, one 16-byte and one 8-byte shared-memory load, become the bf16 pairs of its wgmma
# A fragment, written in the fragment's register order (`out`: 4 pairs per k-step). A word's four
# pairs take 11 integer instructions: pair 2 one mask, pair 0 a shift and a mask, pairs 1 and 3
# their magnitudes and signs shifted apart. Read as bf16 a pair is its values times 2^-126 (code 1
# the subnormal 2^-127); one packed multiply by the scale, stored times 2^126, makes it exact,
# rounding once. A step holding a scale beyond bf16 once multiplied (stored negative) takes the
# other branch, a multiply by -2^126 first.
RS_DECODE = "tileops_mxfp4_rs_decode"
# Where each pair's magnitudes (a code's low three bits) and signs lie in a half of a prepacked
# word: the shifts and masks below, and prepack.py's layout.
MAGNITUDE = (0, 3, 6, 11)
SIGN = (9, 10, 15, 14)
RS_SOURCE = r"""
#include <cuda_bf16.h>
template <bool kWide>
__device__ __forceinline__ void tileops_mxfp4_rs_pairs(const uint4 q, const uint2 sc,
                                                       unsigned int* o) {
  const unsigned int scale[4] = {__byte_perm(sc.x, 0u, 0x1010), __byte_perm(sc.x, 0u, 0x3232),
                                 __byte_perm(sc.y, 0u, 0x1010), __byte_perm(sc.y, 0u, 0x3232)};
  const unsigned int word[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned int x = word[k];
    unsigned int r[4];
    r[0] = (x << 6) & 0x81C081C0u;
    r[1] = ((x << 3) & 0x01C001C0u) | ((x << 5) & 0x80008000u);
    r[2] = x & 0x81C081C0u;
    r[3] = ((x >> 5) & 0x01C001C0u) | ((x << 1) & 0x80008000u);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&r[p]);
      const unsigned int sp = scale[2 * (k / 2) + (p % 2)];
      if (kWide) {  // -2^126 where the scale is negative, 1 elsewhere
        const unsigned int neg = (sp >> 15) & 0x00010001u;
        const unsigned int bias = 0x3F803F80u ^ (neg * (0x3F80u ^ 0xFE80u));
        v = __hmul2(v, *reinterpret_cast<const __nv_bfloat162*>(&bias));
      }
      v = __hmul2(v, *reinterpret_cast<const __nv_bfloat162*>(&sp));
      o[4 * k + p] = *reinterpret_cast<unsigned int*>(&v);
    }
  }
}

// A step's atoms (up to four; unused pointers repeat the first): every load first, then one
// branch for the whole step, which the compiler cannot schedule loads across.
__device__ __forceinline__ void tileops_mxfp4_rs_decode(int atoms, void* out,
    const int* w0, const short* s0, const int* w1, const short* s1,
    const int* w2, const short* s2, const int* w3, const short* s3) {
  const int* w[4] = {w0, w1, w2, w3};
  const short* s[4] = {s0, s1, s2, s3};
  uint4 q[4];
  uint2 sc[4];
  unsigned int any = 0u;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (a < atoms) {
      q[a] = *reinterpret_cast<const uint4*>(w[a]);
      sc[a] = *reinterpret_cast<const uint2*>(s[a]);
      any |= sc[a].x | sc[a].y;
    }
  }
  unsigned int* o = reinterpret_cast<unsigned int*>(out);
  if (any & 0x80008000u) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      if (a < atoms) tileops_mxfp4_rs_pairs<true>(q[a], sc[a], o + 16 * a);
    }
  } else {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      if (a < atoms) tileops_mxfp4_rs_pairs<false>(q[a], sc[a], o + 16 * a);
    }
  }
}
"""


def thread_regs(ctas_per_sm: int, producer: int = 1) -> int:
    """Registers per thread when `ctas_per_sm` CTAs share an SM's 64K, each of one consumer
    warpgroup and, `producer` 1, a TMA producer warpgroup: the cap `__launch_bounds__` puts on
    the kernel."""
    return min(255, 65536 // (128 * (1 + producer) * ctas_per_sm) // 8 * 8)


def packed_program(N: int, K: int, dtype: str, *, block_M: int, block_K: int, num_stages: int,
                   threads: int, block_N: int = 64, split_k: int = 1, ctas_per_sm: int = 1,
                   cluster_sum: int = 0, producer: int = 1):
    """The prepacked weight's kernel (Hopper): C^T = W X^T with the weight decoded in registers
    as wgmma's A operand and never written back to shared memory. block_M tokens ride wgmma's N
    side; the block_N weight rows are one or two groups of 64, one 16-row atom row of each per
    consumer warp, decoded into one fragment and multiplied group after group into an
    accumulator each, so that one activation tile serves both (at M = 16 it is as many bytes as
    64 rows of weight). The weight's words and scales arrive by TMA, a K step per pipeline
    stage; split-K as `gpu_tiles` does it, its sum in a second kernel or, `cluster_sum` 1, among
    the splits of a tile as one cluster (`gpu_tiles.sum_in_cluster`).
    `ctas_per_sm` > 1 caps registers (`thread_regs`) so that CTAs share an SM: one CTA's decode
    runs while another's wgmma and loads are in flight. No setmaxnreg then: a consumer growing
    past its share would wait forever for registers wherever ptxas allotted the kernel fewer.
    `producer` 0 drops the TMA producer warpgroup: the consumers issue each stage's loads as
    cp.async themselves, so that a CTA is one warpgroup and four fit an SM at 128 registers
    (eight consumer warps an SM with the producer, sixteen without)."""
    M = T.dynamic("m")
    group = threads // 32 * ATOM_ROWS  # weight rows one wgmma takes: an atom row per warp
    two = block_N == 2 * group  # check_config: block_N is one group or two
    atoms = block_K // ATOM_K
    k_steps = K // block_K // split_k  # check_config: block_K and split_k divide K's steps
    partial = split_k > 1
    cluster = partial and cluster_sum == 1
    launch = {"cluster_dims": (1, 1, split_k)} if cluster else {}
    # Without TMA loads in the pipeline TileLang does not warp-specialise it.
    loads = None if producer else {"disable_tma": True}

    @T.macro
    def decode(W_s, S_s, fragment, row, lane):
        # The fragment's registers are written through their address, which TileLang does not
        # see: the decode's order is the fragment's (prepack.py), checked by the tests. Each
        # atom's address comes from TileLang's own indexing: it may split a tile row into TMA
        # boxes.
        at = [(T.address_of(W_s[row, a * 128 + lane * 4]),
               T.address_of(S_s[row, a * 32 + lane // 4 * 4])) for a in range(atoms)]
        at += [at[0]] * (4 - atoms)
        T.call_extern("handle", RS_DECODE, atoms, fragment.data, *at[0], *at[1], *at[2], *at[3])

    @T.macro
    def tiles(A, Wp, Sp, C, partials):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k,
                      threads=threads, **launch) as (bx, by, bz):
            A_s = T.alloc_shared((block_M, block_K), dtype)
            W_s = T.alloc_shared((block_N // ATOM_ROWS, atoms * 128), "int32")
            S_s = T.alloc_shared((block_N // ATOM_ROWS, atoms * 32), "int16")
            B_f = T.alloc_fragment((group, block_K), dtype)
            C_f = gpu_tiles.accumulator(block_M, group, 1)
            if two:
                C_g = gpu_tiles.accumulator(block_M, group, 1)
            T.import_source(RS_SOURCE + (gpu_tiles.CLUSTER_SOURCE if cluster else ""))
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                T.no_set_max_nreg()
            tx = T.get_thread_binding()
            warp, lane = tx // 32, tx % 32
            T.clear(C_f)
            if two:
                T.clear(C_g)
            for k in T.Pipelined(k_steps, num_stages=num_stages):
                ko = bz * k_steps + k
                T.copy(A[by * block_M, ko * block_K], A_s, annotations=loads)
                T.copy(Wp[bx * (block_N // ATOM_ROWS), ko * atoms * 128], W_s, annotations=loads)
                T.copy(Sp[bx * (block_N // ATOM_ROWS), ko * atoms * 32], S_s, annotations=loads)
                decode(W_s, S_s, B_f, warp, lane)
                T.gemm(B_f, A_s, C_f, transpose_B=True)
                if two:
                    decode(W_s, S_s, B_f, group // ATOM_ROWS + warp, lane)
                    T.gemm(B_f, A_s, C_g, transpose_B=True)
            # Both groups' accumulators transposed into one tile, written (or summed) at once.
            C_s = T.alloc_shared((block_M, block_N), ACCUM if partial else dtype)
            gpu_tiles.transpose(C_f, C_s, 0)
            if two:
                gpu_tiles.transpose(C_g, C_s, group)
            if cluster:
                gpu_tiles.sum_in_cluster(C_s, C, M, by * block_M, bx * block_N, bz, split_k)
            else:
                gpu_tiles.write_tile(C_s, C, partials, by * block_M, bx * block_N, bz, partial)

    if not partial or cluster:
        @T.prim_func
        def mxfp4_gemm_packed(A: T.Tensor((M, K), dtype),
                              Wp: T.Tensor((N // ATOM_ROWS, K // ATOM_K * 128), "int32"),
                              Sp: T.Tensor((N // ATOM_ROWS, K // ATOM_K * 32), "int16"),
                              C: T.Tensor((M, N), dtype)):
            tiles(A, Wp, Sp, C, C)

        return mxfp4_gemm_packed

    @T.prim_func
    def mxfp4_gemm_packed_split_k(A: T.Tensor((M, K), dtype),
                                  Wp: T.Tensor((N // ATOM_ROWS, K // ATOM_K * 128), "int32"),
                                  Sp: T.Tensor((N // ATOM_ROWS, K // ATOM_K * 32), "int16"),
                                  C: T.Tensor((M, N), dtype),
                                  partials: T.Tensor((split_k, M, N), ACCUM)):
        tiles(A, Wp, Sp, C, partials)
        gpu_tiles.sum_partials(partials, C, M, N, split_k)

    return mxfp4_gemm_packed_split_k


def cpu_packed_program(N: int, K: int, dtype: str, *, block_M: int, block_N: int, block_K: int):
    """The CPU form of `packed_program`: the same tiles as `cpu_program`, each element found in
    the prepacked layout by the index arithmetic of prepack.py (which CI checks this way)."""
    def pick(table, i):
        value = T.uint32(table[-1])
        for j in range(len(table) - 2, -1, -1):
            value = T.if_then_else(i == j, T.uint32(table[j]), value)
        return value

    def element(Wp, Sp, table, n, k):
        rr, kk = n % ATOM_ROWS, k % ATOM_K
        half, r8, c8 = rr // 8, rr % 8, kk % 8
        pair = kk % 16 // 8 * 2 + half
        lane = r8 * 4 + c8 // 2
        word = T.cast(Wp[n // ATOM_ROWS, k // ATOM_K * 128 + lane * 4 + kk // 16], "uint32")
        at = T.cast(c8 % 2 * 16, "uint32")
        magnitude = T.bitwise_and(T.shift_right(word, pick(MAGNITUDE, pair) + at), T.uint32(7))
        sign = T.bitwise_and(T.shift_right(word, pick(SIGN, pair) + at), T.uint32(1))
        code = T.bitwise_or(magnitude, T.shift_left(sign, T.uint32(3)))
        slot = r8 * 4 + kk // BLOCK * 2 + half
        bf16 = T.bitwise_and(T.cast(Sp[n // ATOM_ROWS, k // ATOM_K * 32 + slot], "uint32"),
                             T.uint32(0xFFFF))
        scale = T.reinterpret(T.shift_left(bf16, T.uint32(16)), "float32")
        # The scale is stored times 2^126 (or negative, beyond bf16 so); 2^-126 is applied in
        # two halves, as no normal float holds code 1's 2^-127 (flushed to zero by fast math).
        value = code_value_bits(code)
        root = T.float32(2.0 ** -63)  # the square root of 2^-126
        return T.if_then_else(scale < 0, value * -scale, value * root * (scale * root))

    return cpu_tiles(N, K, dtype, (N // ATOM_ROWS, K // ATOM_K * 128), "int32",
                      (N // ATOM_ROWS, K // ATOM_K * 32), "int16", element, False,
                      block_M=block_M, block_N=block_N, block_K=block_K)
