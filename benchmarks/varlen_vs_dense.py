"""flash_attention_varlen against the dense kernel on the same data: packed batches of equal
lengths, which `flash_attention` takes as a dense (batch, seqlen) batch.

    python benchmarks/varlen_vs_dense.py [--device auto] [--out FILE] [--limit N]

Each case packs `batch` sequences of `seqlen` tokens and is timed as the harness times a suite
case (the call with validate=True, the tile kernel alone, flash-attn 2's varlen forward, the
library paths the spec reports), with beside them, on the same tensors viewed as (batch, seqlen,
heads, head_dim): our dense tile kernel in its record's configuration (`beside_us["dense
kernel"]`) and the dense call as dispatched (`beside_us["dense call"]`: cuDNN where the record
says cuDNN wins). The same work, so `vs_dense` = dense kernel / packed kernel (both tile
kernels alone) is what the packing costs the kernel, and `vs_dense_call` = dense call / the
varlen call what it costs a caller. Writes `results/<device>/attention_varlen_dense.json` in the
harness's format with those fields added.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from harness import RESULTS, device_dir, new_report, time_inputs

from tileops.dispatch import DISPATCHER, compile_kernel
from tileops.ops import get_spec
from tileops.ops.host import DTYPE_NAMES
from tileops.target import Target, resolve_device
from tileops.tuner.timing import Timer

# (batch, seqlen, heads_kv, causal), 32 query heads, head_dim 128: the dense suite's prompts
CASES = [(16, 2048, 8, True), (16, 2048, 8, False), (4, 8192, 8, True), (2, 16384, 8, True),
         (64, 512, 8, True), (8, 4096, 32, True), (8, 4096, 8, False), (1, 32768, 8, True)]


def dense_case(batch: int, seqlen: int, heads_kv: int, causal: bool, target: Target,
               device: torch.device, timer: Timer, heads_q: int = 32, head_dim: int = 128,
               dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    spec, dense = get_spec("attention_varlen"), get_spec("attention")
    gen = torch.Generator(device=device).manual_seed(7)
    tokens = batch * seqlen
    q, k, v = (torch.randn(tokens, H, head_dim, generator=gen, device=device).to(dtype)
               for H in (heads_q, heads_kv, heads_kv))
    cu = torch.arange(0, tokens + 1, seqlen, dtype=torch.int32, device=device)
    inputs = (q, k, v, cu, cu, seqlen, seqlen, causal)
    qd, kd, vd = (t.view(batch, seqlen, *t.shape[1:]) for t in (q, k, v))
    DISPATCHER(dense, qd, kd, vd, causal, None)  # compiled before it is timed
    call = dense.prepare(qd, kd, vd, causal, None)
    choice = DISPATCHER.choice(dense, target, call.problem)
    kernel = compile_kernel(dense, call.problem, choice.config, target)
    label = f"{batch}x{seqlen} packed, {heads_q}/{heads_kv}{' causal' if causal else ''}"
    case = time_inputs(spec, inputs, label, target, timer,
                       beside={"dense kernel": lambda: dense.launch(kernel, call.args),
                               "dense call": lambda: DISPATCHER(dense, qd, kd, vd, causal,
                                                                None)})
    problem = dense.Problem(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, causal,
                            DTYPE_NAMES[dtype])
    us = case["beside_us"]
    return {"problem": {"batch": batch, "seqlen": seqlen, "heads_q": heads_q,
                        "heads_kv": heads_kv, "head_dim": head_dim, "causal": causal},
            "dtype": problem.dtype, **case, "dense_config": choice.config,
            "tflops": dense.flops(problem) / case["tileops_us"] / 1e6,
            "gbps": dense.bytes_moved(problem) / case["tileops_us"] / 1e3,
            "vs_dense": us["dense kernel"] / case["tile_us"],
            "vs_dense_call": us["dense call"] / case["tileops_us"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, help="default results/<device>/attention_varlen_dense.json")
    ap.add_argument("--limit", type=int, help="first N cases only")
    args = ap.parse_args(argv)
    target, device = resolve_device(args.device)
    out = args.out or RESULTS / device_dir(target) / "attention_varlen_dense.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = new_report(get_spec("attention_varlen"), target)
    timer = Timer(device)
    for batch, seqlen, heads_kv, causal in CASES[: args.limit]:
        case = dense_case(batch, seqlen, heads_kv, causal, target, device, timer)
        report["cases"].append(case)
        out.write_text(json.dumps(report, indent=1))
        print(f"{batch}x{seqlen} 32/{heads_kv} causal={causal}: varlen kernel "
              f"{case['tile_us']:.1f} us, x{case['vs_dense']:.2f} of the dense kernel; the call "
              f"{case['tileops_us']:.1f} us, x{case['vs_dense_call']:.2f} of the dense call",
              flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
