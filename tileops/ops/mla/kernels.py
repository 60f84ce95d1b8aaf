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


def gpu_program(h_q: int, s_q: int, dtype: str, *, block_H: int, block_N: int, num_stages: int,
                threads: int, num_splits: int):
    """The GPU tile program (wgmma on sm_90a, mma on older CUDA)."""
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
            r0 = by * block_H
            # l = 0: the row saw no key (a zero-length sequence, unvalidated): zeros and a
            # log-sum-exp of -inf, as flash_attention gives. l == 0, not l > 0: NaN stays NaN.
            if num_splits == 1:
                for i, j in T.Parallel(block_H, D_LATENT):
                    acc_o[i, j] = T.if_then_else(l[i] == 0, 0, acc_o[i, j] / l[i])
                T.copy(acc_o, Out[bx, r0:r0 + block_H, :])
                for i in T.Parallel(block_H):
                    if r0 + i < rows:
                        LSE[bx, (r0 + i) % h_q, (r0 + i) // h_q] = (T.log2(l[i]) + msc[i]) * LN2
            else:  # an empty split writes a zero partial with log2-sum-exp -inf
                for i, j in T.Parallel(block_H, D_LATENT):
                    acc_o[i, j] = T.if_then_else(l[i] == 0, 0, acc_o[i, j] / l[i])
                T.copy(acc_o, O_part[bx, r0:r0 + block_H, bz, :])
                for i in T.Parallel(block_H):
                    if r0 + i < rows:
                        L_part[bx, r0 + i, bz] = T.log2(l[i]) + msc[i]
        if num_splits > 1:
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
