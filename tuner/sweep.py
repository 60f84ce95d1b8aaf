"""A sweep: every problem of a list searched, its winner re-timed and recorded.

With one worker each problem is searched and recorded in turn. With several, the parent creates
the studies (warm starts included), starts one spawned worker process per device (cuda:0, cuda:1,
... or N on the CPU) that all search every problem through the shared Optuna storage, then, once
they are done, re-times and records each problem itself: one writer, one device for the final
figures.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from tileops.db.layers import read_record
from tileops.db.storage import DatabaseError, TuningDB
from tileops.spec import Config, OpSpec, canonical
from tileops.target import Target

from . import lifecycle, studies, winners
from .evaluate import Job
from .progress import Progress
from .search import ABANDON, Limits, SearchReport, Task, search
from .session import Session
from .studies import Space
from .winners import Decision

log = logging.getLogger("tileops.tuner")

# Nearest tuned problems of the database whose winners seed a new study.
WARM_START_NEIGHBOURS = 2


@dataclass
class Plan:
    """Everything a sweep needs; picklable, so worker processes receive it whole."""

    spec: OpSpec
    target: Target
    devices: list[str]  # one per worker
    problems: list[tuple]
    db: Path
    storage: str  # Optuna storage URL or journal path
    sampler: str = "tpe"
    trials: int = 32
    timeout: float | None = None  # seconds per problem
    seed: int = 0
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)  # compile processes, in all
    trial_timeout: float = 300.0
    retime_top: int = 4
    retime_rounds: int = 5
    patience: int | None = None  # stop a problem's search after this many trials without gain
    abandon: float | None = ABANDON  # abandon candidates this many times slower than the best
    space: Space | None = None  # None: the spec's space for the target
    study_prefix: str = "tileops"
    warm_start: bool = True
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.space is None:
            self.space = self.spec.space(self.target)

    def task(self, problem: tuple, device: str | None = None) -> Task:
        assert self.space is not None
        return Task(self.spec, self.target, device or self.devices[0], problem, self.space)

    def first_candidates(self, problem: tuple) -> list[Job]:
        """What a search of `problem` compiles first: the whole grid, or the warm start."""
        assert self.space is not None
        if self.sampler == "grid":
            configs = list(self.spec.configs(problem, self.target, self.space))
        elif self.warm_start:
            configs = [c for c, _ in warm_start_configs(self, problem)]
        else:
            configs = []
        return [Job(self.spec, problem, self.target, self.devices[0], c) for c in configs]

    def limits(self) -> Limits:
        """The search's limits; a grid is searched whole (no patience)."""
        return Limits(self.trials, self.timeout,
                      patience=None if self.sampler == "grid" else self.patience,
                      abandon=self.abandon)

    def study_name(self, problem: tuple) -> str:
        """Trials measured one kernel source with one TileLang: a change of either starts a new
        study rather than reusing timings of kernels that no longer exist."""
        import tilelang

        assert self.space is not None
        prefix = f"{self.study_prefix}@{tilelang.__version__}/{self.spec.kernel_hash()}"
        return studies.study_name(prefix, self.spec.name, self.target.key,
                                  self.spec.problem_dict(problem), self.space)


@dataclass
class Result:
    """How one problem went."""

    task: Task
    ledger: studies.Ledger
    decision: Decision | None = None
    baseline_us: float | None = None
    stopped: str = ""
    note: str = ""
    recorded: bool = False  # a record was written (else: kept, already there, or refused)
    new_trials: int = 0  # counted trials this run added
    new_abandoned: int = 0  # of which abandoned after their estimate
    seconds: dict[str, float] = field(default_factory=dict)  # the parent's wall time, by part


def run(plan: Plan, progress: Progress,
        on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Search and record every problem of the plan; `on_result` is told of each as it ends."""
    storage = studies.open_storage(plan.storage)
    if len(plan.devices) > 1:
        return _run_workers(plan, storage, progress, on_result)
    results: list[Result] = []
    with Session(plan.devices[0], plan.jobs, plan.trial_timeout) as session:
        for i, problem in enumerate(plan.problems):
            task = plan.task(problem)
            study = _prepare(plan, storage, task)
            before = studies.read_ledger(study)
            ahead = plan.first_candidates(plan.problems[i + 1]) if i + 1 < len(plan.problems) \
                else None
            report = search(session, study, task, plan.limits(), progress,
                            studies.in_flight(plan.sampler, plan.jobs), plan.seed, ahead=ahead)
            results.append(_finish(plan, session, task, study, before, report))
            if len(results) == 1:  # the first problem's time includes starting the children
                results[0].seconds["child_start"] = session.startup_s
            if on_result:
                on_result(results[-1])
    return results


def _prepare(plan: Plan, storage: optuna.storages.BaseStorage, task: Task) -> optuna.Study:
    """Open (or create) the problem's study and enqueue its warm start."""
    study = _open(plan, storage, task)
    if plan.warm_start and plan.sampler != "grid" and not study.trials:
        studies.warm_start(study, warm_start_configs(plan, task.problem), task.space)
    return study


def _open(plan: Plan, storage: optuna.storages.BaseStorage, task: Task,
          stream: int = 0) -> optuna.Study:
    return studies.open_study(storage, plan.study_name(task.problem), plan.sampler, task.space,
                              plan.seed, stream)


def warm_start_configs(plan: Plan, problem: tuple) -> list[tuple[Config, str]]:
    """The heuristic default, then the winners of the nearest tuned problems in the database,
    each as its nearest point of the plan's space."""
    spec, target = plan.spec, plan.target
    configs = [(spec.default_config(problem, target), "default")]
    if not plan.db.exists():
        return _projected(configs, plan.space)
    try:
        with TuningDB(plan.db, readonly=True) as db:
            records = db.records(spec.name, target.key)
    except DatabaseError as e:
        log.warning("no warm start from %s: %s", plan.db, e)
        return _projected(configs, plan.space)
    near = []
    for r in records:
        try:
            other, config = read_record(spec, r, target)
        except ValueError:
            continue  # an unusable record seeds nothing (`tileops db verify` lists it)
        d = spec.distance(problem, other)
        if d is not None:
            near.append((d, r.problem, config, spec.problem_label(other)))
    near.sort(key=lambda x: (x[0], x[1]))
    configs += [(c, f"db: {label}") for _, _, c, label in near[:WARM_START_NEIGHBOURS]]
    return _projected(configs, plan.space)


def _projected(configs: list[tuple[Config, str]], space: Space) -> list[tuple[Config, str]]:
    """Each configuration as its nearest point of the space, the first source of each kept."""
    out, seen = [], set()
    for config, source in configs:
        point = studies.nearest(config, space)
        key = canonical(point)
        if key not in seen:
            seen.add(key)
            out.append((point, source))
    return out


def _finish(plan: Plan, session: Session, task: Task, study: optuna.Study, before: studies.Ledger,
            report: SearchReport | None = None) -> Result:
    """Re-time the study's best configurations and record the winner (`before`: the study's
    ledger before this run searched it)."""
    ledger = studies.read_ledger(study)
    new_trials = ledger.counted - before.counted
    result = Result(task, ledger, stopped=report.stopped if report else "workers done",
                    new_trials=new_trials, new_abandoned=ledger.abandoned - before.abandoned,
                    seconds=dict(report.seconds) if report else {})
    if report is not None:
        base = report.baseline
        result.baseline_us = base.stats.median_us if base and base.ok and base.stats else None
    if not ledger.complete():
        result.note = ("no trial ran (time was up first); nothing recorded" if not ledger.counted
                       else "no configuration passed its check; nothing recorded")
        return result
    if not new_trials and winners.already_recorded(plan.db, task, ledger.counted):
        result.note = "already recorded"
        return result
    started = time.perf_counter()
    decision, why = winners.retime_top(session, task, ledger, plan.retime_top,
                                       plan.retime_rounds, plan.seed + 7919, result.baseline_us)
    result.decision = decision
    if decision is None:
        result.note = f"{why}; nothing recorded"
    else:
        result.baseline_us = decision.baseline_us
        result.recorded = winners.write(plan.db, task, decision, ledger.counted)
        if not result.recorded:
            result.note = "the database's record is faster; kept"
    result.seconds["retime"] = time.perf_counter() - started
    return result


def _run_workers(plan: Plan, storage: optuna.storages.BaseStorage, progress: Progress,
                 on_result: Callable[[Result], None] | None) -> list[Result]:
    tasks = [plan.task(p) for p in plan.problems]
    before = {task.problem: studies.read_ledger(_prepare(plan, storage, task)) for task in tasks}
    ctx = mp.get_context("spawn")
    jobs = max(1, plan.jobs // len(plan.devices))
    workers = [ctx.Process(target=_worker, args=(plan, i, jobs), name=f"tileops-worker-{i}")
               for i in range(len(plan.devices))]
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.join()
    finally:  # also when the parent is told to stop: its workers give their trials back first
        lifecycle.stop_workers(workers)
    failed = [w.name for w in workers if w.exitcode != 0]
    if failed:
        progress.note(f"worker(s) {', '.join(failed)} stopped early; re-run to resume")
    results = []
    with Session(plan.devices[0], 0, plan.trial_timeout) as session:  # measures only
        for task in tasks:
            study = _open(plan, storage, task)
            results.append(_finish(plan, session, task, study, before[task.problem]))
            if on_result:
                on_result(results[-1])
    return results


def _worker(plan: Plan, index: int, jobs: int) -> None:
    """One worker process: search every problem on its device (the parent records)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    device = plan.devices[index]
    progress = Progress(quiet=plan.quiet, tty=False, prefix=f"[worker {index} {device}] ")
    storage = studies.open_storage(plan.storage)
    try:
        with lifecycle.stop_on_sigterm(), Session(device, jobs, plan.trial_timeout) as session:
            for problem in plan.problems:
                task = plan.task(problem, device)
                study = _open(plan, storage, task, stream=index + 1)
                search(session, study, task, plan.limits(), progress,
                       studies.in_flight(plan.sampler, jobs), plan.seed,
                       time_baseline=index == 0)  # the parent re-times it with the winners
    except KeyboardInterrupt:
        raise SystemExit(lifecycle.INTERRUPTED) from None
