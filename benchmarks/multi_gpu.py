"""Report of `benchmarks/multi_gpu.sh`: two workers on two GPUs against one worker on one.

    python3 benchmarks/multi_gpu.py OUTDIR [--out results/h200/multi_gpu.json]

Reads each run's Optuna journal (`two`, `one`) and tuning database, and compares them on the
problems both searched:
- trials: counted per problem and per worker, none lost (left running or waiting), none run twice
  (a second counted trial of a configuration already counted in the same study);
- where they ran: the GPU (UUID) each worker timed its trials on and, from nvidia-smi's process
  logs (`gpu_apps*.csv`), that no process held a context on more than one GPU;
- throughput: counted trials per minute of search, each problem's search timed from its first
  trial's start to its last trial's end (problems resumed by a later process are left out, so
  that start-up and the time between calls count for neither run);
- quality: per problem, the latency recorded by the two-worker run over the one-worker run's.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

import optuna
from optuna.trial import TrialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileops.db import TuningDB  # noqa: E402
from tileops.tuner import studies  # noqa: E402

RUNS = {"two": 2, "one": 1}  # run name -> workers


def searched(journal: Path, keep: set[int] | None = None) -> dict[str, dict]:
    """Per problem (canonical JSON; only M in `keep` if given): what the run's trials show."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = studies.open_storage(f"journal:{journal}")
    problems = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        trials = study.get_trials(deepcopy=False)
        states = Counter(t.state.name for t in trials)
        counted = studies.counted_trials(study)
        if not counted:
            continue
        keys = Counter(studies.canonical(t.params) for t in counted)
        gpus: dict[str, set[str]] = defaultdict(set)
        for t in counted:
            gpus[t.user_attrs.get(studies.OWNER, "?")].add(t.user_attrs.get(studies.GPU, "?"))
        span = max(t.datetime_complete for t in counted) - min(t.datetime_start for t in counted)
        problem = summary.study_name.split(":", 5)[5].rsplit(":", 1)[0]
        if keep is not None and json.loads(problem).get("M") not in keep:
            continue
        problems[problem] = {
            "counted": len(counted),
            "run_twice": sum(n - 1 for n in keys.values()),
            "lost": states["RUNNING"] + states["WAITING"],
            "per_worker": dict(Counter(t.user_attrs.get(studies.OWNER, "?") for t in counted)),
            "gpus_per_worker": {w: sorted(g) for w, g in gpus.items()},
            "search_s": span.total_seconds(),
            "best_us": min((t.value for t in counted if t.state == TrialState.COMPLETE),
                           default=None),
        }
    return problems


def recorded(db: Path) -> dict[str, dict]:
    with TuningDB(db, readonly=True) as tdb:
        return {r.problem: {"chosen": r.chosen, "tile_us": r.tile_us,
                            "baseline_us": r.baseline_us, "config": json.loads(r.config)}
                for r in tdb.records()}


def gpu_processes(out: Path) -> dict:
    """From nvidia-smi's logs: how many processes held a context on each GPU, and on several."""
    if not (out / "gpus.csv").exists():
        return {}
    index = {row[1].strip(): int(row[0]) for row in csv.reader(
        (out / "gpus.csv").read_text().splitlines())}
    per_pid: dict[tuple[str, str], set[int]] = defaultdict(set)
    for log in sorted(out.glob("gpu_apps*.csv")):
        for row in csv.reader(log.read_text().splitlines()):
            if len(row) >= 3 and row[1].strip() in index:
                per_pid[log.name, row[2].strip()].add(index[row[1].strip()])
    return {
        "gpus": index,
        "processes": len(per_pid),
        "processes_per_gpu": dict(Counter(g for gs in per_pid.values() for g in gs)),
        "on_several_gpus": sorted(f"{log}:{pid}" for (log, pid), gs in per_pid.items()
                                  if len(gs) > 1),
    }


def report(out: Path, keep: set[int] | None = None) -> dict:
    runs = {name: searched(out / f"{name}.optuna.journal", keep) for name in RUNS}
    common = sorted(runs["two"].keys() & runs["one"].keys())
    # A problem searched by more processes than the run has workers was resumed by a later call.
    single = [p for p in common
              if all(len(runs[n][p]["per_worker"]) <= w for n, w in RUNS.items())]
    summary = {}
    for name, workers in RUNS.items():
        mine = runs[name]
        per_gpu = defaultdict(set)  # worker -> GPUs, over every problem
        for p in mine.values():
            for w, g in p["gpus_per_worker"].items():
                per_gpu[w].update(g)
        trials = sum(mine[p]["counted"] for p in single)
        seconds = sum(mine[p]["search_s"] for p in single)
        summary[name] = {
            "workers": workers, "problems": len(mine),
            "counted": sum(p["counted"] for p in mine.values()),
            "run_twice": sum(p["run_twice"] for p in mine.values()),
            "lost": sum(p["lost"] for p in mine.values()),
            "workers_on_one_gpu": all(len(g) == 1 for g in per_gpu.values()),
            "distinct_gpus": len(set().union(*per_gpu.values())) if per_gpu else 0,
            "timed_problems": len(single), "timed_trials": trials, "search_s": seconds,
            "trials_per_min": trials / seconds * 60 if seconds else None,
        }
    quality = []
    dbs = {n: recorded(out / f"{n}.sqlite") for n in RUNS if (out / f"{n}.sqlite").exists()}
    if len(dbs) == 2:
        for p in sorted(dbs["two"].keys() & dbs["one"].keys()):
            a, b = dbs["two"][p], dbs["one"][p]
            quality.append({"problem": json.loads(p), "two_us": a["tile_us"],
                            "one_us": b["tile_us"], "ratio": a["tile_us"] / b["tile_us"],
                            "same_config": a["config"] == b["config"],
                            "two_chosen": a["chosen"], "one_chosen": b["chosen"]})
    result = {"summary": summary, "common_problems": len(common), "quality": quality,
              "gpu_processes": gpu_processes(out), "problems": runs}
    one, two = summary["one"]["trials_per_min"], summary["two"]["trials_per_min"]
    result["throughput_ratio"] = two / one if one and two else None
    if quality:
        ratios = [q["ratio"] for q in quality]
        result["quality_geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return result


def markdown(r: dict) -> str:
    lines = ["| run | workers | problems | counted trials | lost | run twice | each worker on "
             "one GPU | GPUs used | trials/min (problems timed) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["summary"].items():
        lines.append(f"| {name} | {s['workers']} | {s['problems']} | {s['counted']} | {s['lost']} "
                     f"| {s['run_twice']} | {s['workers_on_one_gpu']} | {s['distinct_gpus']} | "
                     f"{s['trials_per_min']:.1f} ({s['timed_problems']}) |")
    if r["throughput_ratio"]:
        lines.append(f"\nthroughput, two workers over one: {r['throughput_ratio']:.2f}x")
    g = r["gpu_processes"]
    if g:
        lines.append(f"\nprocesses with a GPU context: {g['processes']} (per GPU index: "
                     f"{g['processes_per_gpu']}); on several GPUs: {g['on_several_gpus'] or 'none'}")
    if r["quality"]:
        lines += ["", "| M x N x K | two workers (us) | one worker (us) | ratio | same config |",
                  "|---|---|---|---|---|"]
        for q in r["quality"]:
            p = q["problem"]
            lines.append(f"| {p['M']}x{p['N']}x{p['K']} | {q['two_us']:.1f} | {q['one_us']:.1f} "
                         f"| {q['ratio']:.3f} | {q['same_config']} |")
        lines.append(f"\ngeomean latency, two workers' records over one worker's: "
                     f"{r['quality_geomean']:.3f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    p.add_argument("--m", help="comma-separated M values: the slice's problems (default: all "
                               "problems in the journals)")
    args = p.parse_args()
    r = report(args.outdir, {int(m) for m in args.m.split(",")} if args.m else None)
    print(markdown(r))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
