"""How the L2 flush between timed launches changes decode-sized GEMM timings.

    python benchmarks/flush_check.py [--out results/<device>/flush_check.json]

For a few weight-bound GEMMs (M = 16), times torch.matmul and the tile kernel dispatch resolves
with the timer's three flush modes: "dirty" (the flush buffer zeroed: its dirty lines are written
back during the timed launch), "clean" (zeroed, then read: clean lines) and "none" (warm cache).
A "clean" figure above the memory bandwidth would mean the read leaves the weight in the L2;
"dirty" slower than "clean" by about the L2's write-back time says which one to trust.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import RESULTS, device_dir, versions

from tileops.dispatch import DISPATCHER, compile_kernel
from tileops.ops.gemm import GEMM
from tileops.target import resolve_device
from tileops.tuner.timing import FLUSH_MODES, Timer

SHAPES = [(16, 4096, 4096), (16, 6144, 4096), (16, 8192, 8192), (16, 28672, 4096)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    target, device = resolve_device("cuda")
    timers = {mode: Timer(device, flush=mode) for mode in FLUSH_MODES}
    cases = []
    for M, N, K in SHAPES:
        problem = GEMM.parse_problem(f"{M}x{N}x{K}", "bfloat16")
        inputs = GEMM.make_inputs(problem, device)
        call = GEMM.prepare(*inputs)
        config = DISPATCHER.choice(GEMM, target, call.problem).config
        kernel = compile_kernel(GEMM, call.problem, config, target)
        case = {"problem": {"M": M, "N": N, "K": K}, "weight_bytes": N * K * 2, "config": config}
        tile = lambda k=kernel, a=call.args: GEMM.launch(k, a)  # noqa: E731
        baseline = lambda a=call.args: GEMM.launch_baseline(a)  # noqa: E731
        for mode, timer in timers.items():
            case[f"tile_us_{mode}"] = timer.measure(tile).median_us
            case[f"baseline_us_{mode}"] = timer.measure(baseline).median_us
        cases.append(case)
        print(json.dumps(case), flush=True)
    out = args.out or RESULTS / device_dir(target) / "flush_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": target.device, "versions": versions(), "cases": cases},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
