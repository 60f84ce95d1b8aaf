"""FlashAttention forward tile programs: O = softmax(Q K^T * scale + mask) V, and its log-sum-exp.

Layout: Q and O (batch, seqlen_q, heads_q, head_dim), K and V (batch, seqlen_kv, heads_kv,
head_dim), LSE (batch, heads_q, seqlen_q) fp32. Query head h reads KV head h // (heads_q //
heads_kv) (GQA/MQA). batch, seqlen_q and seqlen_kv are dynamic dimensions: one compiled kernel
serves every size. The causal mask is aligned to the bottom-right corner (query i sees keys
j <= i + seqlen_kv - seqlen_q); a query that sees no key gets O = 0 and LSE = -inf, and a NaN
among the inputs a query reads gives NaN.

Each program instance owns block_M queries of one head and streams KV in blocks of block_N with
the FlashAttention-2 online softmax: a running row max m and row sum l in fp32, the accumulator
rescaled by exp2(m_old - m_new) when the max grows. Scores are kept in log2 units (log2(e) is
folded into the softmax scale) so that every exponential is an exp2. Under the causal mask the KV
loop stops at the last block the query block can see.

The warp-specialised body of one query block (`_ws_overlap_tile`) serves three layouts of K and
V: dense (`ws_overlap_program`), packed sequences (`ragged_program`, flash-attn's varlen) and a
paged cache (`paged_program`), each passing how it finds the rows of a KV block; `_cpu_tile` is
the CPU's counterpart. In the packed and paged layouts the rows past a sequence's end are not
zeros but other rows; those programs zero them in V before P V (`zero_tail`).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables.
import tilelang.cpu.language as TC
import tilelang.language as T

from ..common import ACCUM, LN2, LOG2E, bits, from_f32, softmax_offset, to_f32
from ..online_softmax import FAST_MATH, online_softmax  # noqa: F401 (FAST_MATH: spec.fast_math)


def _kv_blocks(q_start, block_M: int, block_N: int, seqlen_q, seqlen_kv, causal: bool):
    """How many KV blocks a query block starting at `q_start` must visit."""
    total = T.ceildiv(seqlen_kv, block_N)
    if not causal:
        return total
    # The block's last query sees keys up to q_start + block_M - 1 + seqlen_kv - seqlen_q.
    last = q_start + block_M + seqlen_kv - seqlen_q
    return T.max(T.min(total, T.ceildiv(T.max(last, 0), block_N)), 0)


def _full_blocks(q_start, block_N: int, seqlen_q, seqlen_kv, causal: bool):
    """How many leading KV blocks every query of the block starting at `q_start` sees whole:
    those need no mask."""
    whole = seqlen_kv // block_N
    if not causal:
        return whole
    # The first query sees keys up to q_start + seqlen_kv - seqlen_q.
    return T.max(T.min(whole, (q_start + seqlen_kv - seqlen_q + 1) // block_N), 0)


def _visible(query, key, seqlen_q, seqlen_kv, causal: bool):
    if causal:
        return T.And(key < seqlen_kv, key <= query + seqlen_kv - seqlen_q)
    return key < seqlen_kv


def _buffers(block_M: int, block_N: int, head_dim: int, dtype: str):
    """A GPU program instance's buffers: the Q, K, V and O tiles in shared memory; the scores S,
    their low-precision copy P, the accumulator and six online-softmax rows in registers."""
    def tile(rows):
        return T.alloc_shared((rows, head_dim), dtype)

    def row():
        return T.alloc_fragment((block_M,), ACCUM)

    return (tile(block_M), tile(block_N), tile(block_N), tile(block_M),
            T.alloc_fragment((block_M, block_N), ACCUM), T.alloc_fragment((block_M, block_N), dtype),
            T.alloc_fragment((block_M, head_dim), ACCUM), *(row() for _ in range(6)))


@T.macro
def _mask_hidden(S, q0, k0, seqlen_q, seqlen_kv, causal: bool):
    """Scores of keys a query does not see become -inf. Applied after the product, only in the
    blocks that hold such keys, so that whatever a hidden key gives, NaN included, never reaches
    the rows that do not see it."""
    for i, j in T.Parallel(S.shape[0], S.shape[1]):
        S[i, j] = T.if_then_else(_visible(q0 + i, k0 + j, seqlen_q, seqlen_kv, causal), S[i, j],
                                 -T.infinity(ACCUM))


@T.macro
def _normalize(acc, l, O_s):  # noqa: E741
    """O = acc / l into shared memory. l = 0: the query saw no key (zeros). A NaN l (a NaN input)
    must give NaN, so the test is l == 0, not l > 0."""
    for i, j in T.Parallel(acc.shape[0], acc.shape[1]):
        acc[i, j] = T.if_then_else(l[i] == 0, 0, acc[i, j] / l[i])
    T.copy(acc, O_s)


def _lse(l, m, scale):  # noqa: E741
    """The natural log-sum-exp of a row from its log2 running max and sum (-inf: no key seen)."""
    return T.if_then_else(l == 0, -T.infinity(ACCUM), (m * scale + T.log2(l)) * LN2)


@T.macro
def _store(acc, l, m, O_s, O, LSE, b, head, q0, seqlen_q, scale):  # noqa: E741
    """O through shared memory, and the log-sum-exp, of a dense batch's query block."""
    _normalize(acc, l, O_s)
    T.copy(O_s, O[b, q0:q0 + acc.shape[0], head, :])
    for i in T.Parallel(acc.shape[0]):
        if q0 + i < seqlen_q:
            LSE[b, head, q0 + i] = _lse(l[i], m[i], scale)


@T.macro
def _store_rows(acc, l, m, O_s, O, LSE, q_row0, head, q0, seqlen_q, scale):  # noqa: E741
    """The same for a packed batch (`ragged`): only the rows of the block's own sequence are
    written, row by row, since the rows after them are the next sequence's."""
    _normalize(acc, l, O_s)
    for i, d in T.Parallel(acc.shape[0], acc.shape[1]):
        if q0 + i < seqlen_q:
            O[q_row0 + q0 + i, head, d] = O_s[i, d]
    for i in T.Parallel(acc.shape[0]):
        if q0 + i < seqlen_q:
            LSE[head, q_row0 + q0 + i] = _lse(l[i], m[i], scale)


# The KV loop body's 14 statements, scheduled for `overlap`: K load (0), Q K^T (1-2), the mask
# of hidden keys (3), online softmax (4-10), rescale O (11), V load (12), P V (13). In steady
# state iteration k loads K and V of k and issues Q K^T(k), then the rescale and P V of k - 1
# (stage 1), then the mask and softmax of k, so the tensor cores work on one product while the
# softmax of the other runs. V is loaded in stage 0, a block ahead of its product, so TileLang
# double-buffers it and waits for the copy of k - 1 before P V reads it. (With the V load in
# stage 1, beside its product, TileLang 0.1.15 waited for all but the newest copy, V's own: P V
# could read V before it landed, and outputs came out wrong or NaN.)
_EMIT = [0, 12, 1, 2, 11, 13, *range(3, 11)]
_OVERLAP = {"order": [_EMIT.index(i) for i in range(14)],
            "stage": [int(i in (11, 13)) for i in range(14)]}


# Named barriers of the ping-pong schedule, one per consumer warpgroup (TileLang's own barriers
# take the low ids).
_PINGPONG_BARRIER = 8


def gpu_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                block_M: int, block_N: int, num_stages: int, threads: int, overlap: int = 0,
                pingpong: int = 0, k_pack: int = 1, persistent: int = 0, units: int = 0):
    """The GPU tile program: T.gemm for Q K^T and P V (wgmma on sm_90a), pipelined KV loads.

    With `overlap` 0, TileLang warp-specialises it on sm_90a: a TMA producer warpgroup feeds
    `threads` of wgmma consumers through `num_stages` K/V buffers. With `overlap` 1 the loop is
    scheduled by hand (`_OVERLAP`, two stages, cp.async loads, no producer warpgroup) so that the
    softmax of one KV block sits between the products of its neighbours. `overlap` 2 is that
    order with a TMA producer (`ws_overlap_program`, sm_90); `persistent` 1 runs it on one CTA
    per SM (`units` of them) walking the tiles.

    `pingpong` 1 (sm_90, `overlap` 0, two consumer warpgroups) takes turns on the tensor cores:
    a warpgroup issues a product only after the other finished its own, and hands over as soon
    as its product is done, so that each one's softmax runs under the other's products instead
    of both warpgroups computing softmax at once while the tensor cores idle.
    """
    if overlap == 2:
        return ws_overlap_program(heads_q, heads_kv, head_dim, causal, dtype, block_M=block_M,
                                  block_N=block_N, num_stages=num_stages, threads=threads,
                                  ctas=units if persistent else 0, pingpong=pingpong)
    batch, seqlen_q, seqlen_kv = T.dynamic("batch"), T.dynamic("seqlen_q"), T.dynamic("seqlen_kv")
    # AMD MFMA K packing (the hip space varies it) for Q K^T; P V keeps the default, since a packed
    # layout of the scores would not match the one P needs as a register operand.
    annotations = {"k_pack": k_pack} if k_pack != 1 else None
    group = heads_q // heads_kv
    scale = head_dim ** -0.5 * LOG2E
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    kv_shape = (batch, seqlen_kv, heads_kv, head_dim)
    neg_inf = -T.infinity(ACCUM)

    @T.prim_func
    def flash_attention(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                        V: T.Tensor(kv_shape, dtype), O: T.Tensor(q_shape, dtype),
                        LSE: T.Tensor((batch, heads_q, seqlen_q), ACCUM)):
        with T.Kernel(T.ceildiv(seqlen_q, block_M), heads_q, batch, threads=threads) as (
                bx, head, b):
            (Q_s, K_s, V_s, O_s, S, P, acc, m, m_prev, m_safe, alpha, l,  # noqa: E741
             row_sum) = _buffers(block_M, block_N, head_dim, dtype)

            # Causal: the last query blocks see the most keys; launching them first leaves the
            # light blocks for the tail of the grid, where they fill SMs as others finish.
            q0 = (T.ceildiv(seqlen_q, block_M) - 1 - bx if causal else bx) * block_M
            kv_head = head // group
            wg = T.get_thread_binding() // 128  # this thread's consumer warpgroup
            mine, other = _PINGPONG_BARRIER + wg, _PINGPONG_BARRIER + 1 - wg
            after = T.alloc_local((1,), "int32")  # see the P V barrier below
            T.copy(Q[b, q0:q0 + block_M, head, :], Q_s)
            T.fill(acc, 0)
            T.fill(l, 0)
            T.fill(m, neg_inf)
            n_blocks = _kv_blocks(q0, block_M, block_N, seqlen_q, seqlen_kv, causal)
            n_full = _full_blocks(q0, block_N, seqlen_q, seqlen_kv, causal)
            if causal:
                # A query block that sees no key (seqlen_q > seqlen_kv) still runs one, fully
                # masked, KV block: with an empty pipelined loop, rows of such blocks came out as
                # garbage now and then on sm_90a (fp16 and bf16, head_dim 64 and 128).
                n_blocks = T.max(n_blocks, 1)
            for kb in T.Pipelined(n_blocks, **(_OVERLAP if overlap else
                                               {"num_stages": num_stages})):
                if pingpong and kb == 0 and wg == 1:  # warpgroup 0 goes first (inside the
                    T.named_barrier_arrive(_PINGPONG_BARRIER, 256)  # loop: consumer threads)
                T.copy(K[b, kb * block_N:(kb + 1) * block_N, kv_head, :], K_s)
                # The scale goes into the exponent's multiply-add: the row maxima are of
                # unscaled scores.
                T.fill(S, 0)
                if pingpong:
                    T.sync_threads(mine, 256)  # the other warpgroup's product is done
                T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                       annotations=annotations)
                if pingpong:
                    T.named_barrier_arrive(other, 256)
                if kb >= n_full:
                    _mask_hidden(S, q0, kb * block_N, seqlen_q, seqlen_kv, causal)
                online_softmax(S, m, m_prev, m_safe, alpha, row_sum, l, scale)
                T.copy(S, P)
                for i, j in T.Parallel(block_M, head_dim):
                    acc[i, j] *= alpha[i]
                T.copy(V[b, kb * block_N:(kb + 1) * block_N, kv_head, :], V_s)
                if pingpong:
                    # ptxas moves register arithmetic across barriers: left alone, it waits for
                    # the turn halfway through the row max and runs the exponentials after it,
                    # so both warpgroups' softmax would overlap each other instead of the
                    # products. The barrier id takes a term of the row sums (always 0: l >= 0
                    # or NaN), so the softmax must be done before the wait.
                    after[0] = 0
                    for i in T.Parallel(block_M):
                        after[0] = after[0] + T.if_then_else(l[i] < -1, 1, 0)
                    T.sync_threads(mine + after[0], 256)
                T.gemm(P, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
                if pingpong:
                    T.named_barrier_arrive(other, 256)
            _store(acc, l, m, O_s, O, LSE, b, head, q0, seqlen_q, scale)

    return flash_attention


# The K and V bytes a causal persistent launch's CTAs in flight should read (H200's L2 holds 50
# MiB; the rest is left to the Q and O streams). FlashAttention-3 sizes its sections the same way.
L2_KV_BYTES = 32 << 20


def _tile(tile, n_q, heads_q: int, group: int, batch, seqlen_kv, head_dim: int, causal: bool,
          at):
    """(query block, head, batch) of a persistent CTA's tile.

    Non-causal: the query block fastest, so that the CTAs in flight share one head's K and V in
    L2. Causal: the heaviest tiles first (`ws_overlap_program` counts the query block down), but
    the (batch, head) pairs are cut into sections of whole KV heads whose K and V (16-bit) fit
    `L2_KV_BYTES`, with the query block slowest inside a section. Heaviest first over every
    head at once kept 132 heads' K and V in flight, more than L2 holds from 1k tokens up.

    `at`: five int32 registers (a list on the host) holding the section's arithmetic, which
    inlined into every index made the lowering minutes long (see `_per_tile`)."""
    if not causal:
        return tile % n_q, tile // n_q % heads_q, tile // (n_q * heads_q)
    kv_heads = T.max(L2_KV_BYTES // (4 * head_dim) // seqlen_kv, 1)
    width = _hold(at, 0, T.min(kv_heads * group, heads_q * batch))  # pairs a section
    section = _hold(at, 1, tile // (width * n_q))
    pairs = _hold(at, 2, T.min(width, heads_q * batch - section * width))  # fewer in the last
    rest = tile - section * width * n_q  # the tile's place in its section
    pair = _hold(at, 3, section * width + rest % pairs)
    return _hold(at, 4, rest // pairs), pair % heads_q, pair // heads_q


def _per_tile(n_blocks, t):
    """A persistent CTA's KV block count for tile loop iteration t, where it varies by tile.
    Read through registers or memory, the count is bound to variables that do not name t, so
    TileLang's warp specialisation takes the nest for rectangular and counts barrier phases as
    t * n_blocks + kb, wrong once two tiles differ (the CTAs hung). t >> 31 is 0: naming t in
    the bound makes it count the phases at run time. The `max` keeps the count visibly positive,
    as `_n_blocks` does: without it the pipeliner's first iteration was conditional and ptxas
    serialised every wgmma of the persistent packed kernel (32 `WARPGROUP.DEPBAR` in the SASS)."""
    return T.max(n_blocks + T.shift_right(t, 31), 1)


def ragged_bounds(at, Tiles, entry, block: int, CuQ, CuKV, tokens_q, tokens_kv):
    """A packed batch's tile `entry` (`Tiles` rows: sequence, block): its sequence, the first row
    of its block, and the sequence's first query and key rows and lengths, held in `at[0..5]`.
    The offsets are clamped to the batch's tokens, so that bad ones read no row outside it."""
    seq = _hold(at, 0, Tiles[entry, 0])
    start = _hold(at, 1, Tiles[entry, 1] * block)
    q_row0 = _hold(at, 2, T.min(CuQ[seq], tokens_q))
    seqlen_q = _hold(at, 3, T.min(T.max(CuQ[seq + 1], q_row0), tokens_q) - q_row0)
    kv_row0 = _hold(at, 4, T.min(CuKV[seq], tokens_kv))
    seqlen_kv = _hold(at, 5, T.min(T.max(CuKV[seq + 1], kv_row0), tokens_kv) - kv_row0)
    return seq, start, q_row0, seqlen_q, kv_row0, seqlen_kv


def _hold(at, i: int, value):
    """Store `value` in register `at[i]` (a list's item on the host) and read it back."""
    if isinstance(at, list):
        at[i] = value
    else:
        T.buffer_store(at, value, [i])
    return at[i]


def consumer_nreg(threads: int) -> int:
    """Registers a consumer thread of the warp-specialised schedule gets (setmaxnreg) beside the
    24 of the producer warpgroup: 240 for up to two consumer warpgroups, 160 for three."""
    return 240 if threads <= 256 else 160


def _ws_overlap_schedule(consumer_warps: int, Q_s, K_s, V_s, num_stages: int,
                         zero_tail: bool = False, pingpong: bool = False):
    """`ws_overlap_program`'s roles, pipelines and the order of its named steps: the KV loop
    inside the loop over the CTA's tiles (one tile, unless persistent). `zero_tail`: the
    "zero_v" step of `_ws_overlap_tile` between V's wait and its product. `pingpong`: the
    "turn" and "hand_over" steps around a warpgroup's two products, and "ready" before its
    first tile (`_ws_overlap_tile`)."""
    turn, hand_over, ready = (["turn"], ["hand_over"], ["ready"]) if pingpong else ([], [], [])
    # setmaxnreg shares the SM's 64K registers: 24 for the producer warpgroup, 240 for two
    # consumer warpgroups, 160 for three (FlashAttention-3's split at head_dim 64).
    return T.WSSchedule(
        num_warps=4 + consumer_warps,
        roles=[T.WSRole("Producer", warps_lo=0, warps_hi=1, max_nreg=24),
               T.WSRole("Consumer", warps_lo=4, warps_hi=4 + consumer_warps,
                        max_nreg=consumer_nreg(consumer_warps * 32))],
        pipelines=[T.WSPipeline("q", [Q_s], depth=1),
                   T.WSPipeline("k", [K_s], depth=num_stages),
                   T.WSPipeline("v", [V_s], depth=num_stages + 1)],
        scopes=[
            T.WSScope("kv", {
                "Producer": [T.WSSync.producer_acquire("k"), "load_k",
                             T.WSSync.producer_commit("k"),
                             T.WSSync.producer_acquire("v"), "load_v",
                             T.WSSync.producer_commit("v")],
                "Consumer": [T.WSSync.consumer_wait("k", stage=1), *turn, "qk",
                             T.WSSync.consumer_wait("v", stage=2),
                             *(["zero_v"] if zero_tail else []), "pv", *hand_over, "wait_qk",
                             T.WSSync.consumer_release("k", stage=1), "mask", "softmax",
                             "wait_pv", T.WSSync.consumer_release("v", stage=2), "rescale",
                             "cast"],
            }),
            T.WSScope("tiles", {
                "Producer": ["bounds", T.WSSync.producer_acquire("q"), "load_q",
                             T.WSSync.producer_commit("q"), "kv"],
                "Consumer": ["bounds", *ready, "init", T.WSSync.consumer_wait("q"), "kv",
                             T.WSSync.consumer_release("q"), "final"],
            }),
            T.WSScope(T.WSScope.ROOT, {"Producer": ["tiles"], "Consumer": ["tiles"]}),
        ])


def _rows(buf, b, start, stop, head):
    """Rows start:stop of one head: of batch entry b of a (batch, seq, heads, dim) tensor, or of
    a packed (tokens, heads, dim) one when b is None."""
    if b is None:
        return buf[start:stop, head, :]
    return buf[b, start:stop, head, :]


def _kv_rows(b, kv_row0, kv_head, block_N: int):
    """The K or V rows of KV block kb of a dense sequence (b) or of a packed one starting at row
    kv_row0 (b None): `_ws_overlap_tile`'s `kv_block` for those layouts."""
    return lambda buf, kb: _rows(buf, b, kv_row0 + kb * block_N, kv_row0 + (kb + 1) * block_N,
                                 kv_head)


# The named barrier of the consumers' "zero_v" step (TileLang's own barriers take the low ids;
# the ping-pong schedule, never warp-specialised by hand, takes 8 and 9).
_ZERO_TAIL_BARRIER = 10


@T.macro
def zero_rows_past(A, start, length, threads: int):
    """Zero the rows of shared tile A that hold positions start + j >= length, when any does:
    the rows a TMA load took past a sequence's end, which are another sequence's rows or stale
    cache rows, not the zeros it reads past a tensor. Run by the `threads` consumer threads of a
    hand-written schedule, after the tile's wait and before a wgmma reads it. Every earlier read
    of the tile has ended (the producer refilled it); the first barrier only keeps TileLang from
    putting one before the branch, in every block."""
    if start + A.shape[0] > length:
        T.sync_threads(_ZERO_TAIL_BARRIER, threads)
        for j, d in T.Parallel(A.shape[0], A.shape[1]):
            if start + j >= length:
                A[j, d] = 0
        T.fence_proxy_async()  # the generic-proxy stores, before wgmma reads the tile
        T.sync_threads(_ZERO_TAIL_BARRIER, threads)


@T.macro
def _ws_overlap_tile(Q, K, V, O, LSE, buffers, b, head, kv_block, q_row0, q0, seqlen_q,
                     seqlen_kv, n_blocks, n_full, causal: bool, scale, num_stages: int,
                     zero_tail: int = 0, turn=None):
    """One query block of `ws_overlap_program`, after its "bounds": Q, the KV loop, the store.
    q_row0 is where the block's sequence starts in a packed batch (b None), 0 in a dense one;
    kv_block(buf, kb) the rows of KV block kb in K or V.

    `zero_tail` (the consumer thread count, or 0): the KV rows past seqlen_kv in the last block
    are not zeros from past the tensor but another sequence's rows or stale cache rows, which may
    hold NaN or Inf; their scores are masked, but P V would still carry 0 * NaN into every row.
    So before that product the consumers zero those V rows in shared memory (the producer's TMA
    cannot predicate rows).

    `turn` (the barriers `_pingpong_turns` gives, or None): a consumer warpgroup issues its two
    products only in its turn and then hands the tensor cores to the other, so that one
    warpgroup's softmax runs under the other's products (FlashAttention-3's scheduler barrier)."""
    (Q_s, K_s, V_s, O_s, S, P, acc, m, m_prev, m_safe, alpha, l,  # noqa: E741
     row_sum) = buffers
    block_M, block_N = S.shape
    T.copy(_rows(Q, b, q_row0 + q0, q_row0 + q0 + block_M, head), Q_s,
           annotations={T.WSID: "load_q"})
    with T.ws_op("init"):
        T.fill(P, 0)  # the first iteration's P V (of no block) reads it
        T.fill(acc, 0)
        T.fill(l, 0)
        T.fill(m, -T.infinity(ACCUM))
    for kb in T.Pipelined(n_blocks, num_stages=num_stages, annotations={T.WSID: "kv"}):
        T.copy(kv_block(K, kb), K_s, annotations={T.WSID: "load_k"})
        T.copy(kv_block(V, kb), V_s, annotations={T.WSID: "load_v"})
        if turn is not None:
            with T.ws_op("turn"):
                T.sync_threads(turn[0], 256)
        with T.ws_op("qk"):
            T.fill(S, 0)
            T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        if zero_tail:
            # At V's stage, kb is the block whose V this P V multiplies (the materialised loop
            # runs it a block behind Q K^T, and the epilogue for the last block).
            with T.ws_op("zero_v"):
                zero_rows_past(V_s, kb * block_N, seqlen_kv, zero_tail)
        T.wgmma_gemm(P, V_s, acc, policy=T.GemmWarpPolicy.FullRow,
                     annotations={T.WSID: "pv"})
        if turn is not None:
            with T.ws_op("hand_over"):
                T.named_barrier_arrive(turn[1], 256)
        with T.ws_op("wait_qk"):  # P V of kb - 1 goes on (none is in flight at kb 0)
            if kb == 0:
                T.wait_wgmma(0)
            else:
                T.wait_wgmma(1)
        with T.ws_op("mask"):
            if kb >= n_full:
                _mask_hidden(S, q0, kb * block_N, seqlen_q, seqlen_kv, causal)
        with T.ws_op("softmax"):
            online_softmax(S, m, m_prev, m_safe, alpha, row_sum, l, scale)
        with T.ws_op("wait_pv"):
            T.wait_wgmma(0)
        with T.ws_op("rescale"):
            for i, j in T.Parallel(block_M, acc.shape[1]):
                acc[i, j] *= alpha[i]
        with T.ws_op("cast"):
            T.copy(S, P)
    with T.ws_op("final"):
        T.wait_wgmma(0)  # the last P V, issued after the loop
        if b is None:
            _store_rows(acc, l, m, O_s, O, LSE, q_row0, head, q0, seqlen_q, scale)
        else:
            _store(acc, l, m, O_s, O, LSE, b, head, q0, seqlen_q, scale)


def _pingpong_turns():
    """(this consumer warpgroup's barrier, the other's, its warpgroup index, a register for it)
    in a hand-written schedule, whose two consumer warpgroups follow the producer's (threads
    128-383)."""
    wg = T.get_thread_binding() // 128 - 1
    return _PINGPONG_BARRIER + wg, _PINGPONG_BARRIER + 1 - wg, wg, T.alloc_local((1,), "int32")


@T.macro
def _pingpong_ready(turn, t):
    """Warpgroup 1 lets warpgroup 0 take the first turn, at the CTA's first tile t: each turn
    after it is handed over, across a persistent CTA's tiles too (both warpgroups run every KV
    block). A step of the tile loop: the schedule drops steps outside it."""
    with T.ws_op("ready"):
        # The launch declares the consumers' threads only, so TileLang takes the thread index
        # below 256 and would fold the test for warpgroup 1 to false; through a register it
        # cannot.
        if t == 0 and _hold(turn[3], 0, turn[2]) == 1:
            T.named_barrier_arrive(_PINGPONG_BARRIER, 256)


def _n_blocks(q0, block_M: int, block_N: int, seqlen_q, seqlen_kv, causal: bool):
    """The KV blocks a query block runs: always one at least (a query block that sees no key runs
    one, masked): with a loop that may be empty, the pipeliner's peeled first iteration is
    conditional, and ptxas then serialises every wgmma (C7515)."""
    return T.max(_kv_blocks(q0, block_M, block_N, seqlen_q, seqlen_kv, causal), 1)


def ws_overlap_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                       block_M: int, block_N: int, num_stages: int, threads: int,
                       ctas: int = 0, pingpong: int = 0):
    """FlashAttention-3's order inside each consumer warpgroup, warp-specialised by hand (sm_90).

    A producer warp (24 registers) streams Q, K and V by TMA; `threads` of consumers (240
    registers) issue Q K^T of block k, then P V of block k - 1, and run the softmax of block k
    while that P V is on the tensor cores. K has `num_stages` buffers and V one more, since a V
    block is read one iteration after its K. Each buffer goes back to the producer only after the
    wait that ends its product: TileLang's automatic warp specialisation releases a stage before
    an asynchronous wgmma's wait, so this schedule is written out (`T.WSSchedule`).

    With `ctas` > 0 the kernel is persistent: that many CTAs walk the (query block, head, batch)
    tiles, and the producer loads the next tile's Q, K and V while the consumers finish this
    one's O (a tile's prologue and epilogue no longer idle the SM). `ragged_program` is the same
    schedule over a packed batch. `pingpong` 1 (two consumer warpgroups) orders their products
    by turns (`_ws_overlap_tile`'s `turn`).
    """
    batch, seqlen_q, seqlen_kv = T.dynamic("batch"), T.dynamic("seqlen_q"), T.dynamic("seqlen_kv")
    group = heads_q // heads_kv
    scale = head_dim ** -0.5 * LOG2E
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    kv_shape = (batch, seqlen_kv, heads_kv, head_dim)

    @T.prim_func
    def flash_attention(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                        V: T.Tensor(kv_shape, dtype), O: T.Tensor(q_shape, dtype),
                        LSE: T.Tensor((batch, heads_q, seqlen_q), ACCUM)):
        n_q = T.ceildiv(seqlen_q, block_M)
        with T.Kernel(*((ctas,) if ctas else (n_q, heads_q, batch)), threads=threads) as ids:
            buffers = _buffers(block_M, block_N, head_dim, dtype)
            T.annotate_ws_schedule(_ws_overlap_schedule(threads // 32, *buffers[:3], num_stages,
                                                        pingpong=bool(pingpong)))
            n_tiles = T.ceildiv(n_q * heads_q * batch - ids, ctas) if ctas else 1
            at = T.alloc_local((5,), "int32") if ctas and causal else None
            turn = _pingpong_turns() if pingpong else None
            for t in T.serial(n_tiles, annotations={T.WSID: "tiles"}):
                with T.ws_op("bounds"):
                    bx, head, b = (_tile(ids + t * ctas, n_q, heads_q, group, batch, seqlen_kv,
                                         head_dim, causal, at) if ctas else ids)
                    q0 = (n_q - 1 - bx if causal else bx) * block_M
                    kv_head = head // group
                    n_blocks = _n_blocks(q0, block_M, block_N, seqlen_q, seqlen_kv, causal)
                    if ctas and causal:
                        n_blocks = _per_tile(n_blocks, t)
                    n_full = _full_blocks(q0, block_N, seqlen_q, seqlen_kv, causal)
                if pingpong:
                    _pingpong_ready(turn, t)
                _ws_overlap_tile(Q, K, V, O, LSE, buffers, b, head,
                                 _kv_rows(b, 0, kv_head, block_N), 0, q0, seqlen_q, seqlen_kv,
                                 n_blocks, n_full, causal, scale, num_stages, turn=turn)

    return flash_attention


def ragged_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                   block_M: int, block_N: int, num_stages: int, threads: int, ctas: int = 0):
    """`ws_overlap_program` over a packed batch: Q and O (tokens_q, heads_q, head_dim), K and V
    (tokens_kv, heads_kv, head_dim), sequence i at rows cu_q[i]:cu_q[i + 1] of Q and
    cu_kv[i]:cu_kv[i + 1] of K and V, LSE (heads_q, tokens_q), as flash-attn's varlen call has
    them.

    `tiles` lists the query blocks as (sequence, block) pairs, in the order they run; an entry
    whose block starts past its sequence runs one masked KV block and writes nothing (the host
    sizes the list for the most blocks the lengths could need). Each tile's heads are adjacent
    in the grid: CTAs running at once share K and V in L2, and the heaviest blocks of every head
    start first. Sequence bounds are clamped to the tensors, so that no offsets (non-monotone,
    past the end) can move a load or a store outside them.
    """
    tokens_q, tokens_kv = T.dynamic("tokens_q"), T.dynamic("tokens_kv")
    n_offsets, n_entries = T.dynamic("n_offsets"), T.dynamic("n_entries")
    group = heads_q // heads_kv
    scale = head_dim ** -0.5 * LOG2E
    q_shape = (tokens_q, heads_q, head_dim)
    kv_shape = (tokens_kv, heads_kv, head_dim)

    @T.prim_func
    def flash_attention_varlen(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype), CuQ: T.Tensor((n_offsets,), "int32"),
            CuKV: T.Tensor((n_offsets,), "int32"), Tiles: T.Tensor((n_entries, 2), "int32"),
            O: T.Tensor(q_shape, dtype), LSE: T.Tensor((heads_q, tokens_q), ACCUM)):
        n_items = n_entries * heads_q
        with T.Kernel(ctas if ctas else n_items, threads=threads) as ids:
            buffers = _buffers(block_M, block_N, head_dim, dtype)
            T.annotate_ws_schedule(_ws_overlap_schedule(threads // 32, *buffers[:3], num_stages,
                                                         zero_tail=True))
            n_tiles = T.ceildiv(n_items - ids, ctas) if ctas else 1
            # the tile's bounds in registers: inlined into every index that uses them, the loads
            # made the lowering 90 s long (TileLang's layout inference)
            at = T.alloc_local((6,), "int32")
            for t in T.serial(n_tiles, annotations={T.WSID: "tiles"}):
                with T.ws_op("bounds"):
                    item = ids + t * ctas if ctas else ids
                    head = item % heads_q
                    seq, q0, q_row0, seqlen_q, kv_row0, seqlen_kv = ragged_bounds(
                        at, Tiles, item // heads_q, block_M, CuQ, CuKV, tokens_q, tokens_kv)
                    kv_head = head // group
                    n_blocks = T.if_then_else(
                        q0 < seqlen_q,
                        _n_blocks(q0, block_M, block_N, seqlen_q, seqlen_kv, causal), 1)
                    if ctas:
                        n_blocks = _per_tile(n_blocks, t)
                    n_full = _full_blocks(q0, block_N, seqlen_q, seqlen_kv, causal)
                _ws_overlap_tile(Q, K, V, O, LSE, buffers, None, head,
                                 _kv_rows(None, kv_row0, kv_head, block_N), q_row0, q0,
                                 seqlen_q, seqlen_kv, n_blocks, n_full, causal, scale,
                                 num_stages, zero_tail=threads)

    return flash_attention_varlen


def _at(buf, b, row, head, d):
    """One element of a dense (b, row, head, d) tensor, or of a packed one when b is None."""
    return buf[row, head, d] if b is None else buf[b, row, head, d]


def _kv_at(b, kv_row0, kv_head):
    """Element d of key j of a dense sequence (b) or of a packed one starting at row kv_row0
    (b None) in K or V: `_cpu_tile`'s `kv_at` for those layouts."""
    return lambda buf, j, d: _at(buf, b, kv_row0 + j, kv_head, d)


@TC.macro
def _cpu_tile(Q, K, V, O, LSE, b, head, kv_at, q_row0, q0, seqlen_q, seqlen_kv, causal: bool,
              dtype: str, block_M: int, block_N: int):
    """One query block of `cpu_program`; q_row0 as in `_ws_overlap_tile`, kv_at(buf, j, d)
    element d of the sequence's key j in K or V."""
    D = Q.shape[-1]
    neg_inf = -TC.infinity(ACCUM)
    scale = D ** -0.5 * LOG2E
    q = TC.alloc_local((block_M, D), ACCUM)
    k = TC.alloc_local((block_N, D), ACCUM)
    v = TC.alloc_local((block_N, D), ACCUM)
    s = TC.alloc_local((block_M, block_N), ACCUM)
    acc = TC.alloc_local((block_M, D), ACCUM)
    m = TC.alloc_local((block_M,), ACCUM)
    m_safe = TC.alloc_local((block_M,), ACCUM)
    alpha = TC.alloc_local((block_M,), ACCUM)
    l = TC.alloc_local((block_M,), ACCUM)  # noqa: E741
    for i, d in TC.grid(block_M, D):
        q[i, d] = TC.if_then_else(q0 + i < seqlen_q,
                                  to_f32(_at(Q, b, q_row0 + q0 + i, head, d), dtype), 0.0)
        acc[i, d] = 0.0
    for i in TC.serial(block_M):
        m[i] = neg_inf
        l[i] = 0.0
    for kb in TC.serial(_kv_blocks(q0, block_M, block_N, seqlen_q, seqlen_kv, causal)):
        k0 = kb * block_N
        for j, d in TC.grid(block_N, D):
            k[j, d] = TC.if_then_else(k0 + j < seqlen_kv, to_f32(kv_at(K, k0 + j, d), dtype), 0.0)
            v[j, d] = TC.if_then_else(k0 + j < seqlen_kv, to_f32(kv_at(V, k0 + j, d), dtype), 0.0)
        for i, j in TC.grid(block_M, block_N):
            s[i, j] = 0.0
        for i, j, d in TC.grid(block_M, block_N, D):
            s[i, j] += q[i, d] * k[j, d]
        for i in TC.serial(block_M):
            alpha[i] = m[i]  # the previous max, until it becomes the rescale factor
            for j in TC.serial(block_N):
                s[i, j] = TC.if_then_else(
                    _visible(q0 + i, k0 + j, seqlen_q, seqlen_kv, causal),
                    s[i, j] * scale, neg_inf)
                m[i] = TC.max(m[i], s[i, j])
            m_safe[i] = softmax_offset(m[i])
            alpha[i] = TC.exp2(alpha[i] - m_safe[i])
            l[i] = l[i] * alpha[i]
            for j in TC.serial(block_N):
                s[i, j] = TC.exp2(s[i, j] - m_safe[i])
                l[i] += s[i, j]
        for i, d in TC.grid(block_M, D):
            acc[i, d] *= alpha[i]
        for i, j, d in TC.grid(block_M, block_N, D):
            acc[i, d] += s[i, j] * v[j, d]
    # Element by element: the C backend's vectorised fp16 cast is broken. l == 0, not l > 0, as
    # in the GPU program: a NaN input gives NaN, not a row of zeros.
    for i, d in TC.grid(block_M, D):
        if q0 + i < seqlen_q:
            if b is None:
                O[q_row0 + q0 + i, head, d] = from_f32(
                    TC.if_then_else(l[i] == 0, 0.0, acc[i, d] / l[i]), dtype)
            else:
                O[b, q0 + i, head, d] = from_f32(
                    TC.if_then_else(l[i] == 0, 0.0, acc[i, d] / l[i]), dtype)
    for i in TC.serial(block_M):
        if q0 + i < seqlen_q:
            if b is None:
                LSE[head, q_row0 + q0 + i] = TC.if_then_else(
                    l[i] == 0, neg_inf, (m[i] + TC.log2(l[i])) * LN2)
            else:
                LSE[b, head, q0 + i] = TC.if_then_else(
                    l[i] == 0, neg_inf, (m[i] + TC.log2(l[i])) * LN2)


def cpu_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                block_M: int, block_N: int):
    """The CPU form of the same tile program, for TileLang's C target.

    Same blocking and online softmax as the GPU program, with fp32 local tiles, scalar loops for
    the two products and bounds checks in place of the GPU's zero-filling copies.
    """
    batch, seqlen_q, seqlen_kv = TC.dynamic("batch"), TC.dynamic("seqlen_q"), \
        TC.dynamic("seqlen_kv")
    group = heads_q // heads_kv
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    kv_shape = (batch, seqlen_kv, heads_kv, head_dim)

    @TC.prim_func
    def flash_attention(Q: TC.Tensor(q_shape, bits(dtype)), K: TC.Tensor(kv_shape, bits(dtype)),
                        V: TC.Tensor(kv_shape, bits(dtype)), O: TC.Tensor(q_shape, bits(dtype)),
                        LSE: TC.Tensor((batch, heads_q, seqlen_q), ACCUM)):
        with TC.Kernel(TC.ceildiv(seqlen_q, block_M), heads_q, batch) as (bx, head, b):
            _cpu_tile(Q, K, V, O, LSE, b, head, _kv_at(b, 0, head // group), 0, bx * block_M,
                      seqlen_q, seqlen_kv, causal, dtype, block_M, block_N)

    return flash_attention


def cpu_ragged_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                       block_M: int, block_N: int):
    """`cpu_program` over the packed batch of `ragged_program`, with the same arguments."""
    tokens_q, tokens_kv = TC.dynamic("tokens_q"), TC.dynamic("tokens_kv")
    n_offsets, n_entries = TC.dynamic("n_offsets"), TC.dynamic("n_entries")
    group = heads_q // heads_kv
    q_shape = (tokens_q, heads_q, head_dim)
    kv_shape = (tokens_kv, heads_kv, head_dim)

    @TC.prim_func
    def flash_attention_varlen(
            Q: TC.Tensor(q_shape, bits(dtype)), K: TC.Tensor(kv_shape, bits(dtype)),
            V: TC.Tensor(kv_shape, bits(dtype)), CuQ: TC.Tensor((n_offsets,), "int32"),
            CuKV: TC.Tensor((n_offsets,), "int32"), Tiles: TC.Tensor((n_entries, 2), "int32"),
            O: TC.Tensor(q_shape, bits(dtype)), LSE: TC.Tensor((heads_q, tokens_q), ACCUM)):
        with TC.Kernel(n_entries, heads_q) as (entry, head):
            seq = Tiles[entry, 0]
            q_row0 = TC.min(CuQ[seq], tokens_q)
            kv_row0 = TC.min(CuKV[seq], tokens_kv)
            _cpu_tile(Q, K, V, O, LSE, None, head, _kv_at(None, kv_row0, head // group),
                      q_row0, Tiles[entry, 1] * block_M,
                      TC.min(TC.max(CuQ[seq + 1], q_row0), tokens_q) - q_row0,
                      TC.min(TC.max(CuKV[seq + 1], kv_row0), tokens_kv) - kv_row0,
                      causal, dtype, block_M, block_N)

    return flash_attention_varlen


def _page(table, b, pos, page_size: int, pages):
    """The cache page holding key `pos` of sequence b, clamped into the cache: [0, pages)."""
    return T.min(T.max(table[b, pos // page_size], 0), pages - 1)


def _paged_rows(table, b, kv_head, block_N: int, page_size: int, pages):
    """The K or V rows of KV block kb of sequence b in a paged cache (pages, page_size, heads,
    dim): one TMA load, since a page holds whole blocks (page_size a multiple of block_N)."""
    def rows(buf, kb):
        pos = kb * block_N
        off = pos % page_size
        return buf[_page(table, b, pos, page_size, pages), off:off + block_N, kv_head, :]

    return rows


def paged_program(heads_q: int, heads_kv: int, head_dim: int, page_size: int, causal: bool,
                  dtype: str, *, block_M: int, block_N: int, num_stages: int, threads: int):
    """`ws_overlap_program` over a paged KV cache, as flash-attn's `flash_attn_with_kvcache`
    takes it: Q, O and LSE as in the dense program; K and V (pages, page_size, heads_kv,
    head_dim), sequence b's key j at row j % page_size of page BlockTable[b, j // page_size];
    CacheSeqlens[b] keys per sequence.

    A length is clamped into what its table row can address and a page id into the cache, so no
    table or lengths can move a load outside the tensors. The last block's rows past the length
    are whatever the cache holds there: the consumers zero them in V (`zero_tail`).
    """
    batch, seqlen_q = T.dynamic("batch"), T.dynamic("seqlen_q")
    pages, table_w = T.dynamic("pages"), T.dynamic("table_w")
    group = heads_q // heads_kv
    scale = head_dim ** -0.5 * LOG2E
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    cache_shape = (pages, page_size, heads_kv, head_dim)

    @T.prim_func
    def flash_attention_paged(
            Q: T.Tensor(q_shape, dtype), KCache: T.Tensor(cache_shape, dtype),
            VCache: T.Tensor(cache_shape, dtype), CacheSeqlens: T.Tensor((batch,), "int32"),
            BlockTable: T.Tensor((batch, table_w), "int32"), O: T.Tensor(q_shape, dtype),
            LSE: T.Tensor((batch, heads_q, seqlen_q), ACCUM)):
        n_q = T.ceildiv(seqlen_q, block_M)
        with T.Kernel(n_q, heads_q, batch, threads=threads) as (bx, head, b):
            buffers = _buffers(block_M, block_N, head_dim, dtype)
            T.annotate_ws_schedule(_ws_overlap_schedule(threads // 32, *buffers[:3], num_stages,
                                                        zero_tail=True))
            for _ in T.serial(1, annotations={T.WSID: "tiles"}):
                with T.ws_op("bounds"):
                    q0 = (n_q - 1 - bx if causal else bx) * block_M
                    seqlen_kv = T.min(T.max(CacheSeqlens[b], 0), table_w * page_size)
                    n_blocks = _n_blocks(q0, block_M, block_N, seqlen_q, seqlen_kv, causal)
                    n_full = _full_blocks(q0, block_N, seqlen_q, seqlen_kv, causal)
                _ws_overlap_tile(Q, KCache, VCache, O, LSE, buffers, b, head,
                                 _paged_rows(BlockTable, b, head // group, block_N, page_size,
                                             pages),
                                 0, q0, seqlen_q, seqlen_kv, n_blocks, n_full, causal, scale,
                                 num_stages, zero_tail=threads)

    return flash_attention_paged


def cpu_paged_program(heads_q: int, heads_kv: int, head_dim: int, page_size: int, causal: bool,
                      dtype: str, *, block_M: int, block_N: int):
    """`cpu_program` over the paged cache of `paged_program`, with the same arguments (any page
    size: the CPU tile reads element by element)."""
    batch, seqlen_q = TC.dynamic("batch"), TC.dynamic("seqlen_q")
    pages, table_w = TC.dynamic("pages"), TC.dynamic("table_w")
    group = heads_q // heads_kv
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    cache_shape = (pages, page_size, heads_kv, head_dim)

    def kv_at(table, b, kv_head):
        return lambda buf, j, d: buf[TC.min(TC.max(table[b, j // page_size], 0), pages - 1),
                                     j % page_size, kv_head, d]

    @TC.prim_func
    def flash_attention_paged(
            Q: TC.Tensor(q_shape, bits(dtype)), KCache: TC.Tensor(cache_shape, bits(dtype)),
            VCache: TC.Tensor(cache_shape, bits(dtype)),
            CacheSeqlens: TC.Tensor((batch,), "int32"),
            BlockTable: TC.Tensor((batch, table_w), "int32"), O: TC.Tensor(q_shape, bits(dtype)),
            LSE: TC.Tensor((batch, heads_q, seqlen_q), ACCUM)):
        with TC.Kernel(TC.ceildiv(seqlen_q, block_M), heads_q, batch) as (bx, head, b):
            _cpu_tile(Q, KCache, VCache, O, LSE, b, head, kv_at(BlockTable, b, head // group), 0,
                      bx * block_M, seqlen_q,
                      TC.min(TC.max(CacheSeqlens[b], 0), table_w * page_size), causal, dtype,
                      block_M, block_N)

    return flash_attention_paged
