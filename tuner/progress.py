"""What the user sees while a sweep runs: a live line per problem and a summary table at the end.

On a terminal the line is rewritten in place (carriage return); otherwise (logs, CI) each trial
prints one line; `quiet` prints nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

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
        self._width = 0

    def begin(self, label: str, budget: int, ledger: Ledger, baseline: Measurement | None
              ) -> None:
        self._label, self._budget = label, budget
        self._baseline_us = baseline.stats.median_us if baseline and baseline.stats else None
        if baseline is not None and not baseline.ok:
            self.note(f"{label}: baseline failed ({baseline.failure}: {baseline.reason})")
        self._show(self._status(ledger), final=not self.tty)

    def update(self, ledger: Ledger, number: int, config: Config, m: Measurement) -> None:
        if self.tty:
            self._show(self._status(ledger))
        else:
            result = (f"{m.stats.median_us:.2f} us" if m.ok and m.stats
                      else f"{m.failure}: {m.reason}")
            self._show(f"#{number} {canonical(config)} -> {result} | {self._status(ledger)}",
                       final=True)

    def end(self, ledger: Ledger, stopped: str) -> None:
        self._show(f"{self._status(ledger)} ({stopped})", final=True)

    def note(self, text: str) -> None:
        """A line of its own that does not clobber the live line."""
        if not self.quiet:
            self._clear()
            print(self.prefix + text, file=self.stream, flush=True)

    def _status(self, ledger: Ledger) -> str:
        parts = [f"{ledger.counted}/{self._budget} trials", f"{ledger.failed} failed"]
        if ledger.skipped:
            parts.append(f"{ledger.skipped} refused")
        if ledger.best is not None:
            best = ledger.best.value
            parts.append(f"best {best:.2f} us")
            if self._baseline_us:
                parts.append(f"{self._baseline_us / best:.2f}x vs baseline "
                             f"{self._baseline_us:.2f} us")
        return f"{self._label}: " + ", ".join(parts)

    def _show(self, text: str, final: bool = False) -> None:
        if self.quiet:
            return
        text = self.prefix + text
        if self.tty:
            pad = " " * max(0, self._width - len(text))
            self.stream.write("\r" + text + pad + ("\n" if final else ""))
            self._width = 0 if final else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0


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
