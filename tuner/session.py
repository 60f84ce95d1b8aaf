"""The child processes one tuning worker uses: a compile pool and one benchmarking child.

Candidates compile in parallel on the host's cores (the kernels land in TileLang's disk cache, and
each compile process hands back the program it built, so the benchmarking child only loads the
kernel) and are then checked and timed one at a time by the single child that owns the device, so
timings never overlap. On a GPU the compile processes go on with the next candidates while the
benchmarking child measures (`overlap`), at a lower scheduling priority so that the host side of a
timed launch is never kept waiting; on the CPU the timed kernels run on those same cores, so
compiling and measuring take turns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from tileops.spec import canonical

from .child import Child, ChildError, Outcome, Pool, close_all, run_parallel
from .evaluate import Job, Measurement, compile_job, measure, ready, retime

# Seconds a child may take to start and import torch and TileLang.
STARTUP_TIMEOUT = 120.0
# Niceness of compile processes: the benchmarking child keeps its core when it needs it.
COMPILE_NICE = 10
_AHEAD = object()  # the tag of compiles ahead, whose outcomes only fill the kernel cache


class Session:
    """Compile and benchmark children for one device; a context manager that ends them.

    `jobs` = 0 makes a session that only measures (kernels already compiled are loaded from the
    disk cache; any other is compiled by the benchmark child itself).
    """

    def __init__(self, device: str, jobs: int, trial_timeout: float):
        self.device = device
        self.trial_timeout = trial_timeout
        self.startup_timeout = max(STARTUP_TIMEOUT, trial_timeout)
        self.overlap = not device.startswith("cpu")  # compile while the device measures
        self.bench = Child("tileops-bench")
        env = _compile_env(device)
        self.compilers = [Child(f"tileops-compile-{i}", env, nice=COMPILE_NICE)
                          for i in range(jobs)]
        started = time.perf_counter()
        self._ready([self.bench, *self.compilers])
        self.startup_s = time.perf_counter() - started  # the children's start, for reports
        self._pool = Pool(self.compilers, trial_timeout)
        self._instant: list[tuple[Any, Outcome]] = []  # jobs=0: "compiled" at once
        self._ahead: list[Job] = []  # compiles for the next search, while this one is done

    def _ready(self, children: list[Child]) -> None:
        """(Re)start children and wait until they have imported everything, so that start-up
        counts against no time limit and no child is still starting (using the cores) while
        something is being timed."""
        dead = [c for c in children if not c.alive]
        if dead:
            run_parallel(dead, ready, [()] * len(dead), self.startup_timeout)

    def compile(self, jobs: list[Job]) -> list[Outcome]:
        """Compile jobs on every compile process, waiting for all of them."""
        if not self.compilers:
            return [Outcome() for _ in jobs]
        assert not self._pool.busy, "compile() while submitted compiles are running"
        self._ready(self.compilers)
        return run_parallel(self.compilers, compile_job, [(job,) for job in jobs],
                            self.trial_timeout)

    @property
    def free(self) -> int:
        """How many compiles `submit` can start now."""
        return self._pool.idle if self.compilers else 1 << 30

    @property
    def compiling(self) -> int:
        return self._pool.busy

    def submit(self, tag: Any, job: Job) -> None:
        """Start compiling a job in the background (a free compile process must exist); its
        outcome comes back from `finished` under `tag`. A session without compile processes
        answers at once, leaving the benchmarking child to compile. (A compile process killed
        at its time limit starts again here, its imports inside the next compile's limit.)"""
        if not self.compilers:
            self._instant.append((tag, Outcome()))
            return
        self._pool.submit(tag, compile_job, job)

    def compile_ahead(self, jobs: list[Job]) -> None:
        """Compile `jobs` (the next search's first candidates) on compile processes that come
        free, until the next search starts (calling this with none), so that the gap between
        two searches (re-timing, the next baseline) fills the kernel cache instead of idling."""
        self._ahead = list(jobs)
        self._top_up()

    def finished(self, block: bool = False) -> list[tuple[Any, Outcome]]:
        """Compiles that ended since the last call, as (tag, outcome); with `block`, wait for at
        least one while any runs (compiles ahead included: a slot comes free). An outcome's
        value is (seconds, program)."""
        done, self._instant = self._instant, []
        done += [(tag, o) for tag, o in self._pool.finished(block=block and not done)
                 if tag is not _AHEAD]
        self._top_up()
        return done

    def _top_up(self) -> None:
        while self._ahead and self._pool.idle:
            self._pool.submit(_AHEAD, compile_job, self._ahead.pop(0))

    def measure(self, job: Job, seed: int, program: Any = None,
                abandon_above_us: float | None = None) -> Measurement:
        """Check and time a job in the benchmarking child; `phases` gain "ipc", what the call
        cost beyond the child's own phases (pickling, the pipe, the child's bookkeeping)."""
        started = time.perf_counter()
        try:
            self._ready([self.bench])
            m = self.bench.call(measure, job, seed, program, abandon_above_us,
                                timeout=self.trial_timeout)
        except ChildError as e:
            return Measurement(failure=e.kind, reason=e.reason)
        m.phases["ipc"] = max(0.0, time.perf_counter() - started - sum(m.phases.values()))
        return m

    def retime(self, jobs: list[Job], seed: int, rounds: int) -> list[Measurement]:
        try:
            self._ready([self.bench])
            return self.bench.call(retime, jobs, seed, rounds,
                                   timeout=self.trial_timeout * (1 + len(jobs)))
        except ChildError as e:
            return [Measurement(failure=e.kind, reason=e.reason) for _ in jobs]

    def close(self) -> None:
        close_all((self.bench, *self.compilers))

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
