"""Nothing silently wrong, no tuning data lost: what a user trying to break tileops ran into.

Gradients refused, meaningful messages for mistyped arguments, the tuner's exit codes and
messages, a torn Optuna journal, unwritable databases, no output from the library.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import tuner_helpers
from helpers import make_record, write_db

import tileops
from tileops.db import TuningDB
from tileops.ops import SPECS, get_spec
from tileops.target import target_of
from tileops.tuner import studies
from tileops.tuner.cli import tileops_main, tune_main
from tileops.tuner.errors import UsageError

GEMM = get_spec("gemm")
CPU_T = target_of(torch.device("cpu"))
CFG = {"block_M": 16, "block_N": 32, "block_K": 64}


def run(capsys, main, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ---- gradients ----------------------------------------------------------------------------------
def _calls():
    """Each operator without a backward: its Python call and custom op, with inputs (a floating
    one requires grad). GEMM and attention over dense and packed batches have one
    (test_gemm_autograd.py, test_attention_backward.py)."""
    a, w = torch.randn(4, 64), torch.randn(64, 64)
    q, cache = torch.randn(1, 4, 2, 64), torch.randn(1, 16, 2, 64)
    mq, kv = torch.randn(1, 1, 16, 576), torch.randn(2, 64, 1, 576)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    w_fp4, w_scale = tileops.quantize_mxfp4(w)
    return [
        (tileops.flash_attention_with_kvcache, torch.ops.tileops.attention_paged,
         (q, cache, cache.clone(), lens * 4, table)),
        (tileops.mxfp4_gemm, torch.ops.tileops.mxfp4_gemm, (a.bfloat16(), w_fp4, w_scale)),
        (tileops.mla_decode, torch.ops.tileops.mla_decode, (mq, kv, table, lens)),
    ]


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("which", [0, -1])  # the first floating input, the last
def test_an_input_that_requires_grad_is_refused(index, which):
    call, op, args = _calls()[index]
    floating = [i for i, t in enumerate(args) if torch.is_tensor(t) and t.is_floating_point()]
    args = list(args)
    args[floating[which]].requires_grad_(True)
    for f in (call, op):
        with pytest.raises(RuntimeError, match="has no backward: .* requires grad"):
            f(*args)


def test_requires_grad_is_refused_inside_torch_compile():
    q = torch.randn(1, 4, 2, 64, requires_grad=True)
    cache = torch.randn(1, 16, 2, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), 4, dtype=torch.int32)
    compiled = torch.compile(
        lambda q: tileops.flash_attention_with_kvcache(q, cache, cache, lens, table),
        fullgraph=True)
    with pytest.raises(Exception, match="attention_paged has no backward: q requires grad"):
        compiled(q)  # the fake implementation refuses it while tracing


def test_requires_grad_under_no_grad_runs():
    a, w = torch.randn(4, 64), torch.randn(64, 64, requires_grad=True)  # a weight Parameter
    with torch.no_grad():
        out = tileops.gemm(a, w.t())
    torch.testing.assert_close(out, a @ w.detach().t(), rtol=1e-4, atol=1e-4)


# ---- clear messages for mistyped arguments ------------------------------------------------------
def test_mistyped_dtypes_say_what_is_expected():
    a = torch.randn(4, 8)
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype .* got str 'float32'"):
        tileops.gemm(a, a.t(), out_dtype="float32")
    w_fp4, w_scale = tileops.quantize_mxfp4(torch.randn(8, 64))
    for dtype in ("float32", torch.int32):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            tileops.dequantize_mxfp4(w_fp4, w_scale, dtype)


# ---- the tuner's command line -------------------------------------------------------------------
DRY = ["--device", "cpu", "--op", "gemm", "--shape", "8x16x16", "--dtype", "float32",
       "--dry-run", "--no-warm-start"]


@pytest.mark.parametrize("argv", [["--trial-timeout", "nan"], ["--trial-timeout", "inf"],
                                  ["--timeout", "inf"], ["--timeout", "nan"]])
def test_non_finite_times_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tune_main([*DRY, *argv])
    assert e.value.code == 2 and "positive finite number" in capsys.readouterr().err


def test_a_shape_that_starts_with_a_dash(capsys):
    with pytest.raises(SystemExit):
        tune_main(["--device", "cpu", "--op", "gemm", "--shape", "-1x64x64"])
    assert "--shape=-1x64x64" in capsys.readouterr().err
    rc, _, err = run(capsys, tune_main, "--device", "cpu", "--op", "gemm", "--shape=-1x64x64")
    assert rc == 2 and "bad GEMM shape '-1x64x64'" in err and one_line(err)


@pytest.mark.parametrize(("argv", "message"), [
    (["--op", "gemm", "--shape", "8x8x8", "--workers", "2"], "--workers 2 on the CPU"),
    (["--op", "gemm", "--shape", "8x8x8", "--space", '{"block_M": ["16"]}'], "takes int values"),
    (["--op", "gemm", "--shape", "8x8x8", "--space", '{"block_M": [[16]]}'], "takes int values"),
])
def test_more_one_line_errors(argv, message, capsys):
    rc, _, err = run(capsys, tune_main, "--device", "cpu", *argv)
    assert rc == 2 and message in err and one_line(err)


def test_binary_problems_file(tmp_path, capsys):
    path = tmp_path / "problems.bin"
    path.write_bytes(bytes(range(256)))
    rc, _, err = run(capsys, tune_main, "--device", "cpu", "--op", "gemm", "--problems", str(path))
    assert rc == 2 and "is not text" in err and one_line(err)


def test_read_only_database_is_refused_before_any_trial(tmp_path, monkeypatch, capsys):
    db = write_db(tmp_path / "ro.sqlite", [])
    real = os.access
    # chmod does not stop root, who runs these tests in CI: os.access answers as for a user
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and str(p) != str(db))
    rc, _, err = run(capsys, tune_main, "--device", "cpu", "--op", "gemm", "--shape", "8x16x16",
                     "--dtype", "float32", "--trials", "1", "--db", str(db), "--space",
                     json.dumps({"block_M": [16], "block_N": [16], "block_K": [16]}))
    assert rc == 2 and "its file" in err and "read-only" in err and one_line(err)
    assert not (tmp_path / "ro.optuna.journal").exists()  # no study was even opened
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and str(p) != str(tmp_path))
    rc, _, err = run(capsys, tune_main, "--device", "cpu", "--op", "gemm", "--shape", "8x16x16",
                     "--dtype", "float32", "--db", str(db))
    assert rc == 2 and "its directory" in err


def _tune_faulty(tmp_path, *extra):
    return ["--device", "cpu", "--op", tuner_helpers.FAULTY.name, "--shape", "16x64x64",
            "--dtype", "float32", "--trial-timeout", "10", "--db", str(tmp_path / "f.sqlite"),
            "--no-warm-start", *extra]


def test_a_sweep_that_records_nothing_exits_non_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SPECS, tuner_helpers.FAULTY.name, tuner_helpers.FAULTY)
    rc, out, err = run(capsys, tune_main, *_tune_faulty(
        tmp_path, "--space", json.dumps({"block_N": [16], "block_K": [16]})))  # fails to build
    assert rc == 1 and "nothing recorded: all 1 trial(s) failed" in err
    assert "all 1 trial(s) failed" in out  # the results table says it too
    rc, _, err = run(capsys, tune_main, *_tune_faulty(tmp_path, "--timeout", "0.001"))
    assert rc == 1 and "--timeout ran out before any trial ran" in err
    assert "passed its check" not in err


def test_cpu_workers_are_refused_before_anything_runs(capsys):
    rc, _, err = run(capsys, tune_main, "--device", "cpu", "--op", "gemm", "--shape", "8x8x8",
                     "--workers", "2", "--dry-run")
    assert rc == 2 and "same cores" in err


# ---- tileops db ---------------------------------------------------------------------------------
@pytest.fixture
def damaged(tmp_path):
    """A database with a zero latency and a record whose config is not JSON."""
    problem = GEMM.parse_problem("64x256x256", "float32")
    path = write_db(tmp_path / "d.sqlite", [
        make_record(GEMM, CPU_T, problem, CFG, tile_us=0.0),
        make_record(GEMM, CPU_T, problem._replace(M=1), CFG),
    ])
    with TuningDB(path) as db:
        db.put(**{**make_record(GEMM, CPU_T, problem._replace(M=2), CFG), "config": "{oops"})
    return path


@pytest.mark.parametrize("command", [["summary"], ["summary", "--json"], ["show"],
                                     ["show", "--json"]])
def test_summary_and_show_of_a_damaged_database(damaged, command, capsys):
    rc, out, err = run(capsys, tileops_main, "db", *command, "--db", str(damaged))
    assert rc == 0 and "Traceback" not in err and out
    rc, out, _ = run(capsys, tileops_main, "db", "verify", "--db", str(damaged))
    assert rc == 1 and "not a positive latency" in out and "is not JSON" in out


@pytest.mark.parametrize("command", [["summary"], ["verify"], ["verify", "--prune"], ["show"],
                                     ["merge"], ["export"]])
@pytest.mark.parametrize("version", ["two", "0", "-3"])
def test_commands_on_unreadable_schemas(damaged, tmp_path, command, version, capsys):
    import sqlite3

    with sqlite3.connect(damaged) as conn:
        conn.execute("UPDATE tileops_meta SET value = ?", (version,))
    if command == ["merge"]:
        argv = ["merge", str(damaged), "--into", str(tmp_path / "dst.sqlite")]
    elif command == ["export"]:
        argv = ["export", str(tmp_path / "out.sqlite"), "--db", str(damaged)]
    else:
        argv = [*command, "--db", str(damaged)]
    rc, _, err = run(capsys, tileops_main, "db", *argv)
    assert rc == 2 and one_line(err)
    assert ("unreadable schema version 'two'" if version == "two" else "cannot migrate") in err


def test_migrate_command(tmp_path, monkeypatch, capsys):
    import sqlite3

    from tileops.db import models

    path = write_db(tmp_path / "old.sqlite", [])
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE tileops_meta SET value = ?", (str(models.SCHEMA_VERSION - 1),))
    monkeypatch.setitem(models.MIGRATIONS, models.SCHEMA_VERSION - 1, lambda conn: None)
    rc, _, err = run(capsys, tileops_main, "db", "summary", "--db", str(path))
    assert rc == 2 and f"tileops db migrate {path}" in err  # the command the message names
    rc, out, _ = run(capsys, tileops_main, "db", "migrate", str(path))
    assert rc == 0 and f"migrated from {models.SCHEMA_VERSION - 1}" in out
    rc, out, _ = run(capsys, tileops_main, "db", "migrate", str(path))
    assert rc == 0 and "already current" in out
    assert run(capsys, tileops_main, "db", "summary", "--db", str(path))[0] == 0


def test_export_never_destroys_its_input(damaged, tmp_path, capsys):
    before = damaged.read_bytes()
    rc, _, err = run(capsys, tileops_main, "db", "export", str(damaged), "--db", str(damaged),
                     "--force", "--op", "attention")
    assert rc == 2 and "read from" in err and one_line(err)
    link = tmp_path / "link.sqlite"
    link.symlink_to(damaged)
    rc, _, _ = run(capsys, tileops_main, "db", "export", str(link), "--db", str(damaged), "--force")
    assert rc == 2 and damaged.read_bytes() == before
    (tmp_path / "dir").mkdir()
    rc, _, err = run(capsys, tileops_main, "db", "export", str(tmp_path / "dir"), "--db",
                     str(damaged), "--force")
    assert rc == 2 and "is a directory" in err and one_line(err)


def test_a_failed_export_leaves_the_old_file(damaged, tmp_path, monkeypatch, capsys):
    out = write_db(tmp_path / "out.sqlite", [make_record(GEMM, CPU_T, GEMM.parse_problem(
        "4x8x8", "float32"), CFG)])
    before = out.read_bytes()

    def full_disk(self, items):
        raise tileops.db.DatabaseError("disk full")

    monkeypatch.setattr(TuningDB, "put_many", full_disk)
    rc, _, err = run(capsys, tileops_main, "db", "export", str(out), "--db", str(damaged),
                     "--force", "--include-stale")
    assert rc == 2 and "disk full" in err
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "d.sqlite", "out.sqlite"]


def test_user_database_that_is_a_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEOPS_USER_DB", str(tmp_path))
    rc, _, err = run(capsys, tileops_main, "db", "summary")
    assert rc == 2 and "is a directory" in err


# ---- the Optuna journal -------------------------------------------------------------------------
def _journal_with_trials(path, n):
    storage = studies.open_storage(str(path))
    study = studies.optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
    for i in range(n):
        study.add_trial(studies.optuna.trial.create_trial(params={}, distributions={}, value=i))


def _trials(path):
    storage = studies.open_storage(str(path))
    return [t.value for t in studies.optuna.load_study(study_name="s", storage=storage).trials]


@pytest.fixture
def tuner_log():
    """The messages the tuner logs (whatever handlers an earlier test configured)."""
    handler = logging.Handler(logging.WARNING)
    messages: list[str] = []
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("tileops.tuner").addHandler(handler)
    yield messages
    logging.getLogger("tileops.tuner").removeHandler(handler)


def test_a_torn_journal_tail_is_set_aside(tmp_path, tuner_log):
    path = tmp_path / "x.optuna.journal"
    _journal_with_trials(path, 2)
    torn = b'{"op_code": 5, "sta'
    with open(path, "ab") as f:
        f.write(torn)
    assert _trials(path) == [0, 1]
    (message,) = tuner_log
    assert "x.optuna.journal.torn" in message and "1 damaged record" in message
    assert (tmp_path / "x.optuna.journal.torn").read_bytes() == torn + b"\n"
    _journal_with_trials(path, 1)  # later runs append and read normally
    assert _trials(path) == [0, 1, 0]
    assert len(tuner_log) == 1


def test_a_record_appended_to_a_torn_one_is_kept(tmp_path):
    """What runs before this repair left: the next run's first record on the torn line."""
    path = tmp_path / "y.optuna.journal"
    _journal_with_trials(path, 1)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + b'{"op_code": 5, "sta' + lines[-1])
    assert _trials(path) == [0]
    assert (tmp_path / "y.optuna.journal.torn").read_bytes() == b'{"op_code": 5, "sta\n'


# ---- a library does not print -------------------------------------------------------------------
def test_compiling_prints_nothing(monkeypatch, capsys, caplog):
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")  # compile for real
    a, b = torch.randn(3, 24), torch.randn(24, 40)
    monkeypatch.setenv("TILEOPS_CONFIG", json.dumps({"block_M": 4, "block_N": 16, "block_K": 8}))
    tileops.gemm(a, b)
    assert capsys.readouterr() == ("", "")
    # ...unless asked for: the tileops logger at DEBUG lets TileLang's lines through.
    monkeypatch.setenv("TILEOPS_CONFIG", json.dumps({"block_M": 4, "block_N": 16, "block_K": 16}))
    tileops.reset()
    logging.getLogger("tileops").setLevel(logging.DEBUG)
    try:
        tileops.gemm(a, b)
    finally:
        logging.getLogger("tileops").setLevel(logging.NOTSET)
    assert "TileLang begins to compile" in capsys.readouterr().out


# ---- discoverability ----------------------------------------------------------------------------
def test_ops_lists_every_operator_from_its_spec(capsys):
    rc, out, _ = run(capsys, tileops_main, "ops")
    assert rc == 0
    for spec in SPECS.values():
        assert spec.name in out and spec.problem_syntax in out and spec.function in out
    assert "attention (also flash_attention)" in out
    assert "cuda (not sm_8*), cpu" in out  # mla_decode's targets


def test_attention_has_its_python_name_too(capsys):
    assert get_spec("flash_attention") is get_spec("attention")
    rc, out, _ = run(capsys, tune_main, "--device", "cpu", "--op", "flash_attention", "--shape",
                     "1x16x2x64", "--dtype", "float32", "--dry-run", "--no-warm-start")
    assert rc == 0 and "configurations pass the checks" in out


def test_tune_from_python(tmp_path):
    db = tmp_path / "api.sqlite"
    outcome = tileops.tune("gemm", "8x16x16", device="cpu", dtype="float32", trials=1, db=str(db),
                           quiet=True, space=json.dumps({"block_M": [16], "block_N": [16],
                                                         "block_K": [16]}), no_warm_start=True)
    (result,) = outcome.results
    assert outcome.code == 0 and result.decision is not None
    with TuningDB(db) as tdb:
        (record,) = tdb.records("gemm")
    assert json.loads(record.config) == {"block_M": 16, "block_N": 16, "block_K": 16}
    with pytest.raises(UsageError, match="unknown operator"):
        tileops.tune("nosuchop", "8x8x8", device="cpu")
    with pytest.raises(UsageError, match="trials"):
        tileops.tune("gemm", "8x8x8", device="cpu", trials=0)
