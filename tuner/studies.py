"""Optuna studies: where they are stored, what they are called, and what their trials say.

One study per (operator, target, problem, search space), in a storage that several workers may
share: a journal file (the default, next to the tuning database; safe for processes on one
machine) or an RDB URL (`sqlite:///...` on one machine, `postgresql://...` across hosts).

Trial states, chosen so that samplers learn the right thing:
- COMPLETE: the candidate passed its check; the value is its median latency (us).
- PRUNED: the candidate cannot win: refused by `spec.check_config` (no compile), failed to
  compile, gave wrong output, crashed, hung, or was abandoned (its few-launch estimate was a
  factor slower than the best so far). TPE ranks pruned trials below every complete one, so it
  learns to avoid such regions (it ignores FAIL trials entirely).
- FAIL: not evaluated (interrupted, or a repeat of a configuration still in flight). An
  interrupted candidate's configuration is enqueued again, so a resumed sweep still evaluates it.
User attributes record why (`failure`, `reason`), who ran it (`owner`) and whether it counts toward
the trial budget (`counted`: a compile was attempted). Who moves a trial between the states, and
when: `tuner.lifecycle`. A configuration already evaluated in the
study is answered from the earlier trial (`repeat_of`) without compiling and is not counted.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.samplers import BaseSampler, GridSampler, RandomSampler, TPESampler
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from optuna.trial import FrozenTrial, Trial, TrialState

from tileops.spec import Config, canonical, space_hash

from . import lifecycle
from .errors import UsageError
from .evaluate import ABANDONED

log = logging.getLogger("tileops.tuner")

SAMPLERS = ("tpe", "random", "grid")
Space = dict[str, list[Any]]

OWNER, CANDIDATE, COUNTED = "owner", "candidate", "counted"
FAILURE, REASON, REPEAT_OF, ERROR = "failure", "reason", "repeat_of", "rel_error"
GPU = "gpu"  # UUID of the GPU a trial was timed on
PHASES = "phases"  # seconds per phase of its measurement (evaluate.PHASES, "ipc", "compile")
ESTIMATE = "estimate_us"  # the few-launch estimate of an abandoned candidate
_EVALUATED = (TrialState.COMPLETE, TrialState.PRUNED)  # trials with a verdict
# A trial improves on the best so far when it is faster by more than this fraction.
IMPROVEMENT = 0.01


def default_storage(db: Path) -> str:
    """The journal file beside a tuning database: `<db stem>.optuna.journal`."""
    return f"journal:{db.with_name(db.stem + '.optuna.journal')}"


def open_storage(url: str) -> BaseStorage:
    """An Optuna storage from a URL (`scheme://...`: RDB) or a journal file (`journal:PATH`/PATH)."""
    try:
        if "://" in url:
            kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
            return RDBStorage(url, engine_kwargs=kwargs)
        path = Path(url.removeprefix("journal:")).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = JournalFileBackend(str(path))
        repair_journal(path)
        return JournalStorage(backend)
    except (OSError, ValueError, ImportError, optuna.exceptions.StorageInternalError) as e:
        raise UsageError(f"cannot open the Optuna storage {url!r}: {e}") from None


def repair_journal(path: Path) -> None:
    """Set aside the damaged records of an Optuna journal file, so that it opens again.

    A crash or a full disk can leave the last record torn (no end of line); Optuna appends the
    next record to it, and that line, which no longer parses, stops every later read. Each
    damaged line is moved to `<journal>.torn`; a record appended to a torn one is kept. This runs
    under the journal's own lock (Optuna's default for file journals), so no other process is
    midway through an append.
    """
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        torn, kept = _set_aside_damaged(path)
    finally:
        lock.release()
    if not torn:
        return
    log.warning("%s: set aside %d damaged record(s) (%d bytes, e.g. a torn last line left by a "
                "crash) in %s.torn; the other %d record(s) are kept", path, len(torn),
                sum(map(len, torn)), path.name, len(kept))


_RECORD_START = b'{"op_code":'  # how Optuna writes each journal record


def _set_aside_damaged(path: Path) -> tuple[list[bytes], list[bytes]]:
    """Move a journal's damaged lines to `<journal>.torn`; (damaged lines, kept lines)."""
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    kept, torn = [], []
    for line in lines:
        whole = line.endswith(b"\n")
        if whole and _parses(line):
            kept.append(line)
            continue
        start = line.rfind(_RECORD_START)  # an append after a torn record: keep that one
        if whole and start > 0 and _parses(line[start:]):
            torn.append(line[:start] + b"\n")
            kept.append(line[start:])
        else:
            torn.append(line if whole else line + b"\n")
    if not torn:
        return torn, kept
    with open(path.with_name(path.name + ".torn"), "ab") as f:
        f.writelines(torn)
    if lines[:-1] == kept:  # only the last line was torn: cut it off in place
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(lines[-1]))
    else:
        partial = path.with_name(path.name + ".repaired")
        partial.write_bytes(b"".join(kept))
        os.replace(partial, path)
    return torn, kept


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def study_name(prefix: str, op: str, target_key: tuple[str, str, str], problem: dict[str, Any],
               space: Space) -> str:
    kind, arch, device = target_key
    return f"{prefix}:{op}:{kind}:{arch}:{device}:{canonical(problem)}:{space_hash(space)}"


@dataclass(frozen=True)
class StudyName:
    """What `study_name` wrote, read back (for tools that work on stored studies offline)."""

    prefix: str
    op: str
    target_key: tuple[str, str, str]
    problem: dict[str, Any]
    space_hash: str


def parse_study_name(name: str) -> StudyName | None:
    """The parts of a `study_name`; None for a name it did not write."""
    parts = name.split(":", 5)
    if len(parts) != 6 or ":" not in parts[5]:
        return None
    problem, _, hashed = parts[5].rpartition(":")
    try:
        problem_dict = json.loads(problem)
    except json.JSONDecodeError:
        return None
    if not isinstance(problem_dict, dict):
        return None
    return StudyName(parts[0], parts[1], (parts[2], parts[3], parts[4]), problem_dict, hashed)


def open_study(storage: BaseStorage, name: str, sampler: str, space: Space, seed: int = 0,
               stream: int = 0) -> optuna.Study:
    """Open (or create) a study with a sampler.

    The grid keeps `seed` in every process and run: the grid's order, and so what its trials'
    grid ids mean, depends on it. Other samplers draw from a stream of their own per worker
    (`stream`) and per resumption (the trial count), so that workers and resumed runs propose
    new configurations instead of replaying the first run's.
    """
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                sampler=make_sampler(sampler, space, seed), load_if_exists=True)
    if sampler != "grid" and (stream or study.trials):
        study.sampler = make_sampler(sampler, space, seed + 1000 * stream + len(study.trials))
    return study


class _Grid(GridSampler):
    """Optuna's grid sampler; the search loop, not the sampler, decides when the grid is done
    (`Study.stop`, which the stock sampler calls, only works inside `Study.optimize`)."""

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        return None


TPE_STARTUP = 4
# TPE's trials asked at once: its model learns from each result, and asked 4-16 at a time (the
# constant liar standing in) a 20-60-trial search degrades towards random (benchmarks/NOTES.md,
# "Tuner efficiency"). Grid and random searches ask as many as there are compile processes.
TPE_IN_FLIGHT = 2


def in_flight(sampler: str, jobs: int) -> int:
    """How many trials a search of `sampler` asks at once, with `jobs` compile processes."""
    return min(jobs, TPE_IN_FLIGHT) if sampler == "tpe" else jobs


def make_sampler(name: str, space: Space, seed: int) -> BaseSampler:
    if name == "tpe":
        # Four random trials, not Optuna's ten, before the model: a slice's search is often
        # 20-30 trials, and the warm start already covers the likely region
        # (benchmarks/NOTES.md, "Tuner efficiency").
        return TPESampler(multivariate=True, constant_liar=True, seed=seed,
                          n_startup_trials=TPE_STARTUP)
    if name == "random":
        return RandomSampler(seed=seed)
    if name == "grid":
        return _Grid(space, seed=seed)
    raise UsageError(f"unknown sampler {name!r}; expected one of {', '.join(SAMPLERS)}")


def grid_size(space: Space) -> int:
    return math.prod(len(v) for v in space.values())


def suggest(trial: Trial, space: Space) -> Config:
    return {name: trial.suggest_categorical(name, choices) for name, choices in space.items()}


def in_space(config: Config, space: Space) -> bool:
    return set(config) == set(space) and all(config[k] in space[k] for k in space)


def nearest(config: Config, space: Space) -> Config:
    """The point of `space` nearest to `config`, parameter by parameter: a numeric value outside
    a parameter's choices becomes the closest choice on a log scale (ties: the smaller), any
    other the first choice. A narrowed space (a tuning slice's) so still starts from the
    heuristic default's neighbourhood rather than from nothing."""
    def closest(value: Any, choices: list) -> Any:
        if value in choices:
            return value
        numeric = [c for c in choices if isinstance(c, int) and c > 0]
        if isinstance(value, int) and value > 0 and len(numeric) == len(choices):
            return min(numeric, key=lambda c: (abs(math.log2(c / value)), c))
        return choices[0]
    return {name: closest(config.get(name), choices) for name, choices in space.items()}


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# ---- reading a study ----------------------------------------------------------------------------
@dataclass
class Ledger:
    """A study's trials, summarised: the budget count, the configurations seen, the best."""

    counted: int = 0  # trials that compiled a candidate: what --trials counts
    failed: int = 0  # counted trials that failed (compile, wrong output, crash, hang, abandoned)
    abandoned: int = 0  # counted trials abandoned after their estimate
    since_improvement: int = 0  # counted trials since the best last improved (IMPROVEMENT)
    skipped: int = 0  # configurations refused by check_config (no compile)
    running: int = 0  # candidates in flight, any worker
    finished: dict[str, FrozenTrial] = field(default_factory=dict)  # config -> first verdict
    in_flight: set[str] = field(default_factory=set)
    best: FrozenTrial | None = None

    @property
    def seen(self) -> int:
        return len(self.finished.keys() | self.in_flight)

    def complete(self) -> list[FrozenTrial]:
        """Trials with a latency, fastest first, one per configuration."""
        trials = [t for t in self.finished.values() if t.state == TrialState.COMPLETE]
        return sorted(trials, key=lambda t: (t.value, canonical(t.params)))


def is_counted(trial: FrozenTrial) -> bool:
    """Whether `--trials` counts a trial: a compiled candidate told a latency or a failure, not a
    repeat of an earlier verdict."""
    return (trial.state in _EVALUATED and bool(trial.user_attrs.get(COUNTED))
            and REPEAT_OF not in trial.user_attrs)


def counted_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The trials `--trials` counts (`is_counted`), in order."""
    return [t for t in study.get_trials(deepcopy=False, states=_EVALUATED) if is_counted(t)]


def read_ledger(study: optuna.Study) -> Ledger:
    ledger = Ledger()
    now = dt.datetime.now()
    for t in study.get_trials(deepcopy=False):  # in trial order
        attrs = t.user_attrs
        if t.state == TrialState.RUNNING:
            if attrs.get(CANDIDATE) and not _presumed_dead(t, now):
                ledger.running += 1
                ledger.in_flight.add(canonical(t.params))
            continue
        if t.state not in _EVALUATED or REPEAT_OF in attrs:
            continue
        ledger.finished.setdefault(canonical(t.params), t)
        if not is_counted(t):  # refused by check_config before any compile
            ledger.skipped += 1
            continue
        ledger.counted += 1
        ledger.failed += t.state == TrialState.PRUNED
        ledger.abandoned += attrs.get(FAILURE) == ABANDONED
        ledger.since_improvement += 1
        if t.state == TrialState.COMPLETE and (ledger.best is None or t.value < ledger.best.value):
            if ledger.best is None or t.value < ledger.best.value * (1 - IMPROVEMENT):
                ledger.since_improvement = 0
            ledger.best = t
    return ledger


def earlier_twin(study: optuna.Study, trial: Trial) -> FrozenTrial | None:
    """The first earlier trial of the same configuration, in flight or finished (not FAIL).

    Workers deduplicate against what they read before asking, which misses a twin another
    worker asked for meanwhile; checking again just before measuring, when both trials' params
    are long written, and letting the lower trial number win, leaves exactly one of them.
    """
    for t in study.get_trials(deepcopy=False, states=_EVALUATED + (TrialState.RUNNING,)):
        if t.number < trial.number and REPEAT_OF not in t.user_attrs \
                and t.params == trial.params:
            return t
    return None


# ---- writing trials -----------------------------------------------------------------------------
def ask(study: optuna.Study, space: Space) -> tuple[Trial, Config]:
    """A new trial, owned by this process, with its configuration: written as one step, so that a
    Ctrl-C never leaves a running trial without an owner or a complete configuration."""
    with lifecycle.signals_deferred():
        trial = study.ask()
        trial.set_user_attr(OWNER, owner_id())
        return trial, suggest(trial, space)


def release_own(study: optuna.Study, space: Space, reason: str) -> int:
    """Give back every trial this process still runs (its search is ending on an exception)."""
    me = owner_id()
    mine = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.user_attrs.get(OWNER) == me]
    for t in mine:
        release(study, t, reason, requeue=in_space(t.params, space))
    return len(mine)


def tell_value(study: optuna.Study, trial: Trial, value: float, **attrs: Any) -> None:
    _tell(study, trial, TrialState.COMPLETE, value, attrs)


def tell_failure(study: optuna.Study, trial: Trial, failure: str, reason: str,
                 **attrs: Any) -> None:
    _tell(study, trial, TrialState.PRUNED, None, {FAILURE: failure, REASON: reason, **attrs})


def tell_repeat(study: optuna.Study, trial: Trial, earlier: FrozenTrial) -> None:
    """Answer a configuration already evaluated with the earlier trial's verdict."""
    copied = (FAILURE, REASON, ERROR) if earlier.state == TrialState.PRUNED else (ERROR,)
    attrs = {k: v for k, v in earlier.user_attrs.items() if k in copied}
    _tell(study, trial, earlier.state, earlier.value, {**attrs, REPEAT_OF: earlier.number})


def release(study: optuna.Study, trial: Trial | FrozenTrial, reason: str,
            requeue: bool = True) -> None:
    """Give back a trial that was not evaluated (FAIL); enqueue its configuration again."""
    params = trial.params
    if _tell(study, trial, TrialState.FAIL, None, {REASON: reason}) and requeue and params:
        study.enqueue_trial(params, user_attrs={"requeued_after": reason})


def repeat_in_flight(study: optuna.Study, trial: Trial) -> None:
    _tell(study, trial, TrialState.FAIL, None, {REASON: "repeat of a configuration in flight"})


def _tell(study: optuna.Study, trial: Trial | FrozenTrial, state: TrialState,
          value: float | None, attrs: dict[str, Any]) -> bool:
    try:
        for k, v in attrs.items():
            _set_user_attr(study, trial, k, v)
        study.tell(trial.number, value if state == TrialState.COMPLETE else None, state=state)
        return True
    except (RuntimeError, ValueError) as e:  # finished meanwhile (e.g. reaped by another worker)
        log.warning("trial %d of %s could not be updated: %s", trial.number, study.study_name, e)
        return False


def _set_user_attr(study: optuna.Study, trial: Trial | FrozenTrial, key: str, value: Any) -> None:
    if isinstance(trial, Trial):
        trial.set_user_attr(key, value)
    else:
        # A trial read back from the storage (another process's, being reaped, or ours found by
        # owner): Optuna has no public way to write a running FrozenTrial's attributes.
        study._storage.set_trial_user_attr(trial._trial_id, key, value)


def reap_interrupted(study: optuna.Study, space: Space, own: bool = True) -> int:
    """Fail (and re-queue) running trials whose worker is gone: killed, or crashed. `own`: this
    process's too, which at the start of a search are left over from a crash (pass False while
    its own trials are in flight)."""
    host = socket.gethostname()
    now = dt.datetime.now()
    me = owner_id()
    reaped = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(OWNER, "")
        if owner == me and not own:
            continue
        owner_host, _, pid = owner.rpartition(":")
        local_dead = owner_host == host and pid.isdigit() and not _pid_alive(int(pid))
        orphan = not owner and now - (t.datetime_start or now) > lifecycle.ORPHAN_AFTER
        if orphan or local_dead or _presumed_dead(t, now):
            release(study, t, "interrupted", requeue=in_space(t.params, space))
            reaped += 1
    return reaped


def _presumed_dead(trial: FrozenTrial, now: dt.datetime) -> bool:
    return trial.datetime_start is not None and now - trial.datetime_start > lifecycle.STALE_AFTER


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a trial of ours still running at start-up is left over from a crash
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def warm_start(study: optuna.Study, configs: list[tuple[Config, str]], space: Space) -> int:
    """Enqueue configurations (each with where it came from) unless the study has them."""
    n = 0
    for config, source in configs:
        if in_space(config, space):
            study.enqueue_trial(config, user_attrs={"warm_start": source}, skip_if_exists=True)
            n += 1
    return n
