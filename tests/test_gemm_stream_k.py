"""The stream-K GEMM's division of work (`tileops.ops.gemm.stream_k`), evaluated on the host
from the expressions the kernel computes: every (tile, K step) exactly once, and the waits of
the tiles cut between CTAs never form a chain."""

from __future__ import annotations

import pytest
import tvm
from tvm import tirx

from tileops.ops.gemm import stream_k

_ANALYZER = tvm.arith.Analyzer()


def _ints(exprs) -> list[int]:
    return [int(_ANALYZER.simplify(e)) for e in exprs]


def _imm(v: int):
    return tirx.IntImm("int32", v)


def _pieces(tiles: int, ctas: int, S: int) -> dict[int, list[tuple[int, int, int, int]]]:
    """Each CTA's pieces of work, (tile, k0, k1, position of k0 among its K steps)."""
    out = {}
    G = _ints([stream_k.grid(_imm(tiles), ctas, S)])[0]
    for cta in range(G):
        dp, work, start, end, first, rounds, pieces = _ints(
            stream_k.schedule(_imm(tiles), _imm(cta), _imm(G), S))
        out[cta] = [tuple(_ints(stream_k.piece(_imm(i), _imm(cta), _imm(dp), _imm(start),
                                               _imm(end), _imm(first), _imm(rounds), _imm(G),
                                               S)))
                    for i in range(pieces)]
    return out


@pytest.mark.parametrize(("tiles", "S", "ctas"), [
    (1, 4, 8),     # fewer iterations than CTAs: most CTAs idle, the tile cut 4 ways
    (5, 3, 8),
    (8, 16, 8),    # one whole wave: every tile whole, no cut
    (12, 7, 8),    # 1.5 waves: all streamed
    (17, 5, 8),    # just over two waves: one data-parallel round
    (40, 128, 132),  # M = 256 at N = 10240 (128 x 256 tiles, K = 8192)
    (160, 128, 132),
    (1536, 64, 132),  # M = 8192 at N = 6144: 10 rounds, then 1.6 waves streamed
])
def test_every_iteration_once_and_no_wait_chain(tiles, S, ctas):
    pieces = _pieces(tiles, ctas, S)
    G = len(pieces)
    assert min(ctas, tiles * S) == G
    seen = {}
    for cta, work in pieces.items():
        position = 0
        for n, (tile, k0, k1, g0) in enumerate(work):
            assert 0 <= tile < tiles and 0 <= k0 < k1 <= S
            assert g0 == position  # the stage ring runs on across pieces
            position += k1 - k0
            for k in range(k0, k1):
                assert (tile, k) not in seen
                seen[(tile, k)] = cta
            if k0 > 0:  # continues a tile: only ever the CTA's first streamed piece
                assert all(w[1] == 0 and w[2] == S for w in work[:n])
            if k1 < S and k0 == 0:  # starts a tile it does not finish: only ever its last
                assert n == len(work) - 1
    assert len(seen) == tiles * S
    # The finisher of a cut tile (the CTA of its first step) waits for the CTAs after it, up
    # to `last_cta`: exactly the tile's other CTAs.
    dp = _ints(stream_k.schedule(_imm(tiles), _imm(0), _imm(G), S))[0]
    work_all = (tiles - dp) * S
    for tile in range(tiles):
        owners = sorted({seen[(tile, k)] for k in range(S)})
        assert owners == list(range(owners[0], owners[-1] + 1))
        if len(owners) > 1:
            assert tile >= dp
            assert _ints([stream_k.last_cta(_imm(tile), _imm(dp), _imm(work_all), _imm(G),
                                            S)]) == [owners[-1]]
            assert seen[(tile, 0)] == owners[0]


def test_data_parallel_rounds_leave_one_to_two_waves_streamed():
    for tiles in (264, 300, 1536):
        dp, *_ = _ints(stream_k.schedule(_imm(tiles), _imm(0), _imm(132), 64))
        assert dp % 132 == 0 and 132 <= tiles - dp < 264
    assert _ints(stream_k.schedule(_imm(200), _imm(0), _imm(132), 64))[0] == 0
