"""The prepacked MXFP4 weight's tile programs (prepack.py has the layout): C[M, N] = A[M, K] @
W^T with W decoded in registers as wgmma's A operand on Hopper, and the CPU form that checks the
layout's index arithmetic in CI."""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from .. import gpu_tiles
from ..common import ACCUM
from .constants import ATOM_K, ATOM_ROWS, BLOCK
from .kernels import code_value_bits, cpu_tiles

# The prepacked weight's decode (prepack.py has the layout): a lane's words and scales for each
# 64-deep atom of its K step, one 16-byte and one 8-byte shared-memory load, become the bf16 pairs
# of its wgmma A fragment, written in the fragment's register order (`out`: 4 pairs per k-step).
# Per pair: one shift puts the codes at bits 12 and 28 (signs where bf16 keeps them), a second
# moves the magnitudes six places down to the lowest exponent and top mantissa bits; read as bf16
# the pair is the E2M1 values times 2^-126 (code 1 the subnormal 2^-127), and two packed multiplies
# (2^126, then the block's scale) make it exact, rounding once as bf16 does.
RS_DECODE = "tileops_mxfp4_rs_decode"
RS_SOURCE = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ void tileops_mxfp4_rs_decode(const int* w, const short* s, void* out,
                                                        int a) {
  unsigned int* o = reinterpret_cast<unsigned int*>(out);
  const __nv_bfloat162 two126 = __halves2bfloat162(__ushort_as_bfloat16(0x7E80),
                                                   __ushort_as_bfloat16(0x7E80));
  {
    const uint4 q = *reinterpret_cast<const uint4*>(w);
    const uint2 sc = *reinterpret_cast<const uint2*>(s);
    const unsigned int scale[4] = {__byte_perm(sc.x, 0u, 0x1010), __byte_perm(sc.x, 0u, 0x3232),
                                   __byte_perm(sc.y, 0u, 0x1010), __byte_perm(sc.y, 0u, 0x3232)};
    const unsigned int word[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const unsigned int x = word[k] << (4 * p);
        unsigned int r = (x & 0x80008000u) | ((x >> 6) & 0x01C001C0u);
        __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&r);
        const unsigned int sp = scale[2 * (k / 2) + (p % 2)];
        v = __hmul2(__hmul2(v, two126), *reinterpret_cast<const __nv_bfloat162*>(&sp));
        o[16 * a + 4 * k + p] = *reinterpret_cast<unsigned int*>(&v);
      }
    }
  }
}
"""


def thread_regs(ctas_per_sm: int) -> int:
    """Registers per thread when `ctas_per_sm` CTAs of two warpgroups (TMA producer, consumer)
    share an SM's 64K: the cap `__launch_bounds__` puts on the kernel."""
    return min(255, 65536 // (256 * ctas_per_sm) // 8 * 8)


def packed_program(N: int, K: int, dtype: str, *, block_M: int, block_K: int, num_stages: int,
                   threads: int, split_k: int = 1, ctas_per_sm: int = 1):
    """The prepacked weight's kernel (Hopper): C^T = W X^T with the weight decoded in registers
    as wgmma's A operand and never written back to shared memory. Each consumer warp owns one
    16-row atom row, so block_N = threads / 2; block_M tokens ride wgmma's N side. The weight's
    words and scales arrive by TMA, a K step per pipeline stage; split-K as `gpu_tiles` does it.
    `ctas_per_sm` > 1 caps registers (`thread_regs`) so that CTAs share an SM: one CTA's decode
    runs while another's wgmma and loads are in flight. No setmaxnreg then: a consumer growing
    past its share would wait forever for registers wherever ptxas allotted the kernel fewer."""
    M = T.dynamic("m")
    block_N = threads // 32 * ATOM_ROWS
    atoms = block_K // ATOM_K
    k_steps = K // block_K // split_k  # check_config: block_K and split_k divide K's steps
    partial = split_k > 1

    @T.macro
    def tiles(A, Wp, Sp, C, partials):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k,
                      threads=threads) as (bx, by, bz):
            A_s = T.alloc_shared((block_M, block_K), dtype)
            W_s = T.alloc_shared((block_N // ATOM_ROWS, atoms * 128), "int32")
            S_s = T.alloc_shared((block_N // ATOM_ROWS, atoms * 32), "int16")
            B_f = T.alloc_fragment((block_N, block_K), dtype)
            C_f = gpu_tiles.accumulator(block_M, block_N, 1)
            T.import_source(RS_SOURCE)
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                T.no_set_max_nreg()
            tx = T.get_thread_binding()
            warp, lane = tx // 32, tx % 32
            T.clear(C_f)
            for k in T.Pipelined(k_steps, num_stages=num_stages):
                ko = bz * k_steps + k
                T.copy(A[by * block_M, ko * block_K], A_s)
                T.copy(Wp[bx * (block_N // ATOM_ROWS), ko * atoms * 128], W_s)
                T.copy(Sp[bx * (block_N // ATOM_ROWS), ko * atoms * 32], S_s)
                # B_f's registers are written through their address, which TileLang does not
                # see: the decode's order is the fragment's (prepack.py), checked by the tests.
                # One call per atom: TileLang may split a tile row into TMA boxes, so only its
                # own indexing finds an atom's words.
                for a in T.unroll(atoms):
                    T.call_extern("handle", RS_DECODE,
                                  T.address_of(W_s[warp, a * 128 + lane * 4]),
                                  T.address_of(S_s[warp, a * 32 + lane // 4 * 4]), B_f.data, a)
                T.gemm(B_f, A_s, C_f, transpose_B=True)
            gpu_tiles.store(C_f, C, partials, by * block_M, bx * block_N, bz, 1, partial)

    if not partial:
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
    def element(Wp, Sp, table, n, k):
        rr, kk = n % ATOM_ROWS, k % ATOM_K
        half, r8, c8 = rr // 8, rr % 8, kk % 8
        pair = kk % 16 // 8 * 2 + half
        lane = r8 * 4 + c8 // 2
        word = Wp[n // ATOM_ROWS, k // ATOM_K * 128 + lane * 4 + kk // 16]
        nibble = T.if_then_else(c8 % 2 == 0, 3 - pair, 7 - pair)
        code = T.bitwise_and(T.shift_right(T.cast(word, "uint32"), T.cast(nibble, "uint32") * 4),
                             T.uint32(15))
        slot = r8 * 4 + kk // BLOCK * 2 + half
        bf16 = T.bitwise_and(T.cast(Sp[n // ATOM_ROWS, k // ATOM_K * 32 + slot], "uint32"),
                             T.uint32(0xFFFF))
        return code_value_bits(code) * T.reinterpret(T.shift_left(bf16, T.uint32(16)), "float32")

    return cpu_tiles(N, K, dtype, (N // ATOM_ROWS, K // ATOM_K * 128), "int32",
                      (N // ATOM_ROWS, K // ATOM_K * 32), "int16", element, False,
                      block_M=block_M, block_N=block_N, block_K=block_K)
