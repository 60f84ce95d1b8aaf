"""The trial loop of one problem: ask the sampler, refuse impossible configs, compile, measure, tell.

Trials are asked as compile processes come free. A configuration refused by `spec.check_config`
is told at once (no compile); the rest compile in the background and are measured one at a time
as their compiles finish, each told as soon as it is measured, so a kill loses at most the trials
in flight, whose configurations a resumed run evaluates again (see `studies`). On a GPU, compiling
goes on while the device measures (`Session.overlap`); on the CPU the two take turns. A candidate
whose few-launch estimate is `abandon` times slower than the best so far is abandoned unchecked
and untimed: it is counted, never a winner.

The loop ends when the study holds `trials` counted trials (from every worker and earlier runs),
the grid is exhausted, the sampler keeps proposing configurations already evaluated, `patience`
counted trials in a row brought no improvement, or time is up.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import Trial

from tileops.spec import Config, OpSpec, canonical
from tileops.target import Target

from . import studies
from .child import Outcome
from .evaluate import Job, Measurement
from .progress import Progress
from .session import Session
from .studies import Ledger, Space

# The sampler proposed only evaluated configurations this many times in a row: it has converged.
MAX_REPEATS = 100
# A candidate whose estimate is this many times the best latency so far is abandoned (TileLang's
# autotuner uses 2.0 after a 5-launch estimate, "typically within 10-20%" of the full figure).
ABANDON = 2.0


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
    patience: int | None = None  # counted trials without improvement that end the search
    abandon: float | None = ABANDON  # None: time every candidate in full

    def time_left(self, started: float) -> bool:
        now = time.monotonic()
        over_timeout = self.timeout is not None and now - started >= self.timeout
        return not over_timeout and (self.deadline is None or now < self.deadline)


@dataclass
class SearchReport:
    ledger: Ledger
    baseline: Measurement | None  # None: not measured (nothing was left to search)
    stopped: str  # why the loop ended: done, exhausted, converged, plateau, timeout
    new_trials: int  # counted trials this run added
    seconds: dict[str, float] = field(default_factory=dict)  # where the parent's time went


def search(session: Session, study: optuna.Study, task: Task, limits: Limits,
           progress: Progress, batch: int, seed: int = 0, time_baseline: bool = True,
           ahead: list[Job] | None = None) -> SearchReport:
    """Ask, compile and measure trials of one study until a limit stops it. `batch` caps the
    trials asked at once; `time_baseline`: time the operator's baseline first (for the progress
    line and the report; one of several workers sharing a study is enough); `ahead`: what the
    next search will compile first, compiled once this one has asked its last."""
    started = time.monotonic()
    clock = _Clock()
    studies.reap_interrupted(study, task.space)
    ledger = studies.read_ledger(study)
    first_count, repeats = ledger.counted, 0
    stopped = _stop_reason(ledger, task, limits, started, repeats)
    baseline = (session.measure(task.job(None), seed)
                if time_baseline and stopped is None else None)
    clock.lap("baseline")
    progress.begin(task.label, limits.trials, ledger, baseline)
    session.compile_ahead([])  # what the last search compiled ahead: this one asks for itself
    compiling: dict[int, tuple[Trial, Config]] = {}  # submitted compiles, by trial number
    compiled: deque[tuple[Trial, Config, Outcome]] = deque()  # waiting to be measured
    try:
        while True:
            if stopped is None and (session.overlap or not compiled):
                room = min(limits.trials - ledger.counted - ledger.running, batch, session.free)
                if room > 0:
                    candidates, repeats = _ask_batch(study, task, ledger, room, repeats)
                    for trial, config in candidates:
                        session.submit(trial.number, task.job(config))
                        compiling[trial.number] = (trial, config)
                    clock.lap("ask")
            if stopped is not None and ahead:
                session.compile_ahead(ahead)
                ahead = None
            if compiling or compiled or (stopped is None and not session.free):
                for number, outcome in session.finished(block=not compiled):
                    if number in compiling:  # else: a compile a timed-out search left behind
                        compiled.append((*compiling.pop(number), outcome))
                clock.lap("compile_wait")
                if compiled and (session.overlap or not compiling):
                    if not limits.time_left(started):
                        stopped = "timeout"  # measure nothing after the deadline
                        break
                    _measure(session, study, task, ledger, limits, compiled.popleft(), progress,
                             seed)
                    clock.lap("measure")
            studies.reap_interrupted(study, task.space, own=False)  # workers that died meanwhile
            ledger = studies.read_ledger(study)
            # "done" once the budget is handed out, with candidates still to finish (a repeat
            # among them gives budget back); "timeout" drops what is in flight.
            stopped = _stop_reason(ledger, task, limits, started, repeats)
            clock.lap("bookkeeping")
            if stopped == "timeout" or (stopped is not None and not (compiling or compiled)):
                break
        for trial, *_ in [*compiling.values(), *compiled]:  # time up
            studies.release(study, trial, "interrupted before it was measured")
    except BaseException:  # Ctrl-C or an error anywhere, even between asking and evaluating
        studies.release_own(study, task.space, "interrupted before it was measured")
        raise
    ledger = studies.read_ledger(study)
    progress.end(ledger, stopped)
    return SearchReport(ledger, baseline, stopped, ledger.counted - first_count, clock.seconds)


class _Clock:
    """Wall seconds of the parent's loop, by what it was doing."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def _stop_reason(ledger: Ledger, task: Task, limits: Limits, started: float,
                 repeats: int) -> str | None:
    if ledger.counted + ledger.running >= limits.trials:
        return "done"
    if ledger.seen >= studies.grid_size(task.space):
        return "exhausted"
    if repeats >= MAX_REPEATS:
        return "converged"
    if limits.patience and ledger.since_improvement >= limits.patience:
        return "plateau"
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


def _measure(session: Session, study: optuna.Study, task: Task, ledger: Ledger, limits: Limits,
             item: tuple[Trial, Config, Outcome], progress: Progress, seed: int) -> None:
    """Measure one compiled candidate (or record why it failed to compile) and tell its trial."""
    trial, config, outcome = item
    twin = studies.earlier_twin(study, trial)
    if twin is not None:  # another worker took the same configuration meanwhile
        if twin.state.is_finished():
            studies.tell_repeat(study, trial, twin)
        else:
            studies.repeat_in_flight(study, trial)
        return
    if outcome.error is not None:
        error = outcome.error  # an exception is a compile error; else it hung or crashed
        m = (Measurement(failure="compile", reason=error.reason) if error.kind == "error"
             else Measurement(failure=error.kind, reason=f"compiling: {error.reason}"))
    else:
        program = outcome.value[1] if outcome.value else None
        best = ledger.best.value if ledger.best is not None else None
        abandon = best * limits.abandon if best is not None and limits.abandon else None
        m = session.measure(task.job(config), seed, program, abandon)
        if outcome.value:
            m.phases["compile"] = outcome.value[0]
    _tell(study, trial, m)
    progress.update(studies.read_ledger(study), trial.number, config, m)


def _tell(study: optuna.Study, trial: Trial, m: Measurement) -> None:
    attrs: dict[str, Any] = {studies.COUNTED: True}
    if m.error is not None:
        attrs[studies.ERROR] = m.error
    if m.gpu is not None:
        attrs[studies.GPU] = m.gpu
    if m.phases:
        attrs[studies.PHASES] = {k: round(v, 5) for k, v in m.phases.items()}
    if m.estimate_us is not None:
        attrs[studies.ESTIMATE] = m.estimate_us
    if m.ok:
        assert m.stats is not None
        studies.tell_value(study, trial, m.stats.median_us, q25_us=m.stats.q25_us,
                           q75_us=m.stats.q75_us, **attrs)
    else:
        studies.tell_failure(study, trial, m.failure or "error", m.reason, **attrs)
