"""Workload suites and other sources of problems to tune.

A suite is `configs/suites/NAME.toml`, for any operator:

    op = "NAME"                      # the operator (tileops.ops.SPECS)
    description = "..."
    dtypes = ["bfloat16", "float16"] # each problem text is made once per dtype
    problems = ["TEXT", ...]         # in the operator's own syntax (what --shape takes)

    [[groups]]                       # texts with {placeholders}, expanded over the lists beside
    problems = ["{M}x4096:{L}"]      # them (their product); a group may set its own dtypes
    M = [1, 16, 64]
    L = "nk"

    [[tables]]                       # problems given by their key fields (spec.problem_from_dict);
    FIELD = [1, 64]                  # every field must be given, lists expand as a product
    OTHER_FIELD = "value"

Problems are parsed by the operator's spec (`spec.parse_problem(text, dtype)`), so bucketing and
defaults are the spec's. A suite's `problems` are the keys the tuner tunes; its `cases` are the
problems as the suite names them (`spec.parse_exact`: a length of 3000 stays 3000 where its key
holds the bucket, 4096), what benchmarks run; a table's case is its problem. A problems file
holds one problem per line in the same syntax, optionally followed by a dtype; `#` starts a
comment.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tileops.ops import get_spec
from tileops.resources import data_dir
from tileops.spec import OpSpec

from .errors import UsageError

_PLACEHOLDER = re.compile(r"{(\w+)}")


@dataclass(frozen=True)
class Suite:
    name: str
    op: str
    description: str
    problems: list[tuple]  # the keys to tune (bucketed), deduplicated
    cases: list[tuple]  # the exact problems to benchmark, deduplicated


def suites_dir() -> Path:
    return data_dir("configs") / "suites"


def available() -> list[str]:
    try:
        return sorted(p.stem for p in suites_dir().glob("*.toml"))
    except FileNotFoundError:
        return []


def load(name: str, dtypes: list[str] | None = None) -> Suite:
    """A suite by name (or path to a .toml); `dtypes` restricts the dtypes of its problem texts."""
    path = Path(name) if name.endswith(".toml") else suites_dir() / f"{name}.toml"
    if not path.is_file():
        raise UsageError(f"unknown suite {name!r}; available: {', '.join(available()) or 'none'}")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read suite {path}: {e}") from None
    if "op" not in data:
        raise UsageError(f"suite {path}: no 'op' (the operator it is for)")
    spec = named_spec(data["op"])
    pairs = list(_suite_problems(spec, data, path, dtypes))
    return Suite(path.stem, spec.name, str(data.get("description", "")),
                 _dedupe(key for _, key in pairs), _dedupe(exact for exact, _ in pairs))


def _suite_problems(spec: OpSpec, data: dict[str, Any], path: Path,
                    only: list[str] | None) -> Iterable[tuple[tuple, tuple]]:
    """(exact problem, key) of each problem of the suite, in order."""
    def dtypes_of(table: dict[str, Any]) -> list[str]:
        listed = list(table.get("dtypes", data.get("dtypes", [])))
        if not listed:
            raise UsageError(f"suite {path}: problem texts need 'dtypes'")
        return [d for d in listed if only is None or d in only]

    for text in data.get("problems", []):
        for dtype in dtypes_of(data):
            yield _case(spec, text, dtype, where=str(path))
    for group in data.get("groups", []):
        names = {k: v if isinstance(v, list) else [v] for k, v in group.items()
                 if k not in ("problems", "dtypes")}
        for values in itertools.product(*names.values()):
            fill = dict(zip(names, values, strict=True))
            for text in group.get("problems", []):
                for dtype in dtypes_of(group):
                    yield _case(spec, _fill(text, fill, path), dtype, where=str(path))
    for table in data.get("tables", []):
        yield from ((p, p) for p in _table_problems(spec, table, path, only))


def _fill(text: str, values: dict[str, Any], path: Path) -> str:
    def sub(match: re.Match[str]) -> str:
        if match.group(1) not in values:
            raise UsageError(f"suite {path}: no values for {{{match.group(1)}}} in {text!r}")
        return str(values[match.group(1)])

    return _PLACEHOLDER.sub(sub, text)


def _table_problems(spec: OpSpec, table: dict[str, Any], path: Path,
                    only: list[str] | None) -> Iterable[tuple]:
    fields = spec.Problem._fields
    missing = [f for f in fields if f not in table]
    unknown = [k for k in table if k not in fields]
    if missing or unknown:
        raise UsageError(f"suite {path}: a table must give exactly the fields {', '.join(fields)}"
                         f" (missing {missing}, unknown {unknown})")
    lists = [table[f] if isinstance(table[f], list) else [table[f]] for f in fields]
    for values in itertools.product(*lists):
        fields_of = dict(zip(fields, values, strict=True))
        if only is None or fields_of.get("dtype", only[0] if only else None) in only:
            try:
                yield spec.problem_from_dict(fields_of)
            except ValueError as e:
                raise UsageError(f"suite {path}: {e}") from None


def read_problems_file(spec: OpSpec, path: str, dtypes: list[str]) -> list[tuple]:
    """Problems from a file: one per line (`TEXT [DTYPE]`), `#` comments."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read problems file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"problems file {path} is not text (UTF-8)") from None
    problems = []
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise UsageError(f"{path}:{n}: expected 'PROBLEM [DTYPE]', got {line.strip()!r}")
        for dtype in words[1:] or dtypes:
            problems.append(parse(spec, words[0], dtype, where=f"{path}:{n}"))
    return _dedupe(problems)


def from_shapes(spec: OpSpec, shapes: list[str], dtypes: list[str]) -> list[tuple]:
    return _dedupe(parse(spec, s, d, where="--shape") for s in shapes for d in dtypes)


def parse(spec: OpSpec, text: str, dtype: str, where: str) -> tuple:
    """The key of a problem text (what `spec.parse_problem` gives)."""
    return _case(spec, text, dtype, where)[1]


def _case(spec: OpSpec, text: str, dtype: str, where: str) -> tuple[tuple, tuple]:
    """(exact problem, key) of a problem text."""
    try:
        exact = spec.parse_exact(text, dtype)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None
    return exact, spec.bucket(exact)


def named_spec(name: str) -> OpSpec:
    """The operator named on the command line or in a suite (a UsageError if there is none)."""
    try:
        return get_spec(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def suite_spec(suite: Suite, op: str | None = None) -> OpSpec:
    """The spec that runs a suite's problems: the suite's operator, or `op`, another spec of the
    same problems (attention_backward for the attention suite, mxfp4_gemm_packed for MXFP4's);
    a UsageError for one whose problems differ."""
    spec = named_spec(op or suite.op)
    if spec.Problem is not named_spec(suite.op).Problem:
        raise UsageError(f"suite {suite.name!r} holds {suite.op} problems; {spec.name} takes "
                         "others")
    return spec


def select(spec: OpSpec, problems: list[tuple], where: str) -> list[tuple]:
    """The problems whose FIELD is one of the values of `where`, "FIELD=V1,V2" (a UsageError
    for a field the spec's problems lack)."""
    field, _, values = where.partition("=")
    if field not in spec.Problem._fields:
        raise UsageError(f"--where: {spec.name} problems have no field {field!r}")
    keep = set(values.split(","))
    return [p for p in problems if str(getattr(p, field)) in keep]


def _dedupe(problems: Iterable[tuple]) -> list[tuple]:
    return list(dict.fromkeys(problems))
