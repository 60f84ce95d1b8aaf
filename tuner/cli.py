"""The `tileops-tune` and `tileops` commands.

    tileops-tune --device auto --op OP (--suite NAME | --problems FILE | --shape TEXT ...) [...]
    tileops tune ...                          (the same)
    tileops ops                               (the operators, their problem syntax, dtypes, targets)
    tileops db summary|show|export|merge|verify|migrate [...]

Exit codes:
    0    done: every problem has its record (this run's, or an earlier run's of the same study)
    1    a problem ended without a record (every trial failed, or none ran before --timeout),
         or dispatch did not run a new record correctly; `tileops db verify` found issues
    2    a mistake in what was asked for (unknown operator, target or suite, unreadable or
         unwritable database, bad problem text): one line on stderr, before any trial runs
    130  interrupted: Ctrl-C (or SIGTERM) leaves the studies and the database consistent; run
         the same command again to resume

`tune_python` is the same sweep called from Python (`tileops.tune`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna

from tileops import dispatch
from tileops.db import DatabaseError
from tileops.ops import SPECS
from tileops.spec import OpSpec
from tileops.target import KINDS, Target

from . import lifecycle
from .dbcli import add_db_arguments, db_command
from .errors import UsageError
from .tunecli import Outcome, add_tune_arguments, run_tune, tune

log = logging.getLogger("tileops.tuner")


# ---- ops ----------------------------------------------------------------------------------------
def ops_table() -> str:
    """Every operator as its spec describes it: names, call, problem syntax, dtypes, targets."""
    lines = []
    for spec in SPECS.values():
        names = " (also " + ", ".join(spec.aliases) + ")" if spec.aliases else ""
        dtypes = "; ".join(f"{kind}: {', '.join(d)}" for kind, d in spec.dtypes.items())
        lines += [f"{spec.name}{names}", f"  call     {spec.function}",
                  f"  problem  {spec.problem_syntax}", f"  dtypes   {dtypes}",
                  f"  targets  {', '.join(_kernel_targets(spec))}", ""]
    return "\n".join(lines).rstrip()


def _kernel_targets(spec: OpSpec) -> list[str]:
    """The target kinds with a configuration space, and the archs the spec refuses among them."""
    out = []
    for kind in _kinds(spec):
        refused = [key.partition(":")[2] for key in spec.unsupported
                   if key.startswith(kind + ":")]
        out.append(kind + (f" (not {', '.join(a + '*' for a in refused)})" if refused else ""))
    return out


def _kinds(spec: OpSpec) -> list[str]:
    return [kind for kind in KINDS if spec.unsupported_reason(Target(kind, "", "", 0)) is None]


# ---- entry points -------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse, with a hint where it reads a value that starts with '-' as an option, and
    errors raised (not printed) for the Python entry point."""

    raise_errors = False

    def error(self, message: str) -> Any:
        if "expected one argument" in message:
            message += " (a value that starts with '-' must be attached with '=', e.g. " \
                       "--shape=-1x64x64)"
        if self.raise_errors:
            raise UsageError(message)
        return super().error(message)


def tune_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tileops-tune", description=(
        "Search each problem's configuration space with Optuna and record the winners."))
    add_tune_arguments(parser)
    return parser


def tune_main(argv: Sequence[str] | None = None) -> int:
    parser = tune_parser()
    return _run(tune, parser.parse_args(argv), parser.prog)


def tileops_main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="tileops", description="tileops tuning and databases")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_tune_arguments(sub.add_parser("tune", help="tune operators (same as tileops-tune)"))
    sub.add_parser("ops", help="list the operators: problem syntax, dtypes, targets")
    add_db_arguments(sub.add_parser("db", help="inspect, ship and check tuning databases"))
    args = parser.parse_args(argv)
    commands = {"tune": tune, "db": db_command, "ops": lambda _: print(ops_table()) or 0}
    return _run(commands[args.command], args, parser.prog)


def tune_python(op: str, shapes: str | Sequence[str], **options: Any) -> Outcome:
    """`tileops-tune --op OP --shape S ...` from Python: options are the command's long options
    with underscores (`trials=8`, `dtype="float16"`, `no_warm_start=True`); lists repeat an option.
    Mistakes raise `UsageError` instead of exiting."""
    argv = ["--op", op]
    for shape in [shapes] if isinstance(shapes, str) else shapes:
        argv.append(f"--shape={shape}")
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [f"{flag}={v}" for v in (value if isinstance(value, list) else [value])]
    parser = tune_parser()
    parser.raise_errors = True
    args = parser.parse_args(argv)
    if args.dry_run:
        raise UsageError("tileops.tune runs a sweep; use tileops-tune --dry-run to list configs")
    try:
        outcome = run_tune(args)
    finally:
        dispatch.reset()  # this process's next calls read the new records
    assert isinstance(outcome, Outcome)
    return outcome


def _run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace,
         prog: str) -> int:
    _configure_logging(getattr(args, "quiet", False))
    try:
        with lifecycle.stop_on_sigterm():
            return command(args)
    except (UsageError, DatabaseError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return lifecycle.USAGE
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; finished trials are kept, run the same command again to "
              "resume", file=sys.stderr)
        return lifecycle.INTERRUPTED


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (tests and embedding programs swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))


def _configure_logging(quiet: bool) -> None:
    if _HANDLER not in log.handlers:
        log.addHandler(_HANDLER)
        log.propagate = False
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


if __name__ == "__main__":
    raise SystemExit(tileops_main())
