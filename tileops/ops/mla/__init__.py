"""MLA decode: `tileops.mla_decode(q, kv_cache, block_table, cache_seqlens)`."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from .kernels import D_LATENT
from .plan import MlaPlan
from .spec import MLA_DECODE, MlaDecodeSpec, MlaMetadata, MlaProblem, mla_metadata, reference


def _fake(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
          cache_seqlens: torch.Tensor, softmax_scale: float | None = None,
          head_dim_v: int = D_LATENT, validate: bool = False, metadata: list[int] | None = None,
          plan_parts: torch.Tensor | None = None, plan_seqs: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4 and kv_cache.dim() == 4, lambda: "mla_decode expects 4-D q, cache")
    B, s_q, h_q, _ = q.shape
    return (q.new_empty((B, s_q, h_q, head_dim_v)),
            q.new_empty((B, h_q, s_q), dtype=torch.float32))


def _impl(q, kv_cache, block_table, cache_seqlens, softmax_scale=None, head_dim_v=D_LATENT,
          validate=False, metadata=None, plan_parts=None, plan_seqs=None):
    if metadata is not None:
        plan = None if plan_parts is None else MlaPlan(plan_parts, plan_seqs)
        metadata = (*metadata, plan)
    return DISPATCHER(MLA_DECODE, q, kv_cache, block_table, cache_seqlens, softmax_scale,
                      head_dim_v, validate, metadata)


# The metadata crosses the custom op as its ints and its plan's two tensors.
_op = register(MLA_DECODE, "(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, "
               "float? softmax_scale=None, int head_dim_v=512, bool validate=False, "
               "int[]? metadata=None, Tensor? plan_parts=None, Tensor? plan_seqs=None) "
               "-> (Tensor, Tensor)", _fake, impl=_impl)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, *, softmax_scale: float | None = None,
               head_dim_v: int = D_LATENT, metadata: MlaMetadata | None = None,
               validate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache, in FlashMLA's convention.

    q: (batch, s_q, h_q, 576), 512 latent + 64 rope channels; h_q in {16, 32, 64, 128}, s_q 1 or
    2 (token t of s_q sees keys j < seqlen - (s_q - 1 - t)). kv_cache: (num_blocks, 64, 1, 576),
    contiguous, q's dtype; values are its first `head_dim_v` = 512 channels. block_table:
    (batch, max_blocks) int32 page ids; cache_seqlens: (batch,) int32. CUDA takes bfloat16 and
    float16, the CPU also float32. `softmax_scale` defaults to 576 ** -0.5, as FlashMLA's does
    (1 / sqrt of q's head dim; DeepSeek models pass their own). Returns out (batch, s_q, h_q, 512)
    in q's dtype and lse (batch, h_q, s_q) float32, the natural log-sum-exp of the scaled scores.

    `metadata` (`tileops.mla_metadata`, once per decode step) lets the call choose its kernel
    from shapes alone and carries the step's split-KV plan, balanced by keys over the SMs so that
    a batch of mixed lengths runs about as fast as a uniform one of the same total: no host
    synchronisation and no plan per call, so it can be captured in a CUDA graph. Without it the
    call reads `cache_seqlens.max()` back (one synchronisation), except inside CUDA-graph
    capture, where it takes 64 * max_blocks as the longest length instead, and makes the plan
    itself (a few small device ops). The result never depends on which: the kernels read the
    lengths on the device, and a sequence's last piece of the plan runs to its current length.

    Only what shapes, dtypes and devices tell is checked on the host by default. Table entries
    and lengths cost no check and cannot cause a read outside the cache: the kernels clamp each
    length into [0, 64 * max_blocks] and each page id a sequence uses into [0, num_blocks). A
    sequence shorter than s_q (even empty) gives its unseeing query rows zeros and a log-sum-exp
    of -inf, as in `flash_attention`; NaN inputs give NaN. `validate=True` is the strict mode:
    it reads the lengths and the used table entries back (a synchronisation; refused inside
    capture) and raises a ValueError for a length outside [s_q, 64 * max_blocks] or a page id
    outside the cache.
    """
    if torch.compiler.is_compiling():
        ints = None if metadata is None else list(metadata[:4])
        plan = metadata[4] if metadata is not None and len(metadata) > 4 else None
        return _op(q, kv_cache, block_table, cache_seqlens, softmax_scale, head_dim_v, validate,
                   ints, *(plan if plan is not None else (None, None)))
    return DISPATCHER(MLA_DECODE, q, kv_cache, block_table, cache_seqlens, softmax_scale,
                      head_dim_v, validate, metadata)


__all__ = ["MLA_DECODE", "MlaDecodeSpec", "MlaMetadata", "MlaPlan", "MlaProblem", "mla_decode",
           "mla_metadata", "reference"]
