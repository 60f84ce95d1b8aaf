"""MLA decode at the heuristic default (and optionally every num_splits) against the torch baseline
(gather pages, matmul, softmax), on the GPU; figures against the H200 roofline (4.27 TB/s).

    python benchmarks/mla_report.py --out mla_decode.json [--splits]

`tileops_us` is the user call (validation of the table included, with its device-to-host read);
`tile_us` is the compiled kernel on prepared arguments. CUDA-event medians after warm-up, L2
flushed before each repeat (`attention_report.cuda_time_us`).
"""

from __future__ import annotations

import argparse
import json

import tilelang
import torch
from attention_report import cuda_time_us

import tileops
from tileops import dispatch
from tileops.ops.mla import MLA_DECODE
from tileops.target import target_of

PROBLEMS = [(B, S, H) for H in (128, 16) for S in (4096, 32768) for B in (1, 16, 64, 132)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--splits", action="store_true", help="also time every num_splits")
    args = parser.parse_args()
    device = torch.device("cuda")
    target = target_of(device)
    cases = []
    for B, S, H in PROBLEMS:
        problem = MLA_DECODE.Problem(B, S, H, 1, "bfloat16")
        inputs = MLA_DECODE.make_inputs(problem, device, seed=1)
        call = MLA_DECODE.prepare(*inputs)
        config = MLA_DECODE.default_config(problem, target)
        kernel = dispatch.compile_kernel(MLA_DECODE, problem, config, target)
        ours = cuda_time_us(lambda i=inputs: tileops.mla_decode(*i))
        tile = cuda_time_us(lambda k=kernel, a=call.args: MLA_DECODE.launch(k, a))
        base = cuda_time_us(lambda a=call.args: MLA_DECODE.launch_baseline(a), reps=10)
        nbytes, flops = MLA_DECODE.bytes_moved(problem), MLA_DECODE.flops(problem)
        case = {"problem": MLA_DECODE.problem_dict(problem), "dtype": "bfloat16",
                "tileops_us": ours, "baseline_us": base, "tile_us": tile, "chosen": "tile",
                "gbps": nbytes / tile / 1e3, "tflops": flops / tile / 1e6,
                "roofline_fraction": nbytes / tile / 1e3 / 4270, "config": config}
        if args.splits:
            grid = {}
            for splits in MLA_DECODE.space(target)["num_splits"]:
                c = dict(config, num_splits=splits)
                if MLA_DECODE.check_config(problem, c, target) is not None:
                    continue
                try:
                    k = dispatch.compile_kernel(MLA_DECODE, problem, c, target)
                    grid[splits] = cuda_time_us(lambda k=k, a=call.args: MLA_DECODE.launch(k, a),
                                                reps=10, warmup=2)
                except Exception as e:  # noqa: BLE001 - report and go on
                    grid[splits] = f"{type(e).__name__}: {str(e)[:80]}"
            case["splits_us"] = grid
        print(json.dumps(case), flush=True)
        cases.append(case)
        del inputs, call
        torch.cuda.empty_cache()
    result = {"op": "mla_decode", "device": torch.cuda.get_device_name(),
              "baseline": MLA_DECODE.baseline_name,
              "versions": {"tileops": tileops.__version__, "tilelang": tilelang.__version__,
                           "torch": torch.__version__, "cuda": torch.version.cuda},
              "cases": cases}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
