"""Two tuning databases' records of the same problems, timed against each other in one run.

    python benchmarks/records_compare.py OLD.sqlite NEW.sqlite [--op gemm] [--rounds 7]

For every problem both databases record for this machine's target, what dispatch would run from
each record (its tile configuration, or the baseline where the record chose it) is checked
against the reference and timed in interleaved rounds in one process, with the tuner's timer
(`tuner.evaluate.retime`). Writes `results/<device>/records_compare.json`: per problem the two
latencies and new/old, and the geometric mean of new/old (above 1: the new records are slower).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from harness import RESULTS, device_dir, versions

from tileops.db import TuningDB
from tileops.ops import get_spec
from tileops.target import resolve_device
from tileops.tuner.evaluate import Job, retime


def records(path: Path, op: str, target_key: tuple) -> dict[str, Any]:
    with TuningDB(path, readonly=True) as db:
        return {r.problem: r for r in db.records(op, target_key)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--op", default="gemm")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    spec = get_spec(args.op)
    target, device = resolve_device(args.device)
    old, new = (records(p, spec.name, target.key) for p in (args.old, args.new))
    cases = []
    for key in sorted(old.keys() & new.keys()):
        problem = spec.problem_from_dict(json.loads(key))
        jobs = [Job(spec, problem, target, str(device),
                    None if r.chosen == "baseline" else json.loads(r.config))
                for r in (old[key], new[key])]
        m_old, m_new = retime(jobs, seed=11, rounds=args.rounds)
        if not (m_old.ok and m_new.ok):
            raise SystemExit(f"{spec.problem_label(problem)}: a record failed its check "
                             f"({m_old.reason or m_new.reason})")
        case = {"problem": json.loads(key), "old": _ran(old[key]), "new": _ran(new[key]),
                "old_us": m_old.stats.median_us, "new_us": m_new.stats.median_us}
        case["new_over_old"] = case["new_us"] / case["old_us"]
        cases.append(case)
        print(f"{spec.problem_label(problem)}: old {case['old_us']:.2f} us, new "
              f"{case['new_us']:.2f} us, new/old {case['new_over_old']:.3f}", flush=True)
    if not cases:
        raise SystemExit("the two databases share no problem of this operator and target")
    ratios = [c["new_over_old"] for c in cases]
    report = {"op": spec.name, "device": target.device, "old": str(args.old), "new": str(args.new),
              "versions": versions(), "cases": cases,
              "geomean_new_over_old": math.exp(sum(map(math.log, ratios)) / len(ratios)),
              "worst_new_over_old": max(ratios)}
    out = args.out or RESULTS / device_dir(target) / "records_compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"geomean new/old {report['geomean_new_over_old']:.4f}, worst "
          f"{report['worst_new_over_old']:.3f}; wrote {out}")
    return 0


def _ran(record: Any) -> Any:
    return "baseline" if record.chosen == "baseline" else json.loads(record.config)


if __name__ == "__main__":
    sys.exit(main())
