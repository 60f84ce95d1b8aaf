"""The search loop and what it rests on: abandoned candidates, patience, compiles overlapping
measurement, inputs made once per problem, timings that contradict each other, and the rule for
replacing a record."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import optuna
import pytest
import torch
from helpers import make_record, write_db
from optuna.trial import TrialState
from tuner_helpers import FakeSession

from tileops import dispatch
from tileops.db import TuningDB
from tileops.ops import get_spec
from tileops.target import resolve_device
from tileops.tuner import evaluate, studies, winners
from tileops.tuner.evaluate import Job, Measurement
from tileops.tuner.progress import Progress
from tileops.tuner.search import Limits, Task, search
from tileops.tuner.timing import Stats, Timer

GEMM = get_spec("gemm")
SPACE = {"block_M": [16, 64], "block_N": [16, 32], "block_K": [16, 32]}
FASTEST = {"block_M": 16, "block_N": 16, "block_K": 16}


def task(space=SPACE, text="16x64x64"):
    target, _ = resolve_device("cpu")
    return Task(GEMM, target, "cpu", GEMM.parse_problem(text, "float32"), space)


def grid_study(first=FASTEST):
    study = optuna.create_study(sampler=studies.make_sampler("grid", SPACE, 0))
    study.enqueue_trial(first)
    return study


def latency(config):
    """1 us for FASTEST, slower the further a configuration is from it."""
    return 1.0 + sum(config[k] != FASTEST[k] for k in FASTEST) * 0.9


def test_candidates_far_slower_than_the_best_are_abandoned_counted_and_never_win():
    session = FakeSession(latency, compilers=1)
    study = grid_study()
    report = search(session, study, task(), Limits(trials=8, abandon=2.0), Progress(quiet=True),
                    batch=1, time_baseline=False)
    assert report.stopped == "done"
    trials = studies.counted_trials(study)
    assert len(trials) == 8
    for t in trials:
        slow = latency(t.params) > 2.0  # the best (1 us) is measured first
        assert (t.user_attrs.get(studies.FAILURE) == studies.ABANDONED) == slow
        assert t.state == (TrialState.PRUNED if slow else TrialState.COMPLETE)
        if slow:
            assert t.user_attrs[studies.ESTIMATE] == latency(t.params)
    ledger = studies.read_ledger(study)
    assert ledger.abandoned == sum(latency(t.params) > 2.0 for t in trials) == 4
    assert ledger.counted == 8 and ledger.best.params == FASTEST
    assert all(latency(t.params) <= 2.0 for t in ledger.complete())  # never a candidate winner
    # The first candidate had no best to be measured against; the others 2x the best.
    assert [above for _, above in session.measured] == [None] + [2.0] * 7


def test_a_search_stops_once_patience_runs_out():
    session = FakeSession(lambda config: 1.0 if config == FASTEST else 1.005, compilers=1)
    study = grid_study()
    report = search(session, study, task(), Limits(trials=8, patience=3, abandon=None),
                    Progress(quiet=True), batch=1, time_baseline=False)
    assert report.stopped == "plateau"
    assert studies.read_ledger(study).counted == 4  # the best, then three within 1% of it


@pytest.mark.parametrize("overlap", [True, False])
def test_compiles_overlap_measurement_on_gpus_and_take_turns_on_the_cpu(overlap):
    session = FakeSession(latency, overlap=overlap, compilers=3, compile_rounds=2)
    study = grid_study()
    search(session, study, task(), Limits(trials=8, abandon=None), Progress(quiet=True),
           batch=3, time_baseline=False)
    assert studies.read_ledger(study).counted == 8
    assert (max(session.in_flight_at_measure) > 0) == overlap


def test_inputs_are_made_once_per_problem_and_kernels_load_from_the_compiled_program(
        monkeypatch):
    t = task(text="16x40x48")
    config = {"block_M": 16, "block_N": 32, "block_K": 16}
    job = Job(GEMM, t.problem, t.target, "cpu", config)
    _, program = evaluate.compile_job(job)
    dispatch._kernels.clear()  # as in the benchmarking child: only the disk cache holds it

    def no_build(*args):
        raise AssertionError("the benchmarking child built a program it was handed")

    monkeypatch.setattr(GEMM, "build", no_build)
    first = evaluate.measure(job, seed=3, program=program)
    assert first.ok and {"load", "inputs", "reference", "check", "timing"} <= set(first.phases)
    second = evaluate.measure(Job(GEMM, t.problem, t.target, "cpu", None), seed=3)
    assert second.ok and "inputs" not in second.phases and "reference" not in second.phases
    # A candidate that wrote into the inputs would fail every later check: inputs that no
    # longer match their reference are made again before a candidate is called wrong.
    (cases,) = evaluate._held.values()
    cases[0].inputs[0].zero_()
    again = evaluate.measure(job, seed=3, program=program)
    assert again.ok and "inputs" in again.phases


def test_abandoned_in_the_benchmarking_child_before_its_check():
    t = task(text="16x40x48")
    job = Job(GEMM, t.problem, t.target, "cpu", {"block_M": 16, "block_N": 16, "block_K": 16})
    m = evaluate.measure(job, seed=1, abandon_above_us=1e-3)
    assert m.failure == studies.ABANDONED and m.estimate_us > 1e-3
    assert "check" not in m.phases and "timing" not in m.phases


class RetimeSession:
    """Answers each re-timing with the given (config medians, baseline medians) in turn."""

    def __init__(self, *attempts):
        self.attempts = list(attempts)
        self.calls = 0

    def retime(self, jobs, seed, rounds):
        self.calls += 1
        tiles, base = self.attempts[min(self.calls, len(self.attempts)) - 1]
        return [_timed(tiles)] * (len(jobs) - 1) + [_timed(base)]


def _timed(medians):
    return Measurement(stats=Stats(sorted(medians)[len(medians) // 2], min(medians),
                                   max(medians), 10, min(medians)), round_medians=tuple(medians))


def ledger_of(value):
    trial = SimpleNamespace(params={"block_M": 16, "block_N": 32, "block_K": 64}, value=value)
    return SimpleNamespace(complete=lambda: [trial])


def test_timings_that_contradict_each_other_are_never_recorded():
    # The reproducer: the baseline measured 53 us while searching, 11990 us when re-timing.
    session = RetimeSession(([400.0] * 5, [11990.0] * 5))
    decision, why = winners.retime_top(session, task(), ledger_of(400.0), 1, 5, 0,
                                       baseline_us=53.0)
    assert decision is None and "contradict" in why and "baseline" in why
    assert session.calls == winners.RETIME_ATTEMPTS
    # A launch stalled now and then within the re-timing contradicts itself too.
    session = RetimeSession(([400.0, 410.0, 2000.0, 405.0, 400.0], [50.0] * 5))
    assert winners.retime_top(session, task(), ledger_of(400.0), 1, 5, 0, 53.0)[0] is None
    # Timings that agree (a second attempt may follow a contradicting first) are recorded.
    session = RetimeSession(([400.0] * 5, [11990.0] * 5), ([401.0] * 5, [52.0] * 5))
    decision, _ = winners.retime_top(session, task(), ledger_of(400.0), 1, 5, 0, 53.0)
    assert decision is not None and decision.chosen == "baseline" and session.calls == 2


def test_a_baseline_that_contradicts_itself_does_not_block_a_tile_faster_than_all_of_it():
    # The H200 reproducer (MLA B1 L4096 h_q 128 against its torch reference, many small ops):
    # the baseline's figures varied 116-667 us on an idle host, the tile's 20.5-20.7 us.
    base = [116.0, 174.2, 153.1, 170.4, 666.8, 612.8]
    tiles = [20.6, 20.5, 20.7, 20.6, 20.6]
    session = RetimeSession((tiles, base))
    decision, _ = winners.retime_top(session, task(), ledger_of(20.6), 1, 5, 0, 288.3)
    assert decision is not None and decision.chosen == "tile" and session.calls == 1
    assert decision.baseline_us == 116.0  # the baseline's fastest figure, a lower bound
    assert decision.band == winners.NOISE_FLOOR  # the baseline's spread stays out of the band
    # Within reach of the tile, a contradicting baseline still blocks the record.
    session = RetimeSession((tiles, [21.0, 90.0, 20.0, 80.0, 22.0]))
    assert winners.retime_top(session, task(), ledger_of(20.6), 1, 5, 0, 21.0)[0] is None
    # So do a tile's own contradicting timings.
    session = RetimeSession(([20.6, 20.5, 90.0, 20.6, 20.6], base))
    assert winners.retime_top(session, task(), ledger_of(20.6), 1, 5, 0, 288.3)[0] is None


def test_a_round_that_slows_every_launch_does_not_widen_the_noise_band():
    # Re-timing rounds measured on the H200 (8 x 4096, 32 heads, head_dim 128): the third round
    # slowed every launch by 5-12%. The kernels 9% faster than the lexicographically first one
    # must not tie with it.
    def config(stages, overlap):
        return {"block_M": 128, "block_N": 128, "num_stages": stages, "overlap": overlap}

    tiles = [(config(2, 2), _timed([3632.0, 3738, 3776, 3776, 3774])),
             (config(1, 2), _timed([3717.0, 3730, 3977, 3741, 3729])),
             (config(1, 0), _timed([4008.0, 4051, 4514, 4064, 4007])),
             (config(2, 0), _timed([3963.0, 3995, 4316, 4012, 3999]))]
    baseline = _timed([3511.0, 3459, 3653, 3376, 3413])
    decision = winners.decide(tiles, baseline)
    assert decision.band < 0.07 and decision.ties == 2  # the old rule: 0.10 (the cap), 4 ties
    assert decision.config == config(1, 2) and decision.chosen == "baseline"
    # One launch alone keeps the spread of its own rounds.
    assert winners.noise_band([_timed([100.0, 104, 102])]) == pytest.approx(0.04 / 1.02)


@pytest.mark.parametrize("gpu", [False, True])
def test_interleaved_timing_rotates_the_launches_and_alternates_them_on_a_gpu(gpu):
    # The harness times the call, its tile kernel and the baseline this way, and the tuner its
    # finalists. On a GPU each sample of one follows a sample of another, the order rotating, so
    # a device whose clocks drift favours none of them; on the host each keeps a warm block.
    calls = []
    launches = [lambda i=i: calls.append(i) for i in range(3)]
    timer = Timer(torch.device("cpu"), budget_s=0)  # 5 samples each: the fewest repeats
    timer.gpu = gpu
    timer._samples = timer._host_samples  # the GPU's order, timed on the host
    timed = timer.interleaved(launches, rounds=2)
    warm_up = len(calls) - 2 * 3 * 5
    assert [i for i, _ in itertools.groupby(calls[:warm_up])] == [0, 1, 2]
    if gpu:
        rows = [calls[k:k + 3] for k in range(warm_up, len(calls), 3)]
        assert all(sorted(row) == [0, 1, 2] for row in rows)
        assert [row[0] for row in rows] == [0, 1, 2, 0, 1] + [1, 2, 0, 1, 2]
    else:  # blocks; round 2 starts one launch later
        assert [i for i, _ in itertools.groupby(calls[warm_up:])] == [0, 1, 2] + [1, 2, 0]
    assert [(len(samples), len(medians)) for samples, medians in timed] == [(10, 2)] * 3


def test_a_retune_replaces_a_record_only_when_it_is_better_or_the_old_one_is_stale(tmp_path):
    t = task()
    db = tmp_path / "user.sqlite"

    def decision(us):
        return winners.Decision("tile", {"block_M": 16, "block_N": 32, "block_K": 64}, us, 2 * us,
                                0.01, 1)

    def stored():
        with TuningDB(db) as tdb:
            (record,) = tdb.records()
        return record

    assert winners.write(db, t, decision(10.0), trials=32)
    assert not winners.write(db, t, decision(12.0), trials=8)  # a narrower, slower re-tune
    assert stored().tile_us == 10.0 and stored().trials == 32
    assert winners.write(db, t, decision(9.0), trials=8)
    assert stored().tile_us == 9.0
    stale = make_record(GEMM, t.target, t.problem, json.loads(stored().config), tile_us=1.0,
                        kernel_hash="0" * 16)
    write_db(db, [stale])
    assert winners.write(db, t, decision(20.0), trials=8)  # fresh beats stale, however fast
    assert stored().tile_us == 20.0


@pytest.fixture(autouse=True)
def _no_held_cases():
    evaluate._held.clear()
    yield
    evaluate._held.clear()


class _WrongWhenLengthsDiffer(type(get_spec("attention"))):
    """Attention whose output is off only where seqlen_q != seqlen_kv (as the `overlap`
    schedule's race was off only at some lengths)."""

    name = "attention_wrong_when_lengths_differ"

    def launch(self, kernel, args, out=None):
        out = super().launch(kernel, args, out)
        if args[0].shape[1] != args[1].shape[1]:
            out[0].mul_(1.5)
        return out


def test_the_gate_checks_unequal_lengths_within_attention_buckets():
    spec = _WrongWhenLengthsDiffer()
    target, _ = resolve_device("cpu")
    problem = spec.parse_problem("1x64x64x2x1x64:causal", "float32")
    assert {"seqlen_kv": 33} in spec.check_sizes(problem)
    assert {"seqlen_q": 33} in spec.check_sizes(problem)
    job = Job(spec, problem, target, "cpu", {"block_M": 16, "block_N": 16})
    m = evaluate.measure(job, seed=0)
    assert m.failure == "wrong" and "seqlen" in m.reason
