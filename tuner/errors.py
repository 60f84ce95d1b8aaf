"""The one error type the command line turns into a one-line message and exit code 2."""

from __future__ import annotations


class UsageError(Exception):
    """A mistake in what the user asked for (unknown operator, suite, target, bad shape ...)."""
