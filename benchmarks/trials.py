"""Every configuration a tuning run measured, per problem: the table behind its one record.

    python benchmarks/trials.py STORAGE [--db DB] [--json OUT]

STORAGE is an Optuna journal or RDB URL, or a tuning database (its journal beside it). Prints,
per study, the measured configurations fastest first (only the parameters that vary within the
study), each one's median and, with `--db` (or a database as STORAGE), its ratio to the baseline
latency the record stored; then the failures with their reasons. A grid over a hand-picked
`--space` is how several variants are compared on the GPU in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import optuna
from optuna.trial import TrialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tileops.db import TuningDB  # noqa: E402
from tileops.spec import canonical  # noqa: E402
from tileops.tuner import studies  # noqa: E402


def baselines(db: Path | None) -> dict[tuple[str, str], float]:
    """(op, canonical problem) -> the baseline latency (us) a record stored."""
    if db is None or not db.exists():
        return {}
    with TuningDB(db) as tdb:
        return {(r.op, r.problem): r.baseline_us for r in tdb.records() if r.baseline_us}


def study_table(study: optuna.Study) -> dict:
    counted = studies.counted_trials(study)
    varying = sorted({k for t in counted for k in t.params
                      if len({json.dumps(u.params.get(k)) for u in counted}) > 1})
    done = sorted((t for t in counted if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    failed = [t for t in counted if t.state == TrialState.PRUNED]
    return {
        "study": study.study_name,
        "fixed": {k: v for k, v in (counted[0].params if counted else {}).items()
                  if k not in varying},
        "measured": [{"config": {k: t.params.get(k) for k in varying}, "median_us": t.value}
                     for t in done],
        "failed": [{"config": {k: t.params.get(k) for k in varying},
                    "reason": t.user_attrs.get(studies.REASON, "")} for t in failed],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("storage")
    ap.add_argument("--db", type=Path, help="tuning database holding the baseline latencies")
    ap.add_argument("--json", type=Path, help="also write the tables here")
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, db = args.storage, args.db
    if storage.endswith((".sqlite", ".db")) and "://" not in storage:
        db = db or Path(storage)
        storage = studies.default_storage(Path(storage))
    base = baselines(db)
    st = studies.open_storage(storage)
    tables = []
    for name in sorted(optuna.get_all_study_names(st)):
        table = study_table(optuna.load_study(study_name=name, storage=st))
        parsed = studies.parse_study_name(name)
        table["baseline_us"] = (base.get((parsed.op, canonical(parsed.problem)))
                                if parsed else None)
        tables.append(table)
        print(f"\n{name}\n  fixed {json.dumps(table['fixed'], sort_keys=True)}")
        for row in table["measured"]:
            ratio = (f"  {table['baseline_us'] / row['median_us']:.3f}x baseline"
                     if table["baseline_us"] else "")
            print(f"  {row['median_us']:10.2f} us{ratio}  {json.dumps(row['config'])}")
        for row in table["failed"]:
            print(f"  {'failed':>13}  {json.dumps(row['config'])}: {row['reason'][:100]}")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
