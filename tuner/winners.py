"""Choosing what a record says: re-time the top configurations, pick a stable winner, write it.

The rule, so that two sweeps on one machine record the same configuration:
1. The fastest few distinct configurations of the study and the baseline are checked again and
   timed in interleaved rounds (`evaluate.retime`).
2. The noise band is the largest relative spread, over the rounds, of any one's round median
   divided by the round's common level (the geometric mean of all their medians in that round),
   clamped to [NOISE_FLOOR, NOISE_CAP]: the spread between runs of the same kernel, less the
   drift that slows a whole round. Rounds are interleaved, so such drift hits every launch of a
   round alike; left in, one slow round widened the band to the cap and tied kernels 12% apart
   (measured on the H200, `benchmarks/NOTES.md`).
3. Every tile configuration within the band of the fastest one ties; of those, the one whose
   canonical JSON sorts first wins.
4. The winner is chosen over the baseline only when it is faster beyond the band; otherwise the
   record says chosen="baseline" (dispatch then calls the baseline) and keeps the tile figure.

No record rests on timings that contradict each other: when the same launch measured `CONTRA`
times faster in one measurement than in another (its search-time median, its fastest re-timed
launch and its re-timing rounds' medians; the baseline's too), something else was using the
device or the host's cores, now and then or throughout (a launch that runs at full speed only
between interruptions has a median far above its fastest launch). The re-timing is repeated, and
after `RETIME_ATTEMPTS` contradicting ones nothing is recorded, with the reason. One exception:
where only the baseline's timings contradict and the fastest tile beats the fastest of them
beyond `NOISE_CAP`, the verdict (tile) holds whichever is right, so it is recorded, with that
fastest baseline figure as the baseline's (a figure it reached). Baselines made of many small
host-launched ops (MLA's torch reference at one sequence) varied 2-7x on an idle H200 host
while the tile kernels agreed within 1%.

A new record replaces the database's record of the same problem and target only under the merge
rule of `tileops db merge` (`dbtools.merge_wins`): a fresh record beats a stale one, and of two
fresh ones measured on the same device the faster one stays, so a narrower or shorter re-tune
never replaces a better record.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tileops.db import provenance
from tileops.db.layers import stale_reason
from tileops.db.storage import KEY_FIELDS, TuningDB, transient_record
from tileops.spec import Config, canonical, space_hash

from .dbtools import merge_wins
from .evaluate import Measurement
from .search import Task
from .session import Session
from .studies import Ledger

log = logging.getLogger("tileops.tuner")

NOISE_FLOOR = 0.01
NOISE_CAP = 0.10
CONTRA = 3.0  # the same launch this many times faster in one measurement than another
RETIME_ATTEMPTS = 3


@dataclass(frozen=True)
class Decision:
    chosen: str  # "tile" or "baseline"
    config: Config  # the winning tile configuration
    tile_us: float
    baseline_us: float | None
    band: float  # relative noise band the tie rule used
    ties: int  # tile configurations inside the band


def noise_band(measurements: list[Measurement]) -> float:
    """Rule 2: the relative spread of each launch's round medians against the rounds' common
    level (with one launch, the spread of its own medians)."""
    timed = [m.round_medians for m in measurements
             if m.ok and m.stats and len(m.round_medians) > 1]
    rounds = min(map(len, timed), default=0)
    if len(timed) > 1:
        level = [math.exp(statistics.fmean(math.log(t[r]) for t in timed)) for r in range(rounds)]
        timed = [[t[r] / level[r] for r in range(rounds)] for t in timed]
    spreads = [(max(t) - min(t)) / statistics.median(t) for t in timed]
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


def contradiction(timings: dict[str, list[float]]) -> str | None:
    """Why the timings of the same launches contradict each other (None: they agree): each
    entry holds every median measured for one launch (label -> microseconds)."""
    for label, values in timings.items():
        values = [v for v in values if v and v > 0]
        if len(values) > 1 and max(values) > CONTRA * min(values):
            return (f"{label} measured {min(values):.4g} us and {max(values):.4g} us "
                    f"(medians {', '.join(f'{v:.4g}' for v in values)})")
    return None


def _figures(m: Measurement) -> list[float]:
    """A re-timed launch's fastest sample and its rounds' medians."""
    return [m.stats.min_us, *m.round_medians] if m.ok and m.stats else []


def retime_top(session: Session, task: Task, ledger: Ledger, top: int, rounds: int, seed: int,
               baseline_us: float | None = None) -> tuple[Decision | None, str]:
    """Re-check and re-time the `top` fastest configurations of a study with the baseline (whose
    search-time median is `baseline_us`); the decision, or None and why not."""
    trials = ledger.complete()[:top]
    configs = [dict(t.params) for t in trials]
    if not configs:
        return None, "no configuration passed its check"
    jobs = [task.job(c) for c in configs] + [task.job(None)]
    why, base_floor = "", None
    for attempt in range(RETIME_ATTEMPTS):
        results = session.retime(jobs, seed + attempt, rounds)
        timings = {canonical(c): [t.value, *_figures(m)]
                   for c, t, m in zip(configs, trials, results, strict=False)}
        base = [v for v in (baseline_us, *_figures(results[-1])) if v and v > 0]
        tiles_why = contradiction(timings)
        why = tiles_why or contradiction({"the baseline": base}) or ""
        if not why:
            break
        if not tiles_why and _tile_beats_all(results[:-1], base):
            log.warning("%s: the baseline's timings contradict each other (%s), but the tile "
                        "beats every one of them", task.label, why)
            base_floor = min(base)
            break
        log.warning("%s: timings contradict each other (%s); is something else using the "
                    "device? measuring again (%d of %d)", task.label, why, attempt + 1,
                    RETIME_ATTEMPTS)
    else:
        return None, (f"timings contradict each other after {RETIME_ATTEMPTS} attempts ({why}): "
                      "is something else using the device or the host's cores?")
    for config, m in zip(configs, results, strict=False):
        if not m.ok:
            log.warning("%s: %s failed when re-timed (%s: %s)", task.label, canonical(config),
                        m.failure, m.reason)
    # A baseline whose timings contradict each other stays out of the noise band.
    baseline = results[-1] if base_floor is None else Measurement(failure="contradicted")
    decision = decide(list(zip(configs, results[:-1], strict=True)), baseline)
    if decision and base_floor is not None:
        decision = replace(decision, baseline_us=base_floor)
    return decision, "" if decision else "the best configurations failed when re-timed"


def _tile_beats_all(tiles: list[Measurement], baseline: list[float]) -> bool:
    """Whether the fastest re-timed tile, at its slowest round, is faster than every baseline
    figure by more than the widest noise band."""
    slowest = [max(m.round_medians or (m.stats.median_us,)) for m in tiles if m.ok and m.stats]
    return bool(slowest and baseline) and min(slowest) * (1 + NOISE_CAP) < min(baseline)


def record_fields(task: Task, decision: Decision, trials: int) -> dict[str, Any]:
    """The tuning record of a decision, with its provenance (the space is the one searched)."""
    return {**provenance(task.spec, task.target, task.space),
            "problem": task.spec.problem_dict(task.problem), "chosen": decision.chosen,
            "config": decision.config, "tile_us": decision.tile_us,
            "baseline_us": decision.baseline_us, "trials": trials}


def already_recorded(db: Path, task: Task, trials: int) -> bool:
    """The database holds a trusted record of this very study's result (nothing to redo)."""
    if not db.exists():
        return False
    problem = canonical(task.spec.problem_dict(task.problem))
    with TuningDB(db, readonly=True) as tdb:
        for r in tdb.records(task.spec.name, task.target.key):
            if r.problem == problem:
                return (r.trials == trials and r.space_hash == space_hash(task.space)
                        and stale_reason(task.spec, r) is None)
    return False


def write(db: Path, task: Task, decision: Decision, trials: int) -> bool:
    """Record a decision unless the database's record of the problem beats it (the merge rule);
    whether it was written."""
    from tileops import dispatch

    fields = record_fields(task, decision, trials)
    with TuningDB(db) as tdb:
        new = transient_record(fields)
        old = tdb.record(**{k: getattr(new, k) for k in KEY_FIELDS})
        if old is not None and not merge_wins(new, old):
            log.info("kept the record of %s in %s (%.2f us) over this run's (%.2f us)",
                     task.label, db, old.latency_us, new.latency_us)
            return False
        tdb.put(**fields)
    dispatch.reset()
    log.info("recorded %s on %s in %s: chosen %s; best tile config %s %.2f us, baseline %s",
             task.label, task.target.describe(), db, decision.chosen,
             json.dumps(decision.config, sort_keys=True), decision.tile_us,
             _us(decision.baseline_us))
    return True


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} us"
