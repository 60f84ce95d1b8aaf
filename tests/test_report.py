"""benchmarks/report.py renders a results file, with the paths reported beside the baseline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def case(tileops_us: float, beside: dict[str, float] | None = None) -> dict:
    c = {"problem": {"B": 8, "S": 4096}, "dtype": "bfloat16", "tileops_us": tileops_us,
         "baseline_us": 100.0, "tflops": 500.0, "gbps": 10.0, "chosen": "tile",
         "tile_us": tileops_us}
    return {**c, "beside_us": beside} if beside else c


def test_markdown_adds_a_column_pair_per_path_reported_beside():
    md = report.markdown({"op": "attention", "device": "H200", "baseline": "cuDNN",
                          "cases": [case(80.0, {"sdpa_flash": 120.0}), case(125.0)]})
    header, _, first, second, *rest = md.splitlines()[2:]
    assert header.endswith("sdpa_flash us | speedup over sdpa_flash |")
    assert first.endswith(" 120.0 | 1.50 |") and second.endswith(" - | - |")
    assert "Geometric-mean speedup 1.000 over 2 cases" in md
