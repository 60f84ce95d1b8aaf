"""What a sweep cost, as JSON lines appended to a file (`tileops-tune --report FILE`): one per
finished problem and one for the time after the last (what a stopped run spent on the problem it
did not finish), so that a slice run in resumable parts, however often stopped, costs the sum of
its lines.

A line holds the operator, the device, the problem (None for the time after the last one), the
counted and abandoned trials the run added to it, whether it was recorded, its wall seconds (on a
GPU machine: device time, the machine being held throughout, compiling included) and where the
parent's time went (`parts`: starting the children, the baseline, asking, waiting for compiles,
measuring, bookkeeping, re-timing). Where a trial's own time went is in its study
(`studies.PHASES`); `benchmarks/tuning_cost.py` puts the two together.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tileops.spec import OpSpec
from tileops.target import Target


class Recorder:
    """Appends the lines of one run to `path` (checked writable at once, not after the sweep:
    raises OSError)."""

    def __init__(self, path: Path, spec: OpSpec, target: Target):
        self.path, self.spec, self.target = path, spec, target
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
        self._last = time.perf_counter()

    def add(self, result: Any) -> None:
        """The line of a finished problem (a `sweep.Result`)."""
        self._append({"problem": result.task.label, "counted_trials": result.new_trials,
                      "abandoned_trials": result.new_abandoned, "recorded": result.recorded,
                      "stopped": result.stopped,
                      "parts": {k: round(v, 3) for k, v in sorted(result.seconds.items())}})

    def close(self) -> None:
        """The time since the last problem finished (the run's end, or a problem it stopped in)."""
        if time.perf_counter() - self._last > 0.5:
            self._append({"problem": None, "counted_trials": 0, "abandoned_trials": 0,
                          "recorded": False, "stopped": "", "parts": {}})

    def _append(self, fields: dict[str, Any]) -> None:
        now = time.perf_counter()
        line = {"op": self.spec.name, "device": self.target.device,
                "target": self.target.describe(), "wall_s": round(now - self._last, 3), **fields}
        self._last = now
        with open(self.path, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    """Every line of a report file (a torn last line, from a run killed while writing, is
    skipped)."""
    lines = []
    for text in Path(path).read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return lines
