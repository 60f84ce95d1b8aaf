"""What a CUDA kernel compiles to, without the GPU: registers, spills, shared memory, and the
static count of the SASS instructions that decide its speed.

    python benchmarks/sass.py --op attention --shape 8x4096x32x128 [--config JSON]
        [--dtype bfloat16] [--arch sm_90a] [--dump FILE.sass] [--source FILE.cu]

The program is built from the operator's spec (its default configuration, or --config merged
over it), lowered by TileLang and compiled by the same nvcc call TileLang makes (same flags, fast
math where the operator asks for it), then disassembled with `cuobjdump`, which runs
`nvdisasm` (pip's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm packages, found in their
wheels' bin/ when not on PATH; or $CUOBJDUMP). Counts are static: an instruction in a loop body
counts once. They answer questions like "does the main loop issue
HGMMA or HMMA?", "how many barriers per K step?", "does it spill?".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tileops.dispatch import pass_configs
from tileops.ops import SPECS, get_spec
from tileops.spec import OpSpec
from tileops.target import Target

# Opcode families worth watching, by the prefix of the SASS mnemonic.
FAMILIES = {
    "HGMMA": "warpgroup tensor-core MMA (Hopper)",
    "HMMA": "warp tensor-core MMA (pre-Hopper form)",
    "UTMALDG": "TMA load",
    "UTMASTG": "TMA store",
    "LDGSTS": "async global->shared copy (cp.async)",
    "LDG": "global load",
    "STG": "global store",
    "LDSM": "shared -> register matrix load (ldmatrix)",
    "LDS": "shared load",
    "STS": "shared store",
    "SYNCS": "mbarrier operation",
    "BAR": "CTA barrier",
    "WARPGROUP": "warpgroup arrive / wait",
    "MUFU": "special function (exp2, rcp, ...)",
    "FFMA": "fp32 fused multiply-add",
    "FMUL": "fp32 multiply",
    "FADD": "fp32 add",
    "FMNMX": "fp32 min / max",
    "F2FP": "fp32 -> packed 16-bit conversion",
    "PRMT": "byte permute",
    "LOP3": "three-input logic op",
    "SHF": "funnel shift",
    "STL": "local store (spill)",
    "LDL": "local load (spill)",
}


def build_source(spec: OpSpec, problem: tuple, config: dict, target: Target) -> str:
    import tilelang
    import tvm

    configs = pass_configs(target, spec.fast_math)
    with tvm.transform.PassContext(config=configs), tvm.target.Target(target.tilelang()):
        return tilelang.lower(spec.build(problem, config, target),
                              target=target.tilelang()).kernel_source


def compile_cubin(source: str, target: Target, fast_math: bool) -> bytes:
    """The cubin TileLang would load for this source (its own nvcc call and flags)."""
    import tvm
    from tilelang.cuda.backend import tilelang_callback_cuda_compile

    return bytes(tilelang_callback_cuda_compile(source, tvm.target.Target(target.tilelang()),
                                                pass_configs(target, fast_math)))


def cuda_tool(name: str) -> str | None:
    """A CUDA binary tool on PATH, else in the bin/ of NVIDIA's pip wheels (nvidia/cu*/bin)."""
    import importlib.util

    if found := shutil.which(name):
        return found
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec else []
    wheels = [p for root in roots for p in sorted(Path(root).glob(f"*/bin/{name}"))]
    return str(wheels[-1]) if wheels else None


def cuobjdump() -> str:
    tool = os.environ.get("CUOBJDUMP") or cuda_tool("cuobjdump")
    if not tool:
        sys.exit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                 "or set $CUOBJDUMP")
    return tool


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(SASS text, resource usage text) of a cubin."""
    env = dict(os.environ)
    if nvdisasm := cuda_tool("nvdisasm"):  # cuobjdump -sass runs it from PATH
        env["PATH"] = os.pathsep.join([os.path.dirname(nvdisasm), env.get("PATH", "")])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = lambda *a: subprocess.run([cuobjdump(), *a, f.name], check=True,  # noqa: E731
                                        capture_output=True, text=True, env=env).stdout
        return run("-sass"), run("-res-usage")


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]+)?")
_RESOURCES = re.compile(r"(REG|STACK|SHARED|LOCAL|CONSTANT\[\d+\]|TEXTURE|SURFACE|SAMPLER)"
                        r":(\d+)")


def summarise(sass: str, resources: str) -> dict:
    """Per kernel function: resource usage and instruction counts by family."""
    kernels: dict[str, dict] = {}
    name = None
    for line in resources.splitlines():
        if m := re.search(r"Function (\S+):", line):
            name = m.group(1)
            kernels[name] = {"resources": {}, "instructions": 0, "families": Counter()}
        elif name and (pairs := _RESOURCES.findall(line)):
            kernels[name]["resources"] = {k: int(v) for k, v in pairs}
    name = None
    for line in sass.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            name = m.group(1)
            kernels.setdefault(name, {"resources": {}, "instructions": 0, "families": Counter()})
        elif name and (m := _INSTRUCTION.search(line)):
            op = m.group(1)
            if op == "NOP":
                continue
            kernels[name]["instructions"] += 1
            family = next((f for f in FAMILIES if op.startswith(f)), None)
            if family:
                kernels[name]["families"][family] += 1
    return kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True, choices=sorted(SPECS))
    ap.add_argument("--shape", required=True, help="a problem in the operator's tuner syntax")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", default="{}", help="JSON merged over the default configuration")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--dump", type=Path, help="write the SASS here")
    ap.add_argument("--source", type=Path, help="write the CUDA source TileLang generated here")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    spec = get_spec(args.op)
    target = Target("cuda", args.arch, "codegen", 132)
    problem = spec.parse_problem(args.shape, args.dtype)
    config = {**spec.default_config(problem, target), **json.loads(args.config)}
    if reason := spec.check_config(problem, config, target):
        sys.exit(f"configuration refused: {reason}")
    source = build_source(spec, problem, config, target)
    if args.source:
        args.source.write_text(source)
    sass, resources = disassemble(compile_cubin(source, target, spec.fast_math))
    if args.dump:
        args.dump.write_text(sass)
    kernels = summarise(sass, resources)
    if args.json:
        print(json.dumps({"problem": spec.problem_dict(problem), "config": config,
                          "kernels": kernels}, indent=1))
        return 0
    print(f"{spec.name} {spec.problem_label(problem)} {args.arch}")
    print(f"config {json.dumps(config, sort_keys=True)}")
    for name, k in kernels.items():
        r = k["resources"]
        print(f"\n{name}\n  registers {r.get('REG')}  stack {r.get('STACK')}  "
              f"local {r.get('LOCAL')}  static shared {r.get('SHARED')} B  "
              f"instructions {k['instructions']}")
        for family, n in sorted(k["families"].items(), key=lambda kv: -kv[1]):
            print(f"  {family:<10} {n:>6}  {FAMILIES[family]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
