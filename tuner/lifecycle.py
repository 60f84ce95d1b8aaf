"""How a sweep stops and dies, and what becomes of its trials: the one place for signals, the
reaper's thresholds and the commands' exit codes.

A trial's states (Optuna's) and who moves it between them:

- WAITING: enqueued, by the warm start (`studies.warm_start`) or by a release below, so that a
  configuration that was not evaluated is asked again.
- RUNNING: asked by a worker (`studies.ask`), which writes its owner (host:pid) and its
  configuration before anything else can happen: SIGINT and SIGTERM are held meanwhile
  (`signals_deferred`).
- COMPLETE: measured, told by its owner (`studies.tell_value`).
- PRUNED: it cannot win, told by its owner: refused by `check_config`, failed to compile, wrong,
  crashed, hung, or abandoned after its estimate (`studies.tell_failure`); or the verdict of an
  earlier trial of the same configuration (`studies.tell_repeat`).
- FAIL: not evaluated. Its owner gives it back when its search ends early (`studies.release`,
  `studies.release_own`), or any worker does once the owner is gone (`studies.reap_interrupted`:
  an owner on this host whose process is dead; no owner after `ORPHAN_AFTER`; any trial after
  `STALE_AFTER`). Either way its configuration goes back to WAITING.

Signals: in the command's process and in each worker process SIGTERM means what Ctrl-C means
(`stop_on_sigterm`), a KeyboardInterrupt: the search gives back the trials it holds and the
command exits with `INTERRUPTED`. A parent with workers tells them to stop first and waits for
them to give their trials back (`stop_workers`) before it kills any that linger.
"""

from __future__ import annotations

import datetime as dt
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

# Exit codes of `tileops-tune` and `tileops` (the CLI docstring says when each is given).
OK, INCOMPLETE, USAGE, INTERRUPTED = 0, 1, 2, 130

# A running trial of another host is presumed dead after this long.
STALE_AFTER = dt.timedelta(hours=6)
# A running trial without an owner (its worker died right after asking for it), after this long.
ORPHAN_AFTER = dt.timedelta(minutes=1)
# Seconds a stopped worker has to give its trials back before it is killed.
WORKER_GRACE_S = 30.0

_HELD = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in this (main) thread while the block runs."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them (main thread only: the
    only thread Python runs signal handlers in)."""
    if threading.current_thread() is not threading.main_thread() \
            or any(signal.getsignal(s) is None for s in _HELD):  # a handler Python cannot restore
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in _HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in caught[:1]:
            signal.raise_signal(s)


def stop_workers(workers: Iterable[BaseProcess], grace_s: float = WORKER_GRACE_S) -> None:
    """Tell live workers to stop (SIGTERM: they give their trials back and exit), wait up to
    `grace_s` for them, then kill any that linger."""
    workers = list(workers)
    for w in workers:
        if w.is_alive():
            w.terminate()
    for w in workers:
        w.join(grace_s)
        if w.is_alive():
            w.kill()
            w.join(5)
