"""What runs inside the child processes: compile a candidate, check it, time it.

A candidate must reproduce `spec.reference` on random inputs (relative Frobenius error within
`spec.tolerance`, NaN never passes) before its time counts. Its output buffer is NaN-filled
first, so elements it never writes fail the check; problems with bucketed sizes are also checked at
a size inside the bucket that is not its largest, where tiles run past the edge. The baseline is
timed by the same timer in the same process.

The configurations change from trial to trial, not the problem: a problem's inputs, references
and output buffers are made once per seed and kept by the benchmarking child (`_cases`) for every
trial that follows. Compile processes build each candidate's program and hand it over with the
compiled kernel in TileLang's disk cache, so the benchmarking child only loads it. A candidate
whose few-launch estimate is slower than `abandon_above_us` (a factor of the best so far) is
abandoned before its check and timing: it cannot win, and the search says so.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tileops.dispatch import compile_kernel
from tileops.spec import Config, OpSpec
from tileops.target import Target

from .timing import Stats, Timer

# Where a measurement's time goes, in the benchmarking child (seconds each): loading the kernel,
# making the problem's inputs and references (first trial of a problem only), checking the
# output, the abandonment estimate, warm-up and the timed launches.
PHASES = ("load", "inputs", "reference", "check", "estimate", "warmup", "timing")
ABANDONED = "abandoned"  # the failure of a candidate dropped after its estimate


@dataclass(frozen=True)
class Job:
    """One thing to compile or measure: a configuration of an operator (None: its baseline)."""

    spec: OpSpec
    problem: tuple
    target: Target
    device: str
    config: Config | None = None


@dataclass(frozen=True)
class Measurement:
    """A measured latency, or why there is none (`failure`: "wrong" output, "abandoned" ...)."""

    stats: Stats | None = None
    failure: str | None = None
    reason: str = ""
    error: float | None = None  # relative error of the checked output
    round_medians: tuple[float, ...] = field(default=())  # re-timing rounds (see `retime`)
    gpu: str | None = None  # the GPU it ran on (its UUID), so a sweep can show where it timed
    phases: dict[str, float] = field(default_factory=dict)  # seconds per PHASES entry
    estimate_us: float | None = None  # the few-launch estimate (abandoned candidates)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.stats is not None


def ready() -> None:
    """Import what compiling and measuring need (children are warmed up before any timing)."""
    import tilelang  # noqa: F401

    _quiet_logs()


def compile_job(job: Job) -> tuple[float, Any]:
    """Compile a candidate into TileLang's disk cache; (seconds taken, its program), the program
    for the benchmarking child to load the kernel without building it again. Raises on compile
    errors."""
    _quiet_logs()
    start = time.perf_counter()
    program = job.spec.build(job.problem, job.config, job.target)
    compile_kernel(job.spec, job.problem, job.config, job.target, program)
    return time.perf_counter() - start, program


def measure(job: Job, seed: int, program: Any = None,
            abandon_above_us: float | None = None) -> Measurement:
    """Check a candidate (or the baseline) on the inputs of `seed`, then time it; abandon it
    first when its estimate is above `abandon_above_us`."""
    device = _device(job.device)
    phases = _Phases(device)
    run = _Runner(job, device, program)
    phases.lap("load")
    timer = _timer(device)
    cases, held = _cases(job, device, seed, phases)
    if abandon_above_us is not None and job.config is not None:
        run.use(cases[0])
        estimate = timer.estimate(run.launch)
        phases.lap("estimate")
        if estimate > abandon_above_us:
            return Measurement(failure=ABANDONED, estimate_us=estimate, phases=phases.times,
                               reason=f"estimate {estimate:.3g} us > {abandon_above_us:.3g} us "
                                      "(a factor of the best so far)")
    failure = run.check(cases)
    if failure is not None and held:
        # An earlier candidate may have written past its output, into the inputs: check again
        # on inputs made afresh before calling this one wrong.
        _held.clear()
        cases, _ = _cases(job, device, seed, phases)
        failure = run.check(cases)
    phases.lap("check")
    if failure is not None:
        return _with_phases(failure, phases)
    cost = timer.warm_up(run.launch)
    phases.lap("warmup")
    stats = Stats.of(timer.timed(run.launch, cost))
    phases.lap("timing")
    return Measurement(stats=stats, error=run.error, gpu=_gpu_id(device), phases=phases.times)


def retime(jobs: list[Job], seed: int, rounds: int) -> list[Measurement]:
    """Check each job again on fresh inputs, then time them in interleaved rounds (drift hits all
    alike), each warmed up once.

    Each result pools the samples of every round and keeps the per-round medians, whose spread
    tells the noise band the winner is chosen in (and whether the timings contradict each other).
    """
    device = _device(jobs[0].device)
    phases = _Phases(device)
    runners = [_Runner(job, device) for job in jobs]  # loaded already when they were searched
    cases, _ = _cases(jobs[0], device, seed, phases)
    failures = [run.check(cases) for run in runners]
    timer = _timer(device)
    ok = [i for i, f in enumerate(failures) if f is None]
    timed = dict(zip(ok, timer.interleaved([runners[i].launch for i in ok], rounds),
                     strict=True))
    return [f if f is not None else Measurement(Stats.of(timed[i][0]), error=runners[i].error,
                                                round_medians=tuple(timed[i][1]))
            for i, f in enumerate(failures)]


class _Phases:
    """Seconds spent per phase of a measurement (device work included: laps synchronise)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        from .timing import synchronize

        synchronize(self.device)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._last
        self._last = now


def _with_phases(m: Measurement, phases: _Phases) -> Measurement:
    return Measurement(m.stats, m.failure, m.reason, m.error, m.round_medians, m.gpu,
                       phases.times, m.estimate_us)


@dataclass
class _Case:
    """One checked size of a problem: the launch arguments, the float64 reference, and an output
    buffer shaped like the baseline's result (NaN-filled before each candidate runs)."""

    sizes: dict[str, int]
    inputs: tuple
    args: tuple
    reference: Any
    out: Any


# The problem whose cases the benchmarking child holds: (operator, problem, target, device, seed).
_held: dict[tuple, list[_Case]] = {}


def _cases(job: Job, device: torch.device, seed: int, phases: _Phases | None = None
           ) -> tuple[list[_Case], bool]:
    """The cases of a job's problem for `seed`, and whether they were held from an earlier call:
    made on first use and kept for the trials that follow (only the last problem's: a sweep
    works through its problems one at a time)."""
    key = (job.spec.name, job.problem, job.target.key, str(device), seed)
    cases = _held.get(key)
    if cases is not None:
        return cases, True
    _held.clear()
    cases = _held[key] = _make_cases(job.spec, job.problem, device, seed, phases)
    return cases, False


def _make_cases(spec: OpSpec, problem: tuple, device: torch.device, seed: int,
                phases: _Phases | None) -> list[_Case]:
    cases = []
    for sizes in spec.check_sizes(problem):
        inputs = spec.make_inputs(problem, device, seed=seed, sizes=sizes)
        call = spec.prepare(*spec.serving_args(inputs))  # per-step work outside the timing
        if sizes and call.problem != problem:
            continue  # this size falls in another bucket for this spec
        out = _poisoned(spec.launch_baseline(call.args))
        if phases:
            phases.lap("inputs")
        cases.append(_Case(sizes, inputs, call.args, spec.reference(inputs), out))
        if phases:
            phases.lap("reference")
    return cases


class _Runner:
    """A compiled candidate (or the baseline), launched on one case's arguments."""

    def __init__(self, job: Job, device: torch.device, program: Any = None):
        self.job, self.device = job, device
        spec = job.spec
        if job.config is None:
            self._launch = lambda case: spec.launch_baseline(case.args)
        else:
            kernel = compile_kernel(spec, job.problem, job.config, job.target, program)
            self._launch = lambda case: spec.launch(kernel, case.args, out=case.out)
        self.case: _Case | None = None
        self.error: float | None = None

    def use(self, case: _Case) -> None:
        self.case = case

    def launch(self) -> Any:
        return self._launch(self.case)

    def check(self, cases: list[_Case]) -> Measurement | None:
        """Compare with the reference at each checked size; None when every check passes. The
        timed launches then use the bucket's own size (the first case)."""
        spec, problem = self.job.spec, self.job.problem
        tolerance = spec.tolerance(problem)
        worst = 0.0
        for case in cases:
            _poison(case.out)
            self.case = case
            out = self.launch()
            error = relative_error(out, case.reference)
            worst = error if math.isnan(error) else max(worst, error)
            if not error <= tolerance:
                where = f" at {case.sizes}" if case.sizes else ""
                return Measurement(failure="wrong", error=error, reason=(
                    f"relative error {error:.3g} > tolerance {tolerance:g}{where}"
                    + (f" ({_count_nan(out)} NaN elements: unwritten?)" if math.isnan(error)
                       else "")))
        self.case = cases[0]
        self.error = worst
        return None


def relative_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| (Frobenius, float64), the largest over the output tensors (so a
    small output such as a log-sum-exp does not hide errors in a large one); NaN stays NaN.

    Infinities the reference has and the output matches exactly (e.g. the -inf log-sum-exp of a
    fully masked attention row) count as exact and drop out of both norms.
    """
    outs, refs = _tensors(out), _tensors(ref)
    if len(outs) != len(refs) or any(o.shape != r.shape for o, r in zip(outs, refs, strict=True)):
        shapes = [tuple(o.shape) for o in outs], [tuple(r.shape) for r in refs]
        raise ValueError(f"output shapes {shapes[0]} differ from the reference's {shapes[1]}")
    errors = []
    for o, r in zip(outs, refs, strict=True):
        o, r = _drop_matching_inf(o.double(), r.to(o.device).double())
        num, den = float(((o - r) ** 2).sum()), float((r ** 2).sum())
        errors.append(math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num))
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _drop_matching_inf(o: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    same = torch.isinf(r) & (o == r)
    if not same.any():
        return o, r
    return o.masked_fill(same, 0.0), r.masked_fill(same, 0.0)


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple | list) else [value]


def _poisoned(like: Any) -> Any:
    """A buffer shaped like `like`, NaN-filled where the dtype has a NaN."""
    if isinstance(like, tuple | list):
        return type(like)(_poisoned(t) for t in like)
    return _poison(torch.empty_like(like))


def _poison(buffers: Any) -> Any:
    """Fill float buffers with NaN in place (others are left as they are)."""
    for t in _tensors(buffers):
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
    return buffers


def _count_nan(out: Any) -> int:
    return sum(int(torch.isnan(t).sum()) for t in _tensors(out) if t.is_floating_point())


_timers: dict[torch.device, Timer] = {}


def _timer(device: torch.device) -> Timer:
    timer = _timers.get(device)
    if timer is None:
        timer = _timers[device] = Timer(device)
    return timer


def _device(name: str) -> torch.device:
    _quiet_logs()
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _gpu_id(device: torch.device) -> str | None:
    """The UUID of the GPU that `device` names (what nvidia-smi lists), None off GPUs."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    return uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"


def _quiet_logs() -> None:
    logging.getLogger("tilelang").setLevel(logging.WARNING)
    logging.getLogger("TileLang").setLevel(logging.WARNING)
