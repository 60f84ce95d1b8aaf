"""Opening, reading and writing one tuning database file (SQLite through SQLAlchemy)."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..spec import canonical
from .models import MIGRATIONS, SCHEMA_VERSION, Base, Meta, Record

# Columns a record holds, all but its row id (`put` fills `created_at` when a caller does not).
RECORD_FIELDS = tuple(c.name for c in Record.__table__.columns if c.name not in ("id",))
KEY_FIELDS = ("op", "problem", "target_kind", "arch", "device")


class DatabaseError(Exception):
    """A tuning database that cannot be used: missing, locked, corrupt, or of a newer schema."""


class TuningDB:
    """One SQLite tuning database.

    Read-only databases (the shipped ones) are opened with SQLite's `mode=ro`, so they work from a
    read-only install directory and are never modified; writable ones are created on demand and
    migrated to the current schema.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False, timeout: float = 30.0):
        self.path = Path(path).expanduser()
        self.readonly = readonly
        self.migrated_from: int | None = None  # the schema version this open migrated from
        if self.path.is_dir():
            raise DatabaseError(f"tuning database {self.path} is a directory, not a file")
        if readonly and not self.path.is_file():
            raise DatabaseError(f"tuning database {self.path} does not exist")
        if not readonly:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(f"cannot create {self.path.parent}: {e}") from None
        self.engine = _engine(self.path, readonly, timeout)
        try:
            self._check_schema()
        except SQLAlchemyError as e:
            self.engine.dispose()
            raise DatabaseError(f"tuning database {self.path} is unusable: {_reason(e)}") from None
        except DatabaseError:
            self.engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r}{', readonly' if self.readonly else ''})"

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- schema ---------------------------------------------------------------------------------
    def _check_schema(self) -> None:
        tables = set(inspect(self.engine).get_table_names())
        if Meta.__tablename__ not in tables:
            if tables:
                raise DatabaseError(f"{self.path} is an SQLite file but not a tileops database")
            if self.readonly:
                raise DatabaseError(f"{self.path} is empty")
            Base.metadata.create_all(self.engine)
            with Session(self.engine) as s, s.begin():
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            return
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise DatabaseError(f"{self.path} has schema version {version}, newer than this tileops "
                                f"understands ({SCHEMA_VERSION}); upgrade tileops")
        if version < SCHEMA_VERSION:
            missing = [v for v in range(version, SCHEMA_VERSION) if v not in MIGRATIONS]
            if missing:
                raise DatabaseError(f"{self.path} has schema version {version}, which this "
                                    f"tileops cannot migrate (no migration from version "
                                    f"{missing[0]}; it reads version {SCHEMA_VERSION})")
            if self.readonly:
                raise DatabaseError(f"{self.path} has old schema version {version}; migrate it "
                                    f"with `tileops db migrate {self.path}`")
            with self.engine.begin() as conn:
                for v in range(version, SCHEMA_VERSION):
                    MIGRATIONS[v](conn)
            with Session(self.engine) as s, s.begin():
                s.merge(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            self.migrated_from = version

    def schema_version(self) -> int:
        with Session(self.engine) as s:
            value = s.get(Meta, "schema_version")
        if value is None:
            raise DatabaseError(f"{self.path} has no schema version")
        try:
            return int(value.value)
        except (TypeError, ValueError):
            raise DatabaseError(f"{self.path} has an unreadable schema version "
                                f"{value.value!r}") from None

    def check_writable(self) -> None:
        """Raise a DatabaseError unless a write would succeed now: the file and its directory
        (SQLite writes its journal beside the file) writable, the database not locked. The
        probe rewrites the schema version row, in a transaction of its own."""
        if self.readonly:
            raise DatabaseError(f"{self.path} is opened read-only")
        for path, what in ((self.path, "file"), (self.path.parent, "directory")):
            if not os.access(path, os.W_OK):
                raise DatabaseError(f"cannot write {self.path}: its {what} {path} is read-only")
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql("UPDATE tileops_meta SET value = value "
                                     "WHERE key = 'schema_version'")
        except SQLAlchemyError as e:
            raise DatabaseError(f"cannot write {self.path}: {_reason(e)}") from None

    # ---- reading --------------------------------------------------------------------------------
    def records(self, op: str | None = None, target_key: tuple[str, str, str] | None = None
                ) -> list[Record]:
        """Records, optionally of one operator and one target (kind, arch, device)."""
        query = select(Record).order_by(Record.id)
        if op is not None:
            query = query.where(Record.op == op)
        if target_key is not None:
            kind, arch, device = target_key
            query = query.where(Record.target_kind == kind, Record.arch == arch,
                                Record.device == device)
        try:
            with Session(self.engine, expire_on_commit=False) as s:
                rows = list(s.scalars(query))
                s.expunge_all()
        except (SQLAlchemyError, ValueError, TypeError) as e:  # the latter: a column's value
            # SQLAlchemy cannot convert (e.g. a created_at that is no date)
            raise DatabaseError(f"cannot read {self.path}: {_reason(e)}") from None
        return rows

    def record(self, **key: Any) -> Record | None:
        """The record with this key (`KEY_FIELDS`; problem as canonical JSON), if any."""
        try:
            with Session(self.engine, expire_on_commit=False) as s:
                row = s.scalars(select(Record).filter_by(**key)).first()
                s.expunge_all()
        except SQLAlchemyError as e:
            raise DatabaseError(f"cannot read {self.path}: {_reason(e)}") from None
        return row

    # ---- writing --------------------------------------------------------------------------------
    def put(self, **fields: Any) -> Record:
        """Insert or replace the record with the same key (op, problem, target kind/arch/device)."""
        return self.put_many([fields])[0]

    def put_many(self, items: Iterable[dict[str, Any]]) -> list[Record]:
        if self.readonly:
            raise DatabaseError(f"{self.path} is opened read-only")
        out = []
        try:
            with Session(self.engine, expire_on_commit=False) as s, s.begin():
                for fields in items:
                    fields = _normalise(fields)
                    key = {k: fields[k] for k in KEY_FIELDS}
                    row = s.scalars(select(Record).filter_by(**key)).first()
                    if row is None:
                        row = Record(**fields)
                        s.add(row)
                    else:
                        for k, v in fields.items():
                            setattr(row, k, v)
                    out.append(row)
                s.flush()
                s.expunge_all()
        except SQLAlchemyError as e:
            raise DatabaseError(f"cannot write {self.path}: {_reason(e)}") from None
        return out

    def delete(self, ids: Iterable[int]) -> int:
        ids = list(ids)
        with Session(self.engine) as s, s.begin():
            rows = s.scalars(select(Record).where(Record.id.in_(ids))).all()
            for row in rows:
                s.delete(row)
        return len(rows)

    def integrity_errors(self) -> list[str]:
        """SQLite's own integrity check; empty when the file is sound."""
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql("PRAGMA integrity_check").fetchall()
        return [r[0] for r in rows if r[0] != "ok"]


def record_dict(record: Record) -> dict[str, Any]:
    """A record's fields as a plain dict (without the id)."""
    return {name: getattr(record, name) for name in RECORD_FIELDS}


def transient_record(fields: dict[str, Any]) -> Record:
    """A record of these fields (as `put` would store them) that belongs to no database."""
    return Record(**_normalise(fields))


def _normalise(fields: dict[str, Any]) -> dict[str, Any]:
    fields = dict(fields)
    for name in ("problem", "config"):
        if not isinstance(fields.get(name), str):
            fields[name] = canonical(fields[name])
    fields.setdefault("created_at", dt.datetime.now(dt.UTC).replace(tzinfo=None))
    unknown = set(fields) - set(RECORD_FIELDS)
    if unknown:
        raise ValueError(f"unknown record fields: {sorted(unknown)}")
    return fields


def _engine(path: Path, readonly: bool, timeout: float) -> Engine:
    if readonly:
        # mode=ro: never written, no journal created, so a read-only directory is fine.
        url = f"sqlite:///file:{path.resolve()}?mode=ro&uri=true"
    else:
        url = f"sqlite:///{path.resolve()}"
    return create_engine(url, connect_args={"timeout": timeout})


def _reason(e: Exception) -> str:
    orig = getattr(e, "orig", None)
    return str(orig) if orig is not None else str(e).splitlines()[0]
