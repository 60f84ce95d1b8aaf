"""The trial loop of one problem: ask the sampler, refuse impossible configs, compile, measure, tell.

Trials are asked in batches as large as the compile pool. A configuration refused by
`spec.check_config` is told at once (no compile); the rest compile in parallel and are then
measured one at a time, each told as soon as it is measured, so a kill loses at most the batch in
flight, whose configurations a resumed run evaluates again (see `studies`). The loop ends when the
study holds `trials` counted trials (from every worker and earlier runs), the grid is exhausted,
the sampler keeps proposing configurations already evaluated, or time is up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import Trial

from tileops.db.storage import canonical
from tileops.spec import Config, OpSpec
from tileops.target import Target

from . import studies
from .evaluate import Job, Measurement
from .progress import Progress
from .session import Session
from .studies import Ledger, Space

# The sampler proposed only evaluated configurations this many times in a row: it has converged.
MAX_REPEATS = 100


@dataclass(frozen=True)
class Task:
    """One problem of one operator to tune on one device, over a search space."""

    spec: OpSpec
    target: Target
    device: str
    problem: tuple
    space: Space

    def job(self, config: Config | None) -> Job:
        return Job(self.spec, self.problem, self.target, self.device, config)

    @property
    def label(self) -> str:
        return f"{self.spec.name} {self.spec.problem_label(self.problem)}"


@dataclass
class Limits:
    """When a search stops asking for trials."""

    trials: int
    timeout: float | None = None  # seconds for this problem
    deadline: float | None = None  # time.monotonic() after which no trial starts

    def time_left(self, started: float) -> bool:
        now = time.monotonic()
        over_timeout = self.timeout is not None and now - started >= self.timeout
        return not over_timeout and (self.deadline is None or now < self.deadline)


@dataclass
class SearchReport:
    ledger: Ledger
    baseline: Measurement | None  # None: not measured (nothing was left to search)
    stopped: str  # why the loop ended: done, exhausted, converged, timeout
    new_trials: int  # counted trials this run added


def search(session: Session, study: optuna.Study, task: Task, limits: Limits,
           progress: Progress, batch: int, seed: int = 0, time_baseline: bool = True
           ) -> SearchReport:
    """Ask, compile and measure trials of one study until a limit stops it. `time_baseline`:
    time the operator's baseline first (for the progress line and the report; one of several
    workers sharing a study is enough)."""
    started = time.monotonic()
    studies.reap_interrupted(study, task.space)
    ledger = studies.read_ledger(study)
    first_count, repeats = ledger.counted, 0
    stopped = _stop_reason(ledger, task, limits, started, repeats)
    baseline = (session.measure(task.job(None), seed)
                if time_baseline and stopped is None else None)
    progress.begin(task.label, limits.trials, ledger, baseline)
    try:
        while stopped is None:
            remaining = limits.trials - ledger.counted - ledger.running
            candidates, repeats = _ask_batch(study, task, ledger, min(remaining, batch), repeats)
            if candidates:
                _evaluate(session, study, task, candidates, limits, started, progress, seed)
            studies.reap_interrupted(study, task.space)  # trials of workers that died meanwhile
            ledger = studies.read_ledger(study)
            stopped = _stop_reason(ledger, task, limits, started, repeats)
    except BaseException:  # Ctrl-C or an error anywhere, even between asking and evaluating
        studies.release_own(study, task.space, "interrupted before it was measured")
        raise
    progress.end(ledger, stopped)
    return SearchReport(ledger, baseline, stopped, ledger.counted - first_count)


def _stop_reason(ledger: Ledger, task: Task, limits: Limits, started: float,
                 repeats: int) -> str | None:
    if ledger.counted + ledger.running >= limits.trials:
        return "done"
    if ledger.seen >= studies.grid_size(task.space):
        return "exhausted"
    if repeats >= MAX_REPEATS:
        return "converged"
    return None if limits.time_left(started) else "timeout"


def _ask_batch(study: optuna.Study, task: Task, ledger: Ledger, n: int, repeats: int
               ) -> tuple[list[tuple[Trial, Config]], int]:
    """Ask up to `n` trials; answer repeats and refused configs at once, return the candidates."""
    candidates: list[tuple[Trial, Config]] = []
    taken = set(ledger.in_flight)
    grid = studies.grid_size(task.space)
    asked = 0
    while (len(candidates) < n and asked < n + MAX_REPEATS and repeats < MAX_REPEATS
           and len(ledger.finished.keys() | taken) < grid):  # else only repeats are left
        asked += 1
        trial, config = studies.ask(study, task.space)
        key = canonical(config)
        if key in ledger.finished:
            studies.tell_repeat(study, trial, ledger.finished[key])
            repeats += 1
        elif key in taken:
            studies.repeat_in_flight(study, trial)
            repeats += 1
        else:
            repeats = 0
            taken.add(key)
            reason = task.spec.check_config(task.problem, config, task.target)
            if reason is not None:
                studies.tell_failure(study, trial, "constraint", reason)
                continue
            trial.set_user_attr(studies.CANDIDATE, True)
            candidates.append((trial, config))
    return candidates, repeats


def _evaluate(session: Session, study: optuna.Study, task: Task,
              candidates: list[tuple[Trial, Config]], limits: Limits, started: float,
              progress: Progress, seed: int) -> None:
    """Compile the batch in parallel, then measure and tell each candidate in turn."""
    pending = list(candidates)
    compiled = session.compile([task.job(config) for _, config in candidates])
    for outcome in compiled:
        trial, config = pending[0]
        if not limits.time_left(started):
            break
        twin = studies.earlier_twin(study, trial)
        if twin is not None:  # another worker took the same configuration meanwhile
            if twin.state.is_finished():
                studies.tell_repeat(study, trial, twin)
            else:
                studies.repeat_in_flight(study, trial)
            pending.pop(0)
            continue
        if outcome.error is not None:
            error = outcome.error  # an exception is a compile error; else it hung or crashed
            m = (Measurement(failure="compile", reason=error.reason) if error.kind == "error"
                 else Measurement(failure=error.kind, reason=f"compiling: {error.reason}"))
        else:
            m = session.measure(task.job(config), seed + trial.number + 1)
        _tell(study, trial, m)
        pending.pop(0)
        progress.update(studies.read_ledger(study), trial.number, config, m)
    for trial, _ in pending:  # time up (an exception: `search` gives back what we hold)
        studies.release(study, trial, "interrupted before it was measured")


def _tell(study: optuna.Study, trial: Trial, m: Measurement) -> None:
    attrs: dict[str, Any] = {studies.COUNTED: True}
    if m.error is not None:
        attrs[studies.ERROR] = m.error
    if m.gpu is not None:
        attrs[studies.GPU] = m.gpu
    if m.ok:
        assert m.stats is not None
        studies.tell_value(study, trial, m.stats.median_us, q25_us=m.stats.q25_us,
                           q75_us=m.stats.q75_us, **attrs)
    else:
        studies.tell_failure(study, trial, m.failure or "error", m.reason, **attrs)
