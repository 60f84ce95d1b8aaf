"""Choosing what a record says: re-time the top configurations, pick a stable winner, write it.

The rule, so that two sweeps on one machine record the same configuration:
1. The fastest few distinct configurations of the study and the baseline are checked again and
   timed in interleaved rounds (`evaluate.retime`).
2. The noise band is the largest relative spread of the per-round medians of any of them (the
   spread between runs of the same kernel), clamped to [NOISE_FLOOR, NOISE_CAP].
3. Every tile configuration within the band of the fastest one ties; of those, the one whose
   canonical JSON sorts first wins.
4. The winner is chosen over the baseline only when it is faster beyond the band; otherwise the
   record says chosen="baseline" (dispatch then calls the baseline) and keeps the tile figure.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tileops.db import provenance
from tileops.db.layers import stale_reason
from tileops.db.storage import TuningDB, canonical
from tileops.spec import Config

from . import studies
from .evaluate import Measurement
from .search import Task
from .session import Session
from .studies import Ledger

log = logging.getLogger("tuner")

NOISE_FLOOR = 0.01
NOISE_CAP = 0.10


@dataclass(frozen=True)
class Decision:
    chosen: str  # "tile" or "baseline"
    config: Config  # the winning tile configuration
    tile_us: float
    baseline_us: float | None
    band: float  # relative noise band the tie rule used
    ties: int  # tile configurations inside the band


def noise_band(measurements: list[Measurement]) -> float:
    spreads = [(max(m.round_medians) - min(m.round_medians)) / m.stats.median_us
               for m in measurements if m.ok and m.stats and len(m.round_medians) > 1]
    return min(NOISE_CAP, max([NOISE_FLOOR, *spreads]))


def decide(tiles: list[tuple[Config, Measurement]], baseline: Measurement) -> Decision | None:
    """Apply the rule above to re-timed tile configurations and the baseline."""
    ok = [(c, m.stats.median_us) for c, m in tiles if m.ok and m.stats]
    if not ok:
        return None
    band = noise_band([m for _, m in tiles] + [baseline])
    fastest = min(us for _, us in ok)
    tied = sorted((canonical(c), c, us) for c, us in ok if us <= fastest * (1 + band))
    _, config, tile_us = tied[0]
    base_us = baseline.stats.median_us if baseline.ok and baseline.stats else None
    chosen = "tile" if base_us is None or tile_us * (1 + band) < base_us else "baseline"
    return Decision(chosen, config, tile_us, base_us, band, len(tied))


def retime_top(session: Session, task: Task, ledger: Ledger, top: int, rounds: int,
               seed: int) -> Decision | None:
    """Re-check and re-time the `top` fastest configurations of a study with the baseline."""
    configs = [dict(t.params) for t in ledger.complete()[:top]]
    if not configs:
        return None
    jobs = [task.job(c) for c in configs] + [task.job(None)]
    results = session.retime(jobs, seed, rounds)
    for config, m in zip(configs, results, strict=False):
        if not m.ok:
            log.warning("%s: %s failed when re-timed (%s: %s)", task.label, canonical(config),
                        m.failure, m.reason)
    return decide(list(zip(configs, results[:-1], strict=True)), results[-1])


def record_fields(task: Task, decision: Decision, trials: int) -> dict[str, Any]:
    """The tuning record of a decision, with its provenance (the space is the one searched)."""
    return {**provenance(task.spec, task.target), "problem": task.spec.problem_dict(task.problem),
            "chosen": decision.chosen, "config": decision.config, "tile_us": decision.tile_us,
            "baseline_us": decision.baseline_us, "space_hash": studies.space_hash(task.space),
            "trials": trials}


def already_recorded(db: Path, task: Task, trials: int) -> bool:
    """The database holds a trusted record of this very study's result (nothing to redo)."""
    if not db.exists():
        return False
    problem = canonical(task.spec.problem_dict(task.problem))
    with TuningDB(db, readonly=True) as tdb:
        for r in tdb.records(task.spec.name, task.target.key):
            if r.problem == problem:
                return (r.trials == trials and r.space_hash == studies.space_hash(task.space)
                        and stale_reason(task.spec, r) is None)
    return False


def write(db: Path, task: Task, decision: Decision, trials: int) -> None:
    from tileops import dispatch

    with TuningDB(db) as tdb:
        tdb.put(**record_fields(task, decision, trials))
    dispatch.reset()
    log.info("recorded %s on %s in %s: chosen %s; best tile config %s %.2f us, baseline %s",
             task.label, task.target.describe(), db, decision.chosen,
             json.dumps(decision.config, sort_keys=True), decision.tile_us,
             _us(decision.baseline_us))


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} us"
