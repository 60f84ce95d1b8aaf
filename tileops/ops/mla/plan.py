"""The split-KV plan balanced by keys: which key blocks of which sequences each CTA takes.

A batch's key blocks (64 keys each) are laid on one line, sequence after sequence, each sequence
charged `FIXED` blocks more for what every piece of work costs beside its blocks (loading Q,
storing the output, combining). The line is cut into `n_parts` parts of `payload` blocks each (at
least `MIN_PAYLOAD`, so that a short batch is not spread over more parts than its blocks pay for),
and part p is one CTA per row tile: it walks the pieces of sequences (segments) its range holds.
Spans and payloads are whole pairs of blocks, so a cut never splits the pair the seesaw takes at
a time (aligned cuts ran ragged batches 0.3-5% faster on the H200). A ragged batch so costs about
what a uniform batch of the same total keys does, where splitting every sequence alike leaves
the CTAs of the short ones idle.

A batch whose sequences all have the same number of blocks is cut where the sequences are, if
that costs at most FIXED blocks more a part: each part takes whole sequences, or each sequence is
split into equal pieces of whole pairs (its line span padded to a whole number of parts). Cut
where the balance alone puts the boundaries, they would drift across the sequences (64 of 66
blocks at batch 64 and 4096 keys on 66 parts) and split every one, and merging the pieces costs
more than the balance gains (benchmarks/NOTES.md).

Sequence b holds the blocks of line positions [cum_b, cum_b + n_b), parts first_b ... last_b
(first_b = cum_b // payload); an empty sequence is one segment of part first_b, which writes its
zeros. A sequence in one segment is written by it directly; a split one writes a partial per
segment into slots base_b ... base_b + count_b - 1 (at most batch + n_parts slots in all), merged
by the combine kernel.

The plan is made on the device from `cache_seqlens` by a few torch ops, with no read back to the
host (so inside CUDA-graph capture too), once per decode step (`mla_metadata`) or by a call that
is given none. The kernels trust it only for the balance: they clamp every index it holds, and a
sequence's last segment runs to the sequence's length as the kernel reads it, so lengths that
changed since the plan was made are still attended to in full (`kernels.segment`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels import PAGE

FIXED = 2  # blocks' worth of cost per sequence beside its key blocks
MIN_PAYLOAD = 2  # blocks per part at least (a pair): a short batch takes fewer parts


class MlaPlan(NamedTuple):
    """`parts` (n_parts, 4) int32: each part's first and last sequence, the payload and the
    number of split sequences; `seqs` (batch, 5) int32: each sequence's line position, first
    slot, first part and number of segments, and the split sequences' list. On the device of the
    lengths it was made from."""

    parts: torch.Tensor
    seqs: torch.Tensor


def balanced_plan(cache_seqlens: torch.Tensor, table_width: int | None, n_parts: int) -> MlaPlan:
    """The plan of `cache_seqlens` (clamped into [0, 64 * table_width], as the kernels read
    them; `mla_metadata`, which sees no table, clamps below only) over `n_parts` parts."""
    dev, batch = cache_seqlens.device, cache_seqlens.shape[0]
    most = None if table_width is None else table_width * PAGE
    blocks = (cache_seqlens.clamp(0, most) + PAGE - 1) // PAGE
    # Ragged: the balanced line, each sequence charged FIXED beside its blocks. Its span and the
    # payload are even, so every cut falls between pairs of blocks (the seesaw's unit of work: a
    # segment of an odd number of blocks pays for a pair's second block).
    cost = _even(blocks + FIXED)
    payload = _even((cost.sum(0, keepdim=True) + n_parts - 1) // n_parts).clamp_(min=MIN_PAYLOAD)
    # Uniform (n blocks each, n >= 1): whole sequences per part where the balance asks for more
    # than n blocks, else each sequence in pieces of an even number of blocks (at least its
    # share), its span a whole number of parts.
    n = blocks.amax(0, keepdim=True)
    uniform = (n == blocks.amin(0, keepdim=True)) & (n > 0)
    share = ((batch * n + n_parts - 1) // n_parts).clamp_(min=MIN_PAYLOAD)
    n = n.clamp(min=1)
    whole = share >= n
    pieces = (n // share).clamp_(min=1)
    piece = _even((n + pieces - 1) // pieces)
    span = torch.where(whole, n, piece * ((n + piece - 1) // piece))
    aligned = torch.where(whole, n * ((batch + n_parts - 1) // n_parts), piece)
    # Aligned where it costs no more than the cuts it saves (FIXED each, at least one a part).
    uniform &= aligned <= payload + FIXED
    cost = torch.where(uniform, span.expand(batch), cost).to(torch.int32)
    payload = torch.where(uniform, aligned, payload).to(torch.int32)
    cum = torch.cumsum(cost, 0, dtype=torch.int32) - cost
    first = cum // payload
    last = (cum + blocks.clamp(min=1) - 1) // payload
    count = last - first + 1
    base = torch.cumsum(count, 0, dtype=torch.int32) - count
    p = torch.arange(n_parts, dtype=torch.int32, device=dev)
    lo = torch.searchsorted(last, p, out_int32=True)  # the first sequence ending at or after p
    hi = torch.searchsorted(first, p, right=True, out_int32=True) - 1  # the last starting by p
    # The split sequences listed first (for the combine), by a scatter with no read back.
    split = count > 1
    at = torch.where(split, torch.cumsum(split, 0, dtype=torch.int32) - 1, batch)
    listed = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    listed.scatter_(0, at.long(), torch.arange(batch, dtype=torch.int32, device=dev))
    n_split = split.sum(0, keepdim=True, dtype=torch.int32)
    parts = torch.stack([lo, hi, payload.expand(n_parts), n_split.expand(n_parts)], 1)
    return MlaPlan(parts.to(torch.int32),
                   torch.stack([cum, base, first, count, listed[:batch]], 1))


def _even(blocks: torch.Tensor) -> torch.Tensor:
    """`blocks` rounded up to a whole number of pairs."""
    return (blocks + 1) // 2 * 2


def parts_for(units: int, rows: int) -> int:
    """Parts of a plan on a device of `units` SMs (cores): one CTA per row tile of 64 rows of
    each part, so that one wave fills the device."""
    return max(1, units // -(-rows // 64))
