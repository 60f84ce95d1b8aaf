"""What the prepacked MXFP4 kernel's decode costs: the shipped register decode timed beside the
same kernel with parts of the decode taken out (their results are wrong on purpose: timing only),
a plain copy of the packed words, and bf16 cuBLAS on the dequantised weight, interleaved sample by
sample. The gap between "shipped" and "no_alu" is the decode's arithmetic; "no_lds" also drops its
shared-memory loads, leaving the TMA pipeline and the wgmma.

    python3 benchmarks/mxfp4_decode_cost.py [OUT.json]     # a CUDA GPU (sm_90a)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tileops.ops.mxfp4.packed_kernels as packed_kernels  # noqa: E402
from tileops import dispatch  # noqa: E402
from tileops.ops import get_spec  # noqa: E402
from tileops.target import resolve_device  # noqa: E402
from tileops.tuner.timing import Timer  # noqa: E402

SHIPPED = packed_kernels.RS_SOURCE
_PAIRS = SHIPPED.index("#pragma unroll\n  for (int k = 0; k < 4; ++k)")  # a word's pairs, per atom
_PAIRS_END = SHIPPED.index("// A step's atoms")
_STEP = SHIPPED.index("  const int* w[4]")  # the step's loads and the decode of its atoms


VARIANTS = {
    "shipped": SHIPPED,
    "no_alu": SHIPPED[:_PAIRS] + """#pragma unroll
  for (int k = 0; k < 16; ++k) { o[k] = word[k % 4] ^ scale[k % 4]; }
}

""" + SHIPPED[_PAIRS_END:],  # the loads kept, one operation per register
    "no_lds": SHIPPED[:_STEP] + """  unsigned int* o = reinterpret_cast<unsigned int*>(out);
#pragma unroll
  for (int k = 0; k < 16 * 4; ++k) { if (k < 16 * atoms) o[k] = 0x3F803F80u; }
}
""",
}
CASES = [  # the configurations the records had before the v2 decode's re-tune (256-deep steps,
    # kept so that the figures compare across decodes), and one CTA per SM beside them
    ("16x8192x8192", {"block_K": 256, "block_M": 16, "ctas_per_sm": 2, "num_stages": 4,
                      "split_k": 2, "threads": 128}),
    ("16x8192x8192", {"block_K": 256, "block_M": 16, "ctas_per_sm": 1, "num_stages": 4,
                      "split_k": 2, "threads": 128}),
    ("16x57344x8192", {"block_K": 256, "block_M": 16, "ctas_per_sm": 2, "num_stages": 4,
                       "split_k": 1, "threads": 128}),
    ("1x4096x4096", {"block_K": 256, "block_M": 16, "ctas_per_sm": 2, "num_stages": 4,
                     "split_k": 4, "threads": 128}),
]


def main(out: Path) -> None:
    spec = get_spec("mxfp4_gemm_packed")
    target, device = resolve_device("cuda")
    timer = Timer(device)
    rows = []
    for shape, config in CASES:
        problem = spec.parse_problem(shape, "bfloat16")
        inputs = spec.make_inputs(problem, device, seed=1)
        call = spec.prepare(*inputs)
        launches = {}
        for name, source in VARIANTS.items():
            packed_kernels.RS_SOURCE = source  # read when the program is built
            program = spec.build(call.problem, config, target)
            kernel = spec.adapt(dispatch._compile(program, target, spec.fast_math), target)
            launches[name] = lambda k=kernel, a=call.args: spec.launch(k, a)
        packed_kernels.RS_SOURCE = SHIPPED
        words = inputs[1].words
        copy = torch.empty_like(words)
        launches["copy_words"] = lambda c=copy, w=words: c.copy_(w)
        launches["cublas_bf16"] = lambda a=call.args: spec.launch_baseline(a)
        timed = timer.interleaved(list(launches.values()), 3)
        us = {name: statistics.median(s) for name, (s, _) in zip(launches, timed, strict=True)}
        weight = words.numel() * 4 + inputs[1].scales.numel() * 2
        row = {"shape": shape, "config": config, "us": us,
               "weight_GBps": {name: weight / t / 1e3 for name, t in us.items()}}
        print(json.dumps(row))
        rows.append(row)
    out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "mxfp4_decode_cost.json"))
