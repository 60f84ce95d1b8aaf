"""FlashAttention backward tile programs: dQ, dK and dV of O = softmax(Q K^T * scale + mask) V,
from the forward's output O and log-sum-exp (FlashAttention-2's algorithm).

Layout as in `kernels`: Q, O, dO and dQ (batch, seqlen_q, heads_q, head_dim), K, V, dK and dV
(batch, seqlen_kv, heads_kv, head_dim), LSE (batch, heads_q, seqlen_q) fp32; batch and both
lengths dynamic; the causal mask aligned bottom-right. `dLSE` is the gradient of the log-sum-exp
output (zeros when only O is used): dS = P (dP - Delta) with Delta = rowsum(dO * O) - dLSE.

A program runs three kernels in order:
1. for every query row, Delta and the log-sum-exp in log2 units into workspaces (batch, heads_q,
   rows) whose rows, `seqlen_q` rounded up to a multiple of 4, keep each head's row 16-byte
   aligned as TMA requires; and the fp32 dQ accumulator zeroed;
2. the main kernel. A program instance owns block_N keys of one KV head and keeps their dK and dV
   in registers while it walks the query blocks of every query head of its group (GQA needs no
   second reduction over heads). Per query block: S^T = K Q^T and dP^T = V dO^T; P^T =
   exp(S^T * scale - LSE), zero where the key is hidden; dV += P^T dO; dS^T = scale * P^T (dP^T -
   Delta); dK += dS^T Q. The block's dQ = dS K goes through shared memory into the accumulator
   with one TMA reduce-add (every KV block adds to it);
3. dQ, the accumulator in the input dtype.

The accumulator is (batch, heads_q, seqlen_q, head_dim), so that a query block's rows of one head
are one contiguous box for the reduce-add.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which
# refer to closure variables.
import tilelang.cpu.language as TC
import tilelang.language as T

from ..common import ACCUM, LOG2E, bits, from_f32, to_f32
from ..online_softmax import FAST_MATH  # noqa: F401 (FAST_MATH: spec.fast_math)
from .kernels import _at, _hold, _rows, _visible, consumer_nreg, ragged_bounds, zero_rows_past

DELTA_ROWS = 64  # query rows per program instance of the Delta and dQ kernels
# A packed sequence's statistics start at any row, but a TMA box must start 16 bytes into its
# row: the load starts at the 4-aligned row below and is this many rows longer, which also keeps
# each stage's shared copy 128-byte aligned.
STAT_PAD = 32


def _first_query(k0, block_M: int, seqlen_q, seqlen_kv, causal: bool):
    """The first query block that sees key k0: under the bottom-right mask query i sees key j
    when i >= j - (seqlen_kv - seqlen_q)."""
    if not causal:
        return 0
    return T.max(k0 - (seqlen_kv - seqlen_q), 0) // block_M


def _seen(query, key, seqlen_q, seqlen_kv, causal: bool):
    """Whether a (query, key) pair is inside the tensors and unmasked: the forward's `_visible`,
    for a query that is a row of the tensors (the backward's query blocks also run past them)."""
    return T.And(query < seqlen_q, _visible(query, key, seqlen_q, seqlen_kv, causal))


# The named barrier of the hand-scheduled consumers (TileLang's own barriers take the low ids).
_DS_BARRIER = 9


@T.macro
def _step(K_s, V_s, Q_s, dO_s, dS_s, dQ_s, lse, delta, lse_f, delta_f, S, dP, P, dS, dk, dv, dq,
          dq_rows, q0, k0, seqlen_q, seqlen_kv, causal: bool, scale: float, consumers: int,
          handoff: bool, shift=None):
    """One query block of the main kernel: the five products and dQ's reduce-add into dq_rows
    (the block's rows of the accumulator). `shift`: the block's first row in `lse` and `delta`
    (packed, `_kv_tile`), None where it is their first.

    `consumers` 0: each product waits for itself (TileLang's warp specialisation). Otherwise the
    `consumers` threads of `_ws_schedule` issue the products asynchronously: dP^T = V dO^T runs
    under P's exponentials, dV under dS's arithmetic, dK under dS's store. `handoff`: the
    producer issues dQ's reduce-add (`_ws_schedule`'s overlap 2)."""
    full = T.GemmWarpPolicy.FullRow
    gemm = T.wgmma_gemm if consumers else T.gemm
    with T.ws_op("s"):
        T.clear(S)
        gemm(K_s, Q_s, S, transpose_B=True, policy=full)
    with T.ws_op("dp"):
        T.clear(dP)
        gemm(V_s, dO_s, dP, transpose_B=True, policy=full)
    block_N, block_M = S.shape
    with T.ws_op("p"):
        if consumers:
            T.wait_wgmma(1)
        _stat_columns(lse, lse_f, shift)  # a column's value once per thread, not per element
        if _whole(q0, k0, block_M, block_N, seqlen_q, seqlen_kv, causal):
            for i, j in T.Parallel(block_N, block_M):
                S[i, j] = T.exp2(S[i, j] * (scale * LOG2E) - lse_f[j])
        else:
            # Selects, not products: a hidden pair's exp2 may be inf (LSE -inf: the query sees
            # no key) and the rows past the tensors hold whatever the loads left.
            for i, j in T.Parallel(block_N, block_M):
                S[i, j] = T.if_then_else(_seen(q0 + j, k0 + i, seqlen_q, seqlen_kv, causal),
                                         T.exp2(S[i, j] * (scale * LOG2E) - lse_f[j]), 0)
        T.copy(S, P)
    gemm(P, dO_s, dv, policy=full, annotations={T.WSID: "dv"})
    with T.ws_op("ds"):
        if consumers:
            T.wait_wgmma(1)
        _stat_columns(delta, delta_f, shift)
        if _whole(q0, k0, block_M, block_N, seqlen_q, seqlen_kv, causal):
            for i, j in T.Parallel(block_N, block_M):
                dS[i, j] = S[i, j] * (dP[i, j] - delta_f[j]) * scale
        else:
            for i, j in T.Parallel(block_N, block_M):
                dS[i, j] = T.if_then_else(_seen(q0 + j, k0 + i, seqlen_q, seqlen_kv, causal),
                                          S[i, j] * (dP[i, j] - delta_f[j]) * scale, 0)
    gemm(dS, Q_s, dk, policy=full, annotations={T.WSID: "dk"})
    with T.ws_op("store_ds"):
        # (TileLang puts a barrier of the consumers before these stores: the last step's dQ
        # product, which read dS_s, is done.)
        T.copy(dS, dS_s)
        if consumers:
            T.fence_proxy_async()  # the generic-proxy stores, before wgmma reads dS_s
            T.sync_threads(_DS_BARRIER, consumers)
    with T.ws_op("dq"):
        T.clear(dq)
        gemm(dS_s, K_s, dq, transpose_A=True)
        if consumers:
            T.wait_wgmma(0)
    with T.ws_op("store_dq"):
        if shift is not None and q0 + block_M > seqlen_q:
            # Packed: the accumulator's rows past the sequence are the next one's. Their dq is
            # 0 * K, NaN where this sequence's keys are, so it is zeroed rather than added.
            for i, d in T.Parallel(block_M, dq.shape[1]):
                if q0 + i >= seqlen_q:
                    dq[i, d] = 0
        T.copy(dq, dQ_s)
        if handoff:
            T.fence_proxy_async()  # the generic-proxy stores, before the producer's TMA reads
    T.atomic_add(dq_rows, dQ_s, use_tma=True, annotations={T.WSID: "reduce_dq"})


@T.macro
def _stat_columns(shared, columns, shift):
    """A block's statistics from shared memory into each thread's columns, from row `shift`."""
    if shift is None:
        T.copy(shared, columns)
    else:
        for j in T.Parallel(columns.shape[0]):
            columns[j] = shared[shift + j]


# The consumers' part of a step up to dQ's tile, in every hand schedule; packed, each of Q and dO
# has its rows past the sequence zeroed after its wait ("zero_q", "zero_do").
def _consumer_step(packed: bool) -> list:
    zero_q, zero_do = (["zero_q"], ["zero_do"]) if packed else ([], [])
    return [T.WSSync.consumer_wait("q"), *zero_q, "s", T.WSSync.consumer_wait("do"), *zero_do,
            "dp", "p", "dv", "ds", "dk", "store_ds", "dq", T.WSSync.consumer_release("q"),
            T.WSSync.consumer_release("do")]


def _ws_schedule(consumer_warps: int, buffers: tuple, num_stages: int, overlap: int,
                 packed: bool = False):
    """The main kernel warp-specialised by hand: a producer warp loads K and V once and each
    query block's Q, LSE, dO and Delta through `num_stages` buffers; each buffer goes back to it
    only after the wait that ends its last product (TileLang's automatic warp specialisation
    would release it before an asynchronous product's wait).

    `overlap` 2: the consumers only write each block's dQ tile into one of two buffers, and the
    producer issues its reduce-add a step later (and waits for it to leave shared memory), so
    that no consumer waits for the reduce. `packed`: both roles first read the tile's bounds,
    and the consumers zero the rows of K ("zero_k") and of each Q and dO block ("zero_q",
    "zero_do") that lie past the sequence."""
    K_s, V_s, Q_s, dO_s, _, dQ_s, lse, delta = buffers[:8]
    consumer_step = _consumer_step(packed)
    if overlap == 2:
        steps = {"Producer": [T.WSSync.producer_acquire("q"), "load_q", "load_lse",
                              T.WSSync.producer_commit("q"), T.WSSync.producer_acquire("do"),
                              "load_do", "load_delta", T.WSSync.producer_commit("do"),
                              T.WSSync.consumer_wait("dq", stage=1), "reduce_dq",
                              T.WSSync.consumer_release("dq", stage=1)],
                 "Consumer": [*consumer_step, T.WSSync.producer_acquire("dq"), "store_dq",
                              T.WSSync.producer_commit("dq")]}
        handoff = [T.WSPipeline("dq", [dQ_s], depth=2)]
    else:
        steps = {"Producer": [T.WSSync.producer_acquire("q"), "load_q", "load_lse",
                              T.WSSync.producer_commit("q"), T.WSSync.producer_acquire("do"),
                              "load_do", "load_delta", T.WSSync.producer_commit("do")],
                 "Consumer": [*consumer_step, "store_dq", "reduce_dq"]}
        handoff = []
    bounds = ["bounds"] if packed else []
    return T.WSSchedule(
        num_warps=4 + consumer_warps,
        roles=[T.WSRole("Producer", warps_lo=0, warps_hi=1, max_nreg=24),
               T.WSRole("Consumer", warps_lo=4, warps_hi=4 + consumer_warps,
                        max_nreg=consumer_nreg(consumer_warps * 32))],
        pipelines=[T.WSPipeline("kv", [K_s, V_s], depth=1),
                   T.WSPipeline("q", [Q_s, lse], depth=num_stages),
                   T.WSPipeline("do", [dO_s, delta], depth=num_stages), *handoff],
        scopes=[
            T.WSScope("steps", steps),
            T.WSScope(T.WSScope.ROOT, {
                "Producer": [*bounds, T.WSSync.producer_acquire("kv"), "load_k", "load_v",
                             T.WSSync.producer_commit("kv"), "steps"],
                "Consumer": [*bounds, "init", T.WSSync.consumer_wait("kv"),
                             *(["zero_k"] if packed else []), "steps", "final",
                             T.WSSync.consumer_release("kv")],
            }),
        ])


def _whole(q0, k0, block_M: int, block_N: int, seqlen_q, seqlen_kv, causal: bool):
    """Whether every (query, key) pair of a block is inside the tensors and unmasked."""
    inside = T.And(q0 + block_M <= seqlen_q, k0 + block_N <= seqlen_kv)
    if causal:  # the block's first query sees its last key
        return T.And(inside, k0 + block_N - 1 <= q0 + seqlen_kv - seqlen_q)
    return inside


def _dense_shapes(lang, heads_q: int, heads_kv: int, D: int) -> tuple:
    """The dense programs' tensor shapes, batch and both lengths dynamic (`lang`: T or TC): q
    (and o, do, dq), k (and v, dk, dv), the lse rows, the statistics' workspaces (rows >=
    seqlen_q: `rows`, 16-byte aligned by the caller) and the dQ accumulator."""
    batch, seqlen_q, seqlen_kv = (lang.dynamic(n) for n in ("batch", "seqlen_q", "seqlen_kv"))
    return ((batch, seqlen_q, heads_q, D), (batch, seqlen_kv, heads_kv, D),
            (batch, heads_q, seqlen_q), (batch, heads_q, lang.dynamic("rows")),
            (batch, heads_q, seqlen_q, D))


def _stat_rows(buf, b, head, start, stop):
    """Rows start:stop of one head's statistics (LSE2, Delta): (batch, heads, rows) dense,
    (heads, rows) packed (b None)."""
    return buf[head, start:stop] if b is None else buf[b, head, start:stop]


def _acc_rows(buf, b, head, start, stop):
    """Rows start:stop of one head of the dQ accumulator: (batch, heads, rows, head_dim) dense,
    (heads, rows, head_dim) packed (b None)."""
    return buf[head, start:stop, :] if b is None else buf[b, head, start:stop, :]


@T.macro
def _row_stats(O, dO, LSE, dLSE, LSE2, Delta, dQ_acc, b, head, r0, seqlen_q, dtype: str):
    """The first kernel's work for DELTA_ROWS query rows of one head from r0: Delta and the
    log2 log-sum-exp into the workspaces, the rows of the dQ accumulator zeroed."""
    D = O.shape[-1]
    o = T.alloc_fragment((DELTA_ROWS, D), dtype)
    do = T.alloc_fragment((DELTA_ROWS, D), dtype)
    prod = T.alloc_fragment((DELTA_ROWS, D), ACCUM)
    delta = T.alloc_fragment((DELTA_ROWS,), ACCUM)
    T.copy(_rows(O, b, r0, r0 + DELTA_ROWS, head), o)
    T.copy(_rows(dO, b, r0, r0 + DELTA_ROWS, head), do)
    for i, d in T.Parallel(DELTA_ROWS, D):
        prod[i, d] = T.cast(o[i, d], ACCUM) * T.cast(do[i, d], ACCUM)
    T.reduce_sum(prod, delta, dim=1)
    for i in T.Parallel(DELTA_ROWS):
        if r0 + i < seqlen_q:
            if b is None:
                Delta[head, r0 + i] = delta[i] - dLSE[head, r0 + i]
                LSE2[head, r0 + i] = LSE[head, r0 + i] * LOG2E
            else:
                Delta[b, head, r0 + i] = delta[i] - dLSE[b, head, r0 + i]
                LSE2[b, head, r0 + i] = LSE[b, head, r0 + i] * LOG2E
    T.clear(prod)
    T.copy(prod, _acc_rows(dQ_acc, b, head, r0, r0 + DELTA_ROWS))


@T.macro
def _dq_rows_out(dQ_acc, dQ, b, head, r0, dtype: str):
    """The last kernel's work: DELTA_ROWS rows of one head's dQ from the accumulator."""
    acc = T.alloc_fragment((DELTA_ROWS, dQ.shape[-1]), ACCUM)
    out = T.alloc_fragment((DELTA_ROWS, dQ.shape[-1]), dtype)
    T.copy(_acc_rows(dQ_acc, b, head, r0, r0 + DELTA_ROWS), acc)
    T.copy(acc, out)
    T.copy(out, _rows(dQ, b, r0, r0 + DELTA_ROWS, head))


def _main_buffers(block_M: int, block_N: int, D: int, dtype: str, stat_pad: int = 0) -> tuple:
    """The main kernel's buffers. Shared: K, V, Q, dO, dS^T, dQ's fp32 tile, LSE, Delta (each
    `stat_pad` rows longer: STAT_PAD packed). Registers: S^T (then P^T), dP^T, P^T and dS^T in the
    dtype, the dK, dV and dQ accumulators, and a thread's LSE and Delta columns."""
    return (T.alloc_shared((block_N, D), dtype), T.alloc_shared((block_N, D), dtype),
            T.alloc_shared((block_M, D), dtype), T.alloc_shared((block_M, D), dtype),
            T.alloc_shared((block_N, block_M), dtype), T.alloc_shared((block_M, D), ACCUM),
            T.alloc_shared((block_M + stat_pad,), ACCUM),
            T.alloc_shared((block_M + stat_pad,), ACCUM),
            T.alloc_fragment((block_N, block_M), ACCUM),
            T.alloc_fragment((block_N, block_M), ACCUM),
            T.alloc_fragment((block_N, block_M), dtype), T.alloc_fragment((block_N, block_M), dtype),
            T.alloc_fragment((block_N, D), ACCUM), T.alloc_fragment((block_N, D), ACCUM),
            T.alloc_fragment((block_M, D), ACCUM), T.alloc_fragment((block_M,), ACCUM),
            T.alloc_fragment((block_M,), ACCUM))


@T.macro
def _kv_tile(Q, K, V, dO, LSE2, Delta, dQ_acc, dK, dV, buffers, b, kv_head, q_row0, kv_row0, k0,
             first, steps, seqlen_q, seqlen_kv, causal: bool, scale: float, group: int,
             num_stages: int, consumers: int, overlap: int):
    """The main kernel's work for keys k0:k0 + block_N of one KV head: their dK and dV over
    `steps` query blocks from block `first` of each of the group's query heads, each block's dQ
    reduce-added into the accumulator. A dense batch entry b, or a packed sequence (b None) whose
    query and key rows start at q_row0 and kv_row0; `consumers`: the hand schedule's consumer
    threads, 0 for TileLang's own (overlap 0, dense only).

    Packed, a tile's rows past the sequence are the next sequence's, not the zeros TMA reads past
    a tensor: the consumers zero them in K (once) and in Q and dO (the sequence's last query
    block) before any product reads them, since 0 * NaN would carry a neighbour's NaN into dK, dV
    or dQ; and dK and dV are stored row by row, only the sequence's own."""
    (K_s, V_s, Q_s, dO_s, dS_s, dQ_s, lse, delta, S, dP, P, dS, dk, dv, dq, lse_f,
     delta_f) = buffers
    block_M = Q_s.shape[0]
    # Packed: statistics from the 16-byte-aligned row at or below q_row0 (STAT_PAD).
    shift = q_row0 % (16 // 4) if b is None else None
    stat0 = q_row0 if shift is None else q_row0 - shift
    T.copy(_rows(K, b, kv_row0 + k0, kv_row0 + k0 + K_s.shape[0], kv_head), K_s,
           annotations={T.WSID: "load_k"})
    T.copy(_rows(V, b, kv_row0 + k0, kv_row0 + k0 + K_s.shape[0], kv_head), V_s,
           annotations={T.WSID: "load_v"})
    with T.ws_op("init"):
        T.clear(dk)
        T.clear(dv)
    if b is None:
        with T.ws_op("zero_k"):
            zero_rows_past(K_s, k0, seqlen_kv, consumers)
    for it in T.Pipelined(group * steps, num_stages=num_stages, annotations={T.WSID: "steps"}):
        q_head = kv_head * group + it // steps
        q0 = (first + it % steps) * block_M
        T.copy(_rows(Q, b, q_row0 + q0, q_row0 + q0 + block_M, q_head), Q_s,
               annotations={T.WSID: "load_q"})
        T.copy(_stat_rows(LSE2, b, q_head, stat0 + q0, stat0 + q0 + lse.shape[0]), lse,
               annotations={T.WSID: "load_lse"})
        T.copy(_rows(dO, b, q_row0 + q0, q_row0 + q0 + block_M, q_head), dO_s,
               annotations={T.WSID: "load_do"})
        T.copy(_stat_rows(Delta, b, q_head, stat0 + q0, stat0 + q0 + delta.shape[0]), delta,
               annotations={T.WSID: "load_delta"})
        if b is None:
            with T.ws_op("zero_q"):
                zero_rows_past(Q_s, q0, seqlen_q, consumers)
            with T.ws_op("zero_do"):
                zero_rows_past(dO_s, q0, seqlen_q, consumers)
        _step(K_s, V_s, Q_s, dO_s, dS_s, dQ_s, lse, delta, lse_f, delta_f, S, dP, P, dS, dk, dv,
              dq, _acc_rows(dQ_acc, b, q_head, q_row0 + q0, q_row0 + q0 + block_M), q0, k0,
              seqlen_q, seqlen_kv, causal, scale, consumers, overlap == 2, shift)
    with T.ws_op("final"):
        # K and V are read no more: their tiles stage dK and dV for the stores.
        T.copy(dk, K_s)
        T.copy(dv, V_s)
        if b is None:
            for i, d in T.Parallel(K_s.shape[0], K_s.shape[1]):
                if k0 + i < seqlen_kv:
                    dK[kv_row0 + k0 + i, kv_head, d] = K_s[i, d]
                    dV[kv_row0 + k0 + i, kv_head, d] = V_s[i, d]
        else:
            T.copy(K_s, dK[b, k0:k0 + K_s.shape[0], kv_head, :])
            T.copy(V_s, dV[b, k0:k0 + K_s.shape[0], kv_head, :])


def gpu_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                block_M: int, block_N: int, num_stages: int, threads: int, overlap: int = 0):
    """The GPU program: wgmma for the five products on sm_90a, the query-block loads (Q, dO, LSE,
    Delta) pipelined over `num_stages` buffers, the dQ reduce-add through TMA; `overlap` 1
    warp-specialised by hand with asynchronous products, 2 with dQ's reduce-add handed to the
    producer (`_ws_schedule`)."""
    group = heads_q // heads_kv
    D = head_dim
    scale = D ** -0.5
    q_shape, kv_shape, rows, stats, acc_shape = _dense_shapes(T, heads_q, heads_kv, D)
    batch, seqlen_q, _, _ = q_shape
    seqlen_kv = kv_shape[1]

    @T.prim_func
    def attention_backward(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                           V: T.Tensor(kv_shape, dtype), O: T.Tensor(q_shape, dtype),
                           dO: T.Tensor(q_shape, dtype), LSE: T.Tensor(rows, ACCUM),
                           dLSE: T.Tensor(rows, ACCUM), LSE2: T.Tensor(stats, ACCUM),
                           Delta: T.Tensor(stats, ACCUM), dQ_acc: T.Tensor(acc_shape, ACCUM),
                           dQ: T.Tensor(q_shape, dtype), dK: T.Tensor(kv_shape, dtype),
                           dV: T.Tensor(kv_shape, dtype)):
        with T.Kernel(T.ceildiv(seqlen_q, DELTA_ROWS), heads_q, batch, threads=128) as (
                bx, head, b):
            r0 = bx * DELTA_ROWS
            _row_stats(O, dO, LSE, dLSE, LSE2, Delta, dQ_acc, b, head, r0, seqlen_q, dtype)

        with T.Kernel(T.ceildiv(seqlen_kv, block_N), heads_kv, batch, threads=threads) as (
                bx, kv_head, b):
            buffers = _main_buffers(block_M, block_N, D, dtype)
            if overlap:
                T.annotate_ws_schedule(_ws_schedule(threads // 32, buffers, num_stages, overlap))
            k0 = bx * block_N
            first = _first_query(k0, block_M, seqlen_q, seqlen_kv, causal)
            steps = T.ceildiv(seqlen_q, block_M) - first  # >= 1: the last query sees every key
            _kv_tile(Q, K, V, dO, LSE2, Delta, dQ_acc, dK, dV, buffers, b, kv_head, 0, 0, k0,
                     first, steps, seqlen_q, seqlen_kv, causal, scale, group, num_stages,
                     threads if overlap else 0, overlap)

        with T.Kernel(T.ceildiv(seqlen_q, DELTA_ROWS), heads_q, batch, threads=128) as (
                bx, head, b):
            r0 = bx * DELTA_ROWS
            _dq_rows_out(dQ_acc, dQ, b, head, r0, dtype)

    return attention_backward


def ragged_gpu_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                       block_M: int, block_N: int, num_stages: int, threads: int,
                       overlap: int = 2):
    """`gpu_program` over a packed batch (`cpu_ragged_program`'s layout), its main kernel run
    over `Tiles`, the (sequence, KV block) list of `varlen.tile_list(..., keys=True)`: each
    entry's KV heads are one after another in the grid, a head's entries adjacent (they read the
    same query rows). Offsets are clamped into the tensors as the forward clamps them; an entry
    past its sequence (or of a sequence without queries) runs one masked query block and stores
    nothing, or zeros. A fourth kernel zeroes dK and dV of the key rows after the last sequence.
    The hand schedules only (`overlap` 1 or 2): the zeroing of rows past a sequence is a step of
    theirs."""
    tokens_q, tokens_kv = T.dynamic("tokens_q"), T.dynamic("tokens_kv")
    n_offsets, n_entries = T.dynamic("n_offsets"), T.dynamic("n_entries")
    group = heads_q // heads_kv
    D = head_dim
    scale = D ** -0.5
    q_shape = (tokens_q, heads_q, D)
    kv_shape = (tokens_kv, heads_kv, D)
    rows = (heads_q, tokens_q)
    stats = (heads_q, T.dynamic("rows"))

    @T.prim_func
    def attention_varlen_backward(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
            V: T.Tensor(kv_shape, dtype), CuQ: T.Tensor((n_offsets,), "int32"),
            CuKV: T.Tensor((n_offsets,), "int32"), Tiles: T.Tensor((n_entries, 2), "int32"),
            O: T.Tensor(q_shape, dtype), dO: T.Tensor(q_shape, dtype),
            LSE: T.Tensor(rows, ACCUM), dLSE: T.Tensor(rows, ACCUM),
            LSE2: T.Tensor(stats, ACCUM), Delta: T.Tensor(stats, ACCUM),
            dQ_acc: T.Tensor((heads_q, tokens_q, D), ACCUM), dQ: T.Tensor(q_shape, dtype),
            dK: T.Tensor(kv_shape, dtype), dV: T.Tensor(kv_shape, dtype)):
        with T.Kernel(T.ceildiv(tokens_q, DELTA_ROWS), heads_q, threads=128) as (bx, head):
            _row_stats(O, dO, LSE, dLSE, LSE2, Delta, dQ_acc, None, head, bx * DELTA_ROWS,
                       tokens_q, dtype)

        with T.Kernel(T.ceildiv(tokens_kv, DELTA_ROWS), heads_kv, threads=128) as (bx, head):
            end = T.min(T.max(CuKV[n_offsets - 1], 0), tokens_kv)
            for i, d in T.Parallel(DELTA_ROWS, D):
                if T.And(bx * DELTA_ROWS + i >= end, bx * DELTA_ROWS + i < tokens_kv):
                    dK[bx * DELTA_ROWS + i, head, d] = T.cast(0, dtype)
                    dV[bx * DELTA_ROWS + i, head, d] = T.cast(0, dtype)

        with T.Kernel(n_entries * heads_kv, threads=threads) as item:
            buffers = _main_buffers(block_M, block_N, D, dtype, STAT_PAD)
            T.annotate_ws_schedule(_ws_schedule(threads // 32, buffers, num_stages, overlap,
                                                packed=True))
            # the tile's bounds in registers, as the forward holds them (`kernels._hold`)
            at = T.alloc_local((8,), "int32")
            with T.ws_op("bounds"):
                entry = item % n_entries
                kv_head = item // n_entries
                seq, k0, q_row0, seqlen_q, kv_row0, seqlen_kv = ragged_bounds(
                    at, Tiles, entry, block_N, CuQ, CuKV, tokens_q, tokens_kv)
                first = _hold(at, 6, T.if_then_else(
                    k0 < seqlen_kv, _first_query(k0, block_M, seqlen_q, seqlen_kv, causal), 0))
                # One masked block for an entry past its sequence or a sequence without queries;
                # the max keeps the count visibly positive (the pipeliner's first iteration is
                # then unconditional, and ptxas keeps the wgmmas asynchronous).
                steps = T.max(_hold(at, 7, T.if_then_else(
                    k0 < seqlen_kv, T.ceildiv(seqlen_q, block_M) - first, 1)), 1)
            _kv_tile(Q, K, V, dO, LSE2, Delta, dQ_acc, dK, dV, buffers, None, kv_head, q_row0,
                     kv_row0, k0, first, steps, seqlen_q, seqlen_kv, causal, scale, group,
                     num_stages, threads, overlap)

        with T.Kernel(T.ceildiv(tokens_q, DELTA_ROWS), heads_q, threads=128) as (bx, head):
            _dq_rows_out(dQ_acc, dQ, None, head, bx * DELTA_ROWS, dtype)

    return attention_varlen_backward


def _stat(buf, b, head, row):
    """Row `row` of one head's statistics (LSE2, Delta): (batch, heads, rows) dense, (heads,
    rows) packed (b None)."""
    return buf[head, row] if b is None else buf[b, head, row]


@TC.macro
def _cpu_kv_block(Q, K, V, dO, LSE2, Delta, dQ_acc, dK, dV, b, kv_head, q_row0, kv_row0, k0,
                  seqlen_q, seqlen_kv, causal: bool, dtype: str, block_M: int, block_N: int,
                  group: int):
    """The CPU main kernel's work for keys k0:k0 + block_N of one KV head: their dK and dV over
    the query blocks of the group's query heads, and those blocks' dQ added into dQ_acc. A dense
    batch entry b, or a packed sequence (b None) whose query and key rows start at q_row0 and
    kv_row0."""
    D = Q.shape[-1]
    scale = D ** -0.5
    k = TC.alloc_local((block_N, D), ACCUM)
    v = TC.alloc_local((block_N, D), ACCUM)
    dk = TC.alloc_local((block_N, D), ACCUM)
    dv = TC.alloc_local((block_N, D), ACCUM)
    q = TC.alloc_local((block_M, D), ACCUM)
    do = TC.alloc_local((block_M, D), ACCUM)
    p = TC.alloc_local((block_N, block_M), ACCUM)
    ds = TC.alloc_local((block_N, block_M), ACCUM)
    for i, d in TC.grid(block_N, D):
        k[i, d] = TC.if_then_else(k0 + i < seqlen_kv,
                                  to_f32(_at(K, b, kv_row0 + k0 + i, kv_head, d), dtype), 0.0)
        v[i, d] = TC.if_then_else(k0 + i < seqlen_kv,
                                  to_f32(_at(V, b, kv_row0 + k0 + i, kv_head, d), dtype), 0.0)
        dk[i, d] = 0.0
        dv[i, d] = 0.0
    first = _first_query(k0, block_M, seqlen_q, seqlen_kv, causal)
    for g, qb in TC.grid(group, TC.ceildiv(seqlen_q, block_M) - first):
        q_head = kv_head * group + g
        q0 = (first + qb) * block_M
        for j, d in TC.grid(block_M, D):
            q[j, d] = TC.if_then_else(q0 + j < seqlen_q,
                                      to_f32(_at(Q, b, q_row0 + q0 + j, q_head, d), dtype), 0.0)
            do[j, d] = TC.if_then_else(q0 + j < seqlen_q,
                                       to_f32(_at(dO, b, q_row0 + q0 + j, q_head, d), dtype), 0.0)
        for i, j in TC.grid(block_N, block_M):
            if _seen(q0 + j, k0 + i, seqlen_q, seqlen_kv, causal):
                p[i, j] = 0.0
                ds[i, j] = 0.0
                for d in TC.serial(D):
                    p[i, j] += k[i, d] * q[j, d]
                    ds[i, j] += v[i, d] * do[j, d]  # dP^T until the line below
                p[i, j] = TC.exp2(p[i, j] * (scale * LOG2E)
                                  - _stat(LSE2, b, q_head, q_row0 + q0 + j))
                ds[i, j] = p[i, j] * (ds[i, j] - _stat(Delta, b, q_head, q_row0 + q0 + j)) * scale
            else:
                p[i, j] = 0.0
                ds[i, j] = 0.0
        for i, j, d in TC.grid(block_N, block_M, D):
            dv[i, d] += p[i, j] * do[j, d]
            dk[i, d] += ds[i, j] * q[j, d]
        for j, i, d in TC.grid(block_M, block_N, D):
            if q0 + j < seqlen_q:
                if b is None:
                    dQ_acc[q_head, q_row0 + q0 + j, d] += ds[i, j] * k[i, d]
                else:
                    dQ_acc[b, q_head, q0 + j, d] += ds[i, j] * k[i, d]
    for i, d in TC.grid(block_N, D):
        if k0 + i < seqlen_kv:
            if b is None:
                dK[kv_row0 + k0 + i, kv_head, d] = from_f32(dk[i, d], dtype)
                dV[kv_row0 + k0 + i, kv_head, d] = from_f32(dv[i, d], dtype)
            else:
                dK[b, k0 + i, kv_head, d] = from_f32(dk[i, d], dtype)
                dV[b, k0 + i, kv_head, d] = from_f32(dv[i, d], dtype)


def cpu_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                block_M: int, block_N: int):
    """The CPU form of the same three kernels for TileLang's C target: fp32 local tiles, scalar
    loops for the products. The C target runs a kernel's instances one after another, so dQ is
    accumulated with plain adds."""
    group = heads_q // heads_kv
    D = head_dim
    q_shape, kv_shape, rows, stats, acc_shape = _dense_shapes(TC, heads_q, heads_kv, D)
    batch, seqlen_q, _, _ = q_shape
    seqlen_kv = kv_shape[1]
    io = bits(dtype)

    @TC.prim_func
    def attention_backward(Q: TC.Tensor(q_shape, io), K: TC.Tensor(kv_shape, io),
                           V: TC.Tensor(kv_shape, io), O: TC.Tensor(q_shape, io),
                           dO: TC.Tensor(q_shape, io), LSE: TC.Tensor(rows, ACCUM),
                           dLSE: TC.Tensor(rows, ACCUM), LSE2: TC.Tensor(stats, ACCUM),
                           Delta: TC.Tensor(stats, ACCUM), dQ_acc: TC.Tensor(acc_shape, ACCUM),
                           dQ: TC.Tensor(q_shape, io), dK: TC.Tensor(kv_shape, io),
                           dV: TC.Tensor(kv_shape, io)):
        with TC.Kernel(seqlen_q, heads_q, batch) as (row, head, b):
            _cpu_row_stats(O, dO, LSE, dLSE, LSE2, Delta, dQ_acc, b, head, row, dtype)
        with TC.Kernel(TC.ceildiv(seqlen_kv, block_N), heads_kv, batch) as (bx, kv_head, b):
            _cpu_kv_block(Q, K, V, dO, LSE2, Delta, dQ_acc, dK, dV, b, kv_head, 0, 0,
                          bx * block_N, seqlen_q, seqlen_kv, causal, dtype, block_M, block_N,
                          group)
        with TC.Kernel(seqlen_q, heads_q, batch) as (row, head, b):
            for d in TC.serial(D):
                dQ[b, row, head, d] = from_f32(dQ_acc[b, head, row, d], dtype)

    return attention_backward


@TC.macro
def _cpu_row_stats(O, dO, LSE, dLSE, LSE2, Delta, dQ_acc, b, head, row, dtype: str):
    """The first kernel's work for one query row: Delta, the log2 log-sum-exp, dQ_acc zeroed."""
    total = TC.alloc_local((1,), ACCUM)
    total[0] = 0.0
    for d in TC.serial(O.shape[-1]):
        total[0] += to_f32(_at(O, b, row, head, d), dtype) * to_f32(_at(dO, b, row, head, d),
                                                                    dtype)
        if b is None:
            dQ_acc[head, row, d] = 0.0
        else:
            dQ_acc[b, head, row, d] = 0.0
    if b is None:
        Delta[head, row] = total[0] - dLSE[head, row]
        LSE2[head, row] = LSE[head, row] * LOG2E
    else:
        Delta[b, head, row] = total[0] - dLSE[b, head, row]
        LSE2[b, head, row] = LSE[b, head, row] * LOG2E


def cpu_ragged_program(heads_q: int, heads_kv: int, head_dim: int, causal: bool, dtype: str, *,
                       block_M: int, block_N: int):
    """`cpu_program` over a packed batch (`kernels.ragged_program`'s layout: q, out, grad_out and
    dq (tokens_q, heads_q, head_dim), k, v, dk, dv (tokens_kv, heads_kv, head_dim), LSE and dLSE
    (heads_q, tokens_q), the workspaces without a batch dimension), sequence i at rows
    CuQ[i]:CuQ[i + 1] and CuKV[i]:CuKV[i + 1], each offset clamped into the tensors as the
    forward clamps it. The main kernel runs the (sequence, KV block) entries of `Tiles` as
    `ragged_gpu_program` does, so the list is checked wherever this runs. Key rows no sequence
    holds get zero gradients."""
    tokens_q, tokens_kv = TC.dynamic("tokens_q"), TC.dynamic("tokens_kv")
    n_offsets, n_entries = TC.dynamic("n_offsets"), TC.dynamic("n_entries")
    group = heads_q // heads_kv
    D = head_dim
    q_shape = (tokens_q, heads_q, D)
    kv_shape = (tokens_kv, heads_kv, D)
    rows = (heads_q, tokens_q)
    stats = (heads_q, TC.dynamic("rows"))
    io = bits(dtype)

    @TC.prim_func
    def attention_varlen_backward(
            Q: TC.Tensor(q_shape, io), K: TC.Tensor(kv_shape, io), V: TC.Tensor(kv_shape, io),
            CuQ: TC.Tensor((n_offsets,), "int32"), CuKV: TC.Tensor((n_offsets,), "int32"),
            Tiles: TC.Tensor((n_entries, 2), "int32"), O: TC.Tensor(q_shape, io),
            dO: TC.Tensor(q_shape, io), LSE: TC.Tensor(rows, ACCUM),
            dLSE: TC.Tensor(rows, ACCUM), LSE2: TC.Tensor(stats, ACCUM),
            Delta: TC.Tensor(stats, ACCUM), dQ_acc: TC.Tensor((heads_q, tokens_q, D), ACCUM),
            dQ: TC.Tensor(q_shape, io), dK: TC.Tensor(kv_shape, io),
            dV: TC.Tensor(kv_shape, io)):
        with TC.Kernel(tokens_q, heads_q) as (row, head):
            _cpu_row_stats(O, dO, LSE, dLSE, LSE2, Delta, dQ_acc, None, head, row, dtype)
        with TC.Kernel(tokens_kv, heads_kv) as (row, kv_head):
            for d in TC.serial(D):  # +0.0 is all zero bits in each dtype (bf16 too)
                dK[row, kv_head, d] = TC.cast(0, io)
                dV[row, kv_head, d] = TC.cast(0, io)
        with TC.Kernel(n_entries, heads_kv) as (entry, kv_head):
            seq = Tiles[entry, 0]
            k0 = Tiles[entry, 1] * block_N
            q_row0 = TC.min(CuQ[seq], tokens_q)
            kv_row0 = TC.min(CuKV[seq], tokens_kv)
            len_q = TC.min(TC.max(CuQ[seq + 1], q_row0), tokens_q) - q_row0
            len_kv = TC.min(TC.max(CuKV[seq + 1], kv_row0), tokens_kv) - kv_row0
            if k0 < len_kv:
                _cpu_kv_block(Q, K, V, dO, LSE2, Delta, dQ_acc, dK, dV, None, kv_head, q_row0,
                              kv_row0, k0, len_q, len_kv, causal, dtype, block_M, block_N, group)
        with TC.Kernel(tokens_q, heads_q) as (row, head):
            for d in TC.serial(D):
                dQ[row, head, d] = from_f32(dQ_acc[head, row, d], dtype)

    return attention_varlen_backward
