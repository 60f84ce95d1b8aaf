"""What rebuilding the tuning database costs: GPU time per slice, trials per GPU-minute, and where
a trial's time goes.

    python benchmarks/tuning_cost.py REPORTS_DIR [--storage JOURNAL ...] [--out FILE]

`REPORTS_DIR` holds the cost reports of `tuning_db/h200.sh` (`tileops-tune --report`): one file
per slice, `<op>-<slice>-<dtype>.jsonl`, a line per finished problem and per stopped run
(`tuner.cost`), so a slice's GPU seconds are the sum of its lines' wall seconds (the machine is
held throughout, compiling included) however often it was stopped and resumed. The
studies (`--storage`, the Optuna journals) give each counted trial's own phases
(`tuner.evaluate.PHASES`, the benchmarking child's IPC and the compile process's seconds).

Writes `results/<device>/tuning_cost.json`:
`{"device", "slices": [{"slice", "op", "problems", "counted_trials", "abandoned_trials",
"gpu_seconds"}], "trials_per_gpu_minute" (the GEMM decode slice), "rebuild_gpu_minutes",
"problems", "suite_problems", "trial_seconds"}` and prints the tables for `NOTES.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import optuna
from harness import RESULTS

from tileops.tuner import cost, studies, suites

DECODE_SLICE = "gemm-decode-bfloat16"
SUITES = ("gemm_llama", "attention", "mla_decode", "mxfp4_llama")


def slice_rows(reports: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(reports.glob("*.jsonl")):
        lines = cost.read(path)
        if not lines:
            continue
        rows.append({"slice": path.stem, "op": lines[0]["op"], "device": lines[0]["device"],
                     "lines": len(lines),
                     "problems": len({x["problem"] for x in lines if x["problem"]}),
                     "counted_trials": sum(x["counted_trials"] for x in lines),
                     "abandoned_trials": sum(x["abandoned_trials"] for x in lines),
                     "gpu_seconds": round(sum(x["wall_s"] for x in lines), 1),
                     "parent_seconds": _sum_parts(lines)})
    return rows


def _sum_parts(lines: list[dict[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for line in lines:
        for k, v in line.get("parts", {}).items():
            total[k] += v
    return {k: round(v, 1) for k, v in sorted(total.items())}


def trial_phases(journals: list[str]) -> dict[str, Any]:
    """Mean seconds per counted trial by phase, for the first trial of each problem (which makes
    its inputs and references) and for the rest, and how many trials each figure covers."""
    first: dict[str, list[float]] = defaultdict(list)
    rest: dict[str, list[float]] = defaultdict(list)
    for journal in journals:
        storage = studies.open_storage(journal)
        for name in optuna.get_all_study_names(storage):
            study = optuna.load_study(study_name=name, storage=storage)
            seen_first = False
            for t in studies.counted_trials(study):
                phases = t.user_attrs.get(studies.PHASES)
                if not phases:
                    continue
                into = rest if seen_first else first
                seen_first = True
                for k, v in phases.items():
                    into[k].append(v)
    return {"first_trial_of_a_problem": _means(first), "later_trials": _means(rest)}


def _means(samples: dict[str, list[float]]) -> dict[str, Any]:
    return {"trials": max((len(v) for v in samples.values()), default=0),
            "mean_seconds": {k: round(statistics.fmean(v), 4) for k, v in sorted(samples.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", type=Path)
    ap.add_argument("--storage", action="append", default=[], help="Optuna journal (repeatable)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = slice_rows(args.reports)
    if not rows:
        raise SystemExit(f"no cost reports (*.jsonl) in {args.reports}")
    decode = next((r for r in rows if r["slice"] == DECODE_SLICE), None)
    per_minute = (decode["counted_trials"] / (decode["gpu_seconds"] / 60)
                  if decode and decode["gpu_seconds"] else None)
    suite_problems = sum(len(suites.load(name).problems) for name in SUITES)
    report = {
        "device": rows[0]["device"],
        "slices": [{k: r[k] for k in ("slice", "op", "problems", "counted_trials",
                                      "abandoned_trials", "gpu_seconds", "lines",
                                      "parent_seconds")} for r in rows],
        "trials_per_gpu_minute": round(per_minute, 1) if per_minute else None,
        "rebuild_gpu_minutes": round(sum(r["gpu_seconds"] for r in rows) / 60, 2),
        "problems": sum(r["problems"] for r in rows),
        "suite_problems": suite_problems,
        "trial_seconds": trial_phases(args.storage) if args.storage else None,
    }
    out = args.out or RESULTS / "h200" / "tuning_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    print(f"wrote {out}")
    return 0


def markdown(report: dict[str, Any]) -> str:
    lines = ["| slice | problems | counted trials | abandoned | GPU s | trials / GPU-min |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["slices"]:
        rate = r["counted_trials"] / (r["gpu_seconds"] / 60) if r["gpu_seconds"] else 0
        lines.append(f"| {r['slice']} | {r['problems']} | {r['counted_trials']} | "
                     f"{r['abandoned_trials']} | {r['gpu_seconds']:.0f} | {rate:.0f} |")
    lines.append(f"\nrebuild: {report['rebuild_gpu_minutes']} GPU-minutes for "
                 f"{report['problems']} of {report['suite_problems']} suite problems")
    phases = report.get("trial_seconds")
    if phases:
        names = sorted({k for part in phases.values() for k in part["mean_seconds"]})
        lines += ["", "| trials | " + " | ".join(names) + " |",
                  "| --- |" + " --- |" * len(names)]
        for label, part in phases.items():
            lines.append(f"| {label} ({part['trials']}) | "
                         + " | ".join(f"{part['mean_seconds'].get(k, 0):.3f}" for k in names)
                         + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
