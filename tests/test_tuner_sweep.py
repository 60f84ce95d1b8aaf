"""Tuner sweeps on the CPU target: records that dispatch uses, and failures that never win."""

from __future__ import annotations

import json

import optuna
import torch
import tuner_helpers

import tileops
from tileops.db import TuningDB
from tileops.db.layers import stale_reason
from tileops.dispatch import DISPATCHER
from tileops.ops import SPECS, get_spec
from tileops.target import target_of
from tileops.tuner import studies
from tileops.tuner.cli import tune_main

TINY = {"block_M": [16, 64], "block_N": [32], "block_K": [64]}


def load_study(db):
    storage = studies.open_storage(studies.default_storage(db))
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def test_sweep_records_winners_that_dispatch_uses(tmp_path, capsys):
    db = tmp_path / "user.sqlite"  # the conftest points TILEOPS_USER_DB here
    rc = tune_main(["--device", "cpu", "--op", "gemm", "--shape", "1x128x128",
                    "--shape", "40x128x128", "--dtype", "float32", "--space", json.dumps(TINY),
                    "--trials", "2", "--db", str(db), "--retime-top", "2", "--quiet"])
    assert rc == 0
    assert capsys.readouterr().out == ""  # --quiet
    spec = get_spec("gemm")
    with TuningDB(db) as tdb:
        records = tdb.records("gemm")
    assert len(records) == 2
    target = target_of(torch.device("cpu"))
    for r in records:
        assert r.trials == 2 and r.baseline_us > 0 and r.tile_us > 0
        assert r.chosen in ("tile", "baseline")
        assert json.loads(r.config) in [{"block_M": m, "block_N": 32, "block_K": 64}
                                        for m in (16, 64)]
        assert stale_reason(spec, r) is None
        assert (r.target_kind, r.arch, r.device) == target.key
    tileops.reset()
    for r in records:
        problem = spec.problem_from_dict(json.loads(r.problem))
        choice = DISPATCHER.choice(spec, target, problem)
        assert choice.source == "user" and choice.exact
        assert choice.config == json.loads(r.config)
        assert choice.use_baseline == (r.chosen == "baseline")
    a, w = torch.randn(33, 128), torch.randn(128, 128)
    torch.testing.assert_close(tileops.gemm(a, w.t()), a @ w.t(), rtol=1e-4, atol=1e-4)
    assert any(c.source == "user" for c in DISPATCHER.choices.values())


def test_failures_never_win_and_do_not_stop_the_sweep(tmp_path, monkeypatch):
    monkeypatch.setitem(SPECS, tuner_helpers.FAULTY.name, tuner_helpers.FAULTY)
    db = tmp_path / "faulty.sqlite"
    rc = tune_main(["--device", "cpu", "--op", tuner_helpers.FAULTY.name, "--shape", "16x64x64",
                    "--dtype", "float32", "--trials", "8", "--sampler", "grid",
                    "--trial-timeout", "10", "--abandon", "0", "--db", str(db), "--quiet"])
    assert rc == 0
    study = load_study(db)
    verdicts = {}
    for t in study.get_trials(deepcopy=False):
        if studies.REPEAT_OF in t.user_attrs or t.state == optuna.trial.TrialState.FAIL:
            continue
        what = tuner_helpers.fault(t.params)
        verdicts[what or json.dumps(t.params, sort_keys=True)] = (
            t.state.name, t.user_attrs.get(studies.FAILURE), t.user_attrs.get(studies.REASON))
    assert verdicts["compile"][:2] == ("PRUNED", "compile")
    assert "injected compile failure" in verdicts["compile"][2]
    assert verdicts["wrong"][:2] == ("PRUNED", "wrong")
    assert verdicts["unwritten"][:2] == ("PRUNED", "wrong") and "NaN" in verdicts["unwritten"][2]
    assert verdicts["hang"][:2] == ("PRUNED", "timeout")
    assert verdicts["crash"][:2] == ("PRUNED", "crash") and "SIGSEGV" in verdicts["crash"][2]
    assert verdicts["refused"][:2] == ("PRUNED", "constraint")
    good = [v for k, v in verdicts.items() if k.startswith("{")]
    assert len(good) == 2 and all(state == "COMPLETE" for state, _, _ in good)
    with TuningDB(db) as tdb:
        (record,) = tdb.records(tuner_helpers.FAULTY.name)
    assert json.loads(record.config) in tuner_helpers.GOOD
    assert record.trials == 7  # every configuration but the refused one was compiled
