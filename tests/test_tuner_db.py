"""`tileops db` (summary, show, export, merge, verify), suites, and the tuner's one-line errors."""

from __future__ import annotations

import datetime as dt
import json
import sqlite3

import pytest
from helpers import make_record, write_db

from tileops.db import TuningDB
from tileops.ops import get_spec
from tileops.target import Target
from tileops.tuner import suites
from tileops.tuner.cli import tileops_main, tune_main
from tileops.tuner.errors import UsageError

GEMM = get_spec("gemm")
CPU = Target("cpu", "x86_64", "Test CPU", 8)
H200 = Target("cuda", "sm_90a", "NVIDIA H200", 132)


def problem(text: str, dtype: str = "float32"):
    return GEMM.parse_problem(text, dtype)


def rec(target, text, config, **kw):
    dtype = "float32" if target.kind == "cpu" else "bfloat16"
    return make_record(GEMM, target, problem(text, dtype), config, **kw)


CPU_CFG = {"block_M": 16, "block_N": 32, "block_K": 64}
GPU_CFG = {"block_M": 128, "block_N": 128, "block_K": 64, "num_stages": 3, "threads": 256,
           "swizzle": 0, "split_k": 1, "swap_ab": 0, "full_row": 0, "staged_store": 0,
           "stream_k": 0, "cluster_sum": 0}


@pytest.fixture
def src(tmp_path):
    return write_db(tmp_path / "src.sqlite", [
        rec(CPU, "64x256x256", CPU_CFG, tile_us=10.0, baseline_us=20.0),
        rec(CPU, "1x256x256", CPU_CFG, tile_us=30.0, baseline_us=20.0, chosen="baseline"),
        rec(H200, "64x4096x4096", GPU_CFG, tile_us=9.0, baseline_us=18.0),
        rec(H200, "1x4096x4096", GPU_CFG, tilelang_version="0.0.1"),  # stale
    ])


def run(capsys, *argv):
    rc = tileops_main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_summary_and_show(src, capsys):
    rc, out, _ = run(capsys, "db", "summary", "--db", str(src), "--json")
    assert rc == 0
    rows = {r["target"]: r for r in json.loads(out)}
    assert rows["cpu:x86_64"]["records"] == 2 and rows["cpu:x86_64"]["tile_chosen"] == 1
    assert rows["cpu:x86_64"]["median_speedup"] == pytest.approx((2.0 + 1.0) / 2)
    assert rows["cuda:sm_90a"]["stale"] == 1 and rows["cuda:sm_90a"]["units"] == 132
    rc, out, _ = run(capsys, "db", "summary", "--db", str(src))
    assert rc == 0 and "NVIDIA H200" in out
    rc, out, _ = run(capsys, "db", "show", "--db", str(src), "--target", "cpu", "--json")
    assert rc == 0 and {r["target_kind"] for r in json.loads(out)} == {"cpu"}


def test_export_copies_chosen_fresh_records_compacted(src, tmp_path, capsys):
    out = tmp_path / "ship" / "h200.sqlite"
    rc, text, _ = run(capsys, "db", "export", str(out), "--db", str(src), "--target",
                      "cuda:sm_90a", "--op", "gemm")
    assert rc == 0 and "exported 1 record" in text
    with TuningDB(out, readonly=True) as db:
        (r,) = db.records()
    assert (r.device, r.tile_us, r.created_at) == ("NVIDIA H200", 9.0, dt.datetime(2026, 1, 1))
    with sqlite3.connect(out) as conn:
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    rc, _, err = run(capsys, "db", "export", str(out), "--db", str(src))
    assert rc == 2 and "--force" in err
    rc, _, _ = run(capsys, "db", "export", str(out), "--db", str(src), "--include-stale",
                   "--force")
    with TuningDB(out, readonly=True) as db:
        assert len(db.records()) == 4
    assert run(capsys, "db", "verify", "--db", str(out))[0] == 1  # the stale one is reported


def test_merge_rule(tmp_path, capsys):
    key = "64x256x256"
    dst = write_db(tmp_path / "dst.sqlite", [
        rec(CPU, key, CPU_CFG, tile_us=10.0),  # vs faster fresh: replaced
        rec(CPU, "2x256x256", CPU_CFG, tile_us=10.0),  # vs slower fresh: kept
        rec(CPU, "4x256x256", CPU_CFG, tile_us=5.0, tilelang_version="0.0.1"),  # stale: replaced
        rec(CPU, "8x256x256", CPU_CFG, tile_us=50.0),  # vs stale faster: kept
        rec(CPU, "16x256x256", CPU_CFG, tile_us=5.0),  # other unit count, newer: replaced
    ])
    src = write_db(tmp_path / "src.sqlite", [
        rec(CPU, key, CPU_CFG, tile_us=8.0),
        rec(CPU, "2x256x256", CPU_CFG, tile_us=12.0),
        rec(CPU, "4x256x256", CPU_CFG, tile_us=9.0),
        rec(CPU, "8x256x256", CPU_CFG, tile_us=1.0, tilelang_version="0.0.1"),
        rec(CPU, "16x256x256", CPU_CFG, tile_us=9.0, units=4,
            created_at=dt.datetime(2026, 2, 1)),
        rec(CPU, "32x256x256", CPU_CFG, tile_us=7.0),  # new key: added
    ])
    rc, out, _ = run(capsys, "db", "merge", str(src), "--into", str(dst))
    assert rc == 0 and "1 added, 3 replaced, 2 kept" in out
    with TuningDB(dst) as db:
        got = {json.loads(r.problem)["M"]: r.tile_us for r in db.records()}
    assert got == {64: 8.0, 2: 10.0, 4: 9.0, 8: 50.0, 16: 9.0, 32: 7.0}
    rc, _, err = run(capsys, "db", "merge", str(tmp_path / "missing.sqlite"), "--into", str(dst))
    assert rc == 2 and "does not exist" in err


def test_verify_reports_and_prunes(tmp_path, capsys):
    db = write_db(tmp_path / "v.sqlite", [
        rec(CPU, "64x256x256", CPU_CFG),
        rec(CPU, "1x256x256", {"block_M": 16}),  # keys differ from the space
        rec(CPU, "2x256x256", CPU_CFG, kernel_hash="0" * 16),  # stale
        rec(H200, "64x4096x4096", {**GPU_CFG, "block_M": 256, "block_N": 256, "threads": 128,
                                   "num_stages": 4}),  # refused by check_config
    ])
    with TuningDB(db) as tdb:
        tdb.put(**{**rec(CPU, "4x256x256", CPU_CFG), "op": "nosuchop"})
    rc, out, _ = run(capsys, "db", "verify", "--db", str(db))
    assert rc == 1
    assert "must set exactly" in out and "stale" in out and "check_config" in out
    assert "unknown operator" in out and "4 issue(s) found" in out
    rc, out, _ = run(capsys, "db", "verify", "--db", str(db), "--prune")
    assert rc == 0 and "4 record(s) deleted" in out
    assert run(capsys, "db", "verify", "--db", str(db))[0] == 0


@pytest.mark.parametrize("argv, message", [
    (["--op", "nosuchop", "--shape", "1x2x3"], "unknown operator 'nosuchop'"),
    (["--op", "gemm", "--shape", "1x2"], "bad GEMM shape"),
    (["--suite", "nosuchsuite"], "unknown suite 'nosuchsuite'"),
    (["--op", "gemm", "--shape", "8x8x8", "--device", "cuda:3"], "--device cuda:3"),
    (["--op", "gemm", "--shape", "8x8x8", "--device", "tpu"], "unknown device"),
    (["--op", "gemm", "--shape", "8x8x8", "--space", '{"tile": [1]}'], "unknown parameter"),
    (["--op", "gemm", "--problems", "/nonexistent/file"], "cannot read problems file"),
])
def test_clear_one_line_errors(argv, message, capsys):
    assert tune_main(["--device", "cpu", *argv] if "--device" not in argv else argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unreadable_database_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    assert tune_main(["--device", "cpu", "--op", "gemm", "--shape", "8x8x8", "--dtype",
                      "float32", "--db", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and len(err.strip().splitlines()) == 1
    assert tileops_main(["db", "summary", "--db", str(bad)]) == 2


def test_dry_run_lists_checked_configs_without_hardware(capsys):
    rc = tune_main(["--device", '{"kind": "cuda", "arch": "sm_90a"}', "--op", "gemm",
                    "--shape", "64x4096x4096", "--dry-run", "--no-warm-start"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and "configurations pass the checks" in out[0]
    configs = [json.loads(line) for line in out[1:]]
    target = Target("cuda", "sm_90a", "x", 132)
    assert configs and all(GEMM.check_config(problem("64x4096x4096", "bfloat16"), c, target)
                           is None for c in configs)


def test_dry_run_lowers_each_config_for_an_absent_target(capsys):
    space = {"block_M": [64, 128], "block_N": [64], "block_K": [32], "num_stages": [2],
             "threads": [256], "swizzle": [0], "k_pack": [1, 2]}
    rc = tune_main(["--device", '{"kind": "hip", "mcpu": "gfx942"}', "--op", "gemm",
                    "--shape", "256x512x512", "--dtype", "float16", "--space", json.dumps(space),
                    "--dry-run", "--lower", "--no-warm-start"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 5 and all(line.endswith("  lowers") for line in out[1:])


def test_dry_run_compiles_each_kernel_once_into_the_cache(tmp_path, monkeypatch, capsys):
    """`--dry-run --compile` fills TileLang's kernel cache, so that a later sweep loads the
    kernels: two problems of one M bucket family share their kernels (M is dynamic)."""
    cache = tmp_path / "kernel-cache"
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    space = {"block_M": [4, 16], "block_N": [16], "block_K": [16]}
    rc = tune_main(["--device", "cpu", "--op", "gemm", "--shape", "4x16x16", "--shape",
                    "16x16x16", "--dtype", "float32", "--space", json.dumps(space), "--dry-run",
                    "--compile", "--no-warm-start", "--jobs", "2"])
    assert rc == 0
    assert "compiled 2 of 2 (0 failed)" in capsys.readouterr().err
    assert len([p for p in cache.rglob("*") if p.is_dir() and p.parent.name == "kernels"]) == 2


def test_suites():
    llama = suites.load("gemm_llama")
    assert llama.op == "gemm" and len(llama.problems) == 7 * 8 * 2
    assert {p.M for p in llama.problems} == {1, 16, 64, 256, 1024, 4096, 8192}
    assert {(p.N, p.K) for p in llama.problems} == {
        (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
        (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)}
    assert {p.layout for p in llama.problems} == {"nk"}
    assert {p.dtype for p in llama.problems} == {"bfloat16", "float16"}
    assert len(suites.load("gemm_llama", ["float16"]).problems) == 56
    quick = suites.load("quickstart")
    assert quick.problems and all(p.dtype == "bfloat16" for p in quick.problems)
    with pytest.raises(UsageError, match="unknown suite"):
        suites.load("nope")


def test_suite_problems_selected_by_a_field():
    suite = suites.load("attention")
    spec = suites.named_spec(suite.op)
    half = suites.select(spec, suite.problems, "head_dim=64")
    assert len(half) == 20 and {p.head_dim for p in half} == {64}
    assert len(suites.select(spec, suite.problems, "head_dim=64,128")) == 40
    with pytest.raises(UsageError, match="no field 'head_dm'"):
        suites.select(spec, suite.problems, "head_dm=64")


def test_suite_file_format(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('op = "gemm"\ndtypes = ["float32"]\nproblems = ["3x8x8"]\n'
                    '[[groups]]\nproblems = ["{M}x{N}x16:kn"]\nM = [1, 2]\nN = 32\n'
                    '[[tables]]\nM = 4\nN = 8\nK = [8, 16]\ndtype = "float16"\n'
                    'layout = "nk"\nout_dtype = "float32"\n')
    got = suites.load(str(path)).problems
    assert got[0] == problem("3x8x8")
    assert got[1:3] == [problem("1x32x16:kn"), problem("2x32x16:kn")]
    assert [p.K for p in got[3:]] == [8, 16] and got[3].out_dtype == "float32"
    cases = suites.load(str(path)).cases  # as the suite names them; a table's are its problems
    assert cases[0] == GEMM.parse_exact("3x8x8", "float32") and cases[0].M == 3
    assert cases[1:] == got[1:]
    lines = tmp_path / "p.txt"
    lines.write_text("# comment\n64x8x8\n1x8x8 float16  # trailing\n")
    assert suites.read_problems_file(GEMM, str(lines), ["float32"]) == [
        problem("64x8x8"), problem("1x8x8", "float16")]


def test_suite_cases_keep_the_lengths_they_name(tmp_path):
    """The tuner tunes each length's bucket; benchmarks run the lengths the suite names."""
    attention = get_spec("attention")
    path = tmp_path / "odd.toml"
    path.write_text('op = "attention"\ndtypes = ["bfloat16"]\nproblems = '
                    '["4x3000x3000x32x8x128:causal", "4x2500x2500x32x8x128:causal"]\n')
    suite = suites.load(str(path))
    assert suite.problems == [attention.Problem(4, 4096, 4096, 32, 8, 128, True, "bfloat16")]
    assert suite.cases == [attention.Problem(4, 3000, 3000, 32, 8, 128, True, "bfloat16"),
                           attention.Problem(4, 2500, 2500, 32, 8, 128, True, "bfloat16")]
    offsuite = suites.load("attention_offsuite")
    assert {c.seqlen_q for c in offsuite.cases} >= {1000, 3000, 12000}
    assert {p.seqlen_q for p in offsuite.problems} >= {1024, 4096, 16384}
    assert offsuite.problems == list(dict.fromkeys(map(attention.bucket, offsuite.cases)))


def test_shipped_records_match_this_kernel_source():
    """A kernel change that stales the shipped records needs a re-tune (or dropping them):
    dispatch ignores stale records, so they would ship as dead weight."""
    from tileops.db.layers import stale_reason
    from tileops.resources import data_dir

    shipped = sorted(data_dir("tuning_db").glob("*.sqlite"))
    assert shipped
    for path in shipped:
        with TuningDB(path) as tdb:
            for record in tdb.records():
                reason = stale_reason(get_spec(record.op), record)
                assert reason is None, f"{path.name}: {record.op} {record.problem}: {reason}"


def test_restamp_takes_exactly_the_records_whose_kernels_did_not_change(tmp_path, monkeypatch,
                                                                         capsys):
    """`db sources` before a refactor, `db restamp` after it: a record whose kernel is generated
    as before takes the new kernel hash; one whose kernel changed, and one stale for another
    reason, stay stale."""
    path = write_db(tmp_path / "db.sqlite", [
        rec(CPU, "64x256x256", CPU_CFG), rec(CPU, "16x256x256", {**CPU_CFG, "block_M": 4}),
        rec(CPU, "1x256x256", CPU_CFG, tilelang_version="0.0.1")])
    sources = tmp_path / "before.json"
    assert run(capsys, "db", "sources", "--db", str(path), "--out", str(sources))[0] == 0
    assert len(json.loads(sources.read_text())["sources"]) == 3
    monkeypatch.setattr(type(GEMM), "kernel_hash", lambda self: "refactored")
    build = type(GEMM).build  # the refactor changes the kernel of block_M 4 only

    def refactored(self, problem, config, target):
        return build(self, problem, {**config, "block_N": 16} if config["block_M"] == 4
                     else config, target)

    monkeypatch.setattr(type(GEMM), "build", refactored)
    rc, out, _ = run(capsys, "db", "restamp", str(sources), "--db", str(path))
    assert rc == 0
    assert "1 record(s) restamped, 1 with changed kernels left stale, 1 stale for other" in out
    with TuningDB(path) as tdb:
        hashes = {json.loads(r.problem)["M"]: r.kernel_hash for r in tdb.records()}
    assert hashes[64] == "refactored" and "refactored" not in (hashes[16], hashes[1])


def test_a_kernel_hashes_alike_whichever_reduction_workspace_its_reductions_take(tmp_path,
                                                                                 monkeypatch):
    """TileLang 0.1.15 hands a kernel's equal reduction workspaces to its reductions in an order
    that varies between lowerings; the generated-code hash must not see it, but must see where
    the workspaces lie."""
    import types

    from tileops import dispatch
    from tileops.tuner import dbtools

    head = "void* workspace = buf + 0; void* workspace_1 = buf + 1024;\n"
    sources = iter([head + "max(workspace_1); sum(workspace);",
                    head + "max(workspace); sum(workspace_1);",
                    head.replace("1024", "2048") + "max(workspace); sum(workspace_1);"])
    monkeypatch.setattr(dispatch, "lower", lambda f, t: types.SimpleNamespace(
        kernel_source=next(sources)))
    path = write_db(tmp_path / "db.sqlite", [rec(CPU, "64x256x256", CPU_CFG)])
    with TuningDB(path) as tdb:
        (record,) = tdb.records()
    first, swapped, moved = (dbtools.kernel_source_hash(record, {}) for _ in range(3))
    assert first == swapped != moved
