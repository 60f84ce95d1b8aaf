"""`tileops db ...`: the command-line side of `dbtools` (arguments and printing), one handler per
subcommand (`set_defaults(run=...)`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from tileops.db import DatabaseError, TuningDB, default_user_db
from tileops.db.models import Record
from tileops.spec import canonical

from . import dbtools, lifecycle
from .errors import UsageError
from .progress import table


def add_db_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="db_command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], help: str,
                description: str | None = None) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help, description=description or help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        q.set_defaults(run=run)
        return q

    def db_option(q: argparse.ArgumentParser) -> None:
        q.add_argument("--db", type=Path, help="database (default: the user database)")

    def filters(q: argparse.ArgumentParser) -> None:
        q.add_argument("--op", action="append", help="only this operator (repeatable)")
        q.add_argument("--target", action="append", metavar="KIND[:ARCH]",
                       help="only this target, e.g. cuda or cuda:sm_90a (repeatable)")
        q.add_argument("--device", help="only devices whose name contains this")

    q = command("summary", _summary,
                "records per operator and target, median speedup over the baseline")
    db_option(q)
    q.add_argument("--json", action="store_true")
    q = command("show", _show, "list records")
    db_option(q)
    filters(q)
    q.add_argument("--json", action="store_true")
    q = command("export", _export,
                "copy chosen operators and targets into a standalone, compacted file")
    q.add_argument("out", type=Path, help="new database file")
    db_option(q)
    filters(q)
    q.add_argument("--include-stale", action="store_true",
                   help="also copy records this installation does not trust")
    q.add_argument("--force", action="store_true", help="replace OUT if it exists")
    q = command("merge", _merge, "merge the records of SRC into DST",
                "merge the records of SRC into DST\n\n" + _merge_rule())
    q.add_argument("src", type=Path)
    q.add_argument("--into", type=Path, required=True, metavar="DST")
    q = command("verify", _verify, "check schema, integrity, staleness and configurations")
    db_option(q)
    q.add_argument("--prune", action="store_true", help="delete the records with problems")
    q = command("sources", _sources,
                "hash each record's generated kernel code, for a later restamp",
                "hash each record's generated kernel code as this checkout makes it (JSON on\n"
                "stdout or in --out): run it before a refactor of kernel code, then `restamp`\n"
                "after it")
    db_option(q)
    filters(q)
    q.add_argument("--out", type=Path, help="write the JSON here")
    q = command("restamp", _restamp,
                "give the current kernel hash to stale records whose kernels did not change",
                "give the current kernel hash to the records that are stale only by their\n"
                "kernel hash and whose kernels this checkout generates exactly as the checkout\n"
                "that wrote SOURCES (`tileops db sources`) did; the others stay stale")
    q.add_argument("sources", type=Path, help="a `tileops db sources` file of the old code")
    db_option(q)
    q = command("migrate", _migrate,
                "upgrade a database of an older schema to this tileops' schema")
    q.add_argument("path", type=Path, nargs="?", help="database (default: the user database)")


def db_command(args: argparse.Namespace) -> int:
    return args.run(args)


def _path(args: argparse.Namespace) -> Path:
    """The database a subcommand works on: --db or PATH, else the user database."""
    return (getattr(args, "db", None) or getattr(args, "path", None)
            or default_user_db()).expanduser()


def _records(args: argparse.Namespace) -> list[Record]:
    with dbtools.open_db(_path(args)) as tdb:
        return tdb.records()


def _migrate(args: argparse.Namespace) -> int:
    path = _path(args)
    with dbtools.open_db(path, write=True) as tdb:
        if tdb.readonly:
            raise UsageError(f"{path} is not writable; cannot migrate it")
        was = tdb.migrated_from
        print(f"{path}: schema version {tdb.schema_version()}"
              + (f" (migrated from {was})" if was is not None else ", already current"))
    return lifecycle.OK


def _merge(args: argparse.Namespace) -> int:
    with dbtools.open_db(args.src) as src, _open_dst(args.into) as dst:
        report = dbtools.merge(src, dst)
    print(f"merged {args.src} into {args.into}: {report.added} added, {report.replaced} "
          f"replaced, {report.kept} kept")
    return lifecycle.OK


def _verify(args: argparse.Namespace) -> int:
    path = _path(args)
    with dbtools.open_db(path, write=args.prune) as tdb:
        version = tdb.schema_version()
        issues = dbtools.verify(tdb)
        if args.prune:
            ids = {i.record_id for i in issues if i.record_id is not None}
            if ids and tdb.readonly:
                raise UsageError(f"{path} is not writable; cannot prune")
            pruned = tdb.delete(ids)
    for issue in issues:
        print(f"record {issue.record_id}: {issue.message}" if issue.record_id is not None
              else issue.message)
    print(f"{path}: schema version {version}, {len(issues)} issue(s) found"
          + (f", {pruned} record(s) deleted" if args.prune else ""))
    return lifecycle.INCOMPLETE if issues and not args.prune else lifecycle.OK


def _sources(args: argparse.Namespace) -> int:
    records = dbtools.select(_records(args), args.op, args.target, args.device)
    text = json.dumps(dbtools.kernel_sources(records), indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"hashed the kernels of {len(records)} record(s) into {args.out}")
    else:
        print(text)
    return lifecycle.OK


def _restamp(args: argparse.Namespace) -> int:
    try:
        before = json.loads(args.sources.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read sources file {args.sources}: {e}") from None
    path = _path(args)
    with dbtools.open_db(path, write=True) as tdb:
        if tdb.readonly:
            raise UsageError(f"{path} is not writable; cannot restamp it")
        report = dbtools.restamp(tdb, before)
    print(f"{path}: {report.restamped} record(s) restamped, {report.changed} with changed "
          f"kernels left stale, {report.other} stale for other reasons")
    return lifecycle.OK


def _summary(args: argparse.Namespace) -> int:
    rows = dbtools.summary(_records(args))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(["op", "target", "device", "units", "records", "tile", "stale",
                     "median speedup", "median tile speedup"],
                    [list(r.values()) for r in rows]) if rows else f"{_path(args)}: no records")
    return lifecycle.OK


def _show(args: argparse.Namespace) -> int:
    rows = dbtools.show_rows(dbtools.select(_records(args), args.op, args.target, args.device))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(["id", "op", "problem", "target", "device", "chosen", "tile us",
                     "baseline us", "trials", "config", "stale"],
                    [[r["id"], r["op"], canonical(r["problem"]),
                      f"{r['target_kind']}:{r['arch']}", r["device"], r["chosen"],
                      r["tile_us"], r["baseline_us"], r["trials"], canonical(r["config"]),
                      r["stale"]] for r in rows]))
    return lifecycle.OK


def _export(args: argparse.Namespace) -> int:
    path = _path(args)
    chosen = dbtools.select(_records(args), args.op, args.target, args.device)
    if not args.include_stale:
        chosen = [r for r in chosen if dbtools.freshness(r) is None]
    n = dbtools.export(chosen, args.out.expanduser(), force=args.force, source=path)
    print(f"exported {n} record(s) from {path} to {args.out}")
    return lifecycle.OK


def _open_dst(path: Path) -> TuningDB:
    try:
        return TuningDB(path.expanduser())
    except DatabaseError as e:
        raise UsageError(str(e)) from None


def _merge_rule() -> str:
    doc = dbtools.__doc__ or ""
    return doc[doc.index("Merge rule"):].strip()
