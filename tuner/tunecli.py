"""`tileops-tune` (or `tileops tune`): its arguments, the sweep they ask for, and what it prints.

`run_tune` turns parsed arguments into a `sweep.Plan`, refuses what cannot work before any trial
runs (a `UsageError`: one line and exit code 2), runs the sweep, checks each new record through
dispatch and says why any problem ended without one; `tuner.cli` holds the entry points.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tileops import dispatch
from tileops.db import DatabaseError, TuningDB, default_user_db
from tileops.ops import SPECS
from tileops.spec import OpSpec, canonical
from tileops.target import Target, parse_override, resolve_device

from . import cost, lifecycle, studies, suites, sweep, winners
from .dispatch_check import Check, check_dispatch
from .errors import UsageError
from .evaluate import Job
from .progress import Progress, table
from .search import ABANDON
from .session import compile_all

log = logging.getLogger("tileops.tuner")


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", help=f"operator to tune ({', '.join(SPECS)}; `tileops ops` lists "
                                "them with their problem syntax); implied by --suite, or "
                                "another spec of the suite's problems (attention_backward)")
    p.add_argument("--device", default="auto",
                   help="auto (first GPU, else the CPU), cpu, cuda[:N], hip, metal, or a TileLang "
                        'target dict such as \'{"kind": "cuda", "arch": "sm_90a"}\'')
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--suite", help="workload suite configs/suites/NAME.toml (or a .toml path)")
    src.add_argument("--problems", metavar="FILE",
                     help="file with one problem per line ('TEXT [DTYPE]', # comments)")
    src.add_argument("--shape", action="append", metavar="TEXT",
                     help="a problem in the operator's own syntax (what its spec's "
                          "parse_problem reads); repeatable")
    p.add_argument("--where", metavar="FIELD=V1,V2",
                   help="only the problems whose FIELD (e.g. head_dim, M) is one of the values")
    p.add_argument("--dtype", help="comma-separated dtypes (default: the suite's, else bfloat16)")
    p.add_argument("--trials", type=_positive(int), default=32,
                   help="compiled configurations per problem, counting earlier runs (default 32)")
    p.add_argument("--timeout", type=_positive(float), metavar="S",
                   help="seconds of search per problem")
    p.add_argument("--db", type=Path, help="tuning database to record into (default: the user "
                                           "database, $TILEOPS_USER_DB or ~/.cache/tileops)")
    p.add_argument("--storage", help="Optuna storage: a journal file path, or an RDB URL such as "
                                     "sqlite:///f.db or postgresql://host/db (default: "
                                     "<db>.optuna.journal beside the database)")
    p.add_argument("--workers", type=_positive(int), default=1,
                   help="worker processes sharing the studies: on CUDA worker i runs on cuda:i")
    p.add_argument("--jobs", type=_positive(int), help="compile processes (default: all cores)")
    p.add_argument("--sampler", choices=studies.SAMPLERS, default="tpe",
                   help="tpe (multivariate, default), random, or grid (exhaustive)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--space", metavar="JSON",
                   help="replace parameters of the search space: a JSON object of "
                        "parameter -> list of values")
    p.add_argument("--trial-timeout", type=_positive(float), default=300.0, metavar="S",
                   help="time limit of one compile and of one measurement (default 300)")
    p.add_argument("--retime-top", type=_positive(int), default=4, metavar="K",
                   help="re-time the K fastest configurations before recording (default 4)")
    p.add_argument("--patience", type=_positive(int), metavar="N",
                   help="stop a problem's search once N counted trials in a row gained under "
                        "1%% on the best (tpe and random; default: search all --trials)")
    p.add_argument("--abandon", type=_abandon_factor, default=ABANDON, metavar="F",
                   help="abandon a candidate whose few-launch estimate is over F times the best "
                        f"so far: counted, never timed in full nor recorded (default {ABANDON}; "
                        "0: time every candidate in full)")
    p.add_argument("--report", type=Path, metavar="FILE",
                   help="append a JSON line of what the run cost (trials, seconds by part) to "
                        "FILE; a sweep run in parts appends one line per part")
    p.add_argument("--no-warm-start", action="store_true",
                   help="do not enqueue the default and the nearest tuned problems' winners")
    p.add_argument("--lower", action="store_true",
                   help="with --dry-run: generate each configuration's code for the target (no "
                        "hardware needed) and mark the ones that fail")
    p.add_argument("--compile", action="store_true",
                   help="with --dry-run: compile each configuration into TileLang's kernel cache "
                        "($TILELANG_CACHE_DIR), on all cores; needs the target's compiler (nvcc "
                        "for CUDA), not its hardware. A sweep that later runs on the hardware with "
                        "that cache loads those kernels instead of compiling them")
    p.add_argument("--dry-run", action="store_true",
                   help="list the configurations that pass the constraint checks; compile nothing")
    p.add_argument("--quiet", action="store_true", help="no progress lines or summary")


@dataclass
class Outcome:
    """What a sweep did: each problem's result, the dispatch checks of the new records, the exit
    code (see the module docstring)."""

    results: list[sweep.Result]
    checks: list[Check]
    unrecorded: list[sweep.Result]  # problems left without a record
    code: int


def tune(args: argparse.Namespace) -> int:
    outcome = run_tune(args)
    return outcome if isinstance(outcome, int) else outcome.code


def run_tune(args: argparse.Namespace) -> Outcome | int:
    """The sweep `args` asks for (an exit code for the dry run, which tunes nothing)."""
    spec, problems = _problems(args)
    target, devices = _devices(args.device, args.workers, dry_run=args.dry_run)
    space = _space(spec, target, args.space)
    db = (args.db or default_user_db()).expanduser()
    plan = sweep.Plan(
        spec=spec, target=target, devices=devices, problems=problems, db=db,
        storage=args.storage or studies.default_storage(db), sampler=args.sampler,
        trials=args.trials, timeout=args.timeout, seed=args.seed,
        trial_timeout=args.trial_timeout, retime_top=args.retime_top, space=space,
        patience=args.patience, abandon=args.abandon or None,
        warm_start=not args.no_warm_start, quiet=args.quiet,
        **({"jobs": args.jobs} if args.jobs else {}))
    if args.dry_run:
        print(dry_run(plan, lower=args.lower))
        if args.compile:
            return precompile(plan, Progress(quiet=args.quiet))
        return lifecycle.OK
    _check_writable(db)
    try:
        recorder = cost.Recorder(args.report, spec, target) if args.report else None
    except OSError as e:
        raise UsageError(f"--report {args.report}: {e.strerror or e}") from None
    log.info("tuning %d %s problem(s) on %s with %d worker(s); records go to %s, studies to %s",
             len(problems), spec.name, target.describe(), len(devices), db, plan.storage)
    try:
        results = sweep.run(plan, Progress(quiet=args.quiet),
                            on_result=recorder.add if recorder else None)
    finally:
        if recorder:
            recorder.close()
    if not args.quiet:
        print(results_table(results))
    tuned = [r.task.problem for r in results if r.decision is not None]
    checks = check_dispatch(spec, tuned, devices[0], db)
    if not args.quiet and checks:
        print("\ndispatch check (tileops called as a user would, against the float64 reference):")
        print(table(["problem", "resolved from", "runs", "rel. error", "ok"],
                    [[c.label, c.source, c.runs, f"{c.rel_error:.1e}", "yes" if c.ok else "NO"]
                     for c in checks]))
    failed = [c for c in checks if not c.ok]
    for c in failed:
        log.error("dispatch check failed for %s: resolved from %s, relative error %.2e",
                  c.label, c.source, c.rel_error)
    unrecorded = [r for r in results if r.decision is None
                  and not winners.already_recorded(db, r.task, r.ledger.counted)]
    for r in unrecorded:
        log.error("%s: nothing recorded: %s", r.task.label, what_happened(r))
    return Outcome(results, checks, unrecorded,
                   lifecycle.INCOMPLETE if failed or unrecorded else lifecycle.OK)


def what_happened(r: sweep.Result) -> str:
    """Why a problem has no new record, in the user's terms."""
    ledger = r.ledger
    if ledger.counted == 0 and r.stopped == "timeout":
        return "--timeout ran out before any trial ran"
    if ledger.counted == 0 and ledger.skipped:
        return f"check_config refused all {ledger.skipped} configuration(s) tried"
    if ledger.counted and ledger.failed == ledger.counted:
        return (f"all {ledger.counted} trial(s) failed (compile error, wrong output, crash or "
                "time limit; the progress lines say which)")
    return r.note or f"stopped: {r.stopped}"


def dry_run(plan: sweep.Plan, lower: bool = False) -> str:
    """The configurations each problem's search may compile (those passing `check_config`), each
    lowered for the target when `lower` is set."""
    assert plan.space is not None
    lines = []
    for problem in plan.problems:
        task = plan.task(problem)
        valid = list(plan.spec.configs(problem, plan.target, plan.space))
        lines.append(f"{task.label} on {plan.target.describe()}: {len(valid)} of "
                     f"{studies.grid_size(plan.space)} configurations pass the checks; up to "
                     f"{min(plan.trials, len(valid))} would be compiled ({plan.sampler})")
        if plan.warm_start and plan.sampler != "grid":
            for config, source in sweep.warm_start_configs(plan, problem):
                lines.append(f"  warm start ({source}): {canonical(config)}")
        lines += [f"  {canonical(c)}{_lowering(plan, problem, c) if lower else ''}" for c in valid]
    return "\n".join(lines)


def precompile(plan: sweep.Plan, progress: Progress) -> int:
    """Compile every configuration `dry_run` lists, warm starts included (each distinct kernel
    once), into TileLang's kernel cache."""
    assert plan.space is not None
    jobs, seen = [], set()
    for problem in plan.problems:
        warm = ([c for c, _ in sweep.warm_start_configs(plan, problem)
                 if plan.spec.check_config(problem, c, plan.target) is None]
                if plan.warm_start and plan.sampler != "grid" else [])
        for config in [*warm, *plan.spec.configs(problem, plan.target, plan.space)]:
            key = (plan.spec.kernel_key(problem), canonical(config))
            if key not in seen:
                seen.add(key)
                jobs.append(Job(plan.spec, problem, plan.target, "cpu", config))
    cache = os.environ.get("TILELANG_CACHE_DIR", "TileLang's default cache")
    progress.note(f"compiling {len(jobs)} kernels for {plan.target.describe()} on {plan.jobs} "
                  f"processes into {cache}")
    failed = compile_all(jobs, plan.jobs, plan.trial_timeout, progress.note)
    return lifecycle.INCOMPLETE if failed else lifecycle.OK


def _lowering(plan: sweep.Plan, problem: tuple, config: dict[str, Any]) -> str:
    try:
        dispatch.lower(plan.spec.build(problem, config, plan.target), plan.target)
    except Exception as e:  # noqa: BLE001 - any failure to generate code is the answer
        return f"  FAILS TO LOWER: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return "  lowers"


def results_table(results: list[sweep.Result]) -> str:
    rows = []
    for r in results:
        d = r.decision
        base = d.baseline_us if d else r.baseline_us
        best = d.tile_us if d else (r.ledger.best.value if r.ledger.best else None)
        rows.append([r.task.label, r.ledger.counted, r.ledger.failed - r.ledger.abandoned,
                     r.ledger.abandoned, best, base,
                     f"{base / best:.2f}x" if base and best else None,
                     d.chosen if d else None,
                     canonical(d.config) if d else what_happened(r)])
    return table(["problem", "trials", "failed", "abandoned", "tile us", "baseline us", "speedup",
                  "chosen", "config"], rows)


def _problems(args: argparse.Namespace) -> tuple[OpSpec, list[tuple]]:
    dtypes = [d.strip() for d in args.dtype.split(",")] if args.dtype else None
    if args.suite:
        suite = suites.load(args.suite, dtypes)
        spec, problems = suites.suite_spec(suite, args.op), suite.problems
    else:
        if not args.op:
            raise UsageError(f"--op is required with --shape or --problems ({', '.join(SPECS)})")
        spec = suites.named_spec(args.op)
        dtypes = dtypes or ["bfloat16"]
        problems = (suites.from_shapes(spec, args.shape, dtypes) if args.shape
                    else suites.read_problems_file(spec, args.problems, dtypes))
    if args.where:
        problems = suites.select(spec, problems, args.where)
    if not problems:
        raise UsageError("no problems to tune (check --dtype against the suite's dtypes, "
                         "--where against its problems)")
    return spec, problems


def _devices(text: str, workers: int, dry_run: bool = False) -> tuple[Target, list[str]]:
    """The target and one torch device string per worker."""
    try:
        target, device = resolve_device(text)
    except ValueError as e:
        if dry_run and text.strip().startswith("{"):  # list configs for absent hardware
            return _described_target(text), ["cpu"]
        raise UsageError(str(e)) from None
    if workers == 1:
        return target, [str(device)]
    if device.type == "cpu":  # each worker times on all cores: they would time each other
        raise UsageError(f"--workers {workers} on the CPU: the workers would time their kernels "
                         "on the same cores and each measurement would include the others' "
                         "load; use one worker (--jobs sets the compile processes)")
    if device.type != "cuda":
        raise UsageError(f"--workers {workers}: several workers need CUDA/ROCm GPUs")
    first = device.index or 0
    if first + workers > torch.cuda.device_count():
        raise UsageError(f"--workers {workers} from cuda:{first}: only "
                         f"{torch.cuda.device_count()} GPU(s) visible")
    names = [f"cuda:{first + i}" for i in range(workers)]
    for name in names[1:]:
        other, _ = resolve_device(name)
        if other.key != target.key:
            raise UsageError(f"--workers: {name} is {other.describe()}, not "
                             f"{target.describe()}; workers must share one kind of device")
    return target, names


def _described_target(text: str) -> Target:
    try:
        raw = parse_override(text)
        return Target(raw["kind"], raw.get("arch", ""), raw.get("device", "(not present)"),
                      int(raw.get("units", 0)))
    except (ValueError, KeyError) as e:
        raise UsageError(f"--device {text}: {e}") from None


def _space(spec: OpSpec, target: Target, text: str | None) -> studies.Space:
    """The spec's space for the target, with the parameters given in `text` replaced."""
    try:
        space = spec.space(target)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    if not text:
        return space
    try:
        override = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--space is not valid JSON: {e}") from None
    if not isinstance(override, dict):
        raise UsageError("--space must be a JSON object of parameter -> list of values")
    for name, values in override.items():
        if name not in space:
            raise UsageError(f"--space: unknown parameter {name!r}; the space has "
                             f"{', '.join(space)}")
        if not isinstance(values, list) or not values:
            raise UsageError(f"--space: {name} must be a non-empty list")
        kinds = {type(v) for v in space[name]}
        odd = [v for v in values if type(v) not in kinds]
        if odd:
            raise UsageError(f"--space: {name} takes {' or '.join(sorted(k.__name__ for k in kinds))}"
                             f" values, like {space[name]}; got {odd[0]!r}")
    return {**space, **override}


def _check_writable(db: Path) -> None:
    """Refuse, before any trial, a database the winners could not be written to."""
    try:
        with TuningDB(db) as tdb:
            tdb.check_writable()
    except DatabaseError as e:
        raise UsageError(str(e)) from None


def _abandon_factor(text: str) -> float:
    value = float(text)
    if not (value == 0 or 1 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a finite factor above 1, got {text}")
    return value


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse
