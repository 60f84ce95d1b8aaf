"""pytest-benchmark over a workload suite, for any operator.

    python -m pytest benchmarks/test_bench_ops.py --suite gemm_llama --bench-dtype bfloat16

Each case runs the harness (`harness.run_case`: CUDA-event medians of the user call, the best tile
kernel and the baseline, correctness checked) and pytest-benchmark's own timing of the synchronised
user call; the session writes `results/<device>/<op>.json` for `report.py`.
"""

from __future__ import annotations

import json

import harness
import pytest

import tileops
from tileops.dispatch import DISPATCHER
from tileops.tuner import suites
from tileops.tuner.timing import Timer, synchronize

_REPORT: dict = {}


def pytest_generate_tests(metafunc):
    if "problem" in metafunc.fixturenames:
        opt = metafunc.config.getoption
        dtypes = opt("--bench-dtype")
        suite = suites.load(opt("--suite"), dtypes.split(",") if dtypes else None)
        problems = suite.cases[: opt("--bench-limit")]  # the sizes the suite names
        spec = tileops.get_spec(suite.op)
        metafunc.parametrize("problem", problems, ids=[spec.problem_label(p) for p in problems])
        metafunc.parametrize("op", [suite.op], scope="session")


@pytest.fixture(scope="session")
def env(request, op):
    spec = tileops.get_spec(op)
    target, device = tileops.target.resolve_device(request.config.getoption("--bench-device"))
    out = harness.RESULTS / harness.device_dir(target) / f"{spec.name}.json"
    _REPORT.update(harness.new_report(spec, target))
    yield spec, target, device, Timer(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_REPORT, indent=1))


def test_case(benchmark, env, problem):
    spec, target, device, timer = env
    case = harness.run_case(spec, problem, target, device, timer)
    _REPORT["cases"].append(case)
    benchmark.extra_info.update({k: case[k] for k in ("tileops_us", "baseline_us", "tile_us",
                                                      "chosen", "tflops", "gbps")})
    args = spec.serving_args(spec.make_inputs(problem, device, seed=11))

    def user_call():
        DISPATCHER(spec, *args)
        synchronize(device)

    benchmark(user_call)
