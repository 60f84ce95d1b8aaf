"""Helpers shared by the tests: tuning records as the tuner writes them, error metrics."""

from __future__ import annotations

import datetime as dt

from tileops.db import TuningDB, provenance
from tileops.tuner.evaluate import relative_error as rel_error  # noqa: F401 - the tests' error metric


def make_record(spec, target, problem, config, *, tile_us=10.0, baseline_us=12.0,
                chosen="tile", **overrides):
    """Record fields as the tuner writes them, with this installation's provenance."""
    fields = provenance(spec, target)
    fields.update(problem=spec.problem_dict(problem), config=config, chosen=chosen,
                  tile_us=tile_us, baseline_us=baseline_us, trials=1,
                  created_at=dt.datetime(2026, 1, 1))
    fields.update(overrides)
    return fields


def write_db(path, records):
    with TuningDB(path) as db:
        db.put_many(records)
    return path
