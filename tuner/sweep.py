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
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from tileops.db.layers import read_record
from tileops.db.storage import DatabaseError, TuningDB
from tileops.spec import Config, OpSpec
from tileops.target import Target

from . import studies, winners
from .progress import Progress
from .search import Limits, SearchReport, Task, search
from .session import Session
from .studies import Space
from .winners import Decision

log = logging.getLogger("tuner")

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

    def limits(self) -> Limits:
        return Limits(self.trials, self.timeout)

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


def run(plan: Plan, progress: Progress) -> list[Result]:
    storage = studies.open_storage(plan.storage)
    if len(plan.devices) > 1:
        return _run_workers(plan, storage, progress)
    results = []
    with Session(plan.devices[0], plan.jobs, plan.trial_timeout) as session:
        for problem in plan.problems:
            task = plan.task(problem)
            study = _prepare(plan, storage, task)
            report = search(session, study, task, plan.limits(), progress, plan.jobs, plan.seed)
            results.append(_finish(plan, session, task, study, report))
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
    """The heuristic default, then the winners of the nearest tuned problems in the database."""
    spec, target = plan.spec, plan.target
    configs = [(spec.default_config(problem, target), "default")]
    if not plan.db.exists():
        return configs
    try:
        with TuningDB(plan.db, readonly=True) as db:
            records = db.records(spec.name, target.key)
    except DatabaseError as e:
        log.warning("no warm start from %s: %s", plan.db, e)
        return configs
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
    return configs


def _finish(plan: Plan, session: Session, task: Task, study: optuna.Study,
            report: SearchReport | None = None, new_trials: int = 0) -> Result:
    """Re-time the study's best configurations and record the winner."""
    ledger = studies.read_ledger(study)
    result = Result(task, ledger, stopped=report.stopped if report else "workers done")
    if report is not None:
        new_trials = report.new_trials
        base = report.baseline
        result.baseline_us = base.stats.median_us if base and base.ok and base.stats else None
    if not ledger.complete():
        result.note = "no configuration passed its check; nothing recorded"
        return result
    if not new_trials and winners.already_recorded(plan.db, task, ledger.counted):
        result.note = "already recorded"
        return result
    decision = winners.retime_top(session, task, ledger, plan.retime_top, plan.retime_rounds,
                                  plan.seed + 7919)
    result.decision = decision
    if decision is None:
        result.note = "the best configurations failed when re-timed; nothing recorded"
    else:
        result.baseline_us = decision.baseline_us
        winners.write(plan.db, task, decision, ledger.counted)
    return result


def _run_workers(plan: Plan, storage: optuna.storages.BaseStorage, progress: Progress
                 ) -> list[Result]:
    tasks = [plan.task(p) for p in plan.problems]
    counts = {}
    for task in tasks:
        study = _prepare(plan, storage, task)
        counts[task.problem] = studies.read_ledger(study).counted
    ctx = mp.get_context("spawn")
    jobs = max(1, plan.jobs // len(plan.devices))
    workers = [ctx.Process(target=_worker, args=(plan, i, jobs), name=f"tileops-worker-{i}")
               for i in range(len(plan.devices))]
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.join()
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
    failed = [w.name for w in workers if w.exitcode != 0]
    if failed:
        progress.note(f"worker(s) {', '.join(failed)} stopped early; re-run to resume")
    results = []
    with Session(plan.devices[0], 0, plan.trial_timeout) as session:  # measures only
        for task in tasks:
            study = _open(plan, storage, task)
            new = studies.read_ledger(study).counted - counts[task.problem]
            results.append(_finish(plan, session, task, study, new_trials=new))
    return results


def _worker(plan: Plan, index: int, jobs: int) -> None:
    """One worker process: search every problem on its device (the parent records)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    device = plan.devices[index]
    progress = Progress(quiet=plan.quiet, tty=False, prefix=f"[worker {index} {device}] ")
    storage = studies.open_storage(plan.storage)
    try:
        with Session(device, jobs, plan.trial_timeout) as session:
            for problem in plan.problems:
                task = plan.task(problem, device)
                study = _open(plan, storage, task, stream=index + 1)
                search(session, study, task, plan.limits(), progress, jobs, plan.seed,
                       time_baseline=index == 0)  # the parent re-times it with the winners
    except KeyboardInterrupt:
        raise SystemExit(130) from None
