"""The layered lookup that picks a configuration for a call.

Order, in the spirit of MIOpen's system + user perf-db:

1. `TILEOPS_CONFIG`: a JSON configuration forced on every problem (for debugging); either a config
   object or `{"<op>": {...}}` per operator.
2. the user database (`TILEOPS_USER_DB`, default `~/.cache/tileops/tuning.sqlite`);
3. the databases shipped in `tuning_db/` (opened read-only), in name order, unless
   `TILEOPS_SHIPPED_DB` is 0;
4. the operator's default (`OpSpec.default_config`).

Within the databases an exact problem match in any layer wins over the nearest tuned problem of
the same operator and target (kind, arch, device). The nearest record lends its configuration
and its verdict only within `OpSpec.nearest_within` (a tile tuned for decode does not suit
prefill). Farther away the call runs the baseline, whatever the record chose: its tile does not
reach, calling the baseline costs at most the baseline's time, and a default tile off every tuned
regime ran 0.2-0.8x cuBLAS (GEMM at M = 100-5000 on the H200, `benchmarks/NOTES.md`). With no
comparable record at all, or where the spec does not dispatch its baseline
(`OpSpec.dispatches_baseline`), the default tile runs (and may be tuned on first use). A database that
is missing, locked, corrupt or of a newer schema is skipped with one warning, never an exception.
Records made with another TileLang version or another version of the kernel code
(`OpSpec.kernel_hash`) are stale: skipped, with one warning per database and operator (`tileops db
verify` lists them). So are records that do not read back as a problem and a configuration this
installation can build (`read_record`): every value taken from a database is validated before use.

`TILEOPS_CONFIG` is validated like a record, and more strictly (`OpSpec.config_error` with
`within_space`): exactly the space's parameters, integers from 1 (0 where the space has 0) up to
the largest value of the target's space (values between its points are allowed, for debugging),
other values among the space's, and `check_config`; anything else raises a ValueError at the
first call.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..resources import data_dir
from ..spec import Config, OpSpec
from ..target import Target
from .models import Record
from .storage import DatabaseError, TuningDB


class TuningDatabaseWarning(UserWarning):
    """A tuning database or record was skipped; dispatch fell through to the next layer."""


def default_user_db() -> Path:
    """The user database: `TILEOPS_USER_DB`, else under the user's cache directory."""
    env = os.environ.get("TILEOPS_USER_DB")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tileops" / "tuning.sqlite"


def shipped_dbs() -> list[Path]:
    """The databases shipped in `tuning_db/`, in name order; none where `TILEOPS_SHIPPED_DB` is 0
    (what a user without them gets: how the benchmarks measure the defaults)."""
    if os.environ.get("TILEOPS_SHIPPED_DB", "").strip().lower() in ("0", "false", "no", "off"):
        return []
    try:
        return sorted(data_dir("tuning_db").glob("*.sqlite"))
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class Choice:
    """What dispatch runs for a problem, and why."""

    config: Config  # tile configuration (the tuned or default one)
    source: str  # "override", "user", "shipped:<file>", "default"
    exact: bool  # record for this very problem (False: nearest problem or default)
    use_baseline: bool = False  # a record says the baseline beats every tile kernel
    record: Record | None = None


@dataclass
class _Layer:
    label: str
    path: Path
    db: TuningDB | None = None
    failed: bool = False


def stale_reason(spec: OpSpec, record: Record) -> str | None:
    """Why a record must not be trusted by this installation (None: it can be)."""
    import tilelang

    if record.tilelang_version != tilelang.__version__:
        return f"made with TileLang {record.tilelang_version}, this is {tilelang.__version__}"
    if record.kernel_hash != spec.kernel_hash():
        return "made for another version of the kernel source"
    return None


class Resolver:
    """Resolves (operator, target, problem) to a `Choice` through the layers above."""

    def __init__(self, user_db: Path | None = None, shipped: list[Path] | None = None):
        self._user_db = user_db
        self._shipped = shipped
        self._layers: list[_Layer] | None = None
        self._tables: dict[tuple[str, str, tuple], dict[tuple, Record]] = {}

    def layers(self) -> list[_Layer]:
        if self._layers is None:
            user = self._user_db if self._user_db is not None else default_user_db()
            shipped = self._shipped if self._shipped is not None else shipped_dbs()
            self._layers = [_Layer("user", user)] + [
                _Layer(f"shipped:{p.name}", p) for p in shipped]
        return self._layers

    def resolve(self, spec: OpSpec, target: Target, problem: tuple) -> Choice:
        forced = _override(spec)
        if forced is not None:
            reason = spec.config_error(problem, forced, target, within_space=True)
            if reason:
                raise ValueError(f"TILEOPS_CONFIG for {spec.name} ({spec.problem_label(problem)}"
                                 f" on {target.describe()}): {reason}")
            return Choice(forced, "override", exact=True)
        tables = [(layer, self._table(layer, spec, target)) for layer in self.layers()]
        for layer, table in tables:
            entry = table.get(problem)
            if entry is not None:
                return _choice(entry, layer.label, exact=True)
        best: tuple[float, str, _Entry] | None = None
        for layer, table in tables:
            for other, entry in table.items():
                d = spec.distance(problem, other)
                if d is not None and (best is None or d < best[0]):
                    best = (d, layer.label, entry)
        if best is not None:
            d, label, (record, config) = best
            baseline = record.chosen == "baseline"
            if d <= spec.nearest_within and spec.check_config(problem, config, target) is None:
                return Choice(config, label, exact=False, use_baseline=baseline, record=record)
            if spec.dispatches_baseline(problem, target):  # out of the record's reach
                return Choice(spec.default_config(problem, target), label, exact=False,
                              use_baseline=True, record=record)
        # The default tile, which a first-use search may replace (`tileops.autotune`).
        return Choice(spec.default_config(problem, target), "default", exact=False)

    def _table(self, layer: _Layer, spec: OpSpec, target: Target) -> dict[tuple, _Entry]:
        """The trusted, readable records of one layer for an operator and target, with their
        configurations, keyed by problem."""
        key = (layer.label, spec.name, target.key)
        table = self._tables.get(key)
        if table is not None:
            return table
        table = {}
        db = self._open(layer)
        if db is not None:
            try:
                records = db.records(spec.name, target.key)
            except DatabaseError as e:
                _warn(f"{e}; falling back to the next layer")
                layer.failed, records = True, []
            stale, unusable = [], []
            for record in records:
                reason = stale_reason(spec, record)
                if reason:
                    stale.append(reason)
                    continue
                try:
                    problem, config = read_record(spec, record, target)
                except ValueError as e:
                    unusable.append(f"record {record.id}: {e}")
                    continue
                table[problem] = _Entry(record, config)
            if stale:
                _warn(f"{layer.path}: ignoring {len(stale)} stale {spec.name} record(s) for "
                      f"{target.describe()} ({stale[0]}); re-tune or run `tileops db verify`")
            if unusable:
                _warn(f"{layer.path}: skipping {len(unusable)} unusable {spec.name} record(s) "
                      f"for {target.describe()} ({unusable[0]}); run `tileops db verify --db "
                      f"{layer.path}`")
        self._tables[key] = table
        return table

    def _open(self, layer: _Layer) -> TuningDB | None:
        if layer.db is not None or layer.failed:
            return layer.db
        if layer.label == "user" and not layer.path.exists():
            return None  # no user database yet: nothing to warn about
        try:
            layer.db = TuningDB(layer.path, readonly=True, timeout=0.5)
        except DatabaseError as e:
            _warn(f"{e}; falling back to the next layer")
            layer.failed = True
        return layer.db

    def close(self) -> None:
        for layer in self._layers or []:
            if layer.db is not None:
                layer.db.close()
        self._layers, self._tables = None, {}


class _Entry(NamedTuple):
    record: Record
    config: Config  # its configuration, read and validated


CHOSEN = ("tile", "baseline")


def read_record(spec: OpSpec, record: Record, target: Target) -> tuple[tuple, Config]:
    """A record's problem and configuration, validated for the target (`OpSpec.config_error`):
    a ValueError says why the record cannot be used."""
    try:
        problem = spec.problem_from_dict(json.loads(record.problem))
    except (TypeError, ValueError) as e:
        raise ValueError(f"unreadable problem {record.problem!r} ({e})") from None
    try:
        config = json.loads(record.config)
    except (TypeError, ValueError):
        raise ValueError(f"config {record.config!r} is not JSON") from None
    if record.chosen not in CHOSEN:
        raise ValueError(f"chosen is {record.chosen!r}, expected one of {CHOSEN}")
    reason = spec.config_error(problem, config, target)
    if reason:
        raise ValueError(f"config {record.config}: {reason}")
    return problem, config


def _choice(entry: _Entry, label: str, exact: bool) -> Choice:
    record, config = entry
    return Choice(config, label, exact, record.chosen == "baseline", record)


def _override(spec: OpSpec) -> Any:
    """`TILEOPS_CONFIG`'s configuration for this operator (None: none), not yet validated."""
    text = os.environ.get("TILEOPS_CONFIG")
    if not text:
        return None
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TILEOPS_CONFIG is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("TILEOPS_CONFIG must be a JSON object (a config, or {op: config})")
    if not any(isinstance(v, dict) for v in value.values()):
        return value  # one configuration for every operator
    from ..ops import get_spec  # the catalog imports dispatch, which imports this module

    by_op = {}
    for name, config in value.items():
        if not isinstance(config, dict):
            raise ValueError(f"TILEOPS_CONFIG: {name!r} must map to a configuration object, got "
                             f"{config!r} (either {{op: config, ...}} or one bare config)")
        try:
            by_op[get_spec(name).name] = config
        except ValueError as e:
            raise ValueError(f"TILEOPS_CONFIG: {e}") from None
    return by_op.get(spec.name)


def _warn(message: str) -> None:
    warnings.warn(message, TuningDatabaseWarning, stacklevel=4)
