"""SQLAlchemy models of the tuning database, with its schema version and migrations.

One `Record` per (operator, problem, target kind, arch, device): the winning configuration of a
tuning sweep with its provenance. `Meta` holds the schema version; `MIGRATIONS[v]` upgrades a
database from version v to v + 1, so old databases open in newer releases, and a database from a
newer release is refused rather than misread.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from sqlalchemy import DateTime, Float, Integer, String, Text, UniqueConstraint
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 1


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "tileops_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Record(Base):
    __tablename__ = "tileops_records"
    __table_args__ = (UniqueConstraint("op", "problem", "target_kind", "arch", "device",
                                       name="uq_record_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    op: Mapped[str] = mapped_column(String(64), index=True)
    problem: Mapped[str] = mapped_column(Text)  # canonical JSON of the problem key
    target_kind: Mapped[str] = mapped_column(String(16))
    arch: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(256))
    units: Mapped[int] = mapped_column(Integer, default=0)  # SM / CU / core count

    chosen: Mapped[str] = mapped_column(String(16), default="tile")  # "tile" or "baseline"
    config: Mapped[str] = mapped_column(Text)  # JSON of the best tile configuration
    tile_us: Mapped[float] = mapped_column(Float)  # best tile kernel's latency
    baseline_us: Mapped[float | None] = mapped_column(Float, nullable=True)  # same run

    tileops_version: Mapped[str] = mapped_column(String(32))
    tilelang_version: Mapped[str] = mapped_column(String(32))
    torch_version: Mapped[str] = mapped_column(String(32))
    toolkit_version: Mapped[str] = mapped_column(String(32), default="")  # CUDA / ROCm
    space_hash: Mapped[str] = mapped_column(String(32))
    kernel_hash: Mapped[str] = mapped_column(String(32))
    trials: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime)

    @property
    def latency_us(self) -> float:
        """Latency of what dispatch runs for this problem."""
        if self.chosen == "baseline" and self.baseline_us is not None:
            return self.baseline_us
        return self.tile_us

    def __repr__(self) -> str:
        return (f"Record({self.op} {self.problem} on {self.target_kind}:{self.arch} "
                f"{self.device!r}: {self.chosen} {self.tile_us:.2f} us)")


# version -> function upgrading a connection's schema from that version to the next.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {}
