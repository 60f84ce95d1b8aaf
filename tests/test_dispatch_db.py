"""Tuning database layering, fallbacks and robustness, and what dispatch does with records."""

from __future__ import annotations

import json
import sqlite3
import warnings

import pytest
import torch
from helpers import make_record, rel_error, write_db

import tileops
from tileops.db import DatabaseError, Resolver, TuningDatabaseWarning, TuningDB, shipped_dbs
from tileops.db.models import SCHEMA_VERSION
from tileops.dispatch import DISPATCHER
from tileops.ops.attention import ATTENTION
from tileops.ops.gemm import GEMM
from tileops.target import Target, target_of

CPU_T = target_of(torch.device("cpu"))
P = GEMM.Problem(16, 64, 96, "float32", "nk", "float32")
CFG_USER = {"block_M": 16, "block_N": 16, "block_K": 32}
CFG_SHIP = {"block_M": 4, "block_N": 32, "block_K": 16}


def choice(problem=P, target=CPU_T):
    return DISPATCHER.choice(GEMM, target, problem)


def test_default_without_databases(tmp_path, use_dbs):
    use_dbs(tmp_path / "none.sqlite")
    c = choice()
    assert c.source == "default" and c.config == GEMM.default_config(P, CPU_T)


def test_user_beats_shipped_and_exact_beats_nearest(tmp_path, use_dbs):
    ship = write_db(tmp_path / "ship.sqlite", [make_record(GEMM, CPU_T, P, CFG_SHIP)])
    near = P._replace(M=32)
    user = write_db(tmp_path / "user.sqlite", [make_record(GEMM, CPU_T, near, CFG_USER)])
    use_dbs(user, [ship])
    c = choice()
    assert (c.source, c.exact, c.config) == ("shipped:ship.sqlite", True, CFG_SHIP)
    # Exact in the user database wins over exact in the shipped one.
    write_db(user, [make_record(GEMM, CPU_T, P, CFG_USER)])
    use_dbs(user, [ship])
    assert (choice().source, choice().config) == ("user", CFG_USER)


def test_nearest_problem_of_same_target(tmp_path, use_dbs):
    far, near = P._replace(M=1024), P._replace(M=32)
    user = write_db(tmp_path / "u.sqlite", [
        make_record(GEMM, CPU_T, far, CFG_SHIP),
        make_record(GEMM, CPU_T, near, CFG_USER),
        make_record(GEMM, CPU_T, P._replace(dtype="float16"), CFG_SHIP),  # not comparable
    ])
    use_dbs(user)
    c = choice()
    assert (c.source, c.exact, c.config) == ("user", False, CFG_USER)
    assert c.record.problem == make_record(GEMM, CPU_T, near, {})["problem"] or c.record


def test_no_configuration_borrowed_from_another_regime(tmp_path, use_dbs):
    # Decode tiles tuned at M = 16 must not serve a prefill GEMM: beyond `nearest_within` neither
    # the record's tile nor its verdict reaches, and the call runs the baseline (a default tile
    # at an untuned M = 100 ran 0.70x cuBLAS beside a tile record at M = 64).
    use_dbs(write_db(tmp_path / "u.sqlite", [make_record(GEMM, CPU_T, P._replace(M=P.M * 8),
                                                         CFG_USER)]))
    assert GEMM.distance(P, P._replace(M=P.M * 8)) > GEMM.nearest_within
    c = choice()
    assert (c.source, c.exact, c.use_baseline) == ("user", False, True)
    assert c.config == GEMM.default_config(P, CPU_T)


def test_a_neighbours_verdict_for_the_baseline_transfers_at_any_distance(tmp_path, use_dbs):
    # Prefill records said cuBLAS wins; a default tile at an untuned M = 333 ran 0.2-0.8x cuBLAS.
    # The verdict reaches beyond `nearest_within` (the baseline suits every problem); the
    # record's configuration does not.
    far = P._replace(M=P.M * 8)
    use_dbs(write_db(tmp_path / "u.sqlite", [make_record(GEMM, CPU_T, far, CFG_USER,
                                                         chosen="baseline")]))
    c = choice()
    assert (c.source, c.exact, c.use_baseline) == ("user", False, True)
    assert c.config == GEMM.default_config(P, CPU_T)
    # Within `nearest_within` the record lends its configuration and its verdict alike.
    use_dbs(write_db(tmp_path / "n.sqlite", [make_record(GEMM, CPU_T, P._replace(M=32),
                                                         CFG_USER, chosen="baseline")]))
    c = choice()
    assert (c.source, c.exact, c.use_baseline, c.config) == ("user", False, True, CFG_USER)


def test_out_of_reach_a_spec_that_does_not_dispatch_its_baseline_takes_the_default(tmp_path,
                                                                                   use_dbs):
    # Chunked prefill with grouped heads never runs its baseline (it would repeat K/V at every
    # call): a record out of reach leaves the default, which a first-use search may replace.
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132)
    def p(text):
        return ATTENTION.parse_problem(text, "bfloat16")

    far_chunked, far_equal = p("4x128x8192x32x8x128:causal"), p("4x512x512x32x8x128:causal")
    cfg = ATTENTION.default_config(far_equal, h200)
    use_dbs(write_db(tmp_path / "u.sqlite", [
        make_record(ATTENTION, h200, far_chunked, cfg, chosen="baseline"),
        make_record(ATTENTION, h200, far_equal, cfg, chosen="baseline")]))
    chunked = p("4x2048x8192x32x8x128:causal")
    assert ATTENTION.distance(chunked, far_chunked) > ATTENTION.nearest_within
    c = DISPATCHER.choice(ATTENTION, h200, chunked)
    assert (c.source, c.use_baseline) == ("default", False)
    c = DISPATCHER.choice(ATTENTION, h200, p("4x8192x8192x32x8x128:causal"))  # cuDNN
    assert (c.source, c.use_baseline) == ("user", True)


def test_a_chunked_call_within_one_bucket_keys_as_chunked(tmp_path, use_dbs):
    # 1000 queries against 1020 keys share the equal-length bucket 1024; the key takes the next
    # bucket of keys so that the equal-length record's cuDNN verdict (a baseline this call could
    # not run) is not borrowed: the call runs a tile kernel.
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132)
    equal = ATTENTION.parse_problem("4x1024x1024x32x8x128:causal", "bfloat16")
    use_dbs(write_db(tmp_path / "u.sqlite", [make_record(
        ATTENTION, h200, equal, ATTENTION.default_config(equal, h200), chosen="baseline")]))
    within = ATTENTION.parse_problem("4x1000x1020x32x8x128:causal", "bfloat16")
    assert (within.seqlen_q, within.seqlen_kv) == (1024, 2048)
    assert ATTENTION.bucket(within) == within  # a key is its own bucket
    assert ATTENTION.distance(within, equal) is None
    c = DISPATCHER.choice(ATTENTION, h200, within)
    assert (c.source, c.use_baseline) == ("default", False)
    q = torch.randn(1, 1000, 2, 64)
    kv = torch.randn(1, 1020, 2, 64)
    assert ATTENTION.prepare(q, kv, kv, causal=True).problem[1:3] == (1024, 2048)
    assert ATTENTION.prepare(q, kv, kv).problem[1:3] == (1024, 1024)  # no mask: no alignment
    assert ATTENTION.prepare(kv, q, q, causal=True).problem[1:3] == (1024, 1024)


def test_records_of_other_targets_are_never_served(tmp_path, use_dbs):
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132)
    mi300 = Target("hip", "gfx942", "AMD Instinct MI300X", 304)
    other_cpu = Target("cpu", CPU_T.arch, "another cpu", 64)
    # Records are validated as the target would build them (check_config included).
    gpu_cfg = {"block_M": 64, "block_N": 128, "block_K": 32, "num_stages": 3, "threads": 128,
               "swizzle": 8, "split_k": 1, "swap_ab": 0, "full_row": 0, "staged_store": 0,
               "stream_k": 0, "cluster_sum": 0}
    hip_cfg = {"block_M": 128, "block_N": 128, "block_K": 32, "num_stages": 2, "threads": 256,
               "swizzle": 0, "k_pack": 1}
    records = [make_record(GEMM, t, P, cfg, space_hash="x")
               for t, cfg in ((h200, gpu_cfg), (mi300, hip_cfg), (other_cpu, CFG_SHIP))]
    records.append(make_record(GEMM, CPU_T, P, CFG_USER))
    use_dbs(write_db(tmp_path / "multi.sqlite", records))
    assert choice().config == CFG_USER
    assert choice(target=h200).config == gpu_cfg
    assert choice(target=mi300).config["block_N"] == 128
    assert choice(target=other_cpu).config == CFG_SHIP
    lone = Target("cuda", "sm_80", "NVIDIA A100", 108)
    assert choice(target=lone).source == "default"


def test_dispatch_runs_the_recorded_config(tmp_path, use_dbs):
    use_dbs(write_db(tmp_path / "u.sqlite", [make_record(GEMM, CPU_T, P, CFG_USER)]))
    a, b, _ = GEMM.make_inputs(P, torch.device("cpu"), sizes={"M": 11})
    out = tileops.gemm(a, b)
    assert rel_error(out, GEMM.reference((a, b))) < 1e-5
    (key, c), = DISPATCHER.choices.items()
    assert c.config == CFG_USER and c.source == "user"


def test_baseline_record_dispatches_to_the_baseline(tmp_path, use_dbs, monkeypatch):
    rec = make_record(GEMM, CPU_T, P, CFG_USER, chosen="baseline", tile_us=20.0, baseline_us=5.0)
    use_dbs(write_db(tmp_path / "u.sqlite", [rec]))
    calls = []
    original = GEMM.launch_baseline
    monkeypatch.setattr(GEMM, "launch_baseline", lambda args: calls.append(1) or original(args))
    a, b, _ = GEMM.make_inputs(P, torch.device("cpu"))
    assert rel_error(tileops.gemm(a, b), GEMM.reference((a, b))) < 1e-5
    assert calls == [1]


def test_override_config(monkeypatch):
    # Values between the space's points are allowed (block_M 2): the override is for debugging.
    monkeypatch.setenv("TILEOPS_CONFIG", '{"gemm": {"block_M": 2, "block_N": 16, "block_K": 24}}')
    c = choice()
    assert (c.source, c.config) == ("override", {"block_M": 2, "block_N": 16, "block_K": 24})
    tileops.reset()
    monkeypatch.setenv("TILEOPS_CONFIG", '{"block_M": 2}')
    with pytest.raises(ValueError, match="must set exactly"):
        choice()


def _expect_warning_and_default(match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = choice()
    assert c.source == "default"
    msgs = [str(w.message) for w in caught if issubclass(w.category, TuningDatabaseWarning)]
    assert len(msgs) == 1 and match in msgs[0], msgs


def test_corrupt_database_warns_once_and_falls_through(tmp_path, use_dbs):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    use_dbs(tmp_path / "none.sqlite", [bad])
    _expect_warning_and_default("bad.sqlite")
    # A second problem does not warn again.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice(P._replace(M=2))
    assert not [w for w in caught if issubclass(w.category, TuningDatabaseWarning)]


def test_shipped_databases_can_be_left_out(monkeypatch):
    """TILEOPS_SHIPPED_DB=0 leaves out the package's databases (a user without them)."""
    assert shipped_dbs()  # tuning_db/h200.sqlite
    for off in ("0", "off"):
        monkeypatch.setenv("TILEOPS_SHIPPED_DB", off)
        assert shipped_dbs() == [] and Resolver().layers()[1:] == []
    monkeypatch.setenv("TILEOPS_SHIPPED_DB", "1")
    assert shipped_dbs()


def test_missing_shipped_database(tmp_path, use_dbs):
    use_dbs(tmp_path / "none.sqlite", [tmp_path / "gone.sqlite"])
    _expect_warning_and_default("does not exist")


def test_not_a_tileops_database(tmp_path, use_dbs):
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    use_dbs(other)
    _expect_warning_and_default("not a tileops database")


def test_newer_schema_is_refused(tmp_path, use_dbs):
    path = write_db(tmp_path / "new.sqlite", [make_record(GEMM, CPU_T, P, CFG_USER)])
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE tileops_meta SET value = ? WHERE key = 'schema_version'",
                     (str(SCHEMA_VERSION + 1),))
    use_dbs(path)
    _expect_warning_and_default("newer")


def test_locked_database(tmp_path, use_dbs):
    path = write_db(tmp_path / "locked.sqlite", [make_record(GEMM, CPU_T, P, CFG_USER)])
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        use_dbs(path)
        _expect_warning_and_default("locked")
    finally:
        holder.rollback()
        holder.close()


def test_stale_records_are_ignored_with_a_warning(tmp_path, use_dbs):
    records = [make_record(GEMM, CPU_T, P, CFG_USER, tilelang_version="0.0.1"),
               make_record(GEMM, CPU_T, P._replace(M=8), CFG_USER, kernel_hash="0" * 16)]
    use_dbs(write_db(tmp_path / "stale.sqlite", records))
    _expect_warning_and_default("2 stale gemm record(s)")


def test_shipped_database_is_opened_read_only(tmp_path, use_dbs):
    ship_dir = tmp_path / "ship"
    ship_dir.mkdir()
    path = write_db(ship_dir / "h.sqlite", [make_record(GEMM, CPU_T, P, CFG_SHIP)])
    before = (path.read_bytes(), sorted(p.name for p in ship_dir.iterdir()))
    use_dbs(tmp_path / "none.sqlite", [path])
    assert choice().config == CFG_SHIP
    with TuningDB(path, readonly=True) as db, pytest.raises(DatabaseError, match="read-only"):
        db.put(**make_record(GEMM, CPU_T, P, CFG_USER))
    assert (path.read_bytes(), sorted(p.name for p in ship_dir.iterdir())) == before


def test_put_replaces_the_record_with_the_same_key(tmp_path):
    path = tmp_path / "db.sqlite"
    with TuningDB(path) as db:
        db.put(**make_record(GEMM, CPU_T, P, CFG_SHIP))
        db.put(**make_record(GEMM, CPU_T, P, CFG_USER, tile_us=3.0))
        db.put(**make_record(GEMM, CPU_T, P._replace(M=2), CFG_USER))
        rows = db.records("gemm", CPU_T.key)
    assert len(rows) == 2 and {r.tile_us for r in rows} == {3.0, 10.0}
    assert db.integrity_errors() == []


def test_target_without_a_kernel_is_refused_clearly(monkeypatch):
    # Dispatch refuses a target kind the operator has no kernel for, before compiling anything.
    from tileops import dispatch as dispatch_module
    from tileops.ops import SPECS

    ascend = Target("ascend", "Ascend910B", "Ascend910B", 30)
    monkeypatch.setattr(dispatch_module._target, "target_of", lambda device: ascend)
    for spec in SPECS.values():
        assert "ascend" in spec.unsupported_reason(ascend)
    with pytest.raises(NotImplementedError, match="gemm has no kernel for ascend"):
        tileops.gemm(torch.randn(2, 3), torch.randn(3, 4))


@pytest.mark.parametrize(("config", "match"), [
    ({"block_M": -32, "block_N": 32, "block_K": 64}, "block_M = -32: must be >= 1"),
    ({"block_M": 0, "block_N": 32, "block_K": 64}, "block_M = 0: must be >= 1"),
    ({"block_M": 100000, "block_N": 32, "block_K": 64}, "block_M = 100000: must be <= 64"),
    ({"block_M": "32", "block_N": 32, "block_K": 64}, "block_M = '32': expected an integer"),
    ({"block_M": 32.5, "block_N": 32, "block_K": 64}, "block_M = 32.5: expected an integer"),
    ({"block_M": True, "block_N": 32, "block_K": 64}, "expected an integer"),
    ({"block_M": 16, "block_N": 32}, "must set exactly"),
    ({"gemm": {"block_M": 16, "block_N": 32, "block_K": 64, "x": 1}}, "must set exactly"),
    ({"gemm": 5, "attention": {}}, "'gemm' must map to a configuration object"),
    ({"gem": {"block_M": 16, "block_N": 32, "block_K": 64}}, "unknown operator 'gem'"),
])
def test_override_values_are_validated_like_any_configuration(monkeypatch, config, match):
    # Negative tiles gave garbage, huge ones a segfault, 0 / "32" / 32.5 pages of CRITICAL logs.
    monkeypatch.setenv("TILEOPS_CONFIG", json.dumps(config))
    with pytest.raises(ValueError, match="TILEOPS_CONFIG") as e:
        tileops.gemm(torch.randn(4, 8), torch.randn(8, 8))
    assert match in str(e.value)


def test_override_is_checked_by_the_operators_check_config(monkeypatch):
    from tileops.ops.mla import MLA_DECODE

    monkeypatch.setenv("TILEOPS_CONFIG", json.dumps(
        {"mla_decode": {"block_H": 16, "block_N": 0},
         "flash_attention": {"block_M": 16, "block_N": 32}}))
    problem = MLA_DECODE.parse_problem("B1xS64xH16", "float32")
    with pytest.raises(ValueError, match="block_N = 0: must be >= 1"):  # not ZeroDivisionError
        DISPATCHER.choice(MLA_DECODE, CPU_T, problem)
    monkeypatch.setenv("TILEOPS_CONFIG", json.dumps(
        {"mla_decode": {"block_H": 16, "block_N": 48}}))
    tileops.reset()
    with pytest.raises(ValueError, match="refused by check_config: block_N 48 does not divide"):
        DISPATCHER.choice(MLA_DECODE, CPU_T, problem)


def _damage(path, sql, *params):
    with sqlite3.connect(path) as conn:
        conn.execute(sql, params)


@pytest.mark.parametrize(("sql", "params", "match"), [
    ("UPDATE tileops_meta SET value = ? WHERE key = 'schema_version'", ("two",),
     "unreadable schema version 'two'"),
    ("UPDATE tileops_meta SET value = ? WHERE key = 'schema_version'", ("0",),
     "cannot migrate"),
    ("UPDATE tileops_records SET config = ?", ("{not json",), "is not JSON"),
    ("UPDATE tileops_records SET config = ?", ('["block_M"]',), "must be an object"),
    ("UPDATE tileops_records SET config = ?", ('{"block_M": 16}',), "must set exactly"),
    ("UPDATE tileops_records SET config = ?", ('{"block_M": "a", "block_N": 16, "block_K": 32}',),
     "expected an integer"),
    ("UPDATE tileops_records SET problem = ?", ("{}",), "unreadable problem"),
    ("UPDATE tileops_records SET chosen = ?", ("maybe",), "chosen is 'maybe'"),
    ("UPDATE tileops_records SET created_at = ?", ("yesterday",), "cannot read"),
])
def test_a_damaged_database_never_escapes_into_the_call(tmp_path, use_dbs, sql, params, match):
    path = write_db(tmp_path / "d.sqlite", [make_record(GEMM, CPU_T, P, CFG_USER)])
    _damage(path, sql, *params)
    use_dbs(path)
    _expect_warning_and_default(match)


def test_a_damaged_neighbour_is_skipped_with_one_warning(tmp_path, use_dbs):
    """A nearest-problem record with a missing key raised a bare KeyError from mla_decode; one
    whose problem field has the wrong type a TypeError from the distance."""
    from tileops.ops.mla import MLA_DECODE

    problem = MLA_DECODE.parse_problem("B1xS64xH16", "float32")
    near = make_record(MLA_DECODE, CPU_T, problem._replace(seqlen=128),
                       {"block_H": 16})
    odd = make_record(MLA_DECODE, CPU_T, problem._replace(seqlen="32"),
                      {"block_H": 16, "block_N": 32})
    use_dbs(write_db(tmp_path / "m.sqlite", [near, odd]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = DISPATCHER.choice(MLA_DECODE, CPU_T, problem)
    assert c.source == "default"
    (w,) = [w for w in caught if issubclass(w.category, TuningDatabaseWarning)]
    assert "skipping 2 unusable mla_decode record(s)" in str(w.message)


def test_user_database_that_is_a_directory(tmp_path, use_dbs):
    (tmp_path / "dir.sqlite").mkdir()
    use_dbs(tmp_path / "dir.sqlite")
    _expect_warning_and_default("is a directory")
