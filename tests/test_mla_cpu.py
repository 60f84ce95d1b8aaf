"""MLA decode on the CPU target: real TileLang kernels against a float64 reference.

Few distinct kernels (each CPU compile costs seconds): a kernel depends only on (h_q, s_q, dtype)
and the configuration, so every batch and length below with the same three shares one.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from helpers import rel_error
from torch.utils._python_dispatch import TorchDispatchMode

import tileops
from tileops import dispatch
from tileops.ops.mla import MLA_DECODE, reference
from tileops.ops.mla.plan import MIN_PAYLOAD, balanced_plan, parts_for
from tileops.spec import pow2_bucket
from tileops.target import target_of

CPU = torch.device("cpu")


def paged(seqlens: list[int], h_q: int, s_q: int, dtype=torch.float32, seed: int = 0,
          spare: int = 1):
    """Inputs with the given lengths: pages shuffled over the cache, unused entries -1."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // 64) for n in seqlens]
    width = max(counts) + spare
    num_blocks = sum(counts) + 2
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(seqlens), width), -1, dtype=torch.int32)
    at = 0
    for b, c in enumerate(counts):
        table[b, :c] = perm[at:at + c]
        at += c
    q = torch.randn(len(seqlens), s_q, h_q, 576, generator=gen).to(dtype)
    kv = torch.randn(num_blocks, 64, 1, 576, generator=gen).to(dtype)
    return q, kv, table, torch.tensor(seqlens, dtype=torch.int32)


def planned(call, n_parts: int):
    """The call's arguments with a plan of `n_parts` parts (the CPU's own has one per core)."""
    return call.args._replace(plan=balanced_plan(call.args.cache_seqlens,
                                                 call.args.block_table.shape[1], n_parts))


def check(out, lse, ref, tol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref[0]) < tol
    assert (lse.double() - ref[1]).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("seqlens", "s_q", "dtype", "tol"),
    [
        ([1, 65, 200, 64], 1, torch.float32, 1e-5),   # seqlen 1, odd lengths, a full page
        ([2, 129, 77], 2, torch.float32, 1e-5),       # s_q = 2: causal within the new tokens
        ([300, 3], 1, torch.bfloat16, 1e-2),
        ([190, 64], 2, torch.float16, 1e-2),
    ],
)
def test_matches_float64_reference(seqlens, s_q, dtype, tol):
    inputs = paged(seqlens, 16, s_q, dtype, seed=len(seqlens))
    out, lse = tileops.mla_decode(*inputs)
    assert out.shape == (len(seqlens), s_q, 16, 512) and out.dtype == dtype
    assert lse.shape == (len(seqlens), 16, s_q) and lse.dtype == torch.float32
    check(out, lse, reference(*inputs), tol)


def test_causal_rule_for_two_tokens():
    # Token 0 of s_q = 2 must not see the last key: make that key dominate and compare.
    q, kv, table, seqlens = paged([70], 16, 2)
    last = kv[table[0, 1], 5, 0]  # key 69
    last.copy_(q[0, 1, 0] * 3)
    out, lse = tileops.mla_decode(q, kv, table, seqlens)
    check(out, lse, reference(q, kv, table, seqlens), 1e-5)
    assert (lse[0, 0, 1] - lse[0, 0, 0]) > 1  # token 1 sees the dominant key, token 0 does not


def test_softmax_scale():
    inputs = paged([100, 33], 16, 1, seed=3)
    out, lse = tileops.mla_decode(*inputs, softmax_scale=0.1)
    check(out, lse, reference(*inputs, softmax_scale=0.1), 1e-5)
    default = tileops.mla_decode(*inputs)
    check(*default, reference(*inputs, softmax_scale=576 ** -0.5), 1e-5)


@pytest.mark.parametrize("n_parts", [1, 3, 7])
def test_splits_combine_every_element_written_and_stale_rows_ignored(n_parts):
    # The planned kernel called directly on NaN-filled (out, lse) buffers, with NaN in every
    # cache row past the lengths: every output written, nothing stale read into the result.
    # Parts ending inside sequences (7 parts: a sequence in three), whole ones, one of 2 keys.
    target = target_of(CPU)
    problem = MLA_DECODE.Problem(3, 256, 16, 2, "float32")
    config = {"block_H": 32, "block_N": 16}
    kernel = dispatch.compile_kernel(MLA_DECODE, problem, config, target)
    q, kv, table, seqlens = paged([2, 200, 150], 16, 2, seed=5)
    for b, n in enumerate(seqlens.tolist()):
        kv[table[b, n // 64], n % 64:] = float("nan")
    call = MLA_DECODE.prepare(q, kv, table, seqlens)
    assert call.problem == problem
    out = (torch.full((3, 2, 16, 512), float("nan")), torch.full((3, 16, 2), float("nan")))
    got = MLA_DECODE.launch(kernel, planned(call, n_parts), out=out)
    assert got[0] is out[0] and got[1] is out[1]
    check(*out, reference(q, kv, table, seqlens), 1e-5)


def _walk(plan, lengths):
    """Each part's segments as the kernels find them (`kernels.part_seq`, `kernels.segment`):
    {(part, sequence): (first block, end block, slot)}."""
    parts, seqs = plan.parts.tolist(), plan.seqs.tolist()
    found = {}
    for p, (lo, hi, payload, _) in enumerate(parts):
        for b in range(lo, hi + 1):
            cum, base, first, count, _ = seqs[b]
            blocks = -(-lengths[b] // 64)
            end = blocks if p >= first + count - 1 else min((p + 1) * payload - cum, blocks)
            found[p, b] = (min(max(p * payload - cum, 0), end), end,
                           base + p - first if count > 1 else -1)
    return found


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_takes_every_block_once_and_balances_the_parts(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, n_parts = [(1, 132), (5, 3), (40, 132), (64, 132), (64, 66), (17, 1)][seed]
    lengths = torch.randint(0, 9000, (batch,), generator=gen, dtype=torch.int32)
    edges = torch.tensor([0, 1, 64, 65, 4096], dtype=torch.int32)  # empty, one key, a page
    lengths[::3] = edges.repeat(batch)[:len(lengths[::3])]
    plan = balanced_plan(lengths, 200, n_parts)
    found = _walk(plan, lengths.tolist())
    taken = {b: [] for b in range(batch)}
    for (_, b), (start, end, slot) in sorted(found.items()):
        assert start < end or (start == end == 0 and lengths[b] == 0)  # no empty piece
        assert start % 2 == 0  # cut between the pairs of blocks the seesaw takes
        taken[b].append((start, end, slot))
    load = [sum(e - s for (p, _), (s, e, _) in found.items() if p == q) for q in range(n_parts)]
    payload = plan.parts[0, 2].item()
    assert max(load) <= payload and plan.parts[:, 2].eq(payload).all()
    slots = set()
    for b, pieces in taken.items():
        blocks = -(-lengths[b].item() // 64)
        assert pieces[0][0] == 0 and pieces[-1][1] == blocks  # every block, in order, once
        assert all(x[1] == y[0] for x, y in zip(pieces, pieces[1:], strict=False))
        assert (len(pieces) == 1) == (pieces[0][2] == -1)
        slots.update(s for *_, s in pieces if s >= 0)
    assert len(slots) == sum(len(v) for v in taken.values() if len(v) > 1)
    split = [b for b, pieces in taken.items() if len(pieces) > 1]  # the combine's list
    assert plan.parts[:, 3].eq(len(split)).all() and plan.seqs[:len(split), 4].tolist() == split
    assert all(0 <= s < batch + n_parts for s in slots)
    uniform = balanced_plan(torch.full((64,), 4096, dtype=torch.int32), 64, 132)
    assert uniform.parts[0, 2].item() == 32 and uniform.seqs[:, 3].eq(2).all()  # 2 pieces each
    whole = balanced_plan(torch.full((64,), 4096, dtype=torch.int32), 64, 66)
    assert whole.parts[0, 2].item() == 64 and whole.seqs[:, 3].eq(1).all()  # none split
    odd = balanced_plan(torch.full((16,), 4000, dtype=torch.int32), 63, 132)  # 63 blocks each
    assert odd.parts[0, 2].item() == 10 and odd.seqs[:, 3].eq(7).all()  # pieces of 5 pairs
    assert balanced_plan(torch.tensor([100], dtype=torch.int32), 2, 132).parts[0, 2] \
        == MIN_PAYLOAD


def test_a_plan_made_for_other_lengths_still_attends_to_every_key():
    # Lengths grown (a graph replayed on a later step) or shrunk since the plan was made: the
    # balance is off, the result is not; a plan of garbage reads nothing outside its tensors.
    q, kv, table, lens = paged([300, 700, 65, 1000], 16, 1, seed=21, spare=4)
    config = {"block_H": 16, "block_N": 32}
    call = MLA_DECODE.prepare(q, kv, table, lens)
    kernel = dispatch.compile_kernel(MLA_DECODE, call.problem, config, target_of(CPU))
    for made_from in ([10, 20, 30, 40], [1200, 900, 400, 1250], [0, 0, 0, 0]):
        plan = balanced_plan(torch.tensor(made_from, dtype=torch.int32), table.shape[1], 5)
        check(*MLA_DECODE.launch(kernel, call.args._replace(plan=plan)),
              reference(q, kv, table, lens), 1e-5)
    big = 2**31 - 1
    for parts, seqs in [(torch.full((3, 4), big), torch.full((4, 5), big)),
                        (torch.full((3, 4), -big), torch.full((4, 5), -big))]:
        plan = balanced_plan(lens, table.shape[1], 3)._replace(parts=parts.int(),
                                                               seqs=seqs.int())
        MLA_DECODE.launch(kernel, call.args._replace(plan=plan))  # no crash, no wild read


def test_one_kernel_for_batches_and_lengths():
    for seqlens in ([40], [33, 64, 17], [60, 1]):  # one bucket (64), three batch sizes
        inputs = paged(seqlens, 16, 1, seed=len(seqlens))
        check(*tileops.mla_decode(*inputs), reference(*inputs), 1e-5)
    kernels = [k for k in dispatch._kernels if k[0] == "mla_decode" and k[2] == (16, 1, "float32")]
    assert len(kernels) == 1
    keys = {p for (op, _, p) in dispatch.DISPATCHER.choices if op == "mla_decode"}
    assert {p.seqlen for p in keys} == {64} and {p.batch for p in keys} == {1, 2, 3}


def test_baseline_matches_reference():
    inputs = paged([130, 5], 16, 2, seed=9)
    out, lse = MLA_DECODE.launch_baseline(MLA_DECODE.prepare(*inputs).args)
    check(out, lse, reference(*inputs), 1e-5)


def test_make_inputs_builds_a_shuffled_paged_problem():
    problem = MLA_DECODE.parse_problem("B3xS1000xH16xQ2", "bfloat16")
    assert problem == MLA_DECODE.Problem(3, 1024, 16, 2, "bfloat16")
    q, kv, table, seqlens = MLA_DECODE.make_inputs(problem, CPU, seed=1, sizes={"seqlen": 513})
    assert int(seqlens.max()) == 513 and int(seqlens.min()) >= 450
    assert MLA_DECODE.prepare(q, kv, table, seqlens).problem.seqlen == 1024
    used = table[table >= 0]
    assert len(used.unique()) == len(used) and not torch.equal(used, used.sort().values)


def test_parse_problem_errors():
    assert MLA_DECODE.parse_problem("b64xs4096xh128", "bfloat16").s_q == 1
    for text in ("64x4096x128", "B1xS4096xH24", "B1xS4096xH16xQ3", "B1xS1xH16xQ2"):
        with pytest.raises(ValueError, match="bad MLA decode problem"):
            MLA_DECODE.parse_problem(text, "bfloat16")


def test_suite_loads():
    from tileops.tuner import suites

    suite = suites.load("mla_decode")
    assert suite.op == "mla_decode" and len(suite.problems) == 32
    assert {p.dtype for p in suite.problems} == {"bfloat16"}


def _bad(**change):
    q, kv, table, seqlens = paged([100, 70], 16, 1)
    args = {"q": q, "kv_cache": kv, "block_table": table, "cache_seqlens": seqlens}
    args.update({k: v(args[k]) if callable(v) else v for k, v in change.items()})
    return args


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"q": lambda q: q[..., :512]}, ValueError, "q must be"),
        ({"q": lambda q: q[:, :, :5]}, ValueError, "h_q = 5"),
        ({"q": lambda q: torch.cat([q] * 3, dim=1)}, ValueError, "s_q 3|s_q = 3"),
        ({"kv_cache": lambda kv: kv.view(-1, 32, 1, 576)}, ValueError, "kv_cache must be"),
        ({"kv_cache": lambda kv: kv.half()}, TypeError, "same dtype"),
        ({"q": lambda q: q.double(), "kv_cache": lambda kv: kv.double()}, TypeError, "float64"),
        ({"block_table": lambda t: t.long()}, TypeError, "block_table must be int32"),
        ({"cache_seqlens": lambda s: s.long()}, TypeError, "cache_seqlens must be int32"),
        ({"block_table": lambda t: t[:1]}, ValueError, "block_table must be"),
        ({"cache_seqlens": lambda s: s[:1]}, ValueError, "cache_seqlens must be"),
        ({"kv_cache": lambda kv: kv[:0]}, ValueError, "kv_cache has no blocks"),
        ({"kv_cache": lambda kv: kv.transpose(0, 1).contiguous().transpose(0, 1)}, ValueError,
         "contiguous"),
        ({"cache_seqlens": lambda s: s.to("meta")}, ValueError, "different devices"),
        ({"q": [[1.0]]}, TypeError, "q must be a tensor"),
        ({"softmax_scale": -0.1}, ValueError, "softmax_scale must be positive"),
        ({"softmax_scale": 0.0}, ValueError, "softmax_scale must be positive"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
        ({"softmax_scale": float("inf")}, ValueError, "softmax_scale must be finite"),
        ({"softmax_scale": "x"}, TypeError, "softmax_scale must be a number"),
        ({name: (lambda t: t.to("meta")) for name in ("q", "kv_cache", "block_table",
                                                      "cache_seqlens")},
         ValueError, "CUDA and CPU tensors, not meta"),
    ],
)
def test_bad_input_is_refused_clearly(change, exc, match):
    with pytest.raises(exc, match=match):
        tileops.mla_decode(**_bad(**change))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cache_seqlens": lambda s: torch.tensor([100, 0], dtype=torch.int32)}, "at least s_q"),
        ({"cache_seqlens": lambda s: torch.tensor([100, 200], dtype=torch.int32)},
         "block_table has 3 pages"),
        ({"block_table": lambda t: t.masked_fill(t == t[1, 1], 99)}, "entry 99"),
        ({"block_table": lambda t: t.masked_fill(t == t[0, 0], -1)}, "entry -1"),
    ],
)
def test_strict_mode_refuses_bad_tables_and_lengths(change, match):
    args = _bad(**change)
    with pytest.raises(ValueError, match=match):
        tileops.mla_decode(**args, validate=True)
    md = tileops.mla_metadata(args["cache_seqlens"], 16, 1, max_seqlen=100)
    with pytest.raises(ValueError, match=match):  # metadata or not, strict mode checks
        tileops.mla_decode(**args, validate=True, metadata=md)
    out, lse = tileops.mla_decode(**args)  # the default clamps on the device instead
    assert not out.isnan().any()


def test_unused_table_entries_are_not_checked():
    q, kv, table, seqlens = paged([100, 10], 16, 1)
    table[1, 1:] = 10_000  # past sequence 1's pages: never read, so not an error
    check(*tileops.mla_decode(q, kv, table, seqlens, validate=True),
          reference(q, kv, table, seqlens), 1e-5)


def test_the_default_checks_no_table_entry():
    call = MLA_DECODE.prepare(*_bad(block_table=lambda t: t.masked_fill(t == t[1, 1], 99))
                              .values())
    assert call.problem.seqlen == 128
    assert math.isclose(call.args.scale_log2, 576 ** -0.5 / math.log(2))


def _close(got, ref, tol):
    """Like `check`, for results whose rows may have seen no key (zeros, lse -inf)."""
    out, lse = got
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    assert rel_error(out, ref[0]) < tol
    assert (lse.double() - ref[1]).nan_to_num(nan=0.0).abs().max() < 1e-4


def test_a_bad_table_or_bad_lengths_read_nothing_outside_the_cache():
    # The cache sits between two NaN guard pages: any read past either end would put NaN in the
    # result; ids and lengths far out of range would crash. The kernels clamp lengths into
    # [0, 64 * max_blocks] and page ids into [0, num_blocks), as `reference` does.
    q, kv, table, lens = paged([100, 70, 30], 16, 1, seed=4)
    nb, width = kv.shape[0], table.shape[1]
    guarded = torch.full((nb + 2, 64, 1, 576), float("nan"))
    guarded[1:-1] = kv
    cache = guarded[1:-1]
    assert cache.is_contiguous() and cache.data_ptr() > guarded.data_ptr()
    big, small = 2**31 - 1, -2**31
    bad_tables = [table.masked_fill(table == table[0, 0], -1),
                  table.masked_fill(table == table[0, 1], nb),
                  table.masked_fill(table == table[1, 0], small),
                  table.masked_fill(table == table[2, 0], big)]
    bad_lens = [torch.tensor([-5, 70, width * 64 + 1000], dtype=torch.int32),
                torch.tensor([big, small, 0], dtype=torch.int32)]
    for t, n in [(t, lens) for t in bad_tables] + [(table, n) for n in bad_lens] \
            + [(bad_tables[3], bad_lens[1])]:
        _close(tileops.mla_decode(q, cache, t, n), reference(q, kv, t, n), 1e-5)
    # A plan of 5 parts (sequences split) on the same inputs, called directly.
    config = {"block_H": 32, "block_N": 16}
    q2 = torch.cat([q, q.flip(0)], dim=1)  # s_q = 2
    call = MLA_DECODE.prepare(q2, cache, bad_tables[2], bad_lens[0])
    kernel = dispatch.compile_kernel(MLA_DECODE, call.problem, config, target_of(CPU))
    _close(MLA_DECODE.launch(kernel, planned(call, 5)),
           reference(q2, kv, bad_tables[2], bad_lens[0]), 1e-5)
    _close(MLA_DECODE.launch_baseline(call.args), reference(q2, kv, bad_tables[2], bad_lens[0]),
           1e-5)


@pytest.mark.parametrize(("seqlens", "s_q", "dtype"),
                         [([100, 70, 3], 1, torch.float32), ([190, 64], 2, torch.float16),
                          ([300, 3], 1, torch.bfloat16)])
def test_metadata_gives_the_bit_identical_result(seqlens, s_q, dtype):
    inputs = paged(seqlens, 16, s_q, dtype, seed=len(seqlens))
    md = tileops.mla_metadata(inputs[3], 16, s_q)
    assert md[:4] == (pow2_bucket(max(seqlens)), len(seqlens), 16, s_q)
    own = balanced_plan(inputs[3], inputs[2].shape[1], parts_for(target_of(CPU).units, 16 * s_q))
    assert torch.equal(md.plan.seqs, own.seqs)  # the plan a call without metadata makes
    assert MLA_DECODE.prepare(*inputs, metadata=md).problem == MLA_DECODE.prepare(*inputs).problem
    plain = tileops.mla_decode(*inputs)
    for got in (tileops.mla_decode(*inputs, metadata=md),
                torch.ops.tileops.mla_decode(*inputs, metadata=list(md[:4]),
                                             plan_parts=md.plan.parts, plan_seqs=md.plan.seqs)):
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_metadata_only_chooses_the_kernel_never_the_result():
    # Lengths grown past what the metadata was made from (a graph replayed on a later step):
    # every key is still attended to.
    q, kv, table, lens = paged([200, 150], 16, 1, seed=6)
    md = tileops.mla_metadata(lens, 16, 1, max_seqlen=40)
    assert MLA_DECODE.prepare(q, kv, table, lens, metadata=md).problem.seqlen == 64
    check(*tileops.mla_decode(q, kv, table, lens, metadata=md), reference(q, kv, table, lens),
          1e-5)


def test_steps_of_one_bucket_share_their_metadata():
    lens = torch.tensor([70, 100], dtype=torch.int32)
    assert tileops.mla_metadata(lens, 16)[:4] == tileops.mla_metadata(lens + 28, 16)[:4]  # 128
    assert tileops.mla_metadata(lens, 16)[:4] != tileops.mla_metadata(lens + 29, 16)[:4]
    # Empty sequences: the same key with metadata as without.
    q, kv, table, _ = paged([1, 1], 16, 2)
    zeros = torch.zeros(2, dtype=torch.int32)
    md = tileops.mla_metadata(zeros, 16, 2)
    assert MLA_DECODE.prepare(q, kv, table, zeros, metadata=md).problem \
        == MLA_DECODE.prepare(q, kv, table, zeros).problem


class _Recorder(TorchDispatchMode):
    """Records every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _host_reads_fail(monkeypatch):
    def read(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__",
                 "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read)


def test_with_metadata_the_call_reads_nothing_back(monkeypatch):
    # On the host side the call may only allocate and take views: no reduction (whose result
    # would have to be read), no _local_scalar_dense (item, int, bool), no tolist/cpu/numpy.
    inputs = paged([100, 70, 3], 16, 2, seed=8)
    md = tileops.mla_metadata(inputs[3], 16, 2)
    want = tileops.mla_decode(*inputs)  # compiles outside the checked region
    with _Recorder() as plain:
        tileops.mla_decode(*inputs)
    assert {"max", "_local_scalar_dense"} <= plain.ops  # the recorder sees a host read
    with monkeypatch.context() as m:
        _host_reads_fail(m)
        with _Recorder() as rec:
            got = tileops.mla_decode(*inputs, metadata=md)
    assert rec.ops <= {"empty", "new_empty", "view"}, rec.ops
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_under_capture_the_key_comes_from_shapes(monkeypatch):
    # CUDA-graph capture is simulated (a CPU tensor is never captured): without metadata the
    # key's length is the table width's 64 * max_blocks, with no host read; strict mode and
    # mla_metadata without max_seqlen refuse, as they would have to read the device.
    from tileops import autotune

    q, kv, table, lens = paged([100, 70], 16, 1, spare=3)  # 5 pages: 320 rows
    monkeypatch.setattr(autotune, "capturing", lambda device: True)
    with monkeypatch.context() as m:
        _host_reads_fail(m)
        call = MLA_DECODE.prepare(q, kv, table, lens)
        assert call.problem.seqlen == 512 and call.args.max_keys == 320
        md = tileops.mla_metadata(lens, 16, 1, max_seqlen=100)
        assert MLA_DECODE.prepare(q, kv, table, lens, metadata=md).problem.seqlen == 128
    with pytest.raises(RuntimeError, match="validate=True .* CUDA-graph capture"):
        tileops.mla_decode(q, kv, table, lens, validate=True)
    with pytest.raises(RuntimeError, match="pass max_seqlen"):
        tileops.mla_metadata(lens, 16, 1)
    check(*tileops.mla_decode(q, kv, table, lens), reference(q, kv, table, lens), 1e-5)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda s: tileops.mla_metadata(s.long(), 16), TypeError, "int32 tensor, got int64"),
        (lambda s: tileops.mla_metadata(s[:0], 16), ValueError, "batch >= 1"),
        (lambda s: tileops.mla_metadata(s[None], 16), ValueError, "batch >= 1"),
        (lambda s: tileops.mla_metadata([100, 70], 16), TypeError, "got list"),
        (lambda s: tileops.mla_metadata(s, 24), ValueError, "h_q = 24"),
        (lambda s: tileops.mla_metadata(s, 16, 3), ValueError, "s_q = 3"),
        (lambda s: tileops.mla_metadata(s, 16, max_seqlen=-1), ValueError, "max_seqlen"),
        (lambda s: tileops.mla_metadata(s, 16, max_seqlen=1.5), ValueError, "max_seqlen"),
        (lambda s: tileops.mla_decode(**_bad(), metadata=tileops.mla_metadata(s, 32)),
         ValueError, "made for batch 2, h_q 32, s_q 1; this call has batch 2, h_q 16"),
        (lambda s: tileops.mla_decode(**_bad(), metadata=tileops.mla_metadata(s[:1], 16)),
         ValueError, "made for batch 1"),
        (lambda s: tileops.mla_decode(**_bad(), metadata=(100, 2)), TypeError,
         "what tileops.mla_metadata returns"),
        (lambda s: tileops.mla_decode(**_bad(), metadata=100), TypeError,
         "what tileops.mla_metadata returns"),
    ],
)
def test_bad_metadata_is_refused_clearly(make, exc, match):
    with pytest.raises(exc, match=match):
        make(torch.tensor([100, 70], dtype=torch.int32))


@pytest.mark.parametrize("with_metadata", [False, True])
def test_under_torch_compile(with_metadata):
    inputs = paged([90, 20], 16, 1, seed=11)
    md = tileops.mla_metadata(inputs[3], 16) if with_metadata else None

    def layer(q):
        out, lse = tileops.mla_decode(q, *inputs[1:], metadata=md)
        return out * 2, lse

    compiled = torch.compile(layer, fullgraph=True)
    out, lse = compiled(inputs[0])
    ref = reference(*inputs)
    assert rel_error(out, 2 * ref[0]) < 1e-5 and rel_error(lse, ref[1]) < 1e-6


def test_custom_op_is_registered():
    inputs = paged([50], 16, 1, seed=12)
    check(*torch.ops.tileops.mla_decode(*inputs), reference(*inputs), 1e-5)


def test_a_row_that_sees_no_key_gets_zeros_and_minus_inf_as_in_attention():
    # Calls may ask for sequences shorter than s_q (strict mode refuses them): an empty
    # sequence, and with s_q = 2 a length of 1 leaves token 0 no key. Such rows used to come out
    # NaN from the combine (-inf - -inf); flash_attention gives zeros and a log-sum-exp of -inf.
    cases = [(1, [0, 70], {"block_H": 16, "block_N": 32}, 1, 16),
             (2, [0, 1, 150], {"block_H": 32, "block_N": 16}, 3, 2 * 16 + 16)]
    for s_q, seqlens, config, n_parts, rows_without_keys in cases:
        q, kv, table, lens = paged([max(n, 1) for n in seqlens], 16, s_q, seed=s_q)
        lens = torch.tensor(seqlens, dtype=torch.int32)
        call = MLA_DECODE.prepare(q, kv, table, lens)
        kernel = dispatch.compile_kernel(MLA_DECODE, call.problem, config, target_of(CPU))
        out, lse = MLA_DECODE.launch(kernel, planned(call, n_parts))
        ref_out, ref_lse = reference(q, kv, table, lens)
        unseen = torch.isneginf(ref_lse).transpose(1, 2)  # (batch, s_q, h_q)
        assert unseen[0].all() and unseen[-1].sum() == 0 and unseen.sum() == rows_without_keys
        assert (out[unseen] == 0).all() and not out.isnan().any()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        check(out, lse.nan_to_num(neginf=0), (ref_out, ref_lse.nan_to_num(neginf=0)), 1e-5)


def test_nan_in_the_cache_propagates():
    q, kv, table, lens = paged([70, 40], 16, 1, seed=9)
    kv[table[0, 1], 3, 0, 100] = float("nan")  # key 67 of sequence 0
    out, lse = tileops.mla_decode(q, kv, table, lens)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert not out[1].isnan().any() and not lse[1].isnan().any()


def test_serving_args_carry_the_steps_metadata():
    # What benchmarks time as tileops_us: the call with metadata made once per step, before it.
    inputs = paged([100, 70], 16, 2, seed=13)
    args = MLA_DECODE.serving_args(inputs)
    assert args[:4] == inputs and args[-1][:4] == (128, 2, 16, 2)
    assert MLA_DECODE.prepare(*args).problem == MLA_DECODE.prepare(*inputs).problem
    assert torch.equal(dispatch.DISPATCHER(MLA_DECODE, *args)[0], tileops.mla_decode(*inputs)[0])
    gemm_inputs = (torch.randn(2, 3), torch.randn(3, 4))
    assert tileops.get_spec("gemm").serving_args(gemm_inputs) is gemm_inputs


def test_offsuite_ragged_case_counts_the_real_lengths(monkeypatch):
    """benchmarks/mla_offsuite.py: a ragged batch checked against the reference and timed beside
    the uniform batch of its total tokens; FLOPs from the lengths drawn."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    loaded = importlib.util.spec_from_file_location("mla_offsuite", bench / "mla_offsuite.py")
    offsuite = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(offsuite)
    from tileops.target import resolve_device
    from tileops.tuner.timing import Timer

    target, device = resolve_device("cpu")
    case = offsuite.ragged_case(3, 16, 5, 130, target, device, Timer(device), dtype="float32")
    lengths = case["problem"]["lengths"]
    assert 5 <= lengths["min"] <= lengths["max"] <= 130 and lengths["total"] == 3 * lengths["mean"]
    assert case["rel_error"] < 1e-5 and case["vs_uniform"] > 0
    assert case["tflops"] == pytest.approx(2 * 16 * lengths["total"] * 1088 / case["tileops_us"]
                                           / 1e6)
