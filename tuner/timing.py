"""Timers: median latency of a launch, measured the same way for candidates and the baseline.

GPUs (CUDA and ROCm through torch.cuda): CUDA events around each launch after warm-up, with the L2
cache flushed before every timed launch, so small problems are not flattered by data left in the
cache; the median of many repeats. The flush writes a buffer twice the L2's size and then reads it
back ("clean", the default): the write evicts everything, and the read leaves the L2 full of
clean lines, so the timed launch does not pay for writing the flush's dirty lines back to memory
(with the write alone, "dirty", a launch may have to write back up to a whole L2 of them: 50 MB
on an H200, ~12 us at its bandwidth); "none" skips the flush (to see what a warm cache gives).
Other devices: wall-clock `perf_counter` around each synchronised launch, median of repeats. The
number of repeats adapts to the launch's duration within a time budget.

A search ranks candidates, so one measurement is short (`BUDGET_S`); the few that may be recorded
are re-timed for longer in interleaved rounds (`tuner.winners`). `estimate` is the few-launch
figure that lets a search abandon a candidate far slower than the best so far.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Seconds of timed launches per measurement, and bounds on the repeat count.
BUDGET_S = {"gpu": 0.05, "host": 0.1}
# A GPU sample also pays the L2 flush (~70 us on an H200), which the budget does not see: at most
# 100 samples keeps a microsecond kernel's measurement near its budget (the median of 100 ranks
# candidates; the few re-timed for a record pool several rounds of them).
REPEATS = {"gpu": (10, 100), "host": (5, 100)}
ESTIMATE_LAUNCHES = 5  # timed launches of an estimate (TileLang's early stop uses 5 too)
FLUSH_MODES = ("clean", "dirty", "none")  # what happens to the L2 before each timed launch
# Seconds of untimed launches first (at least 3), so that clocks, caches and libraries settle.
WARMUP_S = {"gpu": 0.01, "host": 0.01}


@dataclass(frozen=True)
class Stats:
    """Summary of the per-launch latencies of one measurement, in microseconds."""

    median_us: float
    q25_us: float
    q75_us: float
    n: int
    min_us: float | None = None  # the fastest sample

    @classmethod
    def of(cls, samples_us: list[float]) -> Stats:
        if len(samples_us) < 2:
            v = samples_us[0]
            return cls(v, v, v, len(samples_us), v)
        q = statistics.quantiles(samples_us, n=4)
        return cls(statistics.median(samples_us), q[0], q[2], len(samples_us), min(samples_us))


class Timer:
    """Measures launches on one device."""

    def __init__(self, device: torch.device, budget_s: float | None = None,
                 flush: str = "clean"):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {', '.join(FLUSH_MODES)}, not {flush!r}")
        self.device = device
        self.flush_mode = flush
        self.gpu = device.type == "cuda"
        kind = "gpu" if self.gpu else "host"
        self.budget_s = BUDGET_S[kind] if budget_s is None else budget_s
        self.min_repeats, self.max_repeats = REPEATS[kind]
        self.warmup_s = WARMUP_S[kind]
        self._flush: torch.Tensor | None = None

    def samples(self, launch: Callable[[], Any]) -> list[float]:
        """Per-launch latencies (us) of `launch` after warm-up."""
        return self.timed(launch, self.warm_up(launch))

    def measure(self, launch: Callable[[], Any]) -> Stats:
        return Stats.of(self.samples(launch))

    def timed(self, launch: Callable[[], Any], cost_us: float) -> list[float]:
        """Per-launch latencies (us) of a warmed-up `launch`, as many as the budget allows for a
        launch that costs `cost_us` (what `warm_up` returned)."""
        return self._samples([launch] * self._count(cost_us))

    def _count(self, cost_us: float) -> int:
        return int(min(self.max_repeats, max(self.min_repeats, self.budget_s * 1e6 / cost_us)))

    def interleaved(self, launches: list[Callable[[], Any]], rounds: int
                    ) -> list[tuple[list[float], list[float]]]:
        """Each launch's samples pooled over `rounds` rounds, and its per-round medians; each
        round starts one launch later.

        On a GPU the launches alternate sample by sample, so a device whose clocks drift (falling
        as it heats over tens of milliseconds, or another tenant) runs them all in the same state:
        timed one block after another, the same kernel measured up to 14% apart depending on what
        ran before it (`benchmarks/NOTES.md`). On the host each launch keeps its block of
        samples: a library call whose thread pool fell asleep under another launch's sample
        measured 3x slower."""
        counts = [self._count(self.warm_up(launch)) for launch in launches]
        samples: list[list[float]] = [[] for _ in launches]
        medians: list[list[float]] = [[] for _ in launches]
        def rotated(first: int) -> list[int]:  # every launch once, starting at `first`
            return [(first + j) % len(launches) for j in range(len(launches))]

        for r in range(rounds):
            if self.gpu:  # sample k of every launch, then sample k + 1, each time one later
                order = [i for k in range(max(counts, default=0)) for i in rotated(r + k)
                         if k < counts[i]]
            else:  # each launch's samples in one block
                order = [i for i in rotated(r) for _ in range(counts[i])]
            got: list[list[float]] = [[] for _ in launches]
            for i, us in zip(order, self._samples([launches[i] for i in order]), strict=True):
                got[i].append(us)
            for i, s in enumerate(got):
                samples[i].extend(s)
                medians[i].append(statistics.median(s))
        return list(zip(samples, medians, strict=True))

    def estimate(self, launch: Callable[[], Any]) -> float:
        """Median latency (us) of a few timed launches after one untimed: within 10-20% of a
        full measurement, enough to tell a candidate twice as slow as the best."""
        launch()
        self.synchronize()
        return statistics.median(self._samples([launch] * ESTIMATE_LAUNCHES))

    def warm_up(self, launch: Callable[[], Any]) -> float:
        """Run untimed launches; their mean latency (us) estimates what one timed launch costs."""
        launch()
        self.synchronize()
        n, start = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - start < self.warmup_s:
            launch()
            self.synchronize()
            n += 1
        return max((time.perf_counter() - start) * 1e6 / n, 1.0)

    def _samples(self, schedule: list[Callable[[], Any]]) -> list[float]:
        """The latency (us) of each launch of `schedule`, run in its order."""
        return self._gpu_samples(schedule) if self.gpu else self._host_samples(schedule)

    def _host_samples(self, schedule: list[Callable[[], Any]]) -> list[float]:
        out = []
        for launch in schedule:
            start = time.perf_counter()
            launch()
            self.synchronize()
            out.append((time.perf_counter() - start) * 1e6)
        return out

    def _gpu_samples(self, schedule: list[Callable[[], Any]]) -> list[float]:
        flush = self._flush_buffer()
        starts = [torch.cuda.Event(enable_timing=True) for _ in schedule]
        ends = [torch.cuda.Event(enable_timing=True) for _ in schedule]
        for launch, start, end in zip(schedule, starts, ends, strict=True):
            if self.flush_mode != "none":
                flush.zero_()
            if self.flush_mode == "clean":
                flush.sum()
            start.record()
            launch()
            end.record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]

    def _flush_buffer(self) -> torch.Tensor:
        if self._flush is None:
            props = torch.cuda.get_device_properties(self.device)
            l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
            self._flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device=self.device)
        return self._flush

    def synchronize(self) -> None:
        synchronize(self.device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]
