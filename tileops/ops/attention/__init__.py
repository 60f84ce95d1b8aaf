"""FlashAttention forward: `tileops.flash_attention(q, k, v)`."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from .spec import ATTENTION, AttentionProblem, AttentionSpec


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
          softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: "flash_attention expects 4-D q, k, v")
    B, Sq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Sq), dtype=torch.float32)


_op = register(ATTENTION, "(Tensor q, Tensor k, Tensor v, bool causal=False, "
                          "float? softmax_scale=None) -> (Tensor, Tensor)", _fake)


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
    """
    if torch.compiler.is_compiling():
        out, lse = _op(q, k, v, causal, softmax_scale)
    else:
        out, lse = DISPATCHER(ATTENTION, q, k, v, causal, softmax_scale)
    return (out, lse) if return_lse else out


__all__ = ["ATTENTION", "AttentionProblem", "AttentionSpec", "flash_attention"]
