"""The child processes one tuning worker uses: a compile pool and one benchmarking child.

Candidates compile in parallel on all cores (the kernels land in TileLang's disk cache, from which
the benchmarking child loads them in milliseconds) and are then checked and timed one at a time by
the single child that owns the device, so timings never overlap.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tileops.db.storage import canonical

from .child import Child, ChildError, Outcome, run_parallel
from .evaluate import Job, Measurement, compile_job, measure, ready, retime

# Seconds a child may take to start and import torch and TileLang.
STARTUP_TIMEOUT = 120.0


class Session:
    """Compile and benchmark children for one device; a context manager that ends them.

    `jobs` = 0 makes a session that only measures (kernels already compiled are loaded from the
    disk cache; any other is compiled by the benchmark child itself).
    """

    def __init__(self, device: str, jobs: int, trial_timeout: float):
        self.device = device
        self.trial_timeout = trial_timeout
        self.startup_timeout = max(STARTUP_TIMEOUT, trial_timeout)
        self.bench = Child("tileops-bench")
        env = _compile_env(device)
        self.compilers = [Child(f"tileops-compile-{i}", env) for i in range(jobs)]
        self._ready([self.bench, *self.compilers])

    def _ready(self, children: list[Child]) -> None:
        """(Re)start children and wait until they have imported everything, so that start-up
        counts against no time limit and no child is still starting (using the cores) while
        something is being timed."""
        dead = [c for c in children if not c.alive]
        if dead:
            run_parallel(dead, ready, [()] * len(dead), self.startup_timeout)

    def compile(self, jobs: list[Job]) -> list[Outcome]:
        if not self.compilers:
            return [Outcome() for _ in jobs]
        self._ready(self.compilers)
        return run_parallel(self.compilers, compile_job, [(job,) for job in jobs],
                            self.trial_timeout)

    def measure(self, job: Job, seed: int) -> Measurement:
        try:
            self._ready([self.bench])
            return self.bench.call(measure, job, seed, timeout=self.trial_timeout)
        except ChildError as e:
            return Measurement(failure=e.kind, reason=e.reason)

    def retime(self, jobs: list[Job], seed: int, rounds: int) -> list[Measurement]:
        try:
            self._ready([self.bench])
            return self.bench.call(retime, jobs, seed, rounds,
                                   timeout=self.trial_timeout * (1 + len(jobs)))
        except ChildError as e:
            return [Measurement(failure=e.kind, reason=e.reason) for _ in jobs]

    def close(self) -> None:
        for child in (self.bench, *self.compilers):
            child.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compile_env(device: str) -> dict[str, str]:
    """Compile children of a GPU worker see only its GPU, so nothing lands on the others."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else []
    return {"CUDA_VISIBLE_DEVICES": ids[int(index)] if int(index) < len(ids) else index}


def compile_all(jobs: list[Job], processes: int, timeout: float, note: Callable[[str], None],
                device: str = "cpu") -> int:
    """Compile `jobs` into TileLang's disk cache on `processes` children, noting each failure and
    the progress every few kernels per process; how many failed."""
    failed = 0
    with Session(device, processes, timeout) as session:
        chunk = 4 * processes
        for start in range(0, len(jobs), chunk):
            part = jobs[start:start + chunk]
            for job, outcome in zip(part, session.compile(part), strict=True):
                if outcome.error is not None:
                    failed += 1
                    note(f"  {job.spec.problem_label(job.problem)} {canonical(job.config)}: "
                         f"{outcome.error}")
            note(f"compiled {start + len(part)} of {len(jobs)} ({failed} failed)")
    return failed
