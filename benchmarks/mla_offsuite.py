"""MLA decode off its suite: s_q 2, h_q 32 and 64, and ragged batches beside uniform ones.

    python benchmarks/mla_offsuite.py [--device auto] [--out FILE] [--limit N]

Uniform cases run as the harness runs a suite's (`harness.run_case`). A ragged case draws each
sequence's length uniformly from [shortest, longest] (seeded), as a serving batch mixes new and
old requests, and is timed three ways like a suite case; its `uniform_us`, timed with them, is
the call on a uniform batch of the same size and the same total tokens (every length the mean),
and `vs_uniform` = uniform_us / tileops_us: a scheduler that balances work by tokens gets ~1.0.
FLOPs and bytes count the real lengths. Writes `results/<device>/mla_decode_offsuite.json` in the
harness's format, with the ragged fields added.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from harness import RESULTS, device_dir, new_report, run_case, time_inputs

from tileops.dispatch import DISPATCHER
from tileops.ops import get_spec
from tileops.ops.host import DTYPE_SIZES
from tileops.ops.mla.spec import D_LATENT, D_QK, paged_inputs
from tileops.target import Target, resolve_device
from tileops.tuner.timing import Timer

UNIFORM = ["B64xS4096xH128xQ2", "B64xS8192xH16xQ2", "B64xS4096xH32", "B64xS4096xH64",
           "B132xS8192xH64"]
# (batch, h_q, shortest, longest): the mixes FlashMLA's users meet, as measured in the issue
RAGGED = [(32, 128, 100, 8000), (64, 128, 100, 8000), (64, 16, 100, 8000), (132, 16, 100, 16000)]


def ragged_case(batch: int, h_q: int, shortest: int, longest: int, target: Target,
                device: torch.device, timer: Timer, dtype: str = "bfloat16",
                seed: int = 7) -> dict[str, Any]:
    """One ragged batch timed as a suite case, with the uniform batch of its total tokens."""
    spec = get_spec("mla_decode")
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=gen, device=device,
                            dtype=torch.int32)
    ragged = paged_inputs(lengths, h_q, 1, dtype, gen)
    total = int(lengths.sum())
    mean = torch.full((batch,), round(total / batch), dtype=torch.int32, device=device)
    uniform = spec.serving_args(paged_inputs(mean, h_q, 1, dtype, gen))
    DISPATCHER(spec, *uniform)  # compiled before it is timed
    # interleaved with the ragged call's own timings, so that drift favours neither
    case = time_inputs(spec, ragged, f"ragged B{batch} h_q {h_q}", target, timer,
                       beside={"uniform batch": lambda: DISPATCHER(spec, *uniform)})
    uniform_us = case["beside_us"]["uniform batch"]
    flops = 2.0 * h_q * total * (D_QK + D_LATENT)
    nbytes = (total * D_QK + batch * h_q * (D_QK + D_LATENT)) * DTYPE_SIZES[dtype]
    return {
        "problem": {"batch": batch, "h_q": h_q, "s_q": 1, "ragged": True,
                    "lengths": {"min": int(lengths.min()), "mean": total / batch,
                                "max": int(lengths.max()), "total": total}},
        "dtype": dtype, **case, "tflops": flops / case["tileops_us"] / 1e6,
        "gbps": nbytes / case["tileops_us"] / 1e3,
        "uniform_us": uniform_us, "vs_uniform": uniform_us / case["tileops_us"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, help="default results/<device>/mla_decode_offsuite.json")
    ap.add_argument("--limit", type=int, help="first N cases of each kind only")
    args = ap.parse_args(argv)
    spec = get_spec("mla_decode")
    target, device = resolve_device(args.device)
    out = args.out or RESULTS / device_dir(target) / "mla_decode_offsuite.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = new_report(spec, target)
    timer = Timer(device)
    for text in UNIFORM[: args.limit]:
        case = run_case(spec, spec.parse_exact(text, "bfloat16"), target, device, timer)
        report["cases"].append(case)
        out.write_text(json.dumps(report, indent=1))
        print(f"{text}: tileops {case['tileops_us']:.1f} us, {case['tflops']:.0f} TFLOP/s, "
              f"{case['gbps']:.0f} GB/s", flush=True)
    for batch, h_q, shortest, longest in RAGGED[: args.limit]:
        case = ragged_case(batch, h_q, shortest, longest, target, device, timer)
        report["cases"].append(case)
        out.write_text(json.dumps(report, indent=1))
        print(f"ragged B{batch} h_q {h_q} ({shortest}-{longest}): tileops "
              f"{case['tileops_us']:.1f} us, {case['tflops']:.0f} TFLOP/s, {case['gbps']:.0f} "
              f"GB/s, x{case['vs_uniform']:.2f} of the uniform batch", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
