"""Render benchmark results (`results/<device>/<op>.json`) as a markdown table and a speedup plot.

    python benchmarks/report.py results/h200/gemm.json [--png speedup.png]

The table has one row per case (time, TFLOP/s, GB/s, what dispatch ran, the best tile kernel's own
time) and ends with the geometric-mean speedup over the baseline and the worst case. The plot
(matplotlib, when installed) shows the speedup per case, tile kernels and baseline fallbacks apart.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def label(case: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in case["problem"].items()) + f" {case['dtype']}"


def markdown(report: dict[str, Any]) -> str:
    cases = report["cases"]
    beside = sorted({name for c in cases for name in c.get("beside_us", {})})
    lines = [f"## {report['op']} on {report['device']} against {report['baseline']}", "",
             "| problem | tileops us | baseline us | speedup | TFLOP/s | GB/s | ran | tile us |"
             + "".join(f" {name} us | speedup over {name} |" for name in beside),
             "| --- | --- | --- | --- | --- | --- | --- | --- |" + " --- | --- |" * len(beside)]
    for c in cases:
        row = (f"| {label(c)} | {c['tileops_us']:.1f} | {c['baseline_us']:.1f} | "
               f"{c['baseline_us'] / c['tileops_us']:.2f} | {c['tflops']:.1f} | "
               f"{c['gbps']:.0f} | {c['chosen']} | {c['tile_us']:.1f} |")
        for name in beside:
            us = c.get("beside_us", {}).get(name)
            row += f" {us:.1f} | {us / c['tileops_us']:.2f} |" if us else " - | - |"
        lines.append(row)
    if cases:
        speedups = [c["baseline_us"] / c["tileops_us"] for c in cases]
        geomean = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        worst = min(range(len(cases)), key=speedups.__getitem__)
        tile = sum(c["chosen"] == "tile" for c in cases)
        lines += ["", f"Geometric-mean speedup {geomean:.3f} over {len(cases)} cases; worst "
                  f"{speedups[worst]:.2f} ({label(cases[worst])}); a tile kernel ran in "
                  f"{tile} of {len(cases)} cases."]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = report["cases"]
    speedups = [c["baseline_us"] / c["tileops_us"] for c in cases]
    colors = ["tab:blue" if c["chosen"] == "tile" else "tab:gray" for c in cases]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(cases)), 4))
    ax.bar(range(len(cases)), speedups, color=colors)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), [label(c) for c in cases], rotation=90, fontsize=6)
    ax.set_ylabel(f"speedup over {report['baseline']}")
    ax.set_title(f"{report['op']} on {report['device']} (gray: baseline dispatched)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--png", type=Path, help="default: beside the results, .png")
    args = ap.parse_args(argv)
    report = json.loads(args.results.read_text())
    print(markdown(report))
    png = args.png or args.results.with_suffix(".png")
    if plot(report, png):
        print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
