"""Tuning database maintenance: summary, show, export, merge, verify, and restamping records
across a refactor that leaves the generated kernels unchanged.

Merge rule (`tileops db merge SRC --into DST`), for each record of SRC against DST's record with
the same key (operator, problem, target kind, arch, device name):
1. DST has none: SRC's record is added.
2. A fresh record (one this installation trusts: same TileLang version and kernel source, see
   `tileops.db.layers.stale_reason`) beats a stale one; a record of an operator this installation
   does not know counts as stale.
3. Both fresh, or both stale: when both were measured on the same device (the key already fixes
   the device name and arch; the unit count, SMs/CUs/cores, must match too), the lower latency of
   what dispatch runs (`latency_us`: the tile kernel's, or the baseline's when chosen) wins.
   Otherwise the newer record wins. An exact tie keeps DST's record.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tileops.db.layers import read_record, stale_reason
from tileops.db.models import Record
from tileops.db.storage import KEY_FIELDS, DatabaseError, TuningDB, record_dict
from tileops.ops import SPECS
from tileops.spec import canonical
from tileops.target import KINDS, Target

from .errors import UsageError


def open_db(path: Path, *, write: bool = False) -> TuningDB:
    """An existing database (never created here): writable when asked and allowed."""
    if path.is_dir():
        raise UsageError(f"tuning database {path} is a directory, not a file")
    if not path.is_file():
        raise UsageError(f"tuning database {path} does not exist")
    try:
        return TuningDB(path, readonly=not (write and os.access(path, os.W_OK)))
    except DatabaseError as e:
        raise UsageError(str(e)) from None


def freshness(record: Record) -> str | None:
    """Why a record is stale for this installation (None: fresh)."""
    spec = SPECS.get(record.op)
    if spec is None:
        return f"unknown operator {record.op!r}"
    return stale_reason(spec, record)


# ---- summary / show -----------------------------------------------------------------------------
def summary(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Per operator and target: record count, device, median speedups over the stored baseline."""
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.op, r.target_kind, r.arch, r.device)].append(r)
    rows = []
    for (op, kind, arch, device), rs in sorted(groups.items()):
        timed = [r for r in rs if r.baseline_us]
        rows.append({
            "op": op, "target": f"{kind}:{arch}", "device": device,
            "units": max(r.units for r in rs), "records": len(rs),
            "tile_chosen": sum(r.chosen == "tile" for r in rs),
            "stale": sum(freshness(r) is not None for r in rs),
            "median_speedup": _median([speedup(r.baseline_us, r.latency_us) for r in timed]),
            "median_tile_speedup": _median([speedup(r.baseline_us, r.tile_us) for r in timed]),
        })
    return rows


def show_rows(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Records as plain values; a problem or config that is not JSON is shown as its text."""
    rows = []
    for r in records:
        d = record_dict(r)
        d["id"] = r.id
        d["problem"] = _json_or_text(r.problem)
        d["config"] = _json_or_text(r.config)
        d["created_at"] = r.created_at.isoformat() if r.created_at else None
        d["speedup"] = speedup(r.baseline_us, r.latency_us)
        d["stale"] = freshness(r)
        rows.append(d)
    return rows


def speedup(baseline_us: Any, us: Any) -> float | None:
    """baseline / latency, or None where either is not a positive number (a damaged record)."""
    ok = all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in (baseline_us, us))
    return baseline_us / us if ok else None


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def select(records: Iterable[Record], ops: list[str] | None = None,
           targets: list[str] | None = None, device: str | None = None) -> list[Record]:
    """Records of the given operators, targets (`kind` or `kind:arch`) and device (substring)."""
    def target_ok(r: Record) -> bool:
        return not targets or any(t in (r.target_kind, f"{r.target_kind}:{r.arch}")
                                  for t in targets)

    return [r for r in records if (not ops or r.op in ops) and target_ok(r)
            and (device is None or device.lower() in r.device.lower())]


# ---- export / merge -----------------------------------------------------------------------------
def export(records: list[Record], out: Path, force: bool = False,
           source: Path | None = None) -> int:
    """Write records into a new standalone database file, compacted (VACUUM) for shipping.

    The file is written beside OUT under a temporary name and renamed over it once complete, so
    a failure leaves OUT as it was; OUT may not be the `source` the records were read from."""
    if out.is_dir():
        raise UsageError(f"{out} is a directory; export writes a database file")
    if out.exists():
        if source is not None and source.exists() and os.path.samefile(out, source):
            raise UsageError(f"{out} is the database the records are read from; export into "
                             "another file")
        if not force:
            raise UsageError(f"{out} exists; pass --force to replace it")
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        with TuningDB(partial) as db:
            db.put_many(record_dict(r) for r in records)
            with db.engine.connect() as conn:
                conn.exec_driver_sql("VACUUM")
        os.replace(partial, out)
    except DatabaseError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e.strerror}") from None
    finally:
        partial.unlink(missing_ok=True)
    return len(records)


@dataclass
class MergeReport:
    added: int = 0
    replaced: int = 0
    kept: int = 0


def merge_wins(new: Record, old: Record) -> bool:
    """Whether `new` replaces `old` (same key) under the rule in this module's docstring."""
    new_fresh, old_fresh = freshness(new) is None, freshness(old) is None
    if new_fresh != old_fresh:
        return new_fresh
    if new.units == old.units:
        return new.latency_us < old.latency_us
    return (new.created_at or dt.datetime.min) > (old.created_at or dt.datetime.min)


def merge(src: TuningDB, dst: TuningDB) -> MergeReport:
    report = MergeReport()
    existing = {_key(r): r for r in dst.records()}
    updates = []
    for r in src.records():
        old = existing.get(_key(r))
        if old is None:
            report.added += 1
        elif merge_wins(r, old):
            report.replaced += 1
        else:
            report.kept += 1
            continue
        updates.append(record_dict(r))
    dst.put_many(updates)
    return report


def _key(r: Record) -> tuple:
    return tuple(getattr(r, k) for k in KEY_FIELDS)


# ---- verify -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Issue:
    record_id: int | None  # None: the file itself
    message: str


def verify(db: TuningDB) -> list[Issue]:
    """Schema, SQLite integrity, stale records and configurations the spec refuses."""
    issues = [Issue(None, f"integrity: {e}") for e in db.integrity_errors()]
    try:
        records = db.records()
    except DatabaseError as e:
        return [*issues, Issue(None, str(e))]
    return issues + [Issue(r.id, m) for r in records for m in record_issues(r)]


def record_issues(r: Record) -> list[str]:
    label = f"{r.op} {r.problem} on {r.target_kind}:{r.arch} ({r.device})"
    spec = SPECS.get(r.op)
    if spec is None:
        return [f"{label}: unknown operator {r.op!r}"]
    out = []
    reason = stale_reason(spec, r)
    if reason:
        out.append(f"{label}: stale ({reason})")
    if speedup(1.0, r.tile_us) is None:
        out.append(f"{label}: tile_us {r.tile_us} is not a positive latency")
    if r.baseline_us is not None and speedup(r.baseline_us, 1.0) is None:
        out.append(f"{label}: baseline_us {r.baseline_us} is not a positive latency")
    if r.target_kind not in KINDS:
        return [*out, f"{label}: unknown target kind {r.target_kind!r}"]
    target = Target(r.target_kind, r.arch, r.device, r.units)
    reason = spec.unsupported_reason(target)
    if reason:
        return [*out, f"{label}: {reason}"]
    try:
        read_record(spec, r, target)  # what dispatch checks before it uses a record
    except ValueError as e:
        out.append(f"{label}: {e}")
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


# ---- sources / restamp --------------------------------------------------------------------------
# A change to a kernel module's code stales every record of its operators (`OpSpec.kernel_hash`),
# even a refactor after which each record's kernel is generated character for character as
# before. `kernel_sources` hashes the device code of each record's kernel as this checkout
# generates it; made before the refactor and compared after it (`restamp`), it lets exactly the
# records whose kernels did not change take the new hash, instead of being tuned again.
def source_key(r: Record) -> str:
    return json.dumps([r.op, r.problem, r.target_kind, r.arch, r.device])


# TileLang 0.1.15 hands a kernel's reduction workspaces (equal scratch tiles in shared memory) to
# its reductions in an order that varies between lowerings in one process, so their names are
# erased before hashing: otherwise one kernel lowered twice can hash apart (MLA decode's max and
# sum reductions, seen in `benchmarks/NOTES.md`). Their offsets still count.
_WORKSPACE = re.compile(r"\bworkspace(_\d+)?\b")


def kernel_source_hash(r: Record, memo: dict[tuple, str]) -> str | None:
    """sha256 of the device code this checkout generates for a record's kernel (None: its
    operator, target or configuration is not one this checkout builds). Records sharing a
    kernel (its key and configuration) share one lowering through `memo`."""
    spec = SPECS.get(r.op)
    if spec is None or r.target_kind not in KINDS:
        return None
    target = Target(r.target_kind, r.arch, r.device, r.units)
    if spec.unsupported_reason(target):
        return None
    try:
        problem, config = read_record(spec, r, target)
    except ValueError:
        return None
    key = (r.op, target.key, spec.kernel_key(problem), canonical(config))
    if key not in memo:
        from tileops.dispatch import lower

        source = lower(spec.build(problem, config, target), target).kernel_source
        source = _WORKSPACE.sub("workspace", source)
        memo[key] = hashlib.sha256(source.encode()).hexdigest()
    return memo[key]


def kernel_sources(records: Iterable[Record]) -> dict[str, Any]:
    """What `restamp` compares against: each operator's kernel hash and each record's
    generated-code hash, as this checkout makes them."""
    records, memo = list(records), {}
    hashes = {r.op: SPECS[r.op].kernel_hash() for r in records if r.op in SPECS}
    return {"kernel_hash": hashes,
            "sources": {source_key(r): h for r in records
                        if (h := kernel_source_hash(r, memo)) is not None}}


@dataclass
class RestampReport:
    restamped: int = 0
    changed: int = 0  # stale records whose kernels this checkout generates differently
    other: int = 0  # stale for another reason, or not in the sources file


def restamp(db: TuningDB, before: dict[str, Any]) -> RestampReport:
    """Give the current kernel hash to every record that is stale only by its kernel hash, was
    made for the code `before` (a `kernel_sources` of the old checkout) was made with, and whose
    kernel this checkout generates exactly as that code did."""
    report, updates, memo = RestampReport(), [], {}
    for r in db.records():
        spec = SPECS.get(r.op)
        reason = stale_reason(spec, r) if spec is not None else "unknown operator"
        if reason is None:
            continue
        old = before.get("sources", {}).get(source_key(r))
        if (reason != "made for another version of the kernel source" or old is None
                or before.get("kernel_hash", {}).get(r.op) != r.kernel_hash):
            report.other += 1
        elif kernel_source_hash(r, memo) == old:
            updates.append({**record_dict(r), "kernel_hash": spec.kernel_hash()})
            report.restamped += 1
        else:
            report.changed += 1
    if updates:
        db.put_many(updates)
    return report
