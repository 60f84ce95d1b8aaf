"""MLA decode on a CUDA GPU (marked `gpu`: skipped cleanly without one)."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_error

import tileops
from tileops import dispatch
from tileops.ops.mla import MLA_DECODE, reference
from tileops.ops.mla.plan import balanced_plan, parts_for
from tileops.target import target_of

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
SEESAW = {"block_H": 64, "block_N": 64, "num_stages": 2, "threads": 384, "num_splits": 1}
SPLIT = {"block_H": 64, "block_N": 64, "num_stages": 2, "threads": 256}


def planned(call, n_parts):
    """The call's arguments with a plan of `n_parts` parts (132 / row tiles of its own)."""
    return call.args._replace(plan=balanced_plan(call.args.cache_seqlens,
                                                 call.args.block_table.shape[1], n_parts))


def check(out, lse, ref):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref[0]) < 1e-2
    assert (lse.double() - ref[1]).abs().max() < 1e-2


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("seqlen", [1000, 4096])
@pytest.mark.parametrize(("batch", "h_q"), [(4, 16), (4, 128)])
def test_mla_decode_cuda(batch, h_q, seqlen, s_q):
    problem = MLA_DECODE.Problem(batch, seqlen, h_q, s_q, "bfloat16")
    inputs = MLA_DECODE.make_inputs(problem, CUDA, seed=seqlen + h_q + s_q)
    out, lse = tileops.mla_decode(*inputs)
    assert out.shape == (batch, s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (batch, h_q, s_q) and lse.dtype == torch.float32
    check(out, lse, reference(*inputs))


@pytest.mark.parametrize(("config", "n_parts"),
                         [(SEESAW, 66), (SEESAW, 5), ({**SPLIT, "num_splits": 1}, 0),
                          ({**SPLIT, "num_splits": 4}, 0), ({**SPLIT, "num_splits": 16}, 0)])
def test_every_element_written_cuda(config, n_parts):
    # NaN-filled outputs and NaN in every cache row past the lengths; lengths 1 ... 4096.
    target = target_of(CUDA)
    problem = MLA_DECODE.Problem(3, 4096, 128, 2, "bfloat16")
    kernel = dispatch.compile_kernel(MLA_DECODE, problem, config, target)
    q, kv, table, seqlens = MLA_DECODE.make_inputs(problem, CUDA, seed=n_parts)
    seqlens[1:] = torch.tensor([2, 1001], dtype=torch.int32)
    for b, n in enumerate(seqlens.tolist()):
        if n % 64:
            kv[table[b, n // 64], n % 64:] = float("nan")
    call = MLA_DECODE.prepare(q, kv, table, seqlens)
    out = (torch.full((3, 2, 128, 512), float("nan"), device=CUDA, dtype=torch.bfloat16),
           torch.full((3, 128, 2), float("nan"), device=CUDA))
    MLA_DECODE.launch(kernel, planned(call, n_parts) if n_parts else call.args, out=out)
    check(*out, reference(q, kv, table, seqlens))


def test_fp16_and_long_context_split():
    problem = MLA_DECODE.Problem(1, 32768, 16, 1, "float16")
    inputs = MLA_DECODE.make_inputs(problem, CUDA, seed=1)
    assert MLA_DECODE.default_config(problem, target_of(CUDA)) == SEESAW
    plan = balanced_plan(inputs[3], inputs[2].shape[1], parts_for(target_of(CUDA).units, 16))
    assert (plan.seqs[0, 3] > 8).item()  # the sequence is split over many parts
    check(*tileops.mla_decode(*inputs), reference(*inputs))


def test_cuda_errors():
    problem = MLA_DECODE.Problem(2, 128, 16, 1, "bfloat16")
    q, kv, table, seqlens = MLA_DECODE.make_inputs(problem, CUDA)
    with pytest.raises(TypeError, match="float32 is not supported"):
        tileops.mla_decode(q.float(), kv.float(), table, seqlens)
    with pytest.raises(ValueError, match="different devices"):
        tileops.mla_decode(q, kv, table, seqlens.cpu())
    table[0, 0] = kv.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        tileops.mla_decode(q, kv, table, seqlens, validate=True)


def test_a_bad_table_reads_nothing_outside_the_cache_cuda():
    # NaN guard pages on both sides of the cache; ids and lengths far out of range. The kernels
    # clamp them as `reference` does: no fault, no NaN, the reference's result.
    problem = MLA_DECODE.Problem(3, 1024, 64, 2, "bfloat16")
    q, kv, table, lens = MLA_DECODE.make_inputs(problem, CUDA, seed=5)
    nb, width = kv.shape[0], table.shape[1]
    guarded = torch.full((nb + 2, *kv.shape[1:]), float("nan"), device=CUDA, dtype=kv.dtype)
    guarded[1:-1] = kv
    cache = guarded[1:-1]
    table[0, 3], table[1, 0], table[2, 5] = -1, nb, 2**31 - 1
    lens = torch.tensor([1000, -7, width * 64 + 500], dtype=torch.int32, device=CUDA)
    out, lse = tileops.mla_decode(q, cache, table, lens)
    torch.cuda.synchronize()
    ref = reference(q, kv, table, lens)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()  # length -7: no key
    check(out[[0, 2]], lse[[0, 2]], (ref[0][[0, 2]], ref[1][[0, 2]]))


def test_with_metadata_the_call_never_synchronises():
    problem = MLA_DECODE.Problem(8, 4096, 128, 1, "bfloat16")
    inputs = MLA_DECODE.make_inputs(problem, CUDA, seed=4)
    md = tileops.mla_metadata(inputs[3], 128)
    want = tileops.mla_decode(*inputs, metadata=md)  # compiles outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising CUDA call raises
    try:
        got = tileops.mla_decode(*inputs, metadata=md)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="synchroniz"):  # the check does see a read
        torch.cuda.set_sync_debug_mode("error")
        try:
            tileops.mla_decode(*inputs)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize(("config", "n_parts"),
                         [(SEESAW, 132), (SEESAW, 1), ({**SPLIT, "num_splits": 4}, 0)])
def test_a_row_that_sees_no_key_gets_zeros_and_minus_inf_cuda(config, n_parts):
    # Calls may hold an empty sequence (strict mode refuses it): its rows get zeros and -inf, as
    # attention's do.
    target = target_of(CUDA)
    problem = MLA_DECODE.Problem(2, 1024, 16, 1, "bfloat16")
    q, kv, table, lens = MLA_DECODE.make_inputs(problem, CUDA, seed=3)
    lens = torch.tensor([0, 700], dtype=torch.int32, device=CUDA)
    call = MLA_DECODE.prepare(q, kv, table, lens, validate=False)
    kernel = dispatch.compile_kernel(MLA_DECODE, call.problem, config, target)
    out, lse = MLA_DECODE.launch(kernel, planned(call, n_parts) if n_parts else call.args)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    ref_out, ref_lse = reference(q, kv, table, lens)
    assert torch.isneginf(ref_lse[0]).all()
    check(out[1:], lse[1:], (ref_out[1:], ref_lse[1:]))


@pytest.mark.parametrize(("h_q", "s_q", "n_parts"),
                         [(128, 2, 1), (128, 2, 4), (128, 1, 7), (128, 1, 66), (64, 1, 3),
                          (16, 1, 2), (16, 2, 4), (16, 1, 132)])
def test_seesaw_schedule_cuda(h_q, s_q, n_parts):
    # threads 384 takes key blocks in pairs over the plan's segments: odd block counts (130
    # keys: 3 blocks), segments ending on a block past an odd count (inside a sequence), parts
    # of several sequences (1 part: all six), one block, lengths down to 2; fewer rows than its
    # 64 (h_q 16); NaN in every cache row past the lengths and NaN-filled outputs.
    target = target_of(CUDA)
    problem = MLA_DECODE.Problem(6, 4096, h_q, s_q, "bfloat16")
    assert MLA_DECODE.check_config(problem, SEESAW, target) is None
    kernel = dispatch.compile_kernel(MLA_DECODE, problem, SEESAW, target)
    q, kv, table, seqlens = MLA_DECODE.make_inputs(problem, CUDA, seed=n_parts + h_q)
    seqlens[1:] = torch.tensor([2, 130, 1001, 64, 4033], dtype=torch.int32)
    for b, n in enumerate(seqlens.tolist()):
        if n % 64:
            kv[table[b, n // 64], n % 64:] = float("nan")
    call = MLA_DECODE.prepare(q, kv, table, seqlens)
    out = (torch.full((6, s_q, h_q, 512), float("nan"), device=CUDA, dtype=torch.bfloat16),
           torch.full((6, h_q, s_q), float("nan"), device=CUDA))
    MLA_DECODE.launch(kernel, planned(call, n_parts), out=out)
    check(*out, reference(q, kv, table, seqlens))


@pytest.mark.parametrize(("lens", "n_parts", "pieces"),
                         [((32768, 100), 300, 256), ((8192,) * 40, 132, 4)])
def test_the_combine_over_many_pieces_and_many_rows_cuda(lens, n_parts, pieces):
    # The combine's two regimes: one sequence in 256 pieces (8 warps a row, more pieces than its
    # log-sum-exp pass loads at once) and 40 sequences of 4 pieces each (a warp a row).
    target = target_of(CUDA)
    problem = MLA_DECODE.Problem(len(lens), 32768, 16, 1, "bfloat16")
    kernel = dispatch.compile_kernel(MLA_DECODE, problem, SEESAW, target)
    q, kv, table, seqlens = MLA_DECODE.make_inputs(problem, CUDA, seed=n_parts)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    call = MLA_DECODE.prepare(q, kv, table, seqlens)
    args = planned(call, n_parts)
    assert int(args.plan.seqs[:, 3].max()) == pieces
    out = (torch.full((len(lens), 1, 16, 512), float("nan"), device=CUDA, dtype=torch.bfloat16),
           torch.full((len(lens), 16, 1), float("nan"), device=CUDA))
    MLA_DECODE.launch(kernel, args, out=out)
    check(*out, reference(q, kv, table, seqlens))


@pytest.mark.parametrize("h_q", [16, 128])
def test_ragged_batch_over_the_plan_cuda(h_q):
    # A serving mix (empty, one key, 100 ... 8000 keys) through the call with the step's
    # metadata, and with a plan made for other lengths (grown and shrunk): the same result.
    gen = torch.Generator(device=CUDA).manual_seed(h_q)
    lens = torch.randint(100, 8000, (40,), generator=gen, device=CUDA, dtype=torch.int32)
    lens[:3] = torch.tensor([0, 1, 8000], dtype=torch.int32)
    inputs = MLA_DECODE.make_inputs(MLA_DECODE.Problem(40, 8192, h_q, 1, "bfloat16"), CUDA)
    inputs = (*inputs[:3], lens)
    ref = reference(*inputs)
    md = tileops.mla_metadata(lens, h_q)
    out, lse = tileops.mla_decode(*inputs, metadata=md)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    check(out[1:], lse[1:], (ref[0][1:], ref[1][1:]))
    stale = tileops.mla_metadata((lens.flip(0) * 0.7).int(), h_q)
    again = tileops.mla_decode(*inputs, metadata=stale)
    check(again[0][1:], again[1][1:], (ref[0][1:], ref[1][1:]))
