"""What a sweep cost: one JSON line per run (`tileops-tune --report FILE`), appended, so that a
sweep stopped and resumed in parts is the sum of its lines.

A line holds the operator, the device, the problems, the counted and abandoned trials the run
added, its wall seconds (on a GPU machine: device time, the machine being held throughout) and
where the parent's time went (`parts`: starting the children, the baseline, asking, waiting for
compiles, measuring, bookkeeping, re-timing). Where a trial's own time went is in its study
(`studies.PHASES`); `benchmarks/tuning_cost.py` puts the two together.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tileops.spec import OpSpec
from tileops.target import Target


def run_line(spec: OpSpec, target: Target, results: Sequence[Any], wall_s: float,
             label: str = "") -> dict[str, Any]:
    """The line of one run over `results` (`sweep.Result`s)."""
    parts: dict[str, float] = {}
    for r in results:
        for k, v in r.seconds.items():
            parts[k] = parts.get(k, 0.0) + v
    return {"op": spec.name, "label": label, "device": target.device,
            "target": target.describe(), "problems": len(results),
            "counted_trials": sum(r.new_trials for r in results),
            "abandoned_trials": sum(r.new_abandoned for r in results),
            "recorded": sum(r.recorded for r in results), "wall_s": round(wall_s, 3),
            "parts": {k: round(v, 3) for k, v in sorted(parts.items())}}


def check_writable(path: Path) -> None:
    """Make sure a line can be appended to `path` (before a sweep, not after it); raises
    OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        pass


def append(path: Path, line: dict[str, Any]) -> None:
    with open(path, "a") as f:
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
