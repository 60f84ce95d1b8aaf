"""Tune on first use (opt-in): a problem no database covers gets a short search at its first call.

Off by default. `TILEOPS_AUTOTUNE=1` turns it on (`TILEOPS_AUTOTUNE_TRIALS`, default 16, and
`TILEOPS_AUTOTUNE_SECONDS`, default 60, cap each search), or `tileops.set_autotune(...)` from
Python. A first call that would run the heuristic default (no exact record, no near one) instead
runs the tuner's sweep for that one problem on the call's device: the same correctness gate, the
winner recorded in the user database, then dispatched. Never while a CUDA graph is being captured
(the sweep times kernels and synchronises): such a call runs the default, and a later uncaptured
first call of another bucket may tune.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger("tileops")


@dataclass(frozen=True)
class Policy:
    """How much one first-use search may spend."""

    trials: int = 16
    seconds: float = 60.0


_policy: Policy | None = None
_from_env = True  # until set_autotune is called, the environment decides


def set_autotune(enabled: bool = True, *, trials: int = 16, seconds: float = 60.0) -> None:
    """Turn tuning on first use on or off for this process (over `TILEOPS_AUTOTUNE`)."""
    global _policy, _from_env
    if enabled and (trials < 1 or not seconds > 0):
        raise ValueError(f"set_autotune: trials must be >= 1 and seconds > 0; got {trials}, "
                         f"{seconds}")
    _policy, _from_env = (Policy(trials, seconds) if enabled else None), False


def policy() -> Policy | None:
    """The policy in force, None when tuning on first use is off."""
    if not _from_env:
        return _policy
    if os.environ.get("TILEOPS_AUTOTUNE", "") not in ("1", "true", "yes", "on"):
        return None
    try:
        return Policy(int(os.environ.get("TILEOPS_AUTOTUNE_TRIALS", "16")),
                      float(os.environ.get("TILEOPS_AUTOTUNE_SECONDS", "60")))
    except ValueError as e:
        raise ValueError(f"TILEOPS_AUTOTUNE_TRIALS / _SECONDS: {e}") from None


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tune(spec, target, device: torch.device, problem: tuple, policy: Policy) -> bool:
    """Search one problem on `device` and record its winner in the user database; whether a
    record was made."""
    from .db.layers import default_user_db
    from .tuner import studies, sweep
    from .tuner.progress import Progress

    db = default_user_db()
    plan = sweep.Plan(spec=spec, target=target, devices=[str(device)], problems=[problem],
                      db=db, storage=studies.default_storage(db), trials=policy.trials,
                      timeout=policy.seconds, quiet=True)
    log.info("%s %s: no record for this problem; tuning it (%d trials, %g s at most)",
             spec.name, spec.problem_label(problem), policy.trials, policy.seconds)
    (result,) = sweep.run(plan, Progress(quiet=True))
    return result.decision is not None
