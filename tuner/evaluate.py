"""What runs inside the child processes: compile a candidate, check it, time it.

A candidate must reproduce `spec.reference` on fresh random inputs (relative Frobenius error
within `spec.tolerance`, NaN never passes) before its time counts. Its output buffer is NaN-filled
first, so elements it never writes fail the check; problems with bucketed sizes are also checked at
a size inside the bucket that is not its largest, where tiles run past the edge. The baseline is
timed by the same timer in the same process.
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
    """A measured latency, or why there is none (`failure`: "wrong" output)."""

    stats: Stats | None = None
    failure: str | None = None
    reason: str = ""
    error: float | None = None  # relative error of the checked output
    round_medians: tuple[float, ...] = field(default=())  # re-timing rounds (see `retime`)
    gpu: str | None = None  # the GPU it ran on (its UUID), so a sweep can show where it timed

    @property
    def ok(self) -> bool:
        return self.failure is None and self.stats is not None


def ready() -> None:
    """Import what compiling and measuring need (children are warmed up before any timing)."""
    import tilelang  # noqa: F401

    _quiet_logs()


def compile_job(job: Job) -> float:
    """Compile a candidate into TileLang's disk cache; seconds taken. Raises on compile errors."""
    _quiet_logs()
    start = time.perf_counter()
    compile_kernel(job.spec, job.problem, job.config, job.target)
    return time.perf_counter() - start


def measure(job: Job, seed: int) -> Measurement:
    """Check a candidate (or the baseline) on inputs from `seed`, then time it."""
    device = _device(job.device)
    run = _Runner(job, device)
    failure = run.check(seed)
    if failure is not None:
        return failure
    return Measurement(stats=_timer(device).measure(run.launch), error=run.error,
                       gpu=_gpu_id(device))


def retime(jobs: list[Job], seed: int, rounds: int) -> list[Measurement]:
    """Check each job again, then time them in interleaved rounds (drift hits all alike).

    Each result pools the samples of every round and keeps the per-round medians, whose spread
    tells the noise band the winner is chosen in.
    """
    device = _device(jobs[0].device)
    runners = [_Runner(job, device) for job in jobs]
    failures = [run.check(seed) for run in runners]
    samples: list[list[float]] = [[] for _ in jobs]
    medians: list[list[float]] = [[] for _ in jobs]
    timer = _timer(device)
    for _ in range(rounds):
        for i, run in enumerate(runners):
            if failures[i] is None:
                s = timer.samples(run.launch)
                samples[i].extend(s)
                medians[i].append(Stats.of(s).median_us)
    return [f if f is not None else Measurement(Stats.of(samples[i]), error=runners[i].error,
                                                round_medians=tuple(medians[i]))
            for i, f in enumerate(failures)]


class _Runner:
    """A compiled candidate (or the baseline) with its arguments for one problem."""

    def __init__(self, job: Job, device: torch.device):
        self.job, self.device = job, device
        spec = job.spec
        if job.config is None:
            self._launch = spec.launch_baseline
        else:
            kernel = compile_kernel(spec, job.problem, job.config, job.target)

            def launch(args: tuple, out: Any = None) -> Any:
                return spec.launch(kernel, args, out=out)

            self._launch = launch
        self.args: tuple = ()
        self.error: float | None = None

    def launch(self) -> Any:
        return self._launch(self.args)

    def check(self, seed: int) -> Measurement | None:
        """Compare with the reference at each checked size; None when every check passes."""
        spec, problem = self.job.spec, self.job.problem
        tolerance = spec.tolerance(problem)
        worst = 0.0
        for sizes in _check_sizes(spec, problem):
            inputs = spec.make_inputs(problem, self.device, seed=seed, sizes=sizes)
            call = spec.prepare(*inputs)
            if sizes and call.problem != problem:
                continue  # this size falls in another bucket for this spec
            if self.job.config is None:
                out = self._launch(call.args)
            else:
                out = self._launch(call.args, _poisoned(spec.launch_baseline(call.args)))
            error = relative_error(out, spec.reference(inputs))
            worst = error if math.isnan(error) else max(worst, error)
            if not error <= tolerance:
                where = f" at {sizes}" if sizes else ""
                return Measurement(failure="wrong", error=error, reason=(
                    f"relative error {error:.3g} > tolerance {tolerance:g}{where}"
                    + (f" ({_count_nan(out)} NaN elements: unwritten?)" if math.isnan(error)
                       else "")))
            if not sizes:
                self.args = call.args
        self.error = worst
        return None


def _check_sizes(spec: OpSpec, problem: tuple) -> list[dict[str, int]]:
    """The bucket's own sizes ({}) and, for bucketed fields, a size just above half the bucket."""
    fields = spec.problem_dict(problem)
    inner = {f: fields[f] // 2 + 1 for f in spec.bucketed if fields[f] > 2}
    return [{}, inner] if inner else [{}]


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
    if like.is_floating_point() or like.is_complex():
        return torch.full_like(like, float("nan"))
    return torch.empty_like(like)


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
