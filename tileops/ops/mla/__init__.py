"""MLA decode: `tileops.mla_decode(q, kv_cache, block_table, cache_seqlens)`."""

from __future__ import annotations

import torch

from ...dispatch import DISPATCHER
from ...library import register
from .kernels import D_LATENT
from .spec import MLA_DECODE, MlaDecodeSpec, MlaProblem, reference


def _fake(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
          cache_seqlens: torch.Tensor, softmax_scale: float | None = None,
          head_dim_v: int = D_LATENT, validate: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4 and kv_cache.dim() == 4, lambda: "mla_decode expects 4-D q, cache")
    B, s_q, h_q, _ = q.shape
    return (q.new_empty((B, s_q, h_q, head_dim_v)),
            q.new_empty((B, h_q, s_q), dtype=torch.float32))


_op = register(MLA_DECODE, "(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, "
               "float? softmax_scale=None, int head_dim_v=512, bool validate=True) "
               "-> (Tensor, Tensor)", _fake)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, *, softmax_scale: float | None = None,
               head_dim_v: int = D_LATENT, validate: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache, in FlashMLA's convention.

    q: (batch, s_q, h_q, 576), 512 latent + 64 rope channels; h_q in {16, 32, 64, 128}, s_q 1 or
    2 (token t of s_q sees keys j < seqlen - (s_q - 1 - t)). kv_cache: (num_blocks, 64, 1, 576),
    contiguous, q's dtype; values are its first `head_dim_v` = 512 channels. block_table:
    (batch, max_blocks) int32 page ids; cache_seqlens: (batch,) int32, s_q <= seqlen <=
    64 * max_blocks. CUDA takes bfloat16 and float16, the CPU also float32.
    `softmax_scale` defaults to 576 ** -0.5, as FlashMLA's does (1 / sqrt of q's head dim; DeepSeek
    models pass their own). Returns out (batch, s_q, h_q, 512) in q's dtype and lse
    (batch, h_q, s_q) float32, the natural log-sum-exp of the scaled scores.

    `validate=True` checks the lengths and every table entry a sequence uses against the cache
    (one reduction over the table, read back with the longest length the problem key needs
    anyway), so a bad table raises a ValueError instead of reading outside the cache.
    With `validate=False` a sequence may be shorter than s_q (even empty): a query row that sees
    no key gets zeros and a log-sum-exp of -inf, as in `flash_attention`; NaN inputs give NaN.
    """
    if torch.compiler.is_compiling():
        return _op(q, kv_cache, block_table, cache_seqlens, softmax_scale, head_dim_v, validate)
    return DISPATCHER(MLA_DECODE, q, kv_cache, block_table, cache_seqlens, softmax_scale,
                      head_dim_v, validate)


__all__ = ["MLA_DECODE", "MlaDecodeSpec", "MlaProblem", "mla_decode", "reference"]
