"""FlashAttention forward at the heuristic default (and optionally a few other configs) against
cuDNN SDPA, on the GPU.

    python benchmarks/attention_report.py --out attention.json [--configs]

CUDA-event medians after warm-up, L2 flushed before each repeat. `tileops_us` is the user call
(dispatch included, lse computed); `baseline_us` is `scaled_dot_product_attention` restricted to
cuDNN (output only, as users call it). `--configs` also times a small grid of tile configs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import tilelang
import torch

import tileops
from tileops import dispatch
from tileops.ops.attention import ATTENTION
from tileops.target import target_of

PROBLEMS = [(B, S, S, 32, Hkv, D, causal) for B, S in ((8, 4096), (2, 16384))
            for Hkv in (32, 8) for D in (128, 64) for causal in (False, True)]


def cuda_time_us(fn, reps: int = 30, warmup: int = 5) -> float:
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def sdpa(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    target = target_of(device)
    cases = []
    for B, Sq, Skv, Hq, Hkv, D, causal in PROBLEMS:
        problem = ATTENTION.Problem(B, Sq, Skv, Hq, Hkv, D, causal, "bfloat16")
        q, k, v, _ = ATTENTION.make_inputs(problem, device, seed=1)
        call = ATTENTION.prepare(q, k, v, causal)
        ours = cuda_time_us(lambda q=q, k=k, v=v, c=causal: tileops.flash_attention(q, k, v,
                                                                                   causal=c))
        base = cuda_time_us(lambda q=q, k=k, v=v, c=causal: sdpa(q, k, v, c))
        flops = ATTENTION.flops(problem)
        case = {"problem": ATTENTION.problem_dict(problem), "dtype": "bfloat16",
                "tileops_us": ours, "baseline_us": base, "tflops": flops / ours / 1e6,
                "baseline_tflops": flops / base / 1e6, "chosen": "tile", "tile_us": ours,
                "config": ATTENTION.default_config(problem, target)}
        if args.configs:
            space = ATTENTION.space(target)
            grid = {}
            for values in itertools.product(*space.values()):
                config = dict(zip(space, values, strict=True))
                if ATTENTION.check_config(problem, config, target) is not None:
                    continue
                try:
                    kernel = dispatch.compile_kernel(ATTENTION, problem, config, target)
                    t = cuda_time_us(lambda k_=kernel, a=call.args: ATTENTION.launch(k_, a),
                                     reps=10, warmup=2)
                except Exception as e:  # noqa: BLE001 - report and go on
                    t = f"{type(e).__name__}: {str(e)[:80]}"
                grid[json.dumps(config, sort_keys=True)] = t
            case["grid_us"] = grid
        print(json.dumps(case), flush=True)
        cases.append(case)
    result = {"op": "attention", "device": torch.cuda.get_device_name(),
              "baseline": "torch SDPA (cuDNN)",
              "versions": {"tileops": tileops.__version__, "tilelang": tilelang.__version__,
                           "torch": torch.__version__, "cuda": torch.version.cuda},
              "cases": cases}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
