"""What a sweep shows: a tqdm bar on a terminal, one plain line per trial in a log."""

from __future__ import annotations

import io
from types import SimpleNamespace

from tileops.tuner.progress import Progress
from tileops.tuner.studies import Ledger


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(stream) -> str:
    progress = Progress(stream)
    ledger = Ledger()
    progress.begin("gemm M=1", 4, ledger, None)
    ledger.counted, ledger.best = 2, SimpleNamespace(value=3.0)
    measured = SimpleNamespace(ok=True, stats=SimpleNamespace(median_us=3.0))
    progress.update(ledger, 7, {"block_M": 16}, measured)
    progress.note("a note")
    progress.end(ledger, "done")
    return stream.getvalue()


def test_a_log_gets_one_plain_line_per_trial():
    lines = run(io.StringIO()).splitlines()
    assert lines == ["gemm M=1: 0/4 trials, 0 failed",
                     '#7 {"block_M":16} -> 3.00 us | gemm M=1: 2/4 trials, 0 failed, best 3.00 us',
                     "a note", "gemm M=1: 2/4 trials, 0 failed, best 3.00 us (done)"]


def test_a_terminal_gets_a_live_bar_with_notes_above_it():
    out = run(Terminal())
    assert "\r" in out and "2/4" in out and "best 3.00 us" in out and "(done)" in out
    assert "a note\n" in out and "#7" not in out  # no line per trial


def test_quiet_prints_nothing():
    stream = Terminal()
    progress = Progress(stream, quiet=True)
    progress.begin("x", 1, Ledger(), None)
    progress.note("n")
    progress.end(Ledger(), "done")
    assert stream.getvalue() == ""
