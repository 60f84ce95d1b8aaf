"""Sweeps that are interrupted and resumed, and workers that share one Optuna storage."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import tuner_helpers
from optuna.trial import TrialState
from tuner_helpers import FakeSession

from tileops.db import TuningDB
from tileops.ops import get_spec
from tileops.target import resolve_device
from tileops.tuner import lifecycle, studies, sweep
from tileops.tuner.cli import tune_main
from tileops.tuner.progress import Progress
from tileops.tuner.search import Limits, Task, search

SPACE = {"block_M": [16, 64], "block_N": [32, 64], "block_K": [64]}
ROOT = Path(__file__).resolve().parents[1]


def command(db: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--op", "gemm", "--shape", "64x128x128", "--dtype", "float32",
            "--space", json.dumps(SPACE), "--abandon", "0", "--db", str(db), "--quiet", *extra]


def trials(db: Path) -> list[optuna.trial.FrozenTrial]:
    storage = studies.open_storage(studies.default_storage(db))
    names = optuna.get_all_study_names(storage)
    if not names:
        return []
    return optuna.load_study(study_name=names[0], storage=storage).get_trials(deepcopy=False)


def counted(db: Path) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials(db) if t.user_attrs.get(studies.COUNTED)
            and studies.REPEAT_OF not in t.user_attrs]


def _default_sigint() -> None:
    """Ctrl-C's default action in a child: a shell that starts a job in the background ignores
    SIGINT for it, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(db: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "tileops.tuner", "tune", *command(db, *extra)]
    return subprocess.Popen(args, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)


def wait_for_complete(db: Path, n: int, proc: subprocess.Popen, limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if sum(t.state == TrialState.COMPLETE for t in counted(db)) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.3)
    raise AssertionError(f"no {n} complete trials after {limit} s")


def session_processes(sid: int) -> list[int]:
    """Processes still alive in a session (Linux /proc)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_interrupted_and_killed_sweeps_resume(tmp_path, monkeypatch):
    # An empty kernel cache: every trial compiles (seconds), so signals land mid-trial.
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "kernels"))
    db = tmp_path / "resume.sqlite"
    extra = ("--trials", "4", "--jobs", "1", "--sampler", "grid")
    # Ctrl-C: the trial in flight is given back, the command says how to resume.
    proc = start(db, *extra)
    wait_for_complete(db, 1, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "run the same command again" in err
    assert not any(t.state == TrialState.RUNNING for t in trials(db))
    # A kill: only the main process, its children must go with it.
    done = len(counted(db))
    proc = start(db, *extra)
    wait_for_complete(db, done + 1, proc)
    proc.kill()
    proc.wait()
    time.sleep(2)
    if sys.platform.startswith("linux"):
        assert session_processes(proc.pid) == []
    with TuningDB(db) as tdb:
        assert tdb.records() == []  # nothing recorded before the search finished
    left_running = [t.number for t in trials(db) if t.state == TrialState.RUNNING]
    # A kill between asking for a trial and writing its owner leaves a trial no one owns, reaped
    # after ORPHAN_AFTER (another host's worker may be in that window); this is the only worker.
    monkeypatch.setattr(lifecycle, "ORPHAN_AFTER", dt.timedelta(0))
    # The same command again finishes the budget, each configuration evaluated once.
    assert tune_main(command(db, *extra)) == 0
    after = {t.number: t for t in trials(db)}
    for number in left_running:  # the killed run's trial in flight was failed and re-queued
        assert after[number].state == TrialState.FAIL
        assert after[number].user_attrs[studies.REASON] == "interrupted"
    finished = counted(db)
    assert len(finished) == 4
    assert len({json.dumps(t.params, sort_keys=True) for t in finished}) == 4
    assert not any(t.state == TrialState.RUNNING for t in trials(db))
    with TuningDB(db) as tdb:
        (record,) = tdb.records("gemm")
    assert record.trials == 4


def test_two_workers_share_one_storage(tmp_path, monkeypatch):
    # A cold kernel cache makes every trial compile (seconds), so the second worker is up before
    # the first could finish the budget alone: both must contribute.
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "kernel-cache"))
    db = tmp_path / "workers.sqlite"
    storage = tmp_path / "shared.journal"
    # The command line refuses CPU workers (they would time each other); two CPU workers are
    # still how the shared-storage protocol is tested without GPUs.
    spec = get_spec("gemm")
    target, _ = resolve_device("cpu")
    plan = sweep.Plan(spec=spec, target=target, devices=["cpu", "cpu"],
                      problems=[spec.parse_problem("64x128x128", "float32")], db=db,
                      storage=str(storage), sampler="random", trials=4, jobs=2, space=SPACE,
                      quiet=True)
    (result,) = sweep.run(plan, Progress(quiet=True))
    assert result.decision is not None
    st = studies.open_storage(str(storage))
    (name,) = optuna.get_all_study_names(st)
    all_trials = optuna.load_study(study_name=name, storage=st).get_trials(deepcopy=False)
    done = [t for t in all_trials if t.user_attrs.get(studies.COUNTED)
            and studies.REPEAT_OF not in t.user_attrs]
    configs = Counter(json.dumps(t.params, sort_keys=True) for t in done)
    assert configs and max(configs.values()) == 1  # nothing evaluated twice
    assert len(done) == 4  # the whole space: 4 configurations
    owners = {t.user_attrs[studies.OWNER] for t in done}
    assert len(owners) == 2  # both workers contributed
    assert not any(t.state == TrialState.RUNNING for t in all_trials)
    # A worker that finds every unseen configuration in flight stops asking (it used to ask up
    # to a hundred repeats, each told back to the shared storage).
    assert len(all_trials) < 40
    with TuningDB(db) as tdb:
        (record,) = tdb.records("gemm")
    assert record.trials == len(done)


def test_reaper_fails_only_trials_whose_worker_is_gone(monkeypatch):
    study = optuna.create_study()
    space = {"block_M": [16, 64]}
    dead = study.ask()  # a worker killed right after asking: no owner yet
    mine, _ = studies.ask(study, space)  # owned by a live process (this one is "live" below)
    monkeypatch.setattr(studies, "owner_id", lambda: "elsewhere:1")
    remote, _ = studies.ask(study, space)  # another host's worker: may be alive
    monkeypatch.setattr(studies, "_pid_alive", lambda pid: True)
    assert studies.reap_interrupted(study, space) == 0  # an owner-less trial is young
    monkeypatch.setattr(lifecycle, "ORPHAN_AFTER", dt.timedelta(0))
    assert studies.reap_interrupted(study, space) == 1
    states = {t.number: (t.state, t.user_attrs.get(studies.REASON)) for t in study.trials}
    assert states[dead.number] == (TrialState.FAIL, "interrupted")
    assert states[mine.number][0] == states[remote.number][0] == TrialState.RUNNING
    monkeypatch.setattr(studies, "_pid_alive", lambda pid: False)  # this worker dies
    assert studies.reap_interrupted(study, space) == 1
    requeued = study.get_trials(states=(TrialState.WAITING,))
    # Its configuration is asked again.
    assert [t.system_attrs["fixed_params"] for t in requeued] == [mine.params]


def test_ctrl_c_while_asking_leaves_an_owned_trial_that_is_given_back(monkeypatch):
    study = optuna.create_study(sampler=studies.make_sampler("grid", SPACE, 0))
    asked = study.ask

    def ask_then_ctrl_c():
        trial = asked()
        os.kill(os.getpid(), signal.SIGINT)  # lands before the owner is written
        return trial

    monkeypatch.setattr(study, "ask", ask_then_ctrl_c)
    # Python raises KeyboardInterrupt only from its own handler, which it does not install when
    # started with SIGINT ignored (a shell's background job).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            studies.ask(study, SPACE)
    finally:
        signal.signal(signal.SIGINT, previous)
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state == TrialState.RUNNING  # held until its owner and configuration were written
    assert trial.user_attrs[studies.OWNER] == studies.owner_id() and studies.in_space(trial.params,
                                                                                      SPACE)
    assert studies.release_own(study, SPACE, "interrupted") == 1
    (requeued,) = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert requeued.system_attrs["fixed_params"] == trial.params


def test_search_gives_back_trials_asked_but_not_yet_evaluated(monkeypatch):
    # Ctrl-C between asking for a trial and compiling it (here: while checking its configuration).
    spec = get_spec("gemm")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(spec, "check_config", interrupted)
    target, _ = resolve_device("cpu")
    task = Task(spec, target, "cpu", spec.parse_problem("64x128x128", "float32"), SPACE)
    study = optuna.create_study(sampler=studies.make_sampler("grid", SPACE, 0))
    with pytest.raises(KeyboardInterrupt):
        search(FakeSession(lambda config: 1.0), study, task, Limits(trials=4),
               Progress(quiet=True), batch=1, time_baseline=False)
    states = Counter(t.state for t in study.get_trials(deepcopy=False))
    assert states == {TrialState.FAIL: 1, TrialState.WAITING: 1}


_WORKERS_SCRIPT = """
import sys
import tuner_helpers
from tileops.target import resolve_device
from tileops.tuner import lifecycle, sweep
from tileops.tuner.progress import Progress

if __name__ == "__main__":
    spec = tuner_helpers.FAULTY
    target, _ = resolve_device("cpu")
    plan = sweep.Plan(spec=spec, target=target, devices=["cpu", "cpu"],
                      problems=[spec.parse_problem("16x64x64", "float32")], db=sys.argv[1],
                      storage=sys.argv[2], sampler="grid", trials=8, jobs=2, quiet=True)
    try:
        with lifecycle.stop_on_sigterm():
            sweep.run(plan, Progress(quiet=True))
    except KeyboardInterrupt:
        sys.exit(lifecycle.INTERRUPTED)
"""


def test_sigterm_to_a_parent_stops_its_workers_who_give_their_trials_back(tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(_WORKERS_SCRIPT)
    storage = tmp_path / "shared.journal"
    # The grid of tests/tuner_helpers.py's faulty GEMM holds a configuration whose launch never
    # returns: a worker measuring it can only stop when it is told to.
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "w.sqlite"),
                             str(storage)], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # until a worker measures the launch that never returns
        st = studies.open_storage(str(storage)) if storage.exists() else None
        names = optuna.get_all_study_names(st) if st else []
        # (a trial just asked has no parameters yet)
        if names and any(t.state == TrialState.RUNNING and t.user_attrs.get(studies.CANDIDATE)
                         and tuner_helpers.fault(t.params) == "hang" for t in optuna.load_study(
                             study_name=names[0], storage=st).get_trials(deepcopy=False)):
            time.sleep(2)  # compiled, and in its measurement
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    else:
        raise AssertionError("no trial in flight after 180 s")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=lifecycle.WORKER_GRACE_S + 60)
    assert proc.returncode == lifecycle.INTERRUPTED
    st = studies.open_storage(str(storage))
    trials_left = optuna.load_study(study_name=optuna.get_all_study_names(st)[0],
                                    storage=st).get_trials(deepcopy=False)
    # Told to stop, the workers gave their trials back (before, they tuned on until killed).
    assert not any(t.state == TrialState.RUNNING for t in trials_left)
    assert session_processes(proc.pid) == []
