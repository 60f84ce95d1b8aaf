"""MLA decode tile programs: paged latent attention in FlashMLA's convention, split-KV + combine.

One query row is a (token, head) pair: the `s_q * h_q` rows of a sequence share its KV cache, so a
CTA takes `block_H` rows of one sequence (row r = token * h_q + head) and walks that sequence's
pages. Scores are Q.K^T over 576 channels, computed as the latent part (512) plus the rope part
(64); values are the first 512 channels of the same rows. Softmax is online, in fp32, base 2.

The batch, the number of cache pages and the block table's width are dynamic; sequence lengths are
read from `cache_seqlens` at run time. Nothing the table or the lengths hold can make a program
read outside its tensors: a length is clamped into [0, 64 * table width] and a page id into
[0, pages) where they are read (`seq_len`, `page_of`), so the host need not check them (a check
would read them back and synchronise). The seesaw (sm_90) and the CPU program take their work from
a plan balanced by keys (plan.py): each CTA walks the pieces of sequences (segments) of its part,
writing a sequence held by one segment directly and a split one's pieces as fp32 partials with
their log2-sum-exps, which a second small kernel combines. The other GPU programs divide each
sequence's key blocks among `num_splits` CTAs alike, combined the same way. Token t of s_q sees
keys j < seqlen - (s_q - 1 - t); a row that sees no key (a sequence shorter than s_q, even empty)
gets zeros and a log-sum-exp of -inf, as in flash_attention, and a NaN input gives NaN.

Only a sequence's last key block can hold rows past its length or causally masked keys: the GPU
program masks its scores and zeroes its value rows past the length in shared memory (a cache page
may hold stale NaN/Inf there, which 0 * NaN would carry into P.V); the CPU program loads every
block with the length predicate.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables.
import tilelang.cpu.language as TC
import tilelang.cuda.language as TL
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


# The widths of a plan's two tensors (plan.py), as the programs read them: per part its first
# and last sequence, payload and number of split sequences; per sequence its line position, first
# slot, first part and number of segments, and the list of split sequences.
PART_FIELDS, SEQ_FIELDS = 4, 5


def part_seq(parts, p, k, batch):
    """The sequence of segment k of part p of a plan (plan.py), clamped into the batch."""
    return T.min(T.max(parts[p, 0] + k, 0), batch - 1)


def segment(parts, seqs, cache_seqlens, p, b, table_w, slots):
    """Part p's segment of sequence b (`part_seq`): b's clamped length, the key blocks
    [start, end) the segment takes and its partial's slot (-1: b is one segment, written to
    Out). Every index the plan holds is clamped into its tensor; b's last segment runs to the end
    of b as `seq_len` reads it, so lengths grown since the plan was made are attended to in
    full."""
    payload = T.max(parts[p, 2], 1)
    seqlen = seq_len(cache_seqlens, b, table_w)
    n_blocks = T.ceildiv(seqlen, PAGE)
    end = T.if_then_else(p >= seqs[b, 2] + seqs[b, 3] - 1, n_blocks,
                         T.min((p + 1) * payload - seqs[b, 0], n_blocks))
    start = T.min(T.max(p * payload - seqs[b, 0], 0), end)
    slot = T.if_then_else(seqs[b, 3] > 1, T.min(T.max(seqs[b, 1] + p - seqs[b, 2], 0),
                                                  slots - 1), -1)
    return seqlen, start, end, slot


def segments(parts, p, batch):
    """How many segments part p walks (its first to its last sequence, clamped)."""
    return T.min(T.max(parts[p, 1] - parts[p, 0] + 1, 0), batch)


@T.macro
def normalise(acc, l):  # noqa: E741
    """acc / l; l = 0: the row saw no key (a zero-length sequence, unvalidated): zeros, as
    flash_attention gives. l == 0, not l > 0: NaN stays NaN."""
    block_H, width = acc.shape
    for i, j in T.Parallel(block_H, width):
        acc[i, j] = T.if_then_else(l[i] == 0, 0, acc[i, j] / l[i])


@T.macro
def write_out(acc, l, msc, Out, LSE, b, r0, c0, rows, h_q: int):  # noqa: E741
    """Rows [r0, +block) of columns [c0, +width) of sequence b's output and (from the tile
    holding column 0) their log-sum-exps (-inf for a row that saw no key)."""
    block_H, width = acc.shape
    T.copy(acc, Out[b, r0:r0 + block_H, c0:c0 + width])
    if c0 == 0:
        for i in T.Parallel(block_H):
            if r0 + i < rows:
                LSE[b, (r0 + i) % h_q, (r0 + i) // h_q] = (T.log2(l[i]) + msc[i]) * LN2


@T.macro
def store(acc, l, msc, Out, LSE, O_part, L_part, bx, r0, bz, c0, rows, h_q: int,
          num_splits: int):
    """Normalised output rows (`write_out`); with splits, split bz's partial and its
    log2-sum-exp (an empty split: a zero partial with -inf)."""
    block_H, width = acc.shape
    normalise(acc, l)
    if num_splits == 1:
        write_out(acc, l, msc, Out, LSE, bx, r0, c0, rows, h_q)
    else:
        T.copy(acc, O_part[bx, r0:r0 + block_H, bz, c0:c0 + width])
        if c0 == 0:
            for i in T.Parallel(block_H):
                if r0 + i < rows:
                    L_part[bx, r0 + i, bz] = T.log2(l[i]) + msc[i]


@T.macro
def store_segment(acc, l, msc, Out, LSE, O_part, L_part, b, r0, slot, c0, rows, h_q: int):
    """`store` for a segment of a plan: Out where it is its sequence's only one, else the
    partial in its slot."""
    block_H, width = acc.shape
    normalise(acc, l)
    if slot < 0:
        write_out(acc, l, msc, Out, LSE, b, r0, c0, rows, h_q)
    else:
        T.copy(acc, O_part[slot, r0:r0 + block_H, c0:c0 + width])
        if c0 == 0:
            for i in T.Parallel(block_H):
                if r0 + i < rows:
                    L_part[slot, r0 + i] = T.log2(l[i]) + msc[i]


def _partial(buf, bx, by, s, base, *j):
    """Partial s of row by of sequence bx: split s of (batch, rows, splits[, 512]) buffers, or
    with a plan slot base + s of (slots, rows[, 512]) ones."""
    return buf[bx, by, s, *j] if base is None else buf[base + s, by, *j]


@T.macro
def merge(O_part, L_part, Out, LSE, bx, by, count, base, h_q: int):
    """Row by of sequence bx: its `count` partial outputs merged by their log2-sum-exps (an empty
    one has -inf and weight 0), stored with the row's log-sum-exp."""
    neg_inf = -T.infinity(ACCUM)
    o = T.alloc_fragment((D_LATENT,), ACCUM)
    lse = T.alloc_local((1,), ACCUM)
    top = T.alloc_local((1,), ACCUM)
    total = T.alloc_local((1,), ACCUM)
    top[0] = neg_inf
    for s in T.serial(count):
        top[0] = T.max(top[0], _partial(L_part, bx, by, s, base))
    top[0] = softmax_offset(top[0])  # every split empty: 0, not -inf - -inf
    total[0] = 0
    for s in T.serial(count):
        total[0] += T.exp2(_partial(L_part, bx, by, s, base) - top[0])
    lse[0] = T.log2(total[0]) + top[0]  # -inf when every split was empty
    T.clear(o)
    for s in T.serial(count):
        for j in T.Parallel(D_LATENT):
            o[j] += T.if_then_else(total[0] == 0, 0, T.exp2(
                _partial(L_part, bx, by, s, base) - lse[0]) * _partial(O_part, bx, by, s, base, j))
    T.copy(o, Out[bx, by, :])
    LSE[bx, by % h_q, by // h_q] = lse[0] * LN2


@T.macro
def combine(O_part, L_part, Out, LSE, batch, rows, h_q: int, num_splits: int):
    """The second kernel of a split-KV launch: each row's `num_splits` partials merged."""
    with T.Kernel(batch, rows, threads=128) as (bx, by):
        merge(O_part, L_part, Out, LSE, bx, by, num_splits, None, h_q)


# The planned combine (sm_90): a fixed grid of 8-warp CTAs, of which each SM holds three.
COMBINE_CTAS, COMBINE_WARPS, COMBINE_CTAS_PER_SM = 1024, 8, 3
LOG_WARPS = 3  # log2 COMBINE_WARPS: the warps sharing a row are 8, 4, 2 or 1
COMBINE_UNROLL = 2  # pieces whose loads a warp has in flight at once (8 x 16 bytes a lane)
COMBINE_CHUNKS = 4  # chunks of 32 pieces whose log-sum-exps a warp loads at once


def _row_sharing(rows, most):
    """log2 of the warps that share a row: the most (COMBINE_WARPS at most) for which the `rows`
    rows take no more than `most` warps."""
    lg = 0
    for j in range(1, LOG_WARPS + 1):
        lg = T.if_then_else(rows * (1 << j) <= most, j, lg)
    return lg


@T.macro
def combine_segments(O_part, L_part, Out, LSE, parts, seqs, batch, rows, slots, n_parts,
                     h_q: int):
    """The second kernel of a planned launch (sm_90): the partials of each sequence in more than
    one segment merged, over the plan's list of split sequences (parts[:, 3] of them, in
    seqs[:, 4]), so that a batch with none costs a few idle CTAs. Indices are clamped as
    `segment` clamps them.

    A row is a warp's: each lane holds 16 of the 512 columns (four 16-byte loads a piece). Where
    the rows are too few to fill the device (one long sequence in many pieces), g = 2, 4 or 8
    warps of one CTA share a row, each taking every g-th piece, and sum in shared memory: the
    row's loads are then spread over g times the warps, and the loads of a warp's pieces are in
    flight `COMBINE_UNROLL` at a time. The row's log-sum-exp takes one trip: lanes over pieces,
    an online max and sum each, then warp reductions. Launched as the seesaw's programmatic
    dependent: its CTAs start as the seesaw's finish and wait for its writes (`pdl_sync`)."""
    neg_inf = -T.infinity(ACCUM)
    W, G, C, U = COMBINE_WARPS, D_LATENT // 128, COMBINE_CHUNKS, COMBINE_UNROLL
    assert 1 << LOG_WARPS == W
    with T.Kernel(COMBINE_CTAS, threads=32 * W) as bx:
        T.annotate_min_blocks_per_sm(COMBINE_CTAS_PER_SM)
        acc_s = T.alloc_shared((W, D_LATENT), ACCUM)
        o = T.alloc_local((G * 4,), ACCUM)
        x = T.alloc_local((U * G * 4,), ACCUM)
        wv = T.alloc_local((U,), ACCUM)
        lv = T.alloc_local((C,), ACCUM)
        st = T.alloc_local((4,), ACCUM)  # max, sum (the lane's, then the row's), lse, weight
        iv = T.alloc_local((7,), "int32")  # rows to merge, log2 g, row index, b, r, n, base
        tx = T.get_thread_binding()
        lane = tx % 32
        warp = tx // 32
        TL.pdl_sync()
        iv[0] = T.min(T.max(parts[0, 3], 0), batch) * rows
        # g: the most warps a row while all rows' warps fit in one CTA an SM (the seesaw's CTA
        # count, n_parts a row tile, stands for the SMs); more warps a row were slower where the
        # rows are many and the pieces few (B64 L4096 h_q 16: 3.9 us at 8 warps an SM, 5.2 at
        # 16, 7.6 at 32).
        most = n_parts * T.ceildiv(rows, 64) * W
        iv[1] = _row_sharing(iv[0], most)
        g = 1 << iv[1]
        k = warp & (g - 1)
        # Trips per CTA, whose warps meet at barriers: an idle CTA makes none.
        for it in T.serial(T.ceildiv(T.max(iv[0] - (bx << (LOG_WARPS - iv[1])), 0),
                                     COMBINE_CTAS << (LOG_WARPS - iv[1]))):
            iv[2] = ((it * COMBINE_CTAS + bx) << (LOG_WARPS - iv[1])) + (warp >> iv[1])
            w = T.min(iv[2], iv[0] - 1)
            iv[3] = T.min(T.max(seqs[w // rows, 4], 0), batch - 1)
            iv[4] = w % rows
            iv[5] = T.min(T.max(seqs[iv[3], 3], 1), slots)
            iv[6] = T.min(T.max(seqs[iv[3], 1], 0), slots - iv[5])
            b, r, n, base = iv[3], iv[4], iv[5], iv[6]
            st[0] = neg_inf
            st[1] = 0
            for cg in T.serial(T.ceildiv(n, 32 * C)):
                for c in T.unroll(C):
                    s = (cg * C + c) * 32 + lane
                    lv[c] = T.if_then_else(s < n, L_part[base + T.min(s, n - 1), r], neg_inf)
                for c in T.unroll(C):
                    st[3] = softmax_offset(T.max(st[0], lv[c]))  # no key yet: 0, not -inf
                    st[1] = st[1] * T.exp2(st[0] - st[3]) + T.exp2(lv[c] - st[3])
                    st[0] = T.max(st[0], lv[c])
            st[3] = softmax_offset(T.warp_reduce_max(st[0]))
            st[1] = T.warp_reduce_sum(st[1] * T.exp2(st[0] - st[3]))
            st[2] = T.log2(st[1]) + st[3]  # -inf when no piece saw a key
            for j in T.serial(G * 4):
                o[j] = 0
            for c in T.serial(T.ceildiv(n, 32)):
                # Lane l holds piece 32 c + l's weight (0 where no piece saw a key); this warp
                # takes the pieces equal to k modulo g, U at a time, each index clamped so that
                # no load is conditional and a piece past the row's adds nothing.
                st[3] = T.if_then_else((c * 32 + lane < n) & (st[1] != 0), T.exp2(
                    L_part[base + T.min(c * 32 + lane, n - 1), r] - st[2]), 0)
                mine = T.max(T.min(n - c * 32, 32) - k + g - 1, 0) >> iv[1]
                for i0 in T.serial(T.ceildiv(mine, U)):
                    for v in T.unroll(U):
                        u = T.min(k + g * (i0 * U + v), 31)
                        wv[v] = T.shfl_sync(st[3], u)
                        for grp in T.unroll(G):
                            for e in T.vectorized(4):
                                x[(v * G + grp) * 4 + e] = O_part[
                                    base + T.min(c * 32 + u, n - 1), r, grp * 128 + lane * 4 + e]
                    for v in T.unroll(U):
                        for j in T.unroll(G * 4):
                            o[j] += T.if_then_else(i0 * U + v < mine, wv[v] * x[v * G * 4 + j], 0)
            if g > 1:
                for grp in T.unroll(G):
                    for e in T.vectorized(4):
                        acc_s[warp, grp * 128 + lane * 4 + e] = o[grp * 4 + e]
                T.sync_threads()
                if k == 0:
                    for j in T.serial(g - 1):
                        for grp in T.unroll(G):
                            for e in T.unroll(4):
                                o[grp * 4 + e] += acc_s[warp + 1 + j, grp * 128 + lane * 4 + e]
                T.sync_threads()
            if (k == 0) & (iv[2] < iv[0]):
                for grp in T.unroll(G):
                    for e in T.vectorized(4):
                        Out[b, r, grp * 128 + lane * 4 + e] = T.cast(o[grp * 4 + e], Out.dtype)
                if lane == 0:
                    LSE[b, r % h_q, r // h_q] = st[2] * LN2


def gpu_program(h_q: int, s_q: int, dtype: str, *, block_H: int, block_N: int, num_stages: int,
                threads: int, num_splits: int):
    """The GPU tile program (wgmma on sm_90a, mma on older CUDA); `threads` 384 is
    `seesaw_program`, which takes 64 rows and 64-key blocks in two buffers."""
    if threads == SEESAW_THREADS:  # its splits come from the plan: num_splits is 1
        return seesaw_program(h_q, s_q, dtype)
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


def seesaw_program(h_q: int, s_q: int, dtype: str):
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
    them in the value tiles it multiplies (stale NaN/Inf must not reach P V through 0 * NaN).

    The work comes from a plan balanced by keys (plan.py): the CTA of row tile by and part bz
    walks its part's segments, one sequence's key blocks each, carrying the pair count (the
    barriers' phases) from one to the next. Q is a one-deep pipeline of its own (q_full,
    q_empty), freed after each warpgroup's last Q K^T of a segment, so the next sequence's Q
    loads while this one's last products and its store run."""
    batch, pages, table_w = T.dynamic("batch"), T.dynamic("pages"), T.dynamic("table_w")
    n_parts, slots = T.dynamic("n_parts"), T.dynamic("slots")
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
    def fill(KV, block_table, K_t, full, empty, b, bx, start, end, pairs, done):
        """The producer warp of block b of each pair of a segment; `done` pairs came before."""
        for i in T.serial(pairs):
            # A block past an odd count loads the segment's last page again (masked).
            page = page_of(block_table, bx, T.min(start + 2 * i + b, end - 1) * N, pages)
            load(KV, K_t, full, empty, b, loads[b][0], page, (done + i) % 2)
            load(KV, K_t, full, empty, b, loads[b][1], page, (done + i) % 2)
            load(KV, K_t, full, empty, b, loads[b][2], page, (done + i) % 2)

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
    def finish(O, l, m, msc, l_s, wg, scale, Out, LSE, O_part, L_part, bx, r0, slot,  # noqa: E741
               k):
        """Warpgroup wg's half of segment k's output: l summed over both (each counted its own
        blocks' rows, at the same final max), then normalised and stored (`store_segment`).
        l_s alternates with the segments: two in a row (empty sequences) have no pair between
        them whose barriers would order one's reads before the next one's writes."""
        for r in T.Parallel(H):
            l_s[k % 2, wg, r] = l[r]
        T.sync_threads(FINAL, 256)
        for r in T.Parallel(H):
            l[r] += l_s[k % 2, 1 - wg, r]
            msc[r] = softmax_offset(m[r], scale)
        store_segment(O, l, msc, Out, LSE, O_part, L_part, bx, r0, slot, wg * HALF, rows, h_q)

    @T.prim_func
    def mla_decode(Q: T.Tensor((batch, rows, D_QK), dtype),
                   KV: T.Tensor((pages, PAGE, 1, D_QK), dtype),
                   block_table: T.Tensor((batch, table_w), "int32"),
                   cache_seqlens: T.Tensor((batch,), "int32"),
                   parts: T.Tensor((n_parts, PART_FIELDS), "int32"),
                   seqs: T.Tensor((batch, SEQ_FIELDS), "int32"),
                   scale: T.float32,
                   O_part: T.Tensor((slots, rows, D_LATENT), ACCUM),
                   L_part: T.Tensor((slots, rows), ACCUM),
                   Out: T.Tensor((batch, rows, D_LATENT), dtype),
                   LSE: T.Tensor((batch, h_q, s_q), ACCUM)):
        with T.Kernel(T.ceildiv(rows, H), n_parts, threads=SEESAW_THREADS) as (by, bz):
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
            l_s = T.alloc_shared((2, 2, H), ACCUM)
            q_full = T.alloc_barrier(3)
            q_empty = T.alloc_barrier(256)
            full = T.alloc_barrier([1] * 6)
            empty = T.alloc_barrier(list(readers))
            O_L, S0, P0, m, m_prev, msc, a0, a1, rowsum, l = _seesaw_registers(dtype)  # noqa: E741
            O_R, S1, P1, m1, m1_prev, msc1, b0, b1, rowsum1, l1 = _seesaw_registers(dtype)

            done = T.alloc_local((1,), "int32")  # pairs of the segments before this one
            tx = T.get_thread_binding()
            r0 = by * H
            count = segments(parts, bz, batch)
            done[0] = 0

            if tx < 128:
                T.set_max_nreg(240, 1)
                for k in T.serial(count):
                    bx = part_seq(parts, bz, k, batch)
                    seqlen, start, end, slot = segment(parts, seqs, cache_seqlens, bz, bx, table_w,
                                                       slots)
                    kv_end = T.min(seqlen, end * N)
                    pairs = T.ceildiv(end - start, 2)
                    T.fill(O_L, 0)
                    T.fill(l, 0)
                    T.fill(m, neg_inf)
                    T.mbarrier_wait_parity(q_full[0], k % 2)
                    for i in T.serial(pairs):
                        pos = (start + 2 * i) * N
                        qk(Q_t, K0, full, 0, S0, (done[0] + i) % 2)
                        if i == pairs - 1:  # Q's last reader in this segment
                            T.barrier_arrive(q_empty[0])
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
                    if pairs == 0:
                        T.barrier_arrive(q_empty[0])
                    finish(O_L, l, m, msc, l_s, 0, scale, Out, LSE, O_part, L_part, bx, r0, slot, k)
                    done[0] += pairs
            elif tx < 256:
                T.set_max_nreg(240, 1)
                for k in T.serial(count):
                    bx = part_seq(parts, bz, k, batch)
                    seqlen, start, end, slot = segment(parts, seqs, cache_seqlens, bz, bx, table_w,
                                                       slots)
                    kv_end = T.min(seqlen, end * N)
                    pairs = T.ceildiv(end - start, 2)
                    T.fill(O_R, 0)
                    T.fill(l1, 0)
                    T.mbarrier_wait_parity(q_full[0], k % 2)
                    for i in T.serial(pairs):
                        pos = (start + 2 * i + 1) * N
                        qk(Q_t, K1, full, 1, S1, (done[0] + i) % 2)
                        if i == pairs - 1:  # Q's last reader in this segment
                            T.barrier_arrive(q_empty[0])
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
                    if pairs == 0:
                        T.barrier_arrive(q_empty[0])
                    finish(O_R, l1, m1, msc1, l_s, 1, scale, Out, LSE, O_part, L_part, bx, r0, slot, k)
                    done[0] += pairs
            else:
                T.set_max_nreg(24, 0)
                w = (tx - 256) // 32
                for k in T.serial(count):
                    bx = part_seq(parts, bz, k, batch)
                    seqlen, start, end, slot = segment(parts, seqs, cache_seqlens, bz, bx, table_w,
                                                       slots)
                    pairs = T.ceildiv(end - start, 2)
                    if w == 0:
                        fill(KV, block_table, K0, full, empty, 0, bx, start, end, pairs, done[0])
                    elif w == 1:
                        fill(KV, block_table, K1, full, empty, 1, bx, start, end, pairs, done[0])
                    elif w == 2:
                        T.mbarrier_wait_parity(q_empty[0], (k % 2) ^ 1)
                        load_q(Q, Q_t, q_full, bx, r0, 0)
                        load_q(Q, Q_t, q_full, bx, r0, 1)
                        load_q(Q, Q_t, q_full, bx, r0, 2)
                    done[0] += pairs
        combine_segments(O_part, L_part, Out, LSE, parts, seqs, batch, rows, slots, n_parts,
                         h_q)

    return mla_decode


def cpu_program(h_q: int, s_q: int, dtype: str, *, block_H: int, block_N: int):
    """The CPU form of the seesaw's work for TileLang's C target (scalar loops, fp32 tiles): the
    same plan walked by the same `segment` arithmetic, so CI checks it on ragged batches.

    Every key block is loaded with the length predicate and masked, so it needs no separate last
    block.
    """
    batch, pages, table_w = TC.dynamic("batch"), TC.dynamic("pages"), TC.dynamic("table_w")
    n_parts, slots = TC.dynamic("n_parts"), TC.dynamic("slots")
    rows = s_q * h_q
    neg_inf = -TC.infinity(ACCUM)
    io = bits(dtype)

    @TC.prim_func
    def mla_decode(Q: TC.Tensor((batch, rows, D_QK), io),
                   KV: TC.Tensor((pages, PAGE, 1, D_QK), io),
                   block_table: TC.Tensor((batch, table_w), "int32"),
                   cache_seqlens: TC.Tensor((batch,), "int32"),
                   parts: TC.Tensor((n_parts, PART_FIELDS), "int32"),
                   seqs: TC.Tensor((batch, SEQ_FIELDS), "int32"),
                   scale: TC.float32,
                   O_part: TC.Tensor((slots, rows, D_LATENT), ACCUM),
                   L_part: TC.Tensor((slots, rows), ACCUM),
                   Out: TC.Tensor((batch, rows, D_LATENT), io),
                   LSE: TC.Tensor((batch, h_q, s_q), ACCUM)):
        with TC.Kernel(TC.ceildiv(rows, block_H), n_parts) as (by, bz):
            q = TC.alloc_local((block_H, D_QK), ACCUM)
            k = TC.alloc_local((block_N, D_QK), ACCUM)
            s = TC.alloc_local((block_H, block_N), ACCUM)
            acc = TC.alloc_local((block_H, D_LATENT), ACCUM)
            m = TC.alloc_local((block_H,), ACCUM)
            msc = TC.alloc_local((block_H,), ACCUM)
            l = TC.alloc_local((block_H,), ACCUM)
            prev = TC.alloc_local((2,), ACCUM)  # the row's previous max, its rescale factor
            r0 = by * block_H
            for sg in TC.serial(segments(parts, bz, batch)):
                b = part_seq(parts, bz, sg, batch)
                seqlen, start, end, slot = segment(parts, seqs, cache_seqlens, bz, b, table_w,
                                                   slots)
                kv_end = TC.min(seqlen, end * PAGE)
                for i, c in TC.grid(block_H, D_QK):
                    q[i, c] = TC.if_then_else(r0 + i < rows, to_f32(Q[b, r0 + i, c], dtype),
                                              0.0)
                for i, c in TC.grid(block_H, D_LATENT):
                    acc[i, c] = 0.0
                for i in TC.serial(block_H):
                    m[i] = neg_inf
                    msc[i] = 0.0
                    l[i] = 0.0
                for kb in TC.serial(TC.ceildiv(TC.max(kv_end - start * PAGE, 0), block_N)):
                    pos = start * PAGE + kb * block_N
                    page = page_of(block_table, b, pos, pages)
                    for j, c in TC.grid(block_N, D_QK):
                        k[j, c] = TC.if_then_else(pos + j < kv_end, to_f32(
                            KV[page, pos % PAGE + j, 0, c], dtype), 0.0)
                    for i, j in TC.grid(block_H, block_N):
                        s[i, j] = 0.0
                    for i, j, c in TC.grid(block_H, block_N, D_QK):
                        s[i, j] += q[i, c] * k[j, c]
                    for i in TC.serial(block_H):
                        prev[0] = m[i]
                        visible = TC.min(kv_end, seqlen - (s_q - 1 - (r0 + i) // h_q))
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
                        for c in TC.serial(D_LATENT):  # l == 0: no key; NaN stays NaN
                            acc[i, c] = TC.if_then_else(l[i] == 0, 0.0, acc[i, c] / l[i])
                        if slot < 0:
                            # Element by element: the C backend's vectorised fp16 cast is broken.
                            for c in TC.serial(D_LATENT):
                                Out[b, r0 + i, c] = from_f32(acc[i, c], dtype)
                            LSE[b, (r0 + i) % h_q, (r0 + i) // h_q] = \
                                (TC.log2(l[i]) + msc[i]) * LN2
                        else:
                            L_part[slot, r0 + i] = TC.log2(l[i]) + msc[i]
                            for c in TC.serial(D_LATENT):
                                O_part[slot, r0 + i, c] = acc[i, c]
        with TC.Kernel(1) as _:
            o = TC.alloc_local((D_LATENT,), ACCUM)
            t = TC.alloc_local((3,), ACCUM)  # running max, sum, lse
            for w in TC.serial(TC.min(TC.max(parts[0, 3], 0), batch) * rows):  # as on the GPU
                b = TC.min(TC.max(seqs[w // rows, 4], 0), batch - 1)
                by = w % rows
                n = TC.min(TC.max(seqs[b, 3], 1), slots)
                base = TC.min(TC.max(seqs[b, 1], 0), slots - n)
                t[0] = neg_inf
                for sp in TC.serial(n):
                    t[0] = TC.max(t[0], L_part[base + sp, by])
                t[0] = softmax_offset(t[0])  # every split empty (no key): 0, as on the GPU
                t[1] = 0.0
                for sp in TC.serial(n):
                    t[1] += TC.exp2(L_part[base + sp, by] - t[0])
                t[2] = TC.log2(t[1]) + t[0]  # -inf when no split saw a key
                for c in TC.serial(D_LATENT):
                    o[c] = 0.0
                for sp, c in TC.grid(n, D_LATENT):
                    o[c] += TC.if_then_else(t[1] == 0, 0.0, TC.exp2(L_part[base + sp, by] - t[2])
                                            * O_part[base + sp, by, c])
                for c in TC.serial(D_LATENT):
                    Out[b, by, c] = from_f32(o[c], dtype)
                LSE[b, by % h_q, by // h_q] = t[2] * LN2

    return mla_decode
