"""The operator spec: one declarative record per operator that every layer reads.

The dispatcher, the tuner, the tests and the benchmarks take an `OpSpec` and never name an operator.
A spec says what a problem is (the key tuning records are stored under, with run-time-varying sizes
bucketed), where its configuration space lives (`configs/<op>.toml`, one table per target kind),
the default for any problem, how to build its kernels, how to make inputs for a problem, the
reference and the baseline, and the FLOP/byte model for roofline figures.

How each target kind's kernels are made is declared, not branched on: a spec's `backends` holds
one `Backend` record per kind it serves (its tile program, calling convention, constraint check
and problem-dependent default), and a constant default sits beside the kind's space in
`configs/<op>.toml` (e.g. `[hip.default]`). `OpSpec.build`, `adapt`, `check_config` and
`default_config` read them, so a new target is a new record rather than a branch in each method.
"""

from __future__ import annotations

import abc
import ast
import functools
import hashlib
import importlib
import inspect
import io
import itertools
import json
import math
import tokenize
import tomllib
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .resources import data_dir
from .target import Target

Config = dict[str, Any]


def canonical(value: Any) -> str:
    """The canonical JSON text that problems and configs are stored, keyed and compared as."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def space_hash(space: dict[str, list[Any]]) -> str:
    """Hash of a search space: what tuning records and studies say they searched."""
    return hashlib.sha256(json.dumps(space, sort_keys=True).encode()).hexdigest()[:16]
Position = tuple[int, int]  # (row, column) in source, as tokenize gives them


def pow2_bucket(n: int) -> int:
    """The bucket of a run-time size: the next power of two at or above it (1, 2, 4, ... )."""
    return 1 << (n - 1).bit_length()


def check_scale(scale: Any, who: str) -> float:
    """A softmax scale given by the caller, as a float: a finite real number (a NaN or infinite
    scale would turn every score into NaN)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{who}: softmax_scale must be a number, got {type(scale).__name__} "
                        f"{scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"{who}: softmax_scale must be finite, got {scale}")
    return float(scale)


def refuse_grad(who: str, **tensors: torch.Tensor) -> None:
    """Raise for an input that requires grad under grad mode: the operators have no backward
    yet, and a result cut off from the graph would drop its gradients silently."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(f"{who} has no backward: {name} requires grad; call it under "
                               "torch.no_grad() or torch.inference_mode(), or pass "
                               f"{name}.detach()")


class Call(NamedTuple):
    """A validated call: where it runs, its problem key and the arguments the kernel launch
    takes; or, its problem None, a call with nothing to compute (an empty operand, as torch
    allows) and its `result`, made without a kernel (`empty_call`)."""

    device: torch.device
    problem: tuple | None
    args: tuple
    result: Any = None


def empty_call(device: torch.device, result: Any) -> Call:
    """The call of an operator on an empty operand: `result` is what torch's own operation
    returns there (empty tensors, or zeros where the reduction is over nothing)."""
    return Call(device, None, (), result)


Space = dict[str, list[Any]]


def _unchanged(kernel: Any) -> Any:
    return kernel


@dataclass(frozen=True)
class Backend:
    """How an operator's kernels are made for one target kind, as one declarative record (as
    TileLang's backend manifests are), so that the spec's methods need no per-kind branches.

    `program` builds the tile program: `program(*spec.program_args(problem), **config,
    **derived(problem, config, target))`. `adapt` wraps the compiled kernel into what the spec's
    `launch` calls. `check` says why a configuration cannot work on the target (None: no
    constraint beyond the space). `default` is the kind's problem-dependent default, given the
    target's space; a kind whose default is constant declares it in `configs/<op>.toml` instead
    (`[<kind>.default]`), and exactly one of the two exists.
    """

    program: Callable[..., Any]
    adapt: Callable[[Any], Callable] = _unchanged
    check: Callable[[tuple, Config, Target], str | None] | None = None
    default: Callable[[tuple, Target, Space], Config] | None = None
    derived: Callable[[tuple, Config, Target], Config] | None = None


class OpSpec(abc.ABC):
    """Everything the library knows about one operator.

    Subclasses set the class attributes and implement the abstract methods; `Problem` is a
    NamedTuple whose fields are the problem key. Fields named in `bucketed` hold bucket values
    (the largest size of the bucket); the compiled kernel is dynamic in the fields of `dynamic`
    (default: the bucketed ones), which its `kernel_key` leaves out.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()  # other names the command line and lookups accept
    function: ClassVar[str]  # the public call, e.g. "tileops.gemm(a, b, *, out_dtype=None)"
    problem_syntax: ClassVar[str]  # what `parse_problem` reads, e.g. "MxNxK[:kn|:nk]"
    dtypes: ClassVar[dict[str, tuple[str, ...]]]  # input dtypes by device type ("cuda", "cpu")
    Problem: ClassVar[type]
    bucketed: ClassVar[tuple[str, ...]] = ()
    dynamic: ClassVar[tuple[str, ...] | None] = None  # None: the `bucketed` fields
    categorical: ClassVar[tuple[str, ...]] = ()  # problem fields that must match exactly
    # A problem with no record of its own borrows the configuration and verdict of the nearest
    # recorded one only within this `distance` (1.0: a factor of two in one size); further away
    # the tiles were chosen for another regime (decode tiles for a prefill, say), and the call
    # runs the baseline (`db.layers`).
    nearest_within: ClassVar[float] = 1.0
    baseline_name: ClassVar[str]
    # Targets with no kernel, and why: a kind ("metal") or a kind and an arch prefix ("hip:gfx11",
    # where TileLang lowers for some archs of a kind and not others). Kinds with no table in
    # configs/<op>.toml, or no entry in `backends`, have none either.
    unsupported: ClassVar[dict[str, str]] = {}
    backends: ClassVar[dict[str, Backend]]  # by target kind

    # ---- problems -------------------------------------------------------------------------------
    @abc.abstractmethod
    def prepare(self, *args: Any, **kwargs: Any) -> Call:
        """Validate a user call (clear TypeError/ValueError) and derive its problem key."""

    def serving_args(self, inputs: tuple) -> tuple:
        """The positional arguments of `prepare` (and the dispatcher) a serving engine passes for
        `inputs` (`make_inputs`' tensors), what it computes once per step rather than per call
        (MLA's scheduler metadata) computed here: benchmarks time the call as such an engine
        makes it, with that work outside the timed region."""
        return inputs

    def warm_recipe(self, args: tuple, call: Call, kernel: Any) -> tuple[Any, Any] | None:
        """How the native warm path (`tileops.native`) runs calls like `args`, which `prepare`
        made into `call` and `kernel` (as `launch` gets it) just ran: the tvm-ffi function and
        its `native.Recipe`, or None to keep such calls on the Python path (the default).
        `launch` and the recipe must agree: the GPU tests compare the two paths."""
        return None

    def dispatches_baseline(self, problem: tuple, target: Target) -> bool:
        """Whether dispatch runs the baseline where a record says it wins. False where a call
        would pay for what the baseline's timing made once (an MXFP4 weight's dense form, the
        repeated K/V heads of grouped chunked-prefill attention): the record's best tile kernel,
        timed beside it, serves instead."""
        return True

    def parse_problem(self, text: str, dtype: str) -> tuple:
        """Parse a problem from the command line (e.g. `4096x4096x4096` for GEMM): its key, the
        problem tuned and dispatched for it."""
        return self.bucket(self.parse_exact(text, dtype))

    @abc.abstractmethod
    def parse_exact(self, text: str, dtype: str) -> tuple:
        """Parse a problem text with its sizes as written: a problem whose bucketed fields hold
        the exact sizes (`make_inputs`, `flops` and `bytes_moved` read them as such), which
        benchmarks run where the tuner tunes its bucket."""

    def bucket(self, problem: tuple) -> tuple:
        """The key of an exact problem (`parse_exact`'s): each `bucketed` field's `pow2_bucket`,
        the one rule `parse_problem` buckets by; a key is its own bucket."""
        return problem._replace(**{f: pow2_bucket(getattr(problem, f)) for f in self.bucketed})

    def problem_dict(self, problem: tuple) -> dict[str, Any]:
        return dict(zip(self.Problem._fields, problem, strict=True))

    def problem_from_dict(self, d: dict[str, Any]) -> tuple:
        """A problem from its fields (a database record, a suite table); a ValueError says which
        field is missing or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError(f"a {self.name} problem must be an object of its fields, got {d!r}")
        for field, kind in _field_types(self.Problem).items():
            if field not in d:
                raise ValueError(f"{self.name} problem {d}: no field {field!r}")
            if type(d[field]) is not kind:  # exact: True is not an int size, 16 not a dtype
                raise ValueError(f"{self.name} problem field {field} = {d[field]!r}: expected "
                                 f"{kind.__name__}")
        return self.Problem(**{f: d[f] for f in self.Problem._fields})

    def problem_label(self, problem: tuple) -> str:
        return " ".join(f"{k}={v}" for k, v in self.problem_dict(problem).items())

    def distance(self, a: tuple, b: tuple) -> float | None:
        """How far apart two problems are (None: not comparable): sum of |log2| size ratios."""
        total = 0.0
        for field, x, y in zip(self.Problem._fields, a, b, strict=True):
            if field in self.categorical:
                if x != y:
                    return None
            else:
                total += abs(math.log2(max(x, 1) / max(y, 1)))
        return total

    # ---- configuration space --------------------------------------------------------------------
    def unsupported_reason(self, target: Target) -> str | None:
        """Why this operator has no kernel for the target's kind (None: it has one)."""
        try:
            self.space(target)
        except (ValueError, FileNotFoundError) as e:
            return str(e)
        return None

    def space(self, target: Target) -> Space:
        """The search space for a target kind, read from `configs/<op>.toml` (its `default`
        table, if any, is not part of it). A ValueError says why the target has none."""
        for key, reason in self.unsupported.items():
            kind, _, arch = key.partition(":")
            if kind == target.kind and target.arch.startswith(arch):
                where = f"{kind} {target.arch}" if arch else kind
                raise ValueError(f"{self.name} is not available on {where}: {reason}")
        spaces = _spaces(self.name)
        if target.kind not in spaces:
            raise ValueError(f"{self.name} has no kernel for {target.kind} targets yet "
                             f"(configs/{self.name}.toml has no [{target.kind}] space)")
        self.backend(target)
        return {k: list(v) for k, v in spaces[target.kind].items()}

    def backend(self, target: Target) -> Backend:
        """The record of how kernels are made for the target's kind (a ValueError: none)."""
        backend = self.backends.get(target.kind)
        if backend is None:
            raise ValueError(f"{self.name} has no kernel for {target.kind} targets yet (its "
                             f"spec declares no {target.kind} backend)")
        return backend

    def space_hash(self, target: Target) -> str:
        return space_hash(self.space(target))

    def configs(self, problem: tuple, target: Target,
                space: Space | None = None) -> Iterator[Config]:
        """Every point of the grid (of the target's space, or of `space`) that passes
        `check_config`."""
        space = self.space(target) if space is None else space
        keys = list(space)
        for values in itertools.product(*(space[k] for k in keys)):
            config = dict(zip(keys, values, strict=True))
            if self.check_config(problem, config, target) is None:
                yield config

    def default_config(self, problem: tuple, target: Target) -> Config:
        """A configuration that is valid for any problem on the target: the backend's heuristic
        where the default depends on the problem, else the constant `[<kind>.default]` table of
        `configs/<op>.toml`."""
        heuristic = self.backend(target).default
        if heuristic is not None:
            return heuristic(problem, target, self.space(target))
        fixed = _defaults(self.name).get(target.kind)
        if fixed is None:
            raise ValueError(f"{self.name} has no default for {target.kind} targets: neither "
                             f"its {target.kind} backend nor configs/{self.name}.toml "
                             f"([{target.kind}.default]) declares one")
        return dict(fixed)

    def check_config(self, problem: tuple, config: Config, target: Target) -> str | None:
        """Why a configuration cannot work for this problem and target (None: it can), as the
        target's backend checks it."""
        check = self.backend(target).check
        return check(problem, config, target) if check is not None else None

    def config_error(self, problem: tuple, config: Any, target: Target, *,
                     within_space: bool = False) -> str | None:
        """Why a configuration that did not come from the search (a database record,
        `TILEOPS_CONFIG`) must not be built (None: it may), checked before `check_config`, which
        assumes well-formed values: it must set exactly the space's parameters; an integer
        parameter takes an integer, at least 1 (0 where the space has 0) and, `within_space`,
        at most the space's largest value (tiles beyond it can overflow the CPU stack); any other
        parameter one of the space's values."""
        if not isinstance(config, dict):
            return f"a configuration must be an object, got {config!r}"
        space = self.space(target)
        if set(config) != set(space):
            return f"must set exactly {sorted(space)}; got {sorted(config)}"
        for name, allowed in space.items():
            reason = _value_error(config[name], allowed, within_space)
            if reason:
                return f"{name} = {config[name]!r}: {reason}"
        reason = self.check_config(problem, config, target)
        return f"refused by check_config: {reason}" if reason else None

    # ---- kernels --------------------------------------------------------------------------------
    def build(self, problem: tuple, config: Config, target: Target) -> Any:
        """The TileLang program (a PrimFunc) for a problem and configuration, from the target's
        backend."""
        backend = self.backend(target)
        derived = backend.derived(problem, config, target) if backend.derived else {}
        return backend.program(*self.program_args(problem), **config, **derived)

    def program_args(self, problem: tuple) -> tuple:
        """The positional arguments of the tile programs: the kernel key, which is what a
        compiled kernel is specialised to."""
        return self.kernel_key(problem)

    def kernel_key(self, problem: tuple) -> tuple:
        """The part of a problem a compiled kernel is specialised to (its `dynamic` fields
        dropped)."""
        dynamic = self.bucketed if self.dynamic is None else self.dynamic
        return tuple(v for f, v in zip(self.Problem._fields, problem, strict=True)
                     if f not in dynamic)

    def adapt(self, kernel: Any, target: Target) -> Callable:
        """Wrap a freshly compiled kernel into what `launch` calls (the target's calling
        convention)."""
        return self.backend(target).adapt(kernel)

    @abc.abstractmethod
    def launch(self, kernel: Callable, args: tuple, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Run a compiled kernel on the arguments `prepare` produced; return the output.

        `out`, when given, is the output buffer to write (shaped like `launch_baseline`'s result);
        the tuner passes a NaN-filled one so that elements a kernel never writes fail its check.
        """

    @abc.abstractmethod
    def launch_baseline(self, args: tuple) -> torch.Tensor:
        """Run the baseline (the vendor library path) on the same arguments."""

    def reported_beside(self, args: tuple) -> dict[str, Callable[[], Any]]:
        """Other library paths that benchmarks time and report beside the baseline (never
        dispatched to), by name: each a call running on these arguments."""
        return {}

    def kernel_hash(self) -> str:
        """Hash of the code of the kernel builders and of the shared helpers they import: records
        made for other kernels are stale. Comments, docstrings and layout do not count, and
        host-side code (this spec, `ops/host.py`) is outside it."""
        return _module_hash(type(self).kernel_module)

    kernel_module: ClassVar[str]  # dotted module holding the tile programs

    @property
    def fast_math(self) -> bool:
        """Whether the kernels compile with fast math (CUDA: exp2 as one `ex2.approx`, division
        approximate), as the kernel module's `FAST_MATH` says: a choice of the kernels' code,
        so it lives there and the kernel hash covers it."""
        return bool(getattr(importlib.import_module(type(self).kernel_module), "FAST_MATH", False))

    # ---- inputs, reference, roofline ------------------------------------------------------------
    @abc.abstractmethod
    def make_inputs(self, problem: tuple, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        """Fresh random user-level inputs (as passed to the public function) for a problem.

        `sizes` gives concrete values for bucketed fields (default: the bucket's largest size).
        """

    @abc.abstractmethod
    def reference(self, inputs: tuple) -> torch.Tensor:
        """The exact result in float64, computed with torch on upcast inputs."""

    @abc.abstractmethod
    def flops(self, problem: tuple) -> float: ...

    @abc.abstractmethod
    def bytes_moved(self, problem: tuple) -> float:
        """The fewest bytes a kernel must move through device memory."""

    def tolerance(self, problem: tuple) -> float:
        """Largest accepted relative error ||out - ref|| / ||ref||."""
        return 1e-2

    def check_sizes(self, problem: tuple) -> list[dict[str, int]]:
        """Sizes of the bucketed fields at which the tuner checks a candidate against the
        reference (each a `make_inputs` `sizes`): the bucket's largest ({}) and just above half
        of it, where tiles run past the edge. A configuration must be right at every size of its
        bucket; operators whose bucketed sizes interact add the combinations that exercise it."""
        fields = self.problem_dict(problem)
        inner = {f: fields[f] // 2 + 1 for f in self.bucketed if fields[f] > 2}
        return [{}, inner] if inner else [{}]


def _value_error(value: Any, allowed: list[Any], within_space: bool) -> str | None:
    """Why one parameter value is unusable (see `OpSpec.config_error`)."""
    if not all(type(v) is int for v in allowed):
        return None if value in allowed else f"expected one of {allowed}"
    if type(value) is not int:
        return "expected an integer"
    low = min(min(allowed), 1)
    if value < low:
        return f"must be >= {low}"
    if within_space and value > max(allowed):
        return f"must be <= {max(allowed)}, the largest value of the space"
    return None


@functools.cache
def _field_types(problem: type) -> dict[str, type]:
    return typing.get_type_hints(problem)


DEFAULT = "default"  # the table of a kind's constant default, beside its space's lists


@functools.cache
def _tables(op: str) -> dict[str, dict[str, Any]]:
    with open(data_dir("configs") / f"{op}.toml", "rb") as f:
        return tomllib.load(f)


@functools.cache
def _spaces(op: str) -> dict[str, dict[str, Any]]:
    """The search spaces of configs/<op>.toml by kind: each table's lists, without its default."""
    return {kind: {k: v for k, v in table.items() if k != DEFAULT}
            for kind, table in _tables(op).items()}


@functools.cache
def _defaults(op: str) -> dict[str, Config]:
    """The constant defaults of configs/<op>.toml, by kind (`[<kind>.default]`)."""
    return {kind: table[DEFAULT] for kind, table in _tables(op).items() if DEFAULT in table}


@functools.cache
def _module_hash(module: str) -> str:
    """Hash of the code of a kernel module and of every tileops module it imports, transitively,
    in name order: a change to a helper stales the records of the operators that use it. Only
    code counts (`code_tokens`): editing a comment or docstring keeps the records."""
    tokens = [code_tokens(inspect.getsource(importlib.import_module(m)))
              for m in (module, *sorted(_tileops_imports(module)))]
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def code_tokens(source: str) -> list[str]:
    """The tokens of Python source that make it behave: comments, docstrings (of the module, its
    classes and functions), blank lines and line breaks inside brackets dropped, indentation kept
    as structure only (INDENT/DEDENT, not its width). Each token is its type and text, so that
    whitespace edits give the same list; the list is the same on Pythons 3.11 to 3.13."""
    lines = io.StringIO(source).readlines()
    docstrings = _docstring_spans(source, lines)
    out: list[str] = []
    after_docstring = False  # a docstring's NEWLINE goes with it
    for kind, text, start, end in _whole_fstrings(tokenize.generate_tokens(iter(lines).__next__),
                                                  lines):
        if kind in ("COMMENT", "NL", "ENDMARKER"):
            continue
        if any(first <= start and end <= last for first, last in docstrings):
            after_docstring = True
            continue
        if kind == "NEWLINE" and after_docstring:
            after_docstring = False
            continue
        after_docstring = False
        out.append(kind if kind in ("NEWLINE", "INDENT", "DEDENT") else f"{kind} {text}")
    return out


def _whole_fstrings(tokens: Iterator[tokenize.TokenInfo], lines: list[str]
                    ) -> Iterator[tuple[str, str, Position, Position]]:
    """(type name, text, start, end) of each token, an f-string as one STRING token: Python 3.12
    splits f-strings into parts (FSTRING_START ... FSTRING_END), earlier versions do not."""
    depth, start = 0, (0, 0)
    for tok in tokens:
        kind = tokenize.tok_name[tok.type]
        if kind == "FSTRING_START":
            depth += 1
            start = tok.start if depth == 1 else start
        elif kind == "FSTRING_END":
            depth -= 1
            if not depth:
                yield "STRING", _text(lines, start, tok.end), start, tok.end
        elif not depth:
            yield kind, tok.string, tok.start, tok.end


def _docstring_spans(source: str, lines: list[str]) -> list[tuple[Position, Position]]:
    """(start, end) token positions of the docstrings of a module, its classes and functions."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            spans.append((_position(lines, first.lineno, first.col_offset),
                          _position(lines, first.end_lineno, first.end_col_offset)))
    return spans


def _position(lines: list[str], row: int, byte_col: int) -> Position:
    """A tokenize position (characters) from an ast one (UTF-8 bytes)."""
    return row, len(lines[row - 1].encode()[:byte_col].decode())


def _text(lines: list[str], start: Position, end: Position) -> str:
    """The source between two tokenize positions."""
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return lines[r0 - 1][c0:c1]
    return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]


def _tileops_imports(module: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The tileops modules `module` imports (absolute names), and theirs."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(inspect.getsource(importlib.import_module(module)))):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue  # kernel modules reach their helpers by relative imports
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        names = [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}"
                                                                  for a in node.names]
        found.update(n for n in names if n not in seen and _is_module(n))
    for dep in list(found):
        found |= _tileops_imports(dep, seen | found | {module})
    return found


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
