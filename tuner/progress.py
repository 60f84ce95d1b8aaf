"""What the user sees while a sweep runs: a progress bar per problem and a summary table at the end.

On a terminal each problem gets a tqdm bar (counted trials against the budget, the best so far
beside it) and notes print above it; elsewhere (logs, CI) each trial prints one plain line;
`quiet` prints nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm

from tileops.spec import Config, canonical

if TYPE_CHECKING:
    from .evaluate import Measurement
    from .studies import Ledger


class Progress:
    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False,
                 tty: bool | None = None, prefix: str = ""):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = self.stream.isatty() if tty is None else tty
        self.prefix = prefix
        self._label = ""
        self._budget = 0
        self._baseline_us: float | None = None
        self._bar: tqdm | None = None

    def begin(self, label: str, budget: int, ledger: Ledger, baseline: Measurement | None
              ) -> None:
        self._label, self._budget = label, budget
        self._baseline_us = baseline.stats.median_us if baseline and baseline.stats else None
        if baseline is not None and not baseline.ok:
            self.note(f"{label}: baseline failed ({baseline.failure}: {baseline.reason})")
        if self.quiet:
            return
        if self.tty:
            self._bar = tqdm(total=budget, initial=ledger.counted, desc=self.prefix + label,
                             file=self.stream, leave=True, dynamic_ncols=True, unit="trial")
            self._bar.set_postfix_str(self._best(ledger))
        else:
            self._line(self._status(ledger))

    def update(self, ledger: Ledger, number: int, config: Config, m: Measurement) -> None:
        if self._bar is not None:
            self._bar.n = ledger.counted
            self._bar.set_postfix_str(self._best(ledger))  # refreshes the bar
        elif not self.quiet:
            result = (f"{m.stats.median_us:.2f} us" if m.ok and m.stats
                      else f"{m.failure}: {m.reason}")
            self._line(f"#{number} {canonical(config)} -> {result} | {self._status(ledger)}")

    def end(self, ledger: Ledger, stopped: str) -> None:
        if self._bar is not None:
            self._bar.n = ledger.counted
            self._bar.set_postfix_str(f"{self._best(ledger)} ({stopped})")
            self._bar.close()
            self._bar = None
        elif not self.quiet:
            self._line(f"{self._status(ledger)} ({stopped})")

    def note(self, text: str) -> None:
        """A line of its own, above the bar."""
        if self.quiet:
            return
        if self._bar is not None:
            tqdm.write(self.prefix + text, file=self.stream)
        else:
            self._line(text)

    def _status(self, ledger: Ledger) -> str:
        return (f"{self._label}: {ledger.counted}/{self._budget} trials, "
                + self._best(ledger))

    def _best(self, ledger: Ledger) -> str:
        parts = [f"{ledger.failed} failed"]
        if ledger.abandoned:
            parts.append(f"{ledger.abandoned} abandoned")
        if ledger.skipped:
            parts.append(f"{ledger.skipped} refused")
        if ledger.best is not None:
            best = ledger.best.value
            parts.append(f"best {best:.2f} us")
            if self._baseline_us:
                parts.append(f"{self._baseline_us / best:.2f}x vs baseline "
                             f"{self._baseline_us:.2f} us")
        return ", ".join(parts)

    def _line(self, text: str) -> None:
        print(self.prefix + text, file=self.stream, flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, columns left-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
