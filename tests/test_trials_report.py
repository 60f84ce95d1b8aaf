"""benchmarks/trials.py lists every configuration a run measured, with the stored baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tileops.tuner.cli import tune_main

ROOT = Path(__file__).resolve().parents[1]
SPACE = {"block_M": [16, 64], "block_N": [32], "block_K": [64]}


def test_trials_report_lists_each_measured_configuration(tmp_path):
    db = tmp_path / "t.sqlite"
    assert tune_main(["--device", "cpu", "--op", "gemm", "--shape", "64x128x128", "--dtype",
                      "float32", "--space", json.dumps(SPACE), "--sampler", "grid", "--trials",
                      "2", "--abandon", "0", "--db", str(db), "--quiet"]) == 0
    out = tmp_path / "t.json"
    printed = subprocess.run([sys.executable, "benchmarks/trials.py", str(db), "--json", str(out)],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
    (table,) = json.loads(out.read_text())
    assert table["fixed"] == {"block_K": 64, "block_N": 32}
    assert sorted(r["config"]["block_M"] for r in table["measured"]) == [16, 64]
    times = [r["median_us"] for r in table["measured"]]
    assert times == sorted(times) and table["baseline_us"] > 0
    assert "x baseline" in printed
