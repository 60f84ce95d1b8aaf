"""Host cost of a warm call, and CUDA-graph capture, for every operator (run on a CUDA GPU).

Per case, at a tiny shape (GPU time far below host time), three ways to make the same call are
timed as 2000 unsynchronised calls with `perf_counter` (host time only; the GPU keeps up):
`tileops_host_us`, the public call as a user makes it (warm: through the native warm path where
the operator has one, `tileops.native`); `baseline_host_us`, the torch call it
replaces (`torch.matmul`, SDPA, `torch.matmul` on the already dequantised weight, the spec's
torch composition for MLA); `kernel_direct_host_us`, the compiled kernel the call dispatches to,
launched by the spec with its output allocated per call in Python. Rounds of
the three are interleaved, and each figure is the median over rounds.

`graph_capture[op]` is true when the call, captured in `torch.cuda.graph` after a warm-up, replays
on new data copied into the captured inputs and matches the float64 reference after each replay.

    python3 benchmarks/host_overhead.py            # -> benchmarks/results/<device>/host_overhead.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

import tileops
from tileops import native
from tileops.dispatch import DISPATCHER, compile_kernel
from tileops.ops import get_spec
from tileops.target import resolve_device, target_of
from tileops.tuner.evaluate import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_dir, versions  # noqa: E402

F = torch.nn.functional


class Case(NamedTuple):
    inputs: tuple  # what make_inputs gave: the captured graph's inputs, refilled per replay
    call: Callable  # the public tileops call on them
    baseline: Callable  # the torch call it replaces
    dispatched: tuple  # the call's arguments as the dispatcher takes them
    refill: int = 99  # how many of the inputs a replay gets fresh (all, but a prepacked weight)


def _gemm(spec, problem) -> Case:
    a, b, _ = spec.make_inputs(problem, "cuda")
    return Case((a, b), tileops.gemm, torch.matmul, (a, b, None))


def _attention(spec, problem) -> Case:
    q, k, v, causal = spec.make_inputs(problem, "cuda")

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return Case((q, k, v), lambda q, k, v: tileops.flash_attention(q, k, v, causal=causal), sdpa,
                (q, k, v, causal, None))


def _mxfp4(spec, problem) -> Case:
    a, w, s = spec.make_inputs(problem, "cuda")
    dense = tileops.dequantize_mxfp4(w, s, a.dtype)
    return Case((a, w, s), tileops.mxfp4_gemm, lambda a, w, s: torch.matmul(a, dense.t()),
                (a, w, s))


def _mxfp4_packed(spec, problem) -> Case:
    # A replay gets fresh activations only: the weight is prepacked once, as at model load.
    a, packed = spec.make_inputs(problem, "cuda")
    dense = tileops.dequantize_mxfp4(*packed.unpack(), a.dtype)
    return Case((a, packed), lambda a, w: tileops.mxfp4_gemm(a, w),
                lambda a, w: torch.matmul(a, dense.t()), (a, packed), refill=1)


def _mla(spec, problem) -> Case:
    q, kv, table, seqlens = spec.make_inputs(problem, "cuda")
    md = tileops.mla_metadata(seqlens, problem.h_q, problem.s_q)
    dispatched = (q, kv, table, seqlens, None, 512, False, md)
    torch_args = spec.prepare(*dispatched).args
    return Case((q, kv, table, seqlens),
                lambda q, kv, t, s: tileops.mla_decode(q, kv, t, s, metadata=md),
                lambda q, kv, t, s: spec.launch_baseline(torch_args), dispatched)


# (spec name, problem text, its case)
CASES: list[tuple[str, str, Callable[..., Case]]] = [
    ("gemm", "1x256x256:nk", _gemm),
    ("attention", "1x128x128x4x4x64", _attention),
    ("mxfp4_gemm", "1x256x256", _mxfp4),
    ("mxfp4_gemm_packed", "1x256x256", _mxfp4_packed),
    ("mla_decode", "B1xS256xH16", _mla),
]


def _host_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _direct(spec, dispatched: tuple) -> Callable[[], object]:
    """The kernel the call dispatches to, launched by the spec without dispatch."""
    call = spec.prepare(*dispatched)
    target = target_of(call.device)
    choice = DISPATCHER.choice(spec, target, call.problem)
    kernel = compile_kernel(spec, call.problem, choice.config, target)
    return lambda: spec.launch(kernel, call.args)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _captures(spec, problem, inputs: tuple, call: Callable, refill: int) -> bool:
    """Capture `call` once, replay on two fresh draws of the first `refill` inputs, check each
    against the reference."""
    call(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*inputs)
    for seed in (2, 3):
        fresh = spec.make_inputs(problem, "cuda", seed=seed)
        for mine, new in zip(inputs, fresh[:refill], strict=False):
            mine.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = spec.reference((*inputs, *fresh[len(inputs):]))
        if not relative_error(_first(out), _first(ref)) < spec.tolerance(problem):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    native.module()  # built before any timing: the warm path measured is the steady one
    cases, captured = [], {}
    for name, text, make in CASES:
        spec = get_spec(name)
        problem = spec.parse_problem(text, "bfloat16")
        case = make(spec, problem)
        ways = {"tileops": functools.partial(case.call, *case.inputs),
                "baseline": functools.partial(case.baseline, *case.inputs),
                "kernel_direct": _direct(spec, case.dispatched)}
        for fn in ways.values():  # warm: compiled, resolved, cuBLAS/cuDNN plans made
            for _ in range(20):
                fn()
        times = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, fn in ways.items():
                times[way].append(_host_us(fn, args.calls))
        row = {"op": name, "shape": text, "dtype": "bfloat16"}
        row.update({f"{way}_host_us": round(statistics.median(t), 2) for way, t in times.items()})
        row["spread"] = {way: round(max(t) / min(t), 3) for way, t in times.items()}
        cases.append(row)
        print(f"{name:18s} {text:18s} tileops {row['tileops_host_us']:6.2f} us  baseline "
              f"{row['baseline_host_us']:6.2f} us  kernel direct "
              f"{row['kernel_direct_host_us']:6.2f} us", flush=True)
        captured[name] = _captures(spec, problem, case.inputs, case.call, case.refill)
    result = {"device": torch.cuda.get_device_name(), "versions": versions(),
              "calls": args.calls, "rounds": args.rounds, "cases": cases,
              "graph_capture": captured}
    out = args.out or Path(__file__).parent / "results" / device_dir(
        target_of(resolve_device("cuda"))) / "host_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(captured), "->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
