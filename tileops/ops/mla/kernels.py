"""MLA decode tile programs: paged latent attention in FlashMLA's convention, split-KV + combine.

One query row is a (token, head) pair: the `s_q * h_q` rows of a sequence share its KV cache, so a
CTA takes `block_H` rows of one sequence (row r = token * h_q + head) and walks that sequence's
pages. Scores are Q.K^T over 576 channels, computed as the latent part (512) plus the rope part
(64); values are the first 512 channels of the same rows. Softmax is online, in fp32, base 2.

The batch, the number of cache pages and the block table's width are dynamic; sequence lengths are
read from `cache_seqlens` at run time. Nothing the table or the lengths hold can make a program
read outside its tensors: a length is clamped into [0, 64 * table width] and a page id into
[0, pages) where they are read (`seq_len`, `page_of`), so the host need not check them (a check
would read them back and synchronise). Each sequence's key blocks are divided among `num_splits`
CTAs; with more than one split every CTA writes an fp32 partial output and its log2-sum-exp, and a
second small kernel combines them. Token t of s_q sees keys j < seqlen - (s_q - 1 - t); a row that
sees no key (a sequence shorter than s_q, even empty) gets zeros and a log-sum-exp of -inf, as in
flash_attention, and a NaN input gives NaN.

Only a sequence's last key block can hold rows past its length or causally masked keys: the GPU
program masks its scores and zeroes its value rows past the length in shared memory (a cache page
may hold stale NaN/Inf there, which 0 * NaN would carry into P.V); the CPU program loads every
block with the length predicate.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables.
import tilelang.cpu.language as TC
import tilelang.language as T

from ..common import ACCUM, LN2, bits, from_f32, softmax_offset, to_f32
from ..online_softmax import FAST_MATH, online_softmax  # noqa: F401 (FAST_MATH: spec.fast_math)

PAGE = 64  # cache page size (rows per block of kv_cache)
D_LATENT, D_ROPE = 512, 64
D_QK = D_LATENT + D_ROPE


def seq_len(cache_seqlens, b, table_w):
    """Sequence b's length, clamped into what its table row can address: [0, 64 * table_w]."""
    return T.min(T.max(cache_seqlens[b], 0), table_w * PAGE)


def page_of(block_table, b, pos, pages):
    """The cache page holding key `pos` of sequence b, clamped into the cache: [0, pages)."""
    return T.min(T.max(block_table[b, pos // PAGE], 0), pages - 1)


@T.macro
def store(acc, l, msc, Out, LSE, O_part, L_part, bx, r0, bz, c0, rows, h_q: int,
          num_splits: int):
    """Rows [r0, +block) of columns [c0, +width) of sequence bx's output, normalised, and (from
    the tile holding column 0) their log-sum-exps; with splits, split bz's partial and its
    log2-sum-exp. l = 0: the row saw no key (a zero-length sequence, unvalidated): zeros and a
    log-sum-exp of -inf, as flash_attention gives. l == 0, not l > 0: NaN stays NaN."""
    block_H, width = acc.shape
    for i, j in T.Parallel(block_H, width):
        acc[i, j] = T.if_then_else(l[i] == 0, 0, acc[i, j] / l[i])
    if num_splits == 1:
        T.copy(acc, Out[bx, r0:r0 + block_H, c0:c0 + width])
        if c0 == 0:
            for i in T.Parallel(block_H):
                if r0 + i < rows:
                    LSE[bx, (r0 + i) % h_q, (r0 + i) // h_q] = (T.log2(l[i]) + msc[i]) * LN2
    else:  # an empty split writes a zero partial with log2-sum-exp -inf
        T.copy(acc, O_part[bx, r0:r0 + block_H, bz, c0:c0 + width])
        if c0 == 0:
            for i in T.Parallel(block_H):
                if r0 + i < rows:
                    L_part[bx, r0 + i, bz] = T.log2(l[i]) + msc[i]


@T.macro
def combine(O_part, L_part, Out, LSE, batch, rows, h_q: int, num_splits: int):
    """The second kernel of a split-KV launch: each row's `num_splits` partial outputs merged by
    their log2-sum-exps (an empty split has -inf and weight 0)."""
    neg_inf = -T.infinity(ACCUM)
    with T.Kernel(batch, rows, threads=128) as (bx, by):
        o = T.alloc_fragment((D_LATENT,), ACCUM)
        lse = T.alloc_local((1,), ACCUM)
        top = T.alloc_local((1,), ACCUM)
        total = T.alloc_local((1,), ACCUM)
        top[0] = neg_inf
        for s in T.serial(num_splits):
            top[0] = T.max(top[0], L_part[bx, by, s])
        top[0] = softmax_offset(top[0])  # every split empty: 0, not -inf - -inf
        total[0] = 0
        for s in T.serial(num_splits):
            total[0] += T.exp2(L_part[bx, by, s] - top[0])
        lse[0] = T.log2(total[0]) + top[0]  # -inf when every split was empty
        T.clear(o)
        for s in T.serial(num_splits):
            for j in T.Parallel(D_LATENT):
                o[j] += T.if_then_else(total[0] == 0, 0, T.exp2(
                    L_part[bx, by, s] - lse[0]) * O_part[bx, by, s, j])
        T.copy(o, Out[bx, by, :])
        LSE[bx, by % h_q, by // h_q] = lse[0] * LN2


def gpu_program(h_q: int, s_q: int, dtype: str, *, block_H: int, block_N: int, num_stages: int,
                threads: int, num_splits: int):
    """The GPU tile program (wgmma on sm_90a, mma on older CUDA); `threads` 384 is
    `seesaw_program`, which takes 64 rows and 64-key blocks in two buffers."""
    if threads == SEESAW_THREADS:
        return seesaw_program(h_q, s_q, dtype, num_splits=num_splits)
    batch, pages, table_w = T.dynamic("batch"), T.dynamic("pages"), T.dynamic("table_w")
    rows = s_q * h_q
    row_tiles = T.ceildiv(rows, block_H)
    neg_inf = -T.infinity(ACCUM)
    policy = T.GemmWarpPolicy.FullCol

    @T.macro
    def update(S, P_s, K_s, acc_o, m, m_prev, msc, alpha, rowsum, l, scale):
        # Online softmax: new running max, rescale what was accumulated, add this block.
        online_softmax(S, m, m_prev, msc, alpha, rowsum, l, scale)
        for i, j in T.Parallel(block_H, D_LATENT):
            acc_o[i, j] *= alpha[i]
        T.copy(S, P_s)
        T.gemm(P_s, K_s, acc_o, policy=policy)

    @T.macro
    def attend(Q, KV, block_table, cache_seqlens, scale, bx, by, bz, acc_o, msc, l):
        """Attention of rows [by * block_H, +block_H) of sequence bx over the keys of split bz."""
        Q_s = T.alloc_shared((block_H, D_LATENT), dtype)
        Qr_s = T.alloc_shared((block_H, D_ROPE), dtype)
        K_s = T.alloc_shared((block_N, D_LATENT), dtype)
        Kr_s = T.alloc_shared((block_N, D_ROPE), dtype)
        P_s = T.alloc_shared((block_H, block_N), dtype)
        S = T.alloc_fragment((block_H, block_N), ACCUM)
        m = T.alloc_fragment((block_H,), ACCUM)
        m_prev = T.alloc_fragment((block_H,), ACCUM)
        alpha = T.alloc_fragment((block_H,), ACCUM)
        rowsum = T.alloc_fragment((block_H,), ACCUM)

        r0 = by * block_H
        T.copy(Q[bx, r0:r0 + block_H, 0:D_LATENT], Q_s)
        T.copy(Q[bx, r0:r0 + block_H, D_LATENT:D_QK], Qr_s)
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, neg_inf)
        T.fill(msc, 0)

        seqlen = seq_len(cache_seqlens, bx, table_w)
        n_blocks = T.ceildiv(seqlen, block_N)
        per_split = T.ceildiv(n_blocks, num_splits)
        start = bz * per_split
        end = T.min(start + per_split, n_blocks)
        for kk in T.Pipelined(T.max(end - start, 0), num_stages=num_stages):
            pos = (start + kk) * block_N
            page = page_of(block_table, bx, pos, pages)
            off = pos % PAGE
            T.copy(KV[page, off:off + block_N, 0, 0:D_LATENT], K_s)
            T.copy(KV[page, off:off + block_N, 0, D_LATENT:D_QK], Kr_s)
            T.clear(S)
            T.gemm(Q_s, K_s, S, transpose_B=True, policy=policy)
            T.gemm(Qr_s, Kr_s, S, transpose_B=True, policy=policy)
            if pos + block_N >= seqlen:  # the last block: rows past the end, causal mask
                # Zero the value rows past the length (after Q.K^T has read them, so after the
                # copy landed): stale NaN/Inf cache rows must not reach P.V through 0 * NaN.
                for i, j in T.Parallel(block_N, D_LATENT):
                    if pos + i >= seqlen:
                        K_s[i, j] = 0
                for i, j in T.Parallel(block_H, block_N):
                    visible = seqlen - (s_q - 1 - (r0 + i) // h_q)
                    S[i, j] = T.if_then_else(pos + j < visible, S[i, j], neg_inf)
            update(S, P_s, K_s, acc_o, m, m_prev, msc, alpha, rowsum, l, scale)

    @T.prim_func
    def mla_decode(Q: T.Tensor((batch, rows, D_QK), dtype),
                   KV: T.Tensor((pages, PAGE, 1, D_QK), dtype),
                   block_table: T.Tensor((batch, table_w), "int32"),
                   cache_seqlens: T.Tensor((batch,), "int32"),
                   scale: T.float32,
                   O_part: T.Tensor((batch, rows, num_splits, D_LATENT), ACCUM),
                   L_part: T.Tensor((batch, rows, num_splits), ACCUM),
                   Out: T.Tensor((batch, rows, D_LATENT), dtype),
                   LSE: T.Tensor((batch, h_q, s_q), ACCUM)):
        # Row tiles innermost: the CTAs of one sequence's row tiles (h_q = 128 takes two) start
        # together and read the same pages, the second from L2. Batch innermost, each wave
        # held one row tile of every sequence and the next re-read every page from HBM.
        with T.Kernel(row_tiles, batch, num_splits, threads=threads) as (by, bx, bz):
            acc_o = T.alloc_fragment((block_H, D_LATENT), ACCUM)
            msc = T.alloc_fragment((block_H,), ACCUM)
            l = T.alloc_fragment((block_H,), ACCUM)
            attend(Q, KV, block_table, cache_seqlens, scale, bx, by, bz, acc_o, msc, l)
            store(acc_o, l, msc, Out, LSE, O_part, L_part, bx, by * block_H, bz, 0, rows, h_q,
                  num_splits)
        if num_splits > 1:
            combine(O_part, L_part, Out, LSE, batch, rows, h_q, num_splits)

    return mla_decode


# The seesaw schedule's named barriers (0 is __syncthreads): each pairs one warpgroup's
# `named_barrier_arrive` with the other's `sync_threads`, once per pair of key blocks.
SCALE0, SCALE1, P0_READY, P1_READY, FINAL, ZERO0, ZERO1 = range(8, 15)
SEESAW_THREADS = 384  # two consumer warpgroups and a TMA producer warpgroup


def _seesaw_registers(dtype: str):
    """One seesaw warpgroup's registers: its half of the output, S and its bf16 copy P (wgmma's
    register operand); its rows' running max, the max before the block, the exponents' offset,
    the two rescale factors, the block's row sums and l."""
    def row():
        return T.alloc_fragment((64,), ACCUM)

    return (T.alloc_fragment((64, D_LATENT // 2), ACCUM), T.alloc_fragment((64, PAGE), ACCUM),
            T.alloc_fragment((64, PAGE), dtype), *(row() for _ in range(7)))


def seesaw_program(h_q: int, s_q: int, dtype: str, *, num_splits: int):
    """FlashMLA's "seesaw" schedule (sm_90): two consumer warpgroups share one 64-row tile's
    64 x 512 output, warpgroup 0 holding columns 0-255 (O_L) and warpgroup 1 columns 256-511
    (O_R), and take the key blocks in pairs, warpgroup 0 the first of a pair (block 0), 1 the
    second, so that one's softmax runs while the other's products are on the tensor cores:

      wg0: S0 = Q K0^T; m0 = max(m, rowmax S0); P0 = exp(S0 - m0); O_L = O_L a0 + P0 V0L
      wg1: S1 = Q K1^T; m1 = max(m0, rowmax S1); P1 = exp(S1 - m1); O_R = O_R a0 a1 + P1 V1R
      wg0: O_L = O_L a1 + P1 V1L (P1 from shared memory)
      wg1: O_R = O_R + (P0 a1) V0R (P0 a1 from shared memory)

    with a0 = exp(m - m0), a1 = exp(m0 - m1) exchanged through shared memory. Each warpgroup's own
    P feeds wgmma from registers. A key block is three tiles (latent columns 0-255, 256-511, the
    rope), each its own TMA copy and full/empty barrier pair, so a tile is refilled as soon as its
    last reader is done (the orders below follow when each is released) and Q K^T starts on the
    first tile to land. P1 goes through block 1's rope tile, dead once S1 is computed: Q, two key
    blocks and P0 fill 224 KiB. Rows past the keys of the split (the last pair's, or a block past
    an odd count, which loads the split's last page again) are masked, and each warpgroup zeroes
    them in the value tiles it multiplies (stale NaN/Inf must not reach P V through 0 * NaN)."""
    batch, pages, table_w = T.dynamic("batch"), T.dynamic("pages"), T.dynamic("table_w")
    rows = s_q * h_q  # below 64 or a multiple of it (spec.HEADS, spec.S_Q)
    H, N, HALF = 64, PAGE, D_LATENT // 2
    neg_inf = -T.infinity(ACCUM)
    # Tile t of a block: 0 latent columns [0, 256), 1 [256, 512), 2 the rope. Barrier 3 b + t.
    cols = ((0, HALF), (HALF, D_LATENT), (D_LATENT, D_QK))
    # Last readers of each tile (the empty barrier's count): block 0's latent left half and rope
    # are warpgroup 0's alone, its right half both; block 1's left half both, its right half
    # warpgroup 1's, its rope (holding P1) warpgroup 0's, the reader of P1.
    readers = (128, 256, 128, 256, 128, 128)
    loads = ((2, 0, 1), (1, 0, 2))  # each block's tiles in the order their readers free them

    @T.macro
    def qk_step(Q_t, K_t, full, b, S, phase, t):
        T.mbarrier_wait_parity(full[3 * b + t], phase)
        T.wgmma_gemm(Q_t[t], K_t[t], S, transpose_B=True)

    @T.macro
    def qk(Q_t, K_t, full, b, S, phase):
        """S = Q K_b^T, each tile's product issued as soon as that tile has landed."""
        T.fill(S, 0)
        qk_step(Q_t, K_t, full, b, S, phase, loads[b][0])
        qk_step(Q_t, K_t, full, b, S, phase, loads[b][1])
        qk_step(Q_t, K_t, full, b, S, phase, loads[b][2])
        T.wait_wgmma(0)

    @T.macro
    def load(KV, K_t, full, empty, b, t, page, phase):
        T.mbarrier_wait_parity(empty[3 * b + t], phase ^ 1)
        T.tma_copy(KV[page, 0:N, 0, cols[t][0]:cols[t][1]], K_t[t], barrier=full[3 * b + t],
                   leader_scope_threads=32, annotations={"emit_arrive": 1},
                   eviction_policy="evict_first")

    @T.macro
    def load_q(Q, Q_t, q_full, bx, r0, t):
        if rows >= H:
            T.tma_copy(Q[bx, r0:r0 + H, cols[t][0]:cols[t][1]], Q_t[t], barrier=q_full[0],
                       leader_scope_threads=32, annotations={"emit_arrive": 1})
        else:  # fewer rows than the tile: the next sequences' (or zeros), never stored
            Q_rows = T.reshape(Q, (batch * rows, D_QK))
            T.tma_copy(Q_rows[bx * rows:bx * rows + H, cols[t][0]:cols[t][1]], Q_t[t],
                       barrier=q_full[0], leader_scope_threads=32,
                       annotations={"emit_arrive": 1})

    @T.macro
    def fill(KV, block_table, K_t, full, empty, b, bx, start, end, pairs):
        """The producer warp of block b of each pair."""
        for i in T.serial(pairs):
            # A block past an odd count loads the split's last page again (masked).
            page = page_of(block_table, bx, T.min(start + 2 * i + b, end - 1) * N, pages)
            load(KV, K_t, full, empty, b, loads[b][0], page, i % 2)
            load(KV, K_t, full, empty, b, loads[b][1], page, i % 2)
            load(KV, K_t, full, empty, b, loads[b][2], page, i % 2)

    @T.macro
    def mask(S, pos, kv_end, seqlen, r0):
        if pos + N >= kv_end:  # the split's last block, or one past it
            for i, j in T.Parallel(H, N):
                visible = T.min(kv_end, seqlen - (s_q - 1 - (r0 + i) // h_q))
                S[i, j] = T.if_then_else(pos + j < visible, S[i, j], neg_inf)

    @T.macro
    def zero_tail(V, pos, kv_end, barrier):
        if pos + N > kv_end:
            for j, d in T.Parallel(N, HALF):
                if pos + j >= kv_end:
                    V[j, d] = 0
            T.fence_proxy_async()  # the generic-proxy stores, before wgmma reads V
            T.sync_threads(barrier, 128)

    @T.macro
    def finish(O, l, m, msc, l_s, wg, scale, Out, LSE, O_part, L_part, bx, r0, bz):  # noqa: E741
        """Warpgroup wg's half of the output: l summed over both (each counted its own blocks'
        rows, at the same final max), then normalised and stored (`store`)."""
        for r in T.Parallel(H):
            l_s[wg, r] = l[r]
        T.sync_threads(FINAL, 256)
        for r in T.Parallel(H):
            l[r] += l_s[1 - wg, r]
            msc[r] = softmax_offset(m[r], scale)
        store(O, l, msc, Out, LSE, O_part, L_part, bx, r0, bz, wg * HALF, rows, h_q, num_splits)

    @T.prim_func
    def mla_decode(Q: T.Tensor((batch, rows, D_QK), dtype),
                   KV: T.Tensor((pages, PAGE, 1, D_QK), dtype),
                   block_table: T.Tensor((batch, table_w), "int32"),
                   cache_seqlens: T.Tensor((batch,), "int32"),
                   scale: T.float32,
                   O_part: T.Tensor((batch, rows, num_splits, D_LATENT), ACCUM),
                   L_part: T.Tensor((batch, rows, num_splits), ACCUM),
                   Out: T.Tensor((batch, rows, D_LATENT), dtype),
                   LSE: T.Tensor((batch, h_q, s_q), ACCUM)):
        with T.Kernel(T.ceildiv(rows, H), batch, num_splits, threads=SEESAW_THREADS) as (by, bx,
                                                                                      bz):
            # Each tile named by its own assignment: unnamed ones are all "v", and TileLang
            # would place them in an order that follows Python's string hashing.
            Q_lo = T.alloc_shared((H, HALF), dtype)
            Q_hi = T.alloc_shared((H, HALF), dtype)
            Q_rope = T.alloc_shared((H, D_ROPE), dtype)
            K0_lo = T.alloc_shared((N, HALF), dtype)
            K0_hi = T.alloc_shared((N, HALF), dtype)
            K0_rope = T.alloc_shared((N, D_ROPE), dtype)
            K1_lo = T.alloc_shared((N, HALF), dtype)
            K1_hi = T.alloc_shared((N, HALF), dtype)
            K1_rope = T.alloc_shared((N, D_ROPE), dtype)
            Q_t, K0, K1 = (Q_lo, Q_hi, Q_rope), (K0_lo, K0_hi, K0_rope), (K1_lo, K1_hi, K1_rope)
            P0_s = T.alloc_shared((H, N), dtype)
            m_s = T.alloc_shared((H,), ACCUM)  # the running max after the last block softmaxed
            a0_s = T.alloc_shared((H,), ACCUM)
            a1_s = T.alloc_shared((H,), ACCUM)
            l_s = T.alloc_shared((2, H), ACCUM)
            q_full = T.alloc_barrier(3)
            full = T.alloc_barrier([1] * 6)
            empty = T.alloc_barrier(list(readers))
            O_L, S0, P0, m, m_prev, msc, a0, a1, rowsum, l = _seesaw_registers(dtype)  # noqa: E741
            O_R, S1, P1, m1, m1_prev, msc1, b0, b1, rowsum1, l1 = _seesaw_registers(dtype)

            tx = T.get_thread_binding()
            r0 = by * H
            seqlen = seq_len(cache_seqlens, bx, table_w)
            n_blocks = T.ceildiv(seqlen, N)
            per_split = T.ceildiv(n_blocks, num_splits)
            start = bz * per_split
            end = T.min(start + per_split, n_blocks)
            kv_end = T.min(seqlen, end * N)
            pairs = T.ceildiv(T.max(end - start, 0), 2)

            if tx < 128:
                T.set_max_nreg(240, 1)
                T.fill(O_L, 0)
                T.fill(l, 0)
                T.fill(m, neg_inf)
                T.mbarrier_wait_parity(q_full[0], 0)
                for i in T.serial(pairs):
                    pos = (start + 2 * i) * N
                    qk(Q_t, K0, full, 0, S0, i % 2)
                    T.barrier_arrive(empty[2])
                    T.barrier_arrive(empty[1])
                    mask(S0, pos, kv_end, seqlen, r0)
                    online_softmax(S0, m, m_prev, msc, a0, rowsum, l, scale)
                    for r in T.Parallel(H):
                        m_s[r] = m[r]
                        a0_s[r] = a0[r]
                    T.named_barrier_arrive(SCALE0, 256)
                    for r, c in T.Parallel(H, HALF):
                        O_L[r, c] *= a0[r]
                    T.copy(S0, P0)
                    zero_tail(K0[0], pos, kv_end, ZERO0)
                    T.wgmma_gemm(P0, K0[0], O_L)
                    T.sync_threads(SCALE1, 256)
                    for r in T.Parallel(H):
                        a1[r] = a1_s[r]
                        m[r] = m_s[r]
                    for r, c in T.Parallel(H, N):
                        S0[r, c] *= a1[r]
                    T.copy(S0, P0_s)
                    T.fence_proxy_async()
                    T.named_barrier_arrive(P0_READY, 256)
                    T.wait_wgmma(0)
                    T.barrier_arrive(empty[0])
                    for r, c in T.Parallel(H, HALF):
                        O_L[r, c] *= a1[r]
                    for r in T.Parallel(H):
                        l[r] *= a1[r]
                    T.sync_threads(P1_READY, 256)
                    zero_tail(K1[0], pos + N, kv_end, ZERO0)
                    T.wgmma_gemm(K1[2], K1[0], O_L)
                    T.wait_wgmma(0)
                    T.barrier_arrive(empty[3])
                    T.barrier_arrive(empty[5])
                finish(O_L, l, m, msc, l_s, 0, scale, Out, LSE, O_part, L_part, bx, r0, bz)
            elif tx < 256:
                T.set_max_nreg(240, 1)
                T.fill(O_R, 0)
                T.fill(l1, 0)
                T.mbarrier_wait_parity(q_full[0], 0)
                for i in T.serial(pairs):
                    pos = (start + 2 * i + 1) * N
                    qk(Q_t, K1, full, 1, S1, i % 2)
                    T.barrier_arrive(empty[3])
                    mask(S1, pos, kv_end, seqlen, r0)
                    T.sync_threads(SCALE0, 256)
                    for r in T.Parallel(H):
                        m1[r] = m_s[r]
                        b0[r] = a0_s[r]
                        l1[r] *= b0[r]
                    online_softmax(S1, m1, m1_prev, msc1, b1, rowsum1, l1, scale)
                    for r in T.Parallel(H):
                        m_s[r] = m1[r]
                        a1_s[r] = b1[r]
                    T.named_barrier_arrive(SCALE1, 256)
                    for r, c in T.Parallel(H, HALF):
                        O_R[r, c] *= b0[r] * b1[r]
                    T.copy(S1, P1)
                    T.copy(S1, K1[2])
                    T.fence_proxy_async()
                    T.named_barrier_arrive(P1_READY, 256)
                    zero_tail(K1[1], pos, kv_end, ZERO1)
                    T.wgmma_gemm(P1, K1[1], O_R)
                    T.sync_threads(P0_READY, 256)
                    zero_tail(K0[1], pos - N, kv_end, ZERO1)
                    T.wgmma_gemm(P0_s, K0[1], O_R)
                    T.wait_wgmma(0)
                    T.barrier_arrive(empty[4])
                    T.barrier_arrive(empty[1])
                finish(O_R, l1, m1, msc1, l_s, 1, scale, Out, LSE, O_part, L_part, bx, r0, bz)
            else:
                T.set_max_nreg(24, 0)
                w = (tx - 256) // 32
                if w == 0:
                    load_q(Q, Q_t, q_full, bx, r0, 0)
                    load_q(Q, Q_t, q_full, bx, r0, 1)
                    load_q(Q, Q_t, q_full, bx, r0, 2)
                    fill(KV, block_table, K0, full, empty, 0, bx, start, end, pairs)
                elif w == 1:
                    fill(KV, block_table, K1, full, empty, 1, bx, start, end, pairs)
        if num_splits > 1:
            combine(O_part, L_part, Out, LSE, batch, rows, h_q, num_splits)

    return mla_decode


def cpu_program(h_q: int, s_q: int, dtype: str, *, block_H: int, block_N: int, num_splits: int):
    """The CPU form of the same program for TileLang's C target (scalar loops, fp32 tiles).

    Every key block is loaded with the length predicate and masked, so it needs no separate last
    block. The CPU program always goes through the partial buffers and the combine kernel.
    """
    batch, pages, table_w = TC.dynamic("batch"), TC.dynamic("pages"), TC.dynamic("table_w")
    rows = s_q * h_q
    neg_inf = -TC.infinity(ACCUM)
    io = bits(dtype)

    @TC.prim_func
    def mla_decode(Q: TC.Tensor((batch, rows, D_QK), io),
                   KV: TC.Tensor((pages, PAGE, 1, D_QK), io),
                   block_table: TC.Tensor((batch, table_w), "int32"),
                   cache_seqlens: TC.Tensor((batch,), "int32"),
                   scale: TC.float32,
                   O_part: TC.Tensor((batch, rows, num_splits, D_LATENT), ACCUM),
                   L_part: TC.Tensor((batch, rows, num_splits), ACCUM),
                   Out: TC.Tensor((batch, rows, D_LATENT), io),
                   LSE: TC.Tensor((batch, h_q, s_q), ACCUM)):
        with TC.Kernel(batch, TC.ceildiv(rows, block_H), num_splits) as (bx, by, bz):
            q = TC.alloc_local((block_H, D_QK), ACCUM)
            k = TC.alloc_local((block_N, D_QK), ACCUM)
            s = TC.alloc_local((block_H, block_N), ACCUM)
            acc = TC.alloc_local((block_H, D_LATENT), ACCUM)
            m = TC.alloc_local((block_H,), ACCUM)
            msc = TC.alloc_local((block_H,), ACCUM)
            l = TC.alloc_local((block_H,), ACCUM)
            prev = TC.alloc_local((2,), ACCUM)  # the row's previous max, its rescale factor
            r0 = by * block_H
            for i, c in TC.grid(block_H, D_QK):
                q[i, c] = TC.if_then_else(r0 + i < rows, to_f32(Q[bx, r0 + i, c], dtype), 0.0)
            for i, c in TC.grid(block_H, D_LATENT):
                acc[i, c] = 0.0
            for i in TC.serial(block_H):
                m[i] = neg_inf
                msc[i] = 0.0
                l[i] = 0.0
            seqlen = seq_len(cache_seqlens, bx, table_w)
            n_blocks = TC.ceildiv(seqlen, block_N)
            per_split = TC.ceildiv(n_blocks, num_splits)
            start = bz * per_split
            for kb in TC.serial(TC.max(TC.min(start + per_split, n_blocks) - start, 0)):
                pos = (start + kb) * block_N
                page = page_of(block_table, bx, pos, pages)
                for j, c in TC.grid(block_N, D_QK):
                    k[j, c] = TC.if_then_else(pos + j < seqlen,
                                              to_f32(KV[page, pos % PAGE + j, 0, c], dtype), 0.0)
                for i, j in TC.grid(block_H, block_N):
                    s[i, j] = 0.0
                for i, j, c in TC.grid(block_H, block_N, D_QK):
                    s[i, j] += q[i, c] * k[j, c]
                for i in TC.serial(block_H):
                    prev[0] = m[i]
                    visible = seqlen - (s_q - 1 - (r0 + i) // h_q)
                    for j in TC.serial(block_N):
                        s[i, j] = TC.if_then_else(pos + j < visible, s[i, j], neg_inf)
                        m[i] = TC.max(m[i], s[i, j])
                    msc[i] = softmax_offset(m[i], scale)
                    prev[1] = TC.exp2(prev[0] * scale - msc[i])
                    l[i] *= prev[1]
                    for c in TC.serial(D_LATENT):
                        acc[i, c] *= prev[1]
                    for j in TC.serial(block_N):
                        s[i, j] = TC.exp2(s[i, j] * scale - msc[i])
                        l[i] += s[i, j]
                for i, j, c in TC.grid(block_H, block_N, D_LATENT):
                    acc[i, c] += s[i, j] * k[j, c]
            for i in TC.serial(block_H):
                if r0 + i < rows:
                    L_part[bx, r0 + i, bz] = TC.log2(l[i]) + msc[i]
                    for c in TC.serial(D_LATENT):  # l == 0: no key; NaN stays NaN
                        O_part[bx, r0 + i, bz, c] = TC.if_then_else(l[i] == 0, 0.0,
                                                                    acc[i, c] / l[i])
        with TC.Kernel(batch, rows) as (bx, by):
            o = TC.alloc_local((D_LATENT,), ACCUM)
            t = TC.alloc_local((3,), ACCUM)  # running max, sum, lse
            t[0] = neg_inf
            for sp in TC.serial(num_splits):
                t[0] = TC.max(t[0], L_part[bx, by, sp])
            t[0] = softmax_offset(t[0])  # every split empty (no key): 0, as in the GPU program
            t[1] = 0.0
            for sp in TC.serial(num_splits):
                t[1] += TC.exp2(L_part[bx, by, sp] - t[0])
            t[2] = TC.log2(t[1]) + t[0]  # -inf when no split saw a key
            for c in TC.serial(D_LATENT):
                o[c] = 0.0
            for sp, c in TC.grid(num_splits, D_LATENT):
                o[c] += TC.if_then_else(t[1] == 0, 0.0, TC.exp2(L_part[bx, by, sp] - t[2])
                                        * O_part[bx, by, sp, c])
            # Element by element: the C backend's vectorised fp16 cast is broken.
            for c in TC.serial(D_LATENT):
                Out[bx, by, c] = from_f32(o[c], dtype)
            LSE[bx, by % h_q, by // h_q] = t[2] * LN2

    return mla_decode
