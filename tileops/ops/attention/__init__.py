"""FlashAttention: `tileops.flash_attention(q, k, v)` over a dense batch (differentiable: its
backward is the `attention_backward` operator), `tileops.flash_attention_varlen` over packed
sequences of different lengths and `tileops.flash_attention_with_kvcache` over a paged KV
cache."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from ...target import target_of
from .backward import ATTENTION_BACKWARD, AttentionBackwardSpec
from .paged import ATTENTION_PAGED, AttentionPagedSpec, PagedProblem
from .spec import ATTENTION, AttentionProblem, AttentionSpec
from .varlen import ATTENTION_VARLEN, AttentionVarlenSpec, VarlenProblem
from .varlen_backward import ATTENTION_VARLEN_BACKWARD, AttentionVarlenBackwardSpec


def _differentiated(spec, *tensors) -> bool:
    """Whether a call needs its graph: grad mode on, an input requiring grad, and a backward
    kernel for the device (elsewhere the forward's checks refuse such inputs)."""
    return (torch.is_grad_enabled()
            and any(getattr(t, "requires_grad", False) for t in tensors)
            and spec.unsupported_reason(target_of(tensors[0].device)) is None)


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
          softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: "flash_attention expects 4-D q, k, v")
    B, Sq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def _fake_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   grad_out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                   softmax_scale: float | None = None, grad_lse: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_backward_op = register(ATTENTION_BACKWARD,
                        "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, Tensor lse, "
                        "bool causal=False, float? softmax_scale=None, Tensor? grad_lse=None) "
                        "-> (Tensor, Tensor, Tensor)", _fake_backward)


def _setup(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale


def _grads(op, grad_out: torch.Tensor | None, out: torch.Tensor, before: tuple,
           after: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv through a backward operator's registered `op` (which dispatches its spec) on
    (*before, out, grad_out, *after). Always the op: AOT autograd traces a compiled backward with
    fake tensors, where some torch releases (2.11) report `torch.compiler.is_compiling()` False.
    A missing grad_out (only lse was used) is zeros."""
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
    return op(*before, out, grad_out, *after)


def _backward(ctx, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None):
    """dq, dk, dv through the `attention_backward` operator. The lse output is differentiable
    too (its gradient enters as dS = P (dP - Delta + grad_lse))."""
    q, k, v, out, lse = ctx.saved_tensors
    grads = _grads(_backward_op, grad_out, out, (q, k, v),
                   (lse, ctx.causal, ctx.softmax_scale, grad_lse))
    return (*grads, None, None)


_op = register(ATTENTION, "(Tensor q, Tensor k, Tensor v, bool causal=False, "
                          "float? softmax_scale=None) -> (Tensor, Tensor)", _fake,
               autograd=(_setup, _backward))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: float | None = None, return_lse: bool = False
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention (FlashAttention-2 forward) through the best known kernel.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_kv, heads_kv, head_dim), with
    heads_q a multiple of heads_kv (GQA; MQA when heads_kv = 1): query head h attends KV head
    h // (heads_q // heads_kv). head_dim 64, 128 or 256; float16 and bfloat16 on CUDA, also
    float32 on the CPU. Any sequence lengths; seqlen_q may differ from seqlen_kv.

    `causal` masks with the bottom-right alignment of FlashAttention 2/3: query i attends keys
    j <= i + seqlen_kv - seqlen_q. A query that sees no key (possible when seqlen_q > seqlen_kv)
    gets an output row of zeros and a log-sum-exp of -inf. `softmax_scale` defaults to
    1/sqrt(head_dim). Returns the output (batch, seqlen_q, heads_q, head_dim) in the input dtype,
    and with `return_lse` also the fp32 log-sum-exp of the scaled scores (batch, heads_q,
    seqlen_q).

    Differentiable: with q, k or v requiring grad (grad mode on) the call goes through the custom
    op, whose backward (dq, dk, dv, in the inputs' dtype; the lse's gradient included) is the
    tuned `attention_backward` kernel (sm_90 and the CPU), also under `torch.compile`.
    """
    if torch.compiler.is_compiling() or _differentiated(ATTENTION_BACKWARD, q, k, v):
        out, lse = _op(q, k, v, causal, softmax_scale)
    else:
        out, lse = DISPATCHER(ATTENTION, q, k, v, causal, softmax_scale)
    return (out, lse) if return_lse else out


def _fake_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 causal: bool = False, softmax_scale: float | None = None,
                 validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 3 and k.dim() == 3, lambda: "flash_attention_varlen expects 3-D q, k, v")
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _fake_varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor,
                          grad_out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                          softmax_scale: float | None = None,
                          grad_lse: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_varlen_backward_op = register(
    ATTENTION_VARLEN_BACKWARD,
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
    "int max_seqlen_k, Tensor out, Tensor grad_out, Tensor lse, bool causal=False, "
    "float? softmax_scale=None, Tensor? grad_lse=None) -> (Tensor, Tensor, Tensor)",
    _fake_varlen_backward)


def _setup_varlen(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, _ = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)
    ctx.sizes, ctx.causal, ctx.softmax_scale = (max_q, max_k), causal, softmax_scale


def _backward_varlen(ctx, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None):
    """dq, dk, dv through the `attention_varlen_backward` operator (the forward validated the
    offsets, or was told not to)."""
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    grads = _grads(_varlen_backward_op, grad_out, out,
                   (q, k, v, cu_q, cu_k, *ctx.sizes), (lse, ctx.causal, ctx.softmax_scale,
                                                       grad_lse))
    return (*grads, *(None,) * 7)


_varlen_op = register(ATTENTION_VARLEN,
                      "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                      "int max_seqlen_q, int max_seqlen_k, bool causal=False, "
                      "float? softmax_scale=None, bool validate=True) -> (Tensor, Tensor)",
                      _fake_varlen, autograd=(_setup_varlen, _backward_varlen))


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           validate: bool = True
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths, as flash-attn's
    `flash_attn_varlen_func`, through the best known kernel.

    q: (tokens_q, heads_q, head_dim), sequence i at rows cu_seqlens_q[i]:cu_seqlens_q[i + 1];
    k, v: (tokens_kv, heads_kv, head_dim) by cu_seqlens_k. The offsets are int32 tensors of
    batch + 1 entries, both on q's device or both on the CPU (a serving engine that builds them
    there saves the validation's read back), starting at 0; cu_seqlens_q must end at tokens_q (every
    output row belongs to a sequence), cu_seqlens_k at most at tokens_kv. max_seqlen_q and
    max_seqlen_k bound the lengths (they choose the tuning record). Heads, head_dim, dtypes,
    `causal` (bottom-right aligned in each sequence), `softmax_scale` and rows that see no key
    are as in `flash_attention`. CUDA needs sm_90.

    Returns the output like q and with `return_lse` the fp32 log-sum-exp (heads_q, tokens_q).
    Differentiable (eager and compiled): the backward is the `attention_varlen_backward`
    operator, on sm_90 for head_dim 64 and 128 and on the CPU.

    `validate` (the default) checks the offsets against the tensors and the max lengths and
    raises a ValueError naming the bad entry; offsets on the GPU are read back to the host for
    it, which waits for the GPU, offsets on the CPU are checked there and copied over without
    waiting. Inside CUDA-graph capture pass the offsets on the GPU and validate=False: the kernel
    clamps every offset to the tensors, so bad offsets give wrong rows but read and write nothing
    outside them.
    """
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
            softmax_scale, validate)
    if torch.compiler.is_compiling() or _differentiated(ATTENTION_VARLEN_BACKWARD, q, k, v):
        out, lse = _varlen_op(*args)
    else:
        out, lse = DISPATCHER(ATTENTION_VARLEN, *args)
    return (out, lse) if return_lse else out


def _fake_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor, causal: bool = True,
                softmax_scale: float | None = None, validate: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4, lambda: "flash_attention_with_kvcache expects 4-D q")
    B, Sq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Sq), dtype=torch.float32)


_paged_op = register(ATTENTION_PAGED,
                     "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
                     "Tensor block_table, bool causal=True, float? softmax_scale=None, "
                     "bool validate=True) -> (Tensor, Tensor)", _fake_paged)


def flash_attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
                                 causal: bool = True, softmax_scale: float | None = None,
                                 return_lse: bool = False, validate: bool = True
                                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries over a paged KV cache, as flash-attn's `flash_attn_with_kvcache`
    with a `block_table` (chunked prefill, decode), through the best known kernel.

    q: (batch, seqlen_q, heads_q, head_dim). k_cache, v_cache: (num_pages, page_size, heads_kv,
    head_dim), contiguous; sequence b's key j is row j % page_size of page
    block_table[b, j // page_size]. cache_seqlens: (batch,) int32 keys per sequence (the new
    tokens' keys already written); block_table: (batch, pages per sequence) int32; both on q's
    device or both on the CPU (checked there, no read back). On CUDA (sm_90)
    page_size is a multiple of 64. Heads, head_dim, dtypes, `softmax_scale` and rows that see no
    key are as in `flash_attention`; `causal` (the default, as chunked prefill needs) aligns the
    mask bottom-right: query i sees keys j <= i + cache_seqlens[b] - seqlen_q.

    Returns the output like q and with `return_lse` the fp32 log-sum-exp (batch, heads_q,
    seqlen_q). Cache rows past a sequence's length are never used, whatever they hold.

    `validate` (the default) checks every length against its table row and every page a
    sequence uses against the cache, with one read of them back to the host where they are on
    the GPU, and raises a ValueError naming the bad entry. Inside CUDA-graph capture pass them on
    the GPU and validate=False: the kernel
    clamps lengths and page ids, so bad ones give wrong rows but read and write nothing outside
    the tensors.
    """
    args = (q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, validate)
    if torch.compiler.is_compiling():
        out, lse = _paged_op(*args)
    else:
        out, lse = DISPATCHER(ATTENTION_PAGED, *args)
    return (out, lse) if return_lse else out


__all__ = ["ATTENTION", "ATTENTION_BACKWARD", "ATTENTION_PAGED", "ATTENTION_VARLEN",
           "ATTENTION_VARLEN_BACKWARD", "AttentionBackwardSpec", "AttentionPagedSpec",
           "AttentionProblem", "AttentionSpec", "AttentionVarlenBackwardSpec",
           "AttentionVarlenSpec", "PagedProblem", "VarlenProblem", "flash_attention",
           "flash_attention_varlen", "flash_attention_with_kvcache"]
