"""MXFP4 weight GEMM tile programs: C[M, N] = A[M, K] @ dequantize(W, S)^T, fp32 accumulation.

W is the packed weight read as (N, K/8) 32-bit words (int32: TileLang's C target takes no
uint32), eight E2M1 codes each, element k of a word in bits 4k..4k+3: the (N, K/2) uint8 layout
of format.py (element 2i in the low nibble of byte i) on a little-endian machine. S holds the
(N, K/32) E8M0 scales. Whole words let a thread decode eight consecutive elements from one load
and store them as one 16-byte vector. M is dynamic; tiles past M, N or K are zero-filled by the
copies (a zero code decodes to zero under any finite scale) or bounds-checked on the CPU.

Where the weight is decoded is a configuration knob (`dequant`):
  "bits": inside the GEMM, one tile at a time, straight into the shared-memory operand tile the
          matrix units read, so the weight crosses memory at 4.25 bits per element; the fp32
          bit pattern of each E2M1 code is assembled with shifts and masks;
  "lut":  the same, with the code's value read from a 16-entry fp32 table in shared memory;
  "reg":  as "bits", but each thread decodes into its registers exactly the elements it feeds
          to wgmma as the A operand (with swap_ab the weight is that operand): no decoded tile
          is written to shared memory and read back;
  "bf16x2": (CUDA, bf16) as "bits", but each word becomes four bf16 pairs in integer registers
          (`BF16X2_SOURCE`), each scale a bf16 pair once per step: ~4 SASS instructions per
          element where the fp32 route takes ~16, against the ~7 that streaming 4.25-bit weights
          at HBM speed leaves an SM;
  "global": a first kernel decodes the whole weight into a (N, K) workspace of the activation
          dtype and the GEMM tile loop (`gpu_tiles.matmul`) reads that. At large M every weight
          tile is used by M / block_M CTAs, so decoding it once beats decoding it in every CTA;
          the price is 2 bytes per weight element written and read again.
Each decoded value is multiplied by its block's scale, whose fp32 bits are built from the E8M0
byte.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables.
import tilelang.cpu.language as TC
import tilelang.language as T

from .. import gpu_tiles
from ..common import ACCUM, bits
from ..cpu_tiles import accumulate, stage, store, zero
from .constants import BLOCK, E2M1_VALUES


def _nibble(word, k):
    """The E2M1 code of element k from the word holding elements k & ~7 ... k | 7."""
    return T.bitwise_and(T.shift_right(T.cast(word, "uint32"), T.cast(k % 8, "uint32") * 4),
                         T.uint32(15))


def code_value_bits(code):
    """fp32 value of an E2M1 code, assembled from its fields: sign, exponent e, mantissa m."""
    e = T.bitwise_and(T.shift_right(code, T.uint32(1)), T.uint32(3))
    m = T.bitwise_and(code, T.uint32(1))
    normal = T.bitwise_or(T.shift_left(e + T.uint32(126), T.uint32(23)),
                          T.shift_left(m, T.uint32(22)))
    magnitude = T.if_then_else(e == T.uint32(0), m * T.uint32(0x3F000000), normal)  # 0 or 0.5
    sign = T.shift_left(T.bitwise_and(code, T.uint32(8)), T.uint32(28))
    return T.reinterpret(T.bitwise_or(magnitude, sign), "float32")


def _code_value_select(code):
    """fp32 value of an E2M1 code by a chain of selects over the table (fills the LUT)."""
    value = T.float32(E2M1_VALUES[-1])
    for c in range(len(E2M1_VALUES) - 2, -1, -1):
        value = T.if_then_else(code == T.uint32(c), T.float32(E2M1_VALUES[c]), value)
    return value


def _scale(e8m0):
    """fp32 value 2^(e - 127) of an E8M0 byte: 2^-127 is subnormal, 255 is NaN."""
    e = T.cast(e8m0, "uint32")
    bits_ = T.if_then_else(e == T.uint32(0), T.uint32(1 << 22), T.shift_left(e, T.uint32(23)))
    bits_ = T.if_then_else(e == T.uint32(255), T.uint32(0x7FC00000), bits_)
    return T.reinterpret(bits_, "float32")


# E2M1 x 8 -> bf16 x 8, times the block scale, in integer registers. For byte j of the word
# (elements 2j, 2j+1): one multiply places two copies of the byte, at bits 6 and 18, so that each
# element's exponent-and-mantissa bits land where a bf16 keeps its lowest exponent bits and top
# mantissa bit (bits 6..8 and 22..24), and its sign bit six places below the bf16 sign (bits 9
# and 25: one shift of 6 for both). Read as bf16 the pair is the E2M1 value times 2^-126 (code
# 1, 0.5, comes out as the subnormal 2^-127), so one packed multiply by 2^126 makes it exact and
# a second applies the scale 2^(e - 127): the one rounding the fp32 route's cast also does.
# The scale pair comes from `tileops_e8m0_bf16x2` (255 is NaN, 0 is 2^-127, a bf16 subnormal).
BF16X2_DECODE, BF16X2_SCALE = "tileops_e2m1x8_bf16", "tileops_e8m0_bf16x2"
BF16X2_SOURCE = r"""
#include <cuda_bf16.h>
#include <cstring>
__host__ __device__ __forceinline__ unsigned int tileops_e8m0_bf16x2(unsigned int e) {
  unsigned int s = e == 0u ? 0x0040u : (e == 255u ? 0x7FC0u : e << 7);
  return s | (s << 16);
}
__host__ __device__ __forceinline__ void tileops_e2m1x8_bf16(unsigned int w, unsigned int s2,
                                                            void* out) {
  unsigned int k = 0x7E807E80u;  // 2^126, a bf16 pair
  unsigned int pairs[4];
  __nv_bfloat162 scale, two126;
  memcpy(&scale, &s2, 4);
  memcpy(&two126, &k, 4);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#ifdef __CUDA_ARCH__
    unsigned int t = __byte_perm(w, 0u, 0x4440u | j) * 0x00040040u;  // byte j alone
#else
    unsigned int t = ((w >> (8 * j)) & 0xFFu) * 0x00040040u;
#endif
    unsigned int r = (t & 0x01C001C0u) | ((t << 6) & 0x80008000u);
    __nv_bfloat162 x;
    memcpy(&x, &r, 4);
    x = __hmul2(__hmul2(x, two126), scale);
    memcpy(&r, &x, 4);
    pairs[j] = r;
  }
#ifdef __CUDA_ARCH__  // one 16-byte store (nvcc splits a uint4 store through this pointer)
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::
               "r"(static_cast<unsigned int>(__cvta_generic_to_shared(out))),
               "r"(pairs[0]), "r"(pairs[1]), "r"(pairs[2]), "r"(pairs[3]) : "memory");
#else
  memcpy(out, pairs, 16);
#endif
}
"""


def gpu_program(N: int, K: int, dtype: str, *, block_M: int, block_N: int, block_K: int,
                num_stages: int, threads: int, dequant: str, split_k: int = 1,
                swap_ab: int = 0, swizzle: int = 0, k_pack: int = 1, ctas_per_sm: int = 1,
                scales_once: bool = True):
    """The GPU tile program: wgmma on sm_90a, mma on older CUDA (see the module docstring for
    `dequant`). `swap_ab` and `split_k` are the decode knobs of `gpu_tiles`; with `split_k` > 1
    the program takes its fp32 workspace (split_k, M, N) after C, and with "global" its
    dequantised weight (N, K) last. `k_pack` packs K for AMD's MFMA (the hip space varies it).
    `scales_once`: load the scales of every K step before the loop (else one step's per step).
    `ctas_per_sm` 2 caps registers (CUDA) so that two CTAs share an SM: twice the warps to hide
    the decode's latencies, where one CTA holds 240 registers per thread for 8 accumulators."""
    M = T.dynamic("m")
    tile = {"block_M": block_M, "block_N": block_N, "block_K": block_K,
            "num_stages": num_stages, "threads": threads, "swizzle": swizzle,
            "split_k": split_k, "swap_ab": swap_ab, "k_pack": k_pack}
    annotations = {"k_pack": k_pack} if k_pack != 1 else None

    if dequant == "global":  # check_config: with split_k 1
        tiles = gpu_tiles.matmul(M, N, K, dtype, True, **tile)

        @T.prim_func
        def mxfp4_gemm_global(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K // 8), "int32"),
                              S: T.Tensor((N, K // BLOCK), "uint8"), C: T.Tensor((M, N), dtype),
                              dequantized: T.Tensor((N, K), dtype)):
            _dequantize(W, S, dequantized, N, K, dtype)
            tiles(A, dequantized, C, C)

        return mxfp4_gemm_global

    lut, reg, bf16x2 = dequant == "lut", dequant == "reg", dequant == "bf16x2"
    words = block_N * block_K // 8  # packed words of a weight tile
    per_step = block_K // BLOCK  # scales per weight row and K step
    k_steps = -(-K // block_K) // split_k  # check_config: split_k divides the K steps
    scale_cols = scale_columns(k_steps * per_step)
    partial = split_k > 1

    @T.macro
    def decode_words(W_s, S_s, S2_s, B_s, s0):
        """"bf16x2": thread t decodes words t, t + threads, ...: rows' words in turn."""
        T.import_source(BF16X2_SOURCE)
        tx = T.get_thread_binding()
        for n, j in T.Parallel(block_N, per_step):
            S2_s[n, j] = T.call_extern("uint32", BF16X2_SCALE, S_s[n, s0 + j])
        # TileLang sees no store in the decoder's call, so the barriers around the tile are
        # ours: every warp's rows are read by the last step's matrix units (before) and decoded
        # by all warps (after).
        T.sync_threads()
        for i in T.serial(words // threads):  # check_config: threads divide words
            word = i * threads + tx
            n, w = word // (block_K // 8), word % (block_K // 8)
            T.call_extern("handle", BF16X2_DECODE, W_s[n, w], S2_s[n, w * 8 // BLOCK],
                          T.address_of(B_s[n, w * 8]))
        T.sync_threads()

    @T.macro
    def decode_elements(W_s, W_f, S_s, S_f, B_s, table, s0):
        """"bits", "lut" and "reg", element by element: TileLang gives each thread the eight
        elements of a word and stores them as one 16-byte vector; a loop over words writing
        eight elements gets a barrier per iteration instead."""
        if not reg:
            T.copy(W_s, W_f)
            T.copy(S_s[0:block_N, s0:s0 + per_step], S_f)
        for n, kk in T.Parallel(block_N, block_K):
            code = _nibble(W_f[n, kk // 8], kk)
            value = table[code] if lut else code_value_bits(code)
            scale = S_s[n, s0 + kk // BLOCK] if reg else S_f[n, kk // BLOCK]
            B_s[n, kk] = T.cast(value * _scale(scale), dtype)

    @T.macro
    def tiles_fused(A, W, S, C, partials):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), split_k,
                      threads=threads) as (bx, by, bz):
            A_s = T.alloc_shared((block_M, block_K), dtype)
            W_s = T.alloc_shared((block_N, block_K // 8), "int32")
            # The scales of every step, loaded once (`scales_once`; per step where shared memory
            # is short, or on Metal): a step's block_N x block_K/32 bytes are too narrow a box
            # for TMA, and copied per step they are a synchronous global load in the consumer's
            # loop, a DRAM round trip per K step.
            S_s = T.alloc_shared((block_N, scale_cols if scales_once else per_step), "uint8")
            # "reg": the decoded tile stays in the registers of the threads that feed it to the
            # matrix units as their A operand (wgmma's register-sourced form; swap_ab only).
            B_s = (T.alloc_fragment if reg else T.alloc_shared)((block_N, block_K), dtype)
            table = T.alloc_shared((16,), ACCUM)
            # "bits" and "lut": the packed words and scales of a step move to registers first
            # (16-byte loads), which frees their shared-memory stage before decoding and keeps
            # the decode loop's only shared access its store: no barrier inside it. ("reg" reads
            # them in place: its threads would each need four rows' words, registers it lacks;
            # "bf16x2" reads one word per thread and step of its loop.)
            in_place = reg or bf16x2
            W_f = W_s if in_place else T.alloc_fragment((block_N, block_K // 8), "int32")
            S_f = None if in_place else T.alloc_fragment((block_N, per_step), "uint8")
            # "bf16x2": a step's scales as bf16 pairs, converted before its words.
            S2_s = T.alloc_shared((block_N, per_step), "uint32") if bf16x2 else None
            C_f = gpu_tiles.accumulator(block_M, block_N, swap_ab)
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                T.no_set_max_nreg()  # growing the consumers to 240 would not fit two CTAs
            if lut:
                for c in T.Parallel(16):
                    table[c] = _code_value_select(T.cast(c, "uint32"))
            if swizzle:
                T.use_swizzle(panel_size=swizzle)
            T.clear(C_f)
            if scales_once:
                T.copy(S[bx * block_N, bz * k_steps * per_step], S_s)
            for k in T.Pipelined(k_steps, num_stages=num_stages):
                ko = bz * k_steps + k
                T.copy(A[by * block_M, ko * block_K], A_s)
                T.copy(W[bx * block_N, ko * (block_K // 8)], W_s)
                if not scales_once:
                    T.copy(S[bx * block_N, ko * per_step], S_s)
                s0 = k * per_step if scales_once else 0  # this step's first scale column
                if bf16x2:
                    decode_words(W_s, S_s, S2_s, B_s, s0)
                else:
                    decode_elements(W_s, W_f, S_s, S_f, B_s, table, s0)
                gpu_tiles.mma(A_s, B_s, C_f, swap_ab, True, annotations)
            gpu_tiles.store(C_f, C, partials, by * block_M, bx * block_N, bz, swap_ab, partial)

    if not partial:
        @T.prim_func
        def mxfp4_gemm(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K // 8), "int32"),
                       S: T.Tensor((N, K // BLOCK), "uint8"), C: T.Tensor((M, N), dtype)):
            tiles_fused(A, W, S, C, C)

        return mxfp4_gemm

    @T.prim_func
    def mxfp4_gemm_split_k(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K // 8), "int32"),
                           S: T.Tensor((N, K // BLOCK), "uint8"), C: T.Tensor((M, N), dtype),
                           partials: T.Tensor((split_k, M, N), ACCUM)):
        tiles_fused(A, W, S, C, partials)
        gpu_tiles.sum_partials(partials, C, M, N, split_k)

    return mxfp4_gemm_split_k


TMA_BOX = 256  # the most elements a TMA box spans in one dimension


def scale_columns(n: int) -> int:
    """Columns of the shared tile holding `n` scales per row: up to TMA's box, else a multiple of
    it, which TileLang splits into boxes (the extra columns read past the slice, unused)."""
    return n if n <= TMA_BOX else -(-n // TMA_BOX) * TMA_BOX


DEQUANT_ROWS, DEQUANT_COLS = 16, 512  # weight rows x elements per CTA of `_dequantize`


@T.macro
def _dequantize(W, S, out, n_rows, k, dtype):
    """out (n_rows, k) = the decoded weight; each thread decodes the eight elements of a word."""
    with T.Kernel(T.ceildiv(n_rows, DEQUANT_ROWS), T.ceildiv(k, DEQUANT_COLS),
                  threads=256) as (bx, by):
        for r, c in T.Parallel(DEQUANT_ROWS, DEQUANT_COLS):
            row, col = bx * DEQUANT_ROWS + r, by * DEQUANT_COLS + c
            if row < n_rows and col < k:
                out[row, col] = T.cast(code_value_bits(_nibble(W[row, col // 8], col))
                                       * _scale(S[row, col // BLOCK]), dtype)


def cpu_program(N: int, K: int, dtype: str, *, block_M: int, block_N: int, block_K: int,
                dequant: str):
    """The CPU form, for TileLang's C target: each program instance decodes a block_K x block_N
    weight tile into a local fp32 buffer and accumulates its product with the A tile."""
    lut = dequant == "lut"

    def element(W, S, table, n, k):
        code = _nibble(W[n, k // 8], k)
        return (table[code] if lut else code_value_bits(code)) * _scale(S[n, k // BLOCK])

    return cpu_tiles(N, K, dtype, (N, K // 8), "int32", (N, K // BLOCK), "uint8", element, lut,
                      block_M=block_M, block_N=block_N, block_K=block_K)


def cpu_tiles(N, K, dtype, w_shape, w_dtype, s_shape, s_dtype, element, lut, *, block_M,
               block_N, block_K):
    """The CPU tile loop around `element(W, S, table, n, k)`, the decoded weight element."""
    M = TC.dynamic("m")

    @TC.prim_func
    def mxfp4_gemm(A: TC.Tensor((M, K), bits(dtype)), W: TC.Tensor(w_shape, w_dtype),
                   S: TC.Tensor(s_shape, s_dtype), C: TC.Tensor((M, N), bits(dtype))):
        with TC.Kernel(TC.ceildiv(N, block_N), TC.ceildiv(M, block_M)) as (bx, by):
            a = TC.alloc_local((block_M, block_K), ACCUM)
            b = TC.alloc_local((block_K, block_N), ACCUM)
            acc = TC.alloc_local((block_M, block_N), ACCUM)
            table = TC.alloc_local((16,), ACCUM)
            if lut:
                for c in TC.serial(16):
                    table[c] = _code_value_select(TC.cast(c, "uint32"))
            zero(acc)
            for ko in TC.serial(TC.ceildiv(K, block_K)):
                stage(a, A, M, K, by * block_M, ko * block_K, dtype, False)
                for kk, j in TC.grid(block_K, block_N):
                    n, k = bx * block_N + j, ko * block_K + kk
                    if n < N and k < K:
                        b[kk, j] = element(W, S, table, n, k)
                    else:
                        b[kk, j] = 0.0
                accumulate(acc, a, b)
            store(C, acc, M, N, by * block_M, bx * block_N, dtype)

    return mxfp4_gemm
