"""Untuned (heuristic default) GEMM against torch.matmul, and the warm-path host overhead.

    python benchmarks/spine_report.py --out results.json

Times with the tuner's timer (CUDA events after warm-up, L2 flushed before each launch, median). The
dispatch overhead is measured on a tiny problem whose GPU time is far below the host time, so a
loop of asynchronous launches measures the host path alone.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import tileops
from tileops import dispatch
from tileops.dispatch import DISPATCHER
from tileops.ops.gemm import GEMM
from tileops.target import target_of
from tileops.tuner.evaluate import relative_error
from tileops.tuner.timing import Timer

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)] + [
    (M, N, K) for M in (16, 4096) for N, K in ((6144, 4096), (4096, 4096), (28672, 4096),
                                               (4096, 14336))]


_TIMER = Timer(torch.device("cuda")) if torch.cuda.is_available() else None


def cuda_time_us(fn) -> float:
    return _TIMER.measure(fn).median_us


def host_us(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best.append((time.perf_counter() - t) / (n // 5) * 1e6)
        torch.cuda.synchronize()
    return min(best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="spine_report.json")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    target = target_of(torch.device("cuda"))
    rows = []
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype)
        err = relative_error(tileops.gemm(a, w.t()), a.double() @ w.double().t())
        t_tile = cuda_time_us(lambda a=a, w=w: tileops.gemm(a, w.t()))
        t_base = cuda_time_us(lambda a=a, w=w: torch.matmul(a, w.t()))
        flops = 2.0 * M * N * K
        choice = DISPATCHER.choice(GEMM, target, GEMM.prepare(a, w.t()).problem)
        rows.append({"M": M, "N": N, "K": K, "dtype": args.dtype, "rel_err": err,
                     "tileops_us": t_tile, "baseline_us": t_base,
                     "tileops_tflops": flops / t_tile / 1e6, "baseline_tflops": flops / t_base / 1e6,
                     "weight_tbps": N * K * a.element_size() / t_tile / 1e6,
                     "speedup": t_base / t_tile, "config": choice.config})
        print(f"{M:5d} {N:6d} {K:6d}  tile {t_tile:9.1f} us {flops / t_tile / 1e6:7.1f} TF/s  "
              f"cuBLAS {t_base:9.1f} us {flops / t_base / 1e6:7.1f} TF/s  x{t_base / t_tile:.2f}"
              f"  err {err:.1e}  {choice.config}", flush=True)

    # Host overhead of the warm path, per call: tileops.gemm against the adapted kernel dispatch
    # launches (the tvm-ffi executable, plus the workspace of a split-K program), TileLang's own
    # JITKernel call, and torch.matmul. 1x256x256: no split; 16x4096x4096: the default's split-K.
    overhead = {}
    for M, N, K in [(1, 256, 256), (16, 4096, 4096)]:
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype)
        wt = w.t()  # the user's view; its cost is the user's, not dispatch's
        tileops.gemm(a, wt)
        problem = GEMM.prepare(a, wt).problem
        config = DISPATCHER.choice(GEMM, target, problem).config
        kernel = dispatch.compile_kernel(GEMM, problem, config, target)
        jit = dispatch._compile(GEMM.build(problem, config, target), target)
        c = torch.empty(M, N, device="cuda", dtype=dtype)
        extra = ([torch.empty(config["split_k"], M, N, device="cuda", dtype=torch.float32)]
                 if config.get("split_k", 1) > 1 else [])
        label = f"{M}x{N}x{K}"
        overhead[label] = {
            "tileops.gemm": host_us(lambda a=a, wt=wt: tileops.gemm(a, wt)),
            "adapted kernel, preallocated C": host_us(
                lambda k=kernel, a=a, w=w, c=c: k(a, w, c)),
            "TileLang JITKernel, preallocated": host_us(
                lambda j=jit, a=a, w=w, c=c, extra=extra: j(a, w, c, *extra)),
            "torch.matmul": host_us(lambda a=a, w=w: torch.matmul(a, w.t())),
        }
        for k, v in overhead[label].items():
            print(f"host {label:14s} {k:34s} {v:6.2f} us")
    versions = {"tileops": tileops.__version__, "torch": torch.__version__,
                "cuda": torch.version.cuda}
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "target": target.describe(),
                   "versions": versions, "cases": rows, "host_overhead_us": overhead}, f, indent=1)


if __name__ == "__main__":
    main()
