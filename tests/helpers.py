"""Helpers shared by the tests: tuning records as the tuner writes them, error metrics, the
attention operators' output check."""

from __future__ import annotations

import datetime as dt

import torch

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


def check_attention(out, lse, ref, tol, lse_tol=2e-2):
    """An attention output and log-sum-exp against the reference pair: no NaN, the output within
    `tol`, -inf exactly where the reference's query sees no key, the rest within `lse_tol`."""
    ref_out, ref_lse = ref
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref_out) < tol
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), masked)
    if (~masked).any():
        assert (lse[~masked].double() - ref_lse[~masked].double()).abs().max() < lse_tol
