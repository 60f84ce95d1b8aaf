"""What serving engines need from the library on the CPU: first calls from several threads."""

from __future__ import annotations

import threading

import torch
from helpers import make_record, write_db

import tileops
from tileops import dispatch
from tileops.target import target_of


def test_threads_making_the_first_call_at_once_compile_once_and_all_get_it_right(
        tmp_path, monkeypatch, use_dbs):
    spec = tileops.get_spec("gemm")
    target = target_of(torch.device("cpu"))
    problem = spec.parse_problem("8x64x48", "float32")
    db = write_db(tmp_path / "user.sqlite", [make_record(
        spec, target, problem, {"block_M": 16, "block_N": 16, "block_K": 16})])
    use_dbs(db)  # the record is read from SQLite by whichever thread comes first
    compiles = []
    compile_once = dispatch._compile

    def counted(*args, **kwargs):
        compiles.append(threading.get_ident())
        return compile_once(*args, **kwargs)

    monkeypatch.setattr(dispatch, "_compile", counted)
    a, w = torch.randn(8, 48), torch.randn(64, 48)
    start = threading.Barrier(6)
    outs, errors = [], []

    def first_call():
        try:
            start.wait(timeout=60)
            outs.append(tileops.gemm(a, w.t()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=first_call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)  # no deadlock
    assert errors == [] and len(outs) == 6 and len(compiles) == 1
    for out in outs:
        torch.testing.assert_close(out, a @ w.t(), rtol=1e-4, atol=1e-4)
    (choice,) = dispatch.DISPATCHER.choices.values()
    assert choice.source == "user" and choice.exact


def test_tune_on_first_use_is_off_by_default_and_records_when_asked(monkeypatch):
    from tileops import autotune

    spec = tileops.get_spec("gemm")
    a, w = torch.randn(8, 40), torch.randn(24, 40)
    tileops.gemm(a, w.t())
    (choice,) = dispatch.DISPATCHER.choices.values()
    assert choice.source == "default"  # off: the default, nothing tuned
    monkeypatch.setenv("TILEOPS_AUTOTUNE", "1")
    monkeypatch.setenv("TILEOPS_AUTOTUNE_TRIALS", "2")
    tileops.reset()
    out = tileops.gemm(a, w.t())
    torch.testing.assert_close(out, a @ w.t(), rtol=1e-4, atol=1e-4)
    problem = spec.prepare(a, w.t()).problem
    choice = dispatch.DISPATCHER.choice(spec, target_of(torch.device("cpu")), problem)
    assert choice.source == "user" and choice.exact and choice.record.trials == 2
    tileops.set_autotune(False)  # the Python switch wins over the environment
    try:
        assert autotune.policy() is None
    finally:
        monkeypatch.setattr(autotune, "_from_env", True)
