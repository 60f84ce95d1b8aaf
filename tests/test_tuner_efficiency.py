"""The sampler-efficiency experiment runs (tiny space, CPU) and resumes from its storage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPACE = {"block_M": [16, 64], "block_N": [32, 64], "block_K": [64]}


def test_efficiency_experiment_runs_and_resumes(tmp_path):
    args = [sys.executable, "benchmarks/tuner_efficiency.py", "--device", "cpu", "--suite",
            "quickstart", "--dtype", "bfloat16", "--problems", "1", "--seeds", "1",
            "--fraction", "0.5", "--space", json.dumps(SPACE), "--results-dir", str(tmp_path),
            "--quiet"]
    for _ in range(2):  # the second run finds every study done
        subprocess.run(args, cwd=ROOT, check=True, timeout=300, capture_output=True)
        report = json.loads((tmp_path / "tuner_efficiency.json").read_text())
        assert report["complete"] and len(report["problems"]) == 1
        (entry,) = report["problems"]
        assert entry["valid_configs"] == 4 and entry["budget"] == 2
        runs = {r["sampler"]: r for r in entry["runs"]}
        assert runs["grid"]["trials"] == 4 and len(runs["grid"]["curve"]) == 4
        assert runs["random"]["trials"] == 2 and runs["tpe"]["trials"] == 2
        assert runs["grid"]["ratio"] == 1.0 and runs["grid"]["found_grid_best"]
        assert runs["tpe"]["grid_us_of_best"] is not None
        assert set(report["summary"]) == {"random", "tpe"}
    assert (tmp_path / "tuner_efficiency.journal").exists()


def test_replay_answers_random_and_tpe_from_the_grid(tmp_path):
    args = [sys.executable, "benchmarks/tuner_efficiency.py", "--device", "cpu", "--suite",
            "quickstart", "--dtype", "bfloat16", "--problems", "1", "--seeds", "5",
            "--fraction", "0.5", "--space", json.dumps(SPACE), "--results-dir", str(tmp_path),
            "--replay", "--quiet", "--jobs", "2"]
    subprocess.run(args, cwd=ROOT, check=True, timeout=300, capture_output=True)
    report = json.loads((tmp_path / "tuner_efficiency.json").read_text())
    assert report["complete"] and report["replay"]
    (entry,) = report["problems"]
    grid, *runs = entry["runs"]
    assert grid["sampler"] == "grid" and grid["trials"] == 4  # measured for real
    assert len(runs) == 10 and all(r["trials"] == 2 for r in runs)
    for run in runs:  # every latency a replayed run saw is the grid's measurement of that config
        assert run["best_us"] == run["grid_us_of_best"]
    # Offline, from the stored grid alone: the same searches, the same results.
    stored = [sys.executable, "benchmarks/tuner_efficiency.py", "--replay-stored", "--seeds", "5",
              "--fraction", "0.5", "--space", json.dumps(SPACE), "--results-dir", str(tmp_path),
              "--storage", str(tmp_path / "tuner_efficiency.journal"), "--quiet", "--jobs", "2"]
    subprocess.run(stored, cwd=ROOT, check=True, timeout=300, capture_output=True)
    offline = json.loads((tmp_path / "tuner_efficiency_replayed.json").read_text())
    assert offline["complete"] and offline["device"] == report["device"]
    assert offline["problems"][0]["runs"] == entry["runs"]
    assert offline["summary"] == report["summary"]
