"""After a sweep: call each tuned problem through dispatch, as a user would, and check the result.

This closes the loop of a tuning run: the records just written must be what dispatch resolves
(source `user`, or the database given with `--db`), and the kernel it then runs must match the
operator's float64 reference on fresh inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tileops.db import Resolver, shipped_dbs
from tileops.dispatch import Dispatcher
from tileops.spec import OpSpec, canonical
from tileops.target import target_of

from .evaluate import relative_error


@dataclass(frozen=True)
class Check:
    label: str
    source: str  # where dispatch found the configuration
    runs: str  # "baseline" or the tile configuration
    rel_error: float
    ok: bool


def check_dispatch(spec: OpSpec, problems: list[tuple], device: str, db: Path) -> list[Check]:
    """Dispatch every problem with `db` as the user database; compare with the reference."""
    dispatcher = Dispatcher()
    dispatcher.resolver = Resolver(user_db=db, shipped=shipped_dbs())
    dev = torch.device(device)
    target = target_of(dev)
    checks = []
    for problem in problems:
        inputs = spec.make_inputs(problem, dev, seed=20261129)
        out = dispatcher(spec, *inputs)
        ref = spec.reference(inputs)
        err = relative_error(out, ref)  # over every output (e.g. attention's (out, lse))
        choice = dispatcher.choice(spec, target, problem)
        runs = ("baseline" if dispatcher.runs_baseline(spec, target, problem)
                else canonical(choice.config))
        source = choice.source + ("" if choice.exact else " (nearest)")
        ok = choice.source == "user" and choice.exact and not math.isnan(err) \
            and err <= spec.tolerance(problem)
        checks.append(Check(spec.problem_label(problem), source, runs, err, ok))
    dispatcher.resolver.close()
    return checks
