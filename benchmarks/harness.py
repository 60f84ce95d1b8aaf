"""Benchmark any operator over a suite: tileops as a user calls it against the spec's baseline.

    python benchmarks/harness.py --suite gemm_llama [--dtype bfloat16] [--limit N] [--device auto]
                                 [--jobs N] [--op NAME] [--where FIELD=V1,V2]

For each case of the suite (its problems at the sizes it names, `Suite.cases`: a length of 3000
runs at 3000, not at its bucket's 4096), in one process on the same inputs and with the tuner's
timer (CUDA events after warm-up, L2 flushed before each launch, median): the public call through
dispatch (`tileops_us`), made as a serving engine makes it (`OpSpec.serving_args`: MLA decode's
per-step metadata computed once, outside the timed region, as an engine computes it once per step
for all its layers), the baseline (`baseline_us`), the best tile kernel on its own (`tile_us`, the
configuration dispatch resolved, launched directly), and the library paths the spec reports beside
the baseline (`beside_us`, e.g. SDPA's flash backend for attention). Writes
`results/<device>/<op>.json` in the results format of the project's guide, which
`benchmarks/report.py` renders; resumable (`--resume` keeps the cases already in the file). The
kernels dispatch will choose are first compiled in parallel (`--jobs` processes, into TileLang's
disk cache), so a long suite is not compiled one kernel at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tileops
from tileops.dispatch import DISPATCHER, compile_kernel
from tileops.spec import OpSpec
from tileops.target import Target, resolve_device
from tileops.tuner import suites
from tileops.tuner.evaluate import Job, relative_error
from tileops.tuner.session import compile_all
from tileops.tuner.timing import Timer

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 3  # timing rounds of a case, its launches interleaved in each


def device_dir(target: Target) -> str:
    """`h200` for "NVIDIA H200": the short name results are filed under."""
    name = re.sub(r"^(nvidia|amd|apple|intel)\s+", "", target.device.lower())
    name = re.sub(r"[^a-z0-9]+", "_", name).strip("_")
    return name or target.kind


def versions() -> dict[str, str]:
    import tilelang

    return {"tileops": tileops.__version__, "tilelang": tilelang.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda or getattr(torch.version, "hip", None) or ""}


def run_case(spec: OpSpec, problem: tuple, target: Target, device: torch.device,
             timer: Timer) -> dict[str, Any]:
    """Time one problem three ways and check the user call against the reference. `problem` may
    be exact (a `Suite.cases` entry): the inputs have its sizes, the call's key their bucket."""
    fields = spec.problem_dict(problem)
    case = time_inputs(spec, spec.make_inputs(problem, device, seed=7), spec.problem_label(problem),
                       target, timer)
    return {"problem": {k: v for k, v in fields.items() if k != "dtype"},
            "dtype": fields.get("dtype"), **case,
            "tflops": spec.flops(problem) / case["tileops_us"] / 1e6,
            "gbps": spec.bytes_moved(problem) / case["tileops_us"] / 1e3}


def time_inputs(spec: OpSpec, inputs: tuple, label: str, target: Target, timer: Timer,
                beside: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """A results case's measured fields for one call's inputs: the call through dispatch checked
    against the reference, then timed beside the tile kernel it resolved, the baseline, the
    library paths the spec reports, and `beside` (more launches, in `beside_us` with those)."""
    args = spec.serving_args(inputs)  # what an engine computes once per step: not timed
    call = spec.prepare(*args)
    out = DISPATCHER(spec, *args)
    error = relative_error(out, spec.reference(inputs))
    if not error <= spec.tolerance(call.problem):
        raise AssertionError(f"{label}: relative error {error:.2e}")
    choice = DISPATCHER.choice(spec, target, call.problem)
    kernel = compile_kernel(spec, call.problem, choice.config, target)
    beside = {**spec.reported_beside(call.args), **(beside or {})}
    launches = [lambda: DISPATCHER(spec, *args), lambda: spec.launch(kernel, call.args),
                lambda: spec.launch_baseline(call.args), *beside.values()]
    timed = timer.interleaved(launches, ROUNDS)  # on a GPU sample by sample: no drift bias
    tileops_us, tile_us, baseline_us, *beside_us = (statistics.median(s) for s, _ in timed)
    beside = dict(zip(beside, beside_us, strict=True))
    return {
        "tileops_us": tileops_us, "baseline_us": baseline_us,
        "speedup": baseline_us / tileops_us,
        "chosen": "baseline" if DISPATCHER.runs_baseline(spec, target, call.problem) else "tile",
        "tile_us": tile_us, "source": choice.source if choice.exact else f"{choice.source}~",
        "config": choice.config, "rel_error": error,
        **({"beside_us": beside} if beside else {}),
    }


def new_report(spec: OpSpec, target: Target) -> dict[str, Any]:
    """An empty results file of the guide's format for `spec` on `target`."""
    return {"op": spec.name, "device": target.device, "baseline": spec.baseline_name,
            "versions": versions(), "cases": []}


def precompile(spec: OpSpec, problems: list[tuple], target: Target, device: torch.device,
               jobs: int) -> None:
    """Compile the tile kernel dispatch resolves for each problem (exact or a key: dispatch
    resolves its key), `jobs` at a time."""
    todo = []
    for problem in dict.fromkeys(map(spec.bucket, problems)):
        choice = DISPATCHER.choice(spec, target, problem)
        if choice.config is not None:
            todo.append(Job(spec, problem, target, str(device), choice.config))
    if jobs < 1 or not todo:
        return
    print(f"compiling {len(todo)} kernels on {jobs} processes", flush=True)
    compile_all(todo, jobs, 600, lambda line: print(line, flush=True), device=str(device))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True)
    ap.add_argument("--dtype", help="comma-separated dtypes to keep (default: the suite's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--limit", type=int, help="first N cases only")
    ap.add_argument("--op", help="another spec of the suite's operator (e.g. mxfp4_gemm_packed: "
                    "the same problems on a prepacked weight)")
    ap.add_argument("--where", metavar="FIELD=V1,V2", help="only cases whose FIELD (e.g. M, "
                    "as the suite names it) is one of these values")
    ap.add_argument("--out", type=Path, help="default results/<device>/<op>.json")
    ap.add_argument("--resume", action="store_true", help="keep cases already in --out")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes compiling the kernels first (default: all cores; 0: none)")
    args = ap.parse_args(argv)

    suite = suites.load(args.suite, args.dtype.split(",") if args.dtype else None)
    try:
        spec = suites.suite_spec(suite, args.op)
    except suites.UsageError as e:
        ap.error(str(e))
    problems = suite.cases
    if args.where:
        try:
            problems = suites.select(spec, problems, args.where)
        except suites.UsageError as e:
            ap.error(str(e))
    target, device = resolve_device(args.device)
    out = args.out or RESULTS / device_dir(target) / f"{spec.name}.json"
    report = new_report(spec, target)
    if args.resume and out.exists():
        report["cases"] = json.loads(out.read_text())["cases"]
    done = {json.dumps([c["problem"], c["dtype"]], sort_keys=True) for c in report["cases"]}
    timer = Timer(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = []
    for problem in problems[: args.limit]:
        fields = spec.problem_dict(problem)
        key = json.dumps([{k: v for k, v in fields.items() if k != "dtype"}, fields.get("dtype")],
                         sort_keys=True)
        if key not in done:
            todo.append(problem)
    precompile(spec, todo, target, device, args.jobs)
    for problem in todo:
        case = run_case(spec, problem, target, device, timer)
        report["cases"].append(case)
        out.write_text(json.dumps(report, indent=1))  # after every case: a stop loses nothing
        print(f"{spec.problem_label(problem)}: tileops {case['tileops_us']:.1f} us "
              f"({case['chosen']}, tile {case['tile_us']:.1f} us), {spec.baseline_name} "
              f"{case['baseline_us']:.1f} us, x{case['speedup']:.2f}", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
