"""How quickly does each sampler find the best configuration? Grid vs random vs TPE.

For each of several problems of a workload suite, the full grid of the configuration space (every
configuration that passes the spec's constraint checks) is measured as the reference; random
search and TPE then get at most `--fraction` (default 25%) of the grid's trial count, for
`--seeds` seeds each. Results: `benchmarks/results/<device>/tuner_efficiency.json` (best-so-far
curves, the best found by each run against the grid's best, trials needed to come within 5% and
1% of it) and a PNG plot of best-so-far latency against trials (when matplotlib is installed).

A sampler's best is judged twice: by its own measurement (`best_us`), and by the grid's
measurement of the configuration it found best (`grid_us_of_best`), which takes run-to-run noise
out of the comparison.

With `--replay`, random and TPE are not measured at all: their searches run through the same loop
as a real sweep (same sampler, constraint checks, repeats), but each configuration's latency is
the one the grid measured. The grid is then the only device work, and many seeds cost seconds.
With `--replay-stored`, no device is used at all: random and TPE are replayed against the complete
grids already in `--storage` (measured earlier, on whatever device), `--space` being the grid's
whole space. Both replays take the grid's constraint verdicts too, so that a configuration the
grid refused is refused again even where the spec's checks have changed since.

Resumable: every study lives in the Optuna journal beside the results (`--storage`), so running
the same command again continues where it stopped; `--time-budget S` stops starting trials after S
seconds and exits with code 3 ("incomplete: run again"). Example on a GPU machine:

    python3 benchmarks/tuner_efficiency.py --device auto --time-budget 540

and on this CPU, with a tiny space (`--plot-from FILE.json` draws the plot elsewhere):

    python3 benchmarks/tuner_efficiency.py --device cpu --suite quickstart --problems 1 \
        --space '{"block_M": [16, 64], "block_N": [32, 64], "block_K": [64]}' --seeds 1

and, anywhere, ten seeds per sampler replayed against the grids measured on the H200:

    python3 benchmarks/tuner_efficiency.py --replay-stored --seeds 10 \
        --storage benchmarks/results/h200/tuner_efficiency.journal.xz \
        --space "$(python3 -c 'import json; print(json.dumps(json.load(open(
            "benchmarks/results/h200/tuner_efficiency.json"))["space"]))')"
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import itertools
import json
import lzma
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import torch

from tileops.ops import get_spec
from tileops.spec import canonical, space_hash
from tileops.target import Target, resolve_device
from tileops.tuner import studies, suites
from tileops.tuner.child import Outcome
from tileops.tuner.evaluate import ABANDONED, Job, Measurement
from tileops.tuner.progress import Progress
from tileops.tuner.search import Limits, Task, search
from tileops.tuner.session import Session
from tileops.tuner.timing import Stats
from tileops.version import __version__

ROOT = Path(__file__).resolve().parent
INCOMPLETE = 3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        path = Path(args.plot_from)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.replay_stored:
        return replay_stored(args)
    target, device = resolve_device(args.device)
    suite = suites.load(args.suite, [args.dtype] if args.dtype else None)
    spec = get_spec(suite.op)
    space = {**spec.space(target), **json.loads(args.space or "{}")}
    problems = (suites.from_shapes(spec, args.shape, [args.dtype]) if args.shape
                else pick(spec, suite.problems, args.problems))
    out_dir = Path(args.results_dir) if args.results_dir else ROOT / "results" / slug(target.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    storage = studies.open_storage(args.storage or str(out_dir / "tuner_efficiency.journal"))
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    progress = Progress(quiet=args.quiet, tty=False)
    jobs = args.jobs or os.cpu_count() or 1
    report: dict[str, Any] = {
        "op": spec.name, "device": target.device, "target": target.describe(),
        "suite": suite.name, "fraction": args.fraction, "seeds": args.seeds, "space": space,
        "replay": args.replay, "versions": versions(), "problems": []}
    complete = True
    with Session(str(device), jobs, args.trial_timeout) as session:
        for problem in problems:
            task = Task(spec, target, str(device), problem, space)
            valid = sum(spec.check_config(problem, c, target) is None for c in grid(space))
            budget = max(1, math.floor(args.fraction * valid))
            runs = [("grid", 0, valid)] + [(s, seed, budget) for s in ("random", "tpe")
                                            for seed in range(args.seeds)]
            entry: dict[str, Any] = {"problem": spec.problem_dict(problem), "label": task.label,
                                     "valid_configs": valid, "budget": budget, "runs": []}
            grid_table: dict[str, float] = {}
            replay: Replay | None = None
            for sampler, seed, trials in runs:
                if replay is not None:  # a sampler's search answered by the grid's timings
                    study = replay.run(task, sampler, seed, trials, progress, jobs)
                else:
                    study = open_run(storage, task, sampler, seed)
                    # The grid times every point in full: the samplers' runs are judged by the
                    # grid's latency of what they found, which an abandoned point would lack.
                    limits = Limits(trials, deadline=deadline,
                                    abandon=None if sampler == "grid" else Limits.abandon)
                    result = search(session, study, task, limits, progress,
                                    studies.in_flight(sampler, jobs), seed)
                    complete &= result.stopped != "timeout"
                    if args.replay and result.stopped != "timeout":
                        replay = Replay(study)
                entry["runs"].append(run_result(study, sampler, seed, trials))
                grid_table = grid_table or latencies(study)
                if args.replay and replay is None:
                    break  # the grid is unfinished: nothing to replay against yet
            score(entry, grid_table)
            report["problems"].append(entry)
            if deadline is not None and time.monotonic() >= deadline:
                complete = False
                break
    complete &= len(report["problems"]) == len(problems)
    report["complete"] = complete
    report["summary"] = summarise(report["problems"])
    path = out_dir / "tuner_efficiency.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    plot(report, out_dir / "tuner_efficiency.png")
    if not complete:
        print("incomplete (time budget reached): run the same command again to continue")
        return INCOMPLETE
    return 0


def replay_stored(args: argparse.Namespace) -> int:
    """Random and TPE replayed against every complete grid of `--space` in `--storage`."""
    if not (args.storage and args.space):
        raise SystemExit("--replay-stored needs --storage (where the grids are) and --space "
                         "(the grids' whole space)")
    space = json.loads(args.space)
    storage = studies.open_storage(_plain_journal(args.storage))
    progress = Progress(quiet=args.quiet, tty=False)
    jobs = args.jobs or os.cpu_count() or 1  # trials asked at once, as a sweep here would
    entries, skipped, target = [], [], None
    for name in optuna.get_all_study_names(storage):
        parsed = studies.parse_study_name(name)
        if parsed is None or parsed.prefix != run_prefix("grid", 0) \
                or parsed.space_hash != space_hash(space):
            continue
        grid_study = optuna.load_study(study_name=name, storage=storage)
        spec, target = get_spec(parsed.op), Target(*parsed.target_key)
        task = Task(spec, target, "replay", spec.problem_from_dict(parsed.problem), space)
        if not _grid_complete(grid_study, task):
            skipped.append(task.label)
            continue
        replay = Replay(grid_study)
        valid = len(replay.trials)
        budget = max(1, math.floor(args.fraction * valid))
        entry: dict[str, Any] = {"op": spec.name, "problem": parsed.problem, "label": task.label,
                                 "valid_configs": valid, "budget": budget,
                                 "runs": [run_result(grid_study, "grid", 0, valid)],
                                 "flops": spec.flops(task.problem)}
        for sampler in ("random", "tpe"):
            for seed in range(args.seeds):
                study = replay.run(task, sampler, seed, budget, progress, jobs)
                entry["runs"].append(run_result(study, sampler, seed, budget))
        score(entry, latencies(grid_study))
        entries.append(entry)
    for label in skipped:
        print(f"skipped (grid incomplete): {label}")
    if target is None or not entries:
        raise SystemExit(f"no complete grid of this space in {args.storage}")
    entries.sort(key=lambda e: (e.pop("flops"), e["label"]))
    report: dict[str, Any] = {
        "op": ", ".join(sorted({e.pop("op") for e in entries})), "device": target.device,
        "target": target.describe(), "fraction": args.fraction, "seeds": args.seeds,
        "space": space, "replay": "stored", "storage": args.storage,
        "asked_at_once": {sampler: studies.in_flight(sampler, jobs)
                          for sampler in ("random", "tpe")},
        "versions": versions(),
        "problems": entries, "skipped_incomplete": skipped, "complete": not skipped}
    report["summary"] = summarise(entries)
    out_dir = Path(args.results_dir) if args.results_dir else ROOT / "results" / slug(target.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tuner_efficiency_replayed.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    plot(report, path.with_suffix(".png"))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--suite", default="gemm_llama")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the suite problems to use")
    p.add_argument("--problems", type=int, default=6,
                   help="problems taken from the suite, spread over its FLOP range (default 6)")
    p.add_argument("--shape", action="append", metavar="TEXT",
                   help="a problem in the operator's syntax, instead of --problems; repeatable "
                        "(GEMMs of one N x K share their kernels across M, so a grid over six "
                        "M values compiles once)")
    p.add_argument("--fraction", type=float, default=0.25,
                   help="random/TPE trial budget as a fraction of the grid's (default 0.25)")
    p.add_argument("--seeds", type=int, default=3, help="runs per sampler (default 3)")
    p.add_argument("--space", help="JSON dict replacing parameters of the space (tiny CPU runs)")
    p.add_argument("--storage", help="Optuna storage (default: a journal beside the results)")
    p.add_argument("--results-dir", help="default benchmarks/results/<device>/")
    p.add_argument("--jobs", type=int,
                   help="compile processes, and trials asked at once (default: all cores)")
    p.add_argument("--trial-timeout", type=float, default=120.0)
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="start no trial after S seconds; exit 3 if unfinished (run again)")
    p.add_argument("--replay", action="store_true",
                   help="replay random and TPE against the grid's measurements (no device work "
                        "beyond the grid)")
    p.add_argument("--replay-stored", action="store_true",
                   help="no device: replay random and TPE against the complete grids of --space "
                        "already in --storage")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--plot-from", metavar="JSON",
                   help="only draw the plot of a results file (e.g. where matplotlib is)")
    return p.parse_args(argv)


class Replay:
    """Stands in for a `Session`: compiles nothing and answers each measurement with the finished
    grid study's trial of the same configuration (its median and quartiles, or its failure)."""

    def __init__(self, grid_study: optuna.Study):
        self._ready: list[tuple[Any, Outcome]] = []
        self.trials = {canonical(t.params): t for t in studies.counted_trials(grid_study)}
        self.refused = {canonical(t.params): t.user_attrs.get(studies.REASON, "refused")
                        for t in grid_study.get_trials(deepcopy=False)
                        if t.user_attrs.get(studies.FAILURE) == "constraint"
                        and studies.REPEAT_OF not in t.user_attrs}

    def run(self, task: Task, sampler: str, seed: int, trials: int, progress: Progress,
            jobs: int) -> optuna.Study:
        """One sampler's search, in memory, answered from the grid (its constraint verdicts in
        place of the spec's checks)."""
        task = dataclasses.replace(task, spec=_GridChecks(task.spec, self.refused))
        study = open_run(optuna.storages.InMemoryStorage(), task, sampler, seed)
        search(self, study, task, Limits(trials), progress, studies.in_flight(sampler, jobs),
               seed, time_baseline=False)
        return study

    overlap, free, compiling = True, 1 << 30, 0  # nothing to compile: every job is ready at once

    def submit(self, tag: Any, job: Job) -> None:
        self._ready.append((tag, Outcome()))

    def compile_ahead(self, jobs: list[Job]) -> None:
        pass

    def finished(self, block: bool = False) -> list[tuple[Any, Outcome]]:
        done, self._ready = self._ready, []
        return done

    def measure(self, job: Job, seed: int, program: Any = None,
                abandon_above_us: float | None = None) -> Measurement:
        """The grid's measurement of the configuration (abandoned where the search would have
        abandoned it, the grid's latency standing in for the estimate)."""
        t = self.trials.get(canonical(job.config))
        if t is None:
            return Measurement(failure="unmeasured", reason="not in the grid's trials")
        if t.value is None:
            return Measurement(failure=t.user_attrs.get(studies.FAILURE, "error"),
                               reason=t.user_attrs.get(studies.REASON, ""))
        if abandon_above_us is not None and t.value > abandon_above_us:
            return Measurement(failure=ABANDONED, estimate_us=t.value,
                               reason=f"grid latency {t.value:.3g} us > {abandon_above_us:.3g}")
        q25, q75 = t.user_attrs.get("q25_us", t.value), t.user_attrs.get("q75_us", t.value)
        return Measurement(stats=Stats(t.value, q25, q75, 1))


def _plain_journal(path: str) -> str:
    """A journal committed xz-compressed (`results/h200/tuner_efficiency.journal.xz`) is read
    from a decompressed copy in the temporary directory."""
    if not path.endswith(".xz"):
        return path
    plain = Path(tempfile.gettempdir()) / f"tileops-{os.getpid()}-{Path(path).stem}"
    plain.write_bytes(lzma.decompress(Path(path).read_bytes()))
    atexit.register(plain.unlink, missing_ok=True)
    return str(plain)


def _grid_complete(grid_study: optuna.Study, task: Task) -> bool:
    """Every point of the space has a trial, or is one the spec's checks refuse (a live grid run
    asks only for the points that pass them)."""
    seen = {canonical(t.params) for t in grid_study.get_trials(deepcopy=False)}
    return all(canonical(c) in seen
               or task.spec.check_config(task.problem, c, task.target) is not None
               for c in grid(task.space))


class _GridChecks:
    """An operator spec whose constraint check answers as the grid run's did."""

    def __init__(self, spec, refused: dict[str, str]):
        self._spec, self._refused = spec, refused

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)

    def check_config(self, problem: tuple, config: dict[str, Any], target: Target) -> str | None:
        return self._refused.get(canonical(config))


def pick(spec, problems: list[tuple], n: int) -> list[tuple]:
    """`n` problems spread evenly (by rank) over the suite's range of FLOP counts."""
    ranked = sorted(problems, key=lambda p: (spec.flops(p), canonical(spec.problem_dict(p))))
    if n >= len(ranked):
        return ranked
    if n == 1:
        return [ranked[len(ranked) // 2]]
    return [ranked[round(i * (len(ranked) - 1) / (n - 1))] for i in range(n)]


def grid(space: dict[str, list]) -> list[dict[str, Any]]:
    return [dict(zip(space, v, strict=True)) for v in itertools.product(*space.values())]


def run_prefix(sampler: str, seed: int) -> str:
    return f"efficiency/{sampler}/{seed}"


def open_run(storage, task: Task, sampler: str, seed: int) -> optuna.Study:
    """A sampler's study; random and TPE start, as the tuner's searches do, from the heuristic
    default (here its nearest point of the space; neighbouring records are left out: each
    problem is searched as if it were the first)."""
    name = studies.study_name(run_prefix(sampler, seed), task.spec.name, task.target.key,
                              task.spec.problem_dict(task.problem), task.space)
    study = studies.open_study(storage, name, sampler, task.space, seed)
    if sampler != "grid" and not study.trials:
        default = task.spec.default_config(task.problem, task.target)
        studies.warm_start(study, [(studies.nearest(default, task.space), "default")],
                           task.space)
    return study


def run_result(study: optuna.Study, sampler: str, seed: int, budget: int) -> dict[str, Any]:
    """Best-so-far latency after each counted trial (failures repeat the previous best)."""
    counted = studies.counted_trials(study)
    curve, best, best_config = [], math.inf, None
    for t in counted:
        if t.value is not None and t.value < best:
            best, best_config = t.value, t.params
        curve.append(best if best < math.inf else None)
    return {"sampler": sampler, "seed": seed, "budget": budget, "trials": len(counted),
            "failed": sum(t.value is None for t in counted), "curve": curve,
            "best_us": best if best < math.inf else None, "best_config": best_config}


def latencies(study: optuna.Study) -> dict[str, float]:
    """Measured latency of every configuration of a study (the grid: all of them)."""
    return {canonical(t.params): t.value for t in study.get_trials(deepcopy=False)
            if t.value is not None and studies.REPEAT_OF not in t.user_attrs}


def score(entry: dict[str, Any], grid_table: dict[str, float]) -> None:
    """Judge every run against the grid's best, also by the grid's own timing of its best."""
    ref, ref_config = entry["runs"][0]["best_us"], entry["runs"][0]["best_config"]
    entry["grid_best_us"], entry["grid_best_config"] = ref, ref_config
    for run in entry["runs"]:
        best = canonical(run["best_config"]) if run["best_config"] else None
        run["ratio"] = run["best_us"] / ref if ref and run["best_us"] else None
        run["grid_us_of_best"] = grid_table.get(best) if best else None
        run["grid_ratio"] = run["grid_us_of_best"] / ref if ref and run["grid_us_of_best"] \
            else None
        run["found_grid_best"] = best is not None and ref_config is not None \
            and best == canonical(ref_config)
        for pct in (5, 1):
            hit = next((i + 1 for i, v in enumerate(run["curve"])
                        if ref and v is not None and v <= ref * (1 + pct / 100)), None)
            run[f"trials_to_within_{pct}pct"] = hit


def summarise(problems: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sampler in ("random", "tpe"):
        runs = [r for p in problems for r in p["runs"] if r["sampler"] == sampler]
        ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
        out[sampler] = {
            "runs": len(runs),
            "median_ratio_to_grid_best": _median(ratios),
            "worst_ratio_to_grid_best": max(ratios) if ratios else None,
            "within_5pct": sum(r["trials_to_within_5pct"] is not None for r in runs),
            "within_1pct": sum(r["trials_to_within_1pct"] is not None for r in runs),
            "found_grid_best": sum(r["found_grid_best"] for r in runs),
            "median_grid_ratio": _median([r["grid_ratio"] for r in runs]),
        }
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    problems = report["problems"]
    if not problems:
        return
    cols = min(3, len(problems))
    rows = math.ceil(len(problems) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    colours = {"grid": "tab:gray", "random": "tab:blue", "tpe": "tab:red"}
    for ax, entry in zip(axes.flat, problems, strict=False):
        labelled = set()
        for run in entry["runs"]:
            xs = [i + 1 for i, v in enumerate(run["curve"]) if v is not None]
            ys = [v for v in run["curve"] if v is not None]
            label = None if run["sampler"] in labelled else run["sampler"]
            labelled.add(run["sampler"])
            ax.step(xs, ys, where="post", color=colours[run["sampler"]], alpha=0.8, label=label,
                    linewidth=1.5 if run["sampler"] == "grid" else 1.0)
        if entry.get("grid_best_us"):
            ax.axhline(entry["grid_best_us"], color="black", linestyle=":", linewidth=0.8)
        ax.axvline(entry["budget"], color="tab:green", linestyle="--", linewidth=0.8)
        ax.set_title(entry["label"], fontsize=8)
        ax.set_xlabel("trials")
        ax.set_ylabel("best latency so far (us)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(problems):]:
        ax.axis("off")
    fig.suptitle(f"{report['op']} on {report['device']}: best-so-far latency vs trials", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def slug(device: str) -> str:
    """A directory name for a device: "NVIDIA H200" -> "h200"."""
    name = re.sub(r"^(nvidia|amd|intel(\(r\))?)\s+", "", device.strip().lower())
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "device"


def versions() -> dict[str, str]:
    import tilelang

    return {"tileops": __version__, "tilelang": tilelang.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "optuna": optuna.__version__}


if __name__ == "__main__":
    sys.exit(main())
