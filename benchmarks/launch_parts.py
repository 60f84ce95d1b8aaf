"""Where a warm GEMM call's host time goes, at 1x256x256 bf16 (run on a CUDA GPU; on the CPU only
the first four parts): tvm-ffi's own call and argument conversion (`testing.nop`), the output
allocation, the compiled kernel's entry function (its generated host code: argument checks, the
device set, three TMA descriptors, the launch), torch's raw stream query, and the whole
`tileops.gemm` and `torch.matmul` calls. Host time of 4000 unsynchronised calls, median of 9
interleaved rounds.

    python3 benchmarks/launch_parts.py [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import tvm_ffi


def parts() -> dict[str, Callable[[], object]]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    nop = tvm_ffi.get_global_func("testing.nop")
    dt = torch.bfloat16
    a = torch.randn(1, 256, device=dev, dtype=dt)
    w = torch.randn(256, 256, device=dev, dtype=dt)
    c = torch.empty(1, 256, device=dev, dtype=dt)
    timed = {"nop()": lambda: nop(), "nop(3 tensors)": lambda: nop(a, w, c),
             "nop(3 ints)": lambda: nop(1, 2, 3),
             "torch.empty(1, 256)": lambda: torch.empty(1, 256, dtype=dt, device=a.device)}
    if dev == "cuda":
        import tileops
        from tileops.dispatch import DISPATCHER, compile_kernel
        from tileops.ops.gemm.spec import GEMM
        from tileops.target import target_of

        tileops.gemm(a, w.t())
        call = GEMM.prepare(a, w.t(), None)
        target = target_of(call.device)
        config = DISPATCHER.choice(GEMM, target, call.problem).config
        kernel = compile_kernel(GEMM, call.problem, config, target)
        timed["kernel main(a, w, c)"] = lambda: kernel(a, w, c)
        timed["raw stream"] = lambda: torch._C._cuda_getCurrentRawStream(0)
        timed["tileops.gemm"] = lambda: tileops.gemm(a, w.t())
        timed["torch.matmul"] = lambda: torch.matmul(a, w.t())
    return timed


def host_us(fn: Callable[[], object], calls: int = 4000) -> float:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    timed = parts()
    for fn in timed.values():
        host_us(fn, 300)
    rounds: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(9):
        for name, fn in timed.items():
            rounds[name].append(host_us(fn))
    out = {name: round(statistics.median(v), 2) for name, v in rounds.items()}
    for name, v in out.items():
        print(f"{name:22s} {v:7.2f} us")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
