"""Dispatch: resolve a call's configuration, compile it once, launch it.

The Python path of a call is `spec.prepare` (validation and the problem key), one dict lookup
keyed by (operator, device, problem) and the launch; resolution and compilation happen on the
first call of each problem bucket only. Where the spec gives a recipe (`OpSpec.warm_recipe`), a
call is then handed to the native warm path (`tileops.native`), which runs later calls of the same
signature from C++. Compiled kernels are memoised in-process by (target, kernel key,
config); TileLang's disk cache (`TILELANG_CACHE_DIR`) makes a new process's first call cheap too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import autotune, native
from . import target as _target
from .db.layers import Choice, Resolver, TuningDatabaseWarning
from .spec import Config, OpSpec, canonical
from .target import Target

log = logging.getLogger("tileops")

Launcher = Callable[[tuple], torch.Tensor]


def compile_kernel(spec: OpSpec, problem: tuple, config: Config, target: Target,
                   program: Any = None) -> Any:
    """Compile (or fetch from the in-process memo) the kernel of `spec` for a configuration.

    `program` is `spec.build(problem, config, target)` made elsewhere (the tuner builds in its
    compile processes and hands the program over: building is most of a cached kernel's load).
    """
    key = (spec.name, target.key, spec.kernel_key(problem), canonical(config))
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                func = program if program is not None else spec.build(problem, config, target)
                kernel = spec.adapt(_compile(func, target, spec.fast_math), target)
                _kernels[key] = kernel
    return kernel


def _compile(func: Any, target: Target, fast_math: bool = False) -> Any:
    import tilelang

    with _quiet_tilelang():
        if target.kind == "cpu":
            # TileLang's C target compiles without optimisation by default (about 15x slower).
            return tilelang.compile(func, target="c", compile_flags=["-O3"])
        return tilelang.compile(func, target=target.tilelang(),
                                pass_configs=pass_configs(target, fast_math) or None)


class _CompileChatter(logging.Filter):
    """Drops the INFO records ("TileLang begins to compile kernel ...") TileLang logs while this
    thread compiles for tileops: TileLang's logger writes them to stdout, inside the user's
    program. They pass when the `tileops` logger is enabled for DEBUG. The filter sits on
    TileLang's handlers (a logger's own filters miss its children's records) and leaves every
    other record, and TileLang's use outside tileops, alone."""

    def __init__(self) -> None:
        super().__init__()
        self.compiling = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno > logging.INFO or not getattr(self.compiling, "on", False)
                or log.isEnabledFor(logging.DEBUG))


_CHATTER = _CompileChatter()


@contextlib.contextmanager
def _quiet_tilelang() -> Iterator[None]:
    for handler in logging.getLogger("tilelang").handlers:
        if _CHATTER not in handler.filters:
            handler.addFilter(_CHATTER)
    _CHATTER.compiling.on = True
    try:
        yield
    finally:
        _CHATTER.compiling.on = False


def pass_configs(target: Target, fast_math: bool) -> dict[Any, Any]:
    """TileLang pass configuration of a GPU compile: fast math where the operator asks for it
    (CUDA only; TileLang's other backends take no such flag)."""
    import tilelang

    return ({tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
            if fast_math and target.kind == "cuda" else {})


def lower(func: Any, target: Target, device_compile: bool = False) -> Any:
    """Generate (and with `device_compile`, compile) a program's code for a target without its
    hardware: how CI checks CUDA, HIP and Metal kernels; `.kernel_source` holds the device code."""
    import tilelang
    import tvm

    with tvm.target.Target(target.tilelang()):
        return tilelang.lower(func, target=target.tilelang(), enable_device_compile=device_compile)


class Dispatcher:
    """Maps calls to launchers; one per process (`tileops.dispatch.DISPATCHER`)."""

    def __init__(self) -> None:
        self.resolver = Resolver()
        self._launchers: dict[tuple, Launcher] = {}
        self.choices: dict[tuple, Choice] = {}  # what each (op, target, problem) resolved to
        # The native warm path (`tileops.native`): the tile kernels it may run, by launcher key,
        # and the operators it holds entries of, by their number in its table.
        self._warm_kernels: dict[tuple, Any] = {}
        self._warm_ops: dict[str, int] = {}
        self._warm_refused: set[str] = set()  # operators whose native calls failed

    def __call__(self, spec: OpSpec, *args: Any) -> torch.Tensor:
        op = self._warm_ops.get(spec.name)
        if op is not None:
            try:
                out = native.module().call(op, *args)
            except Exception as exc:
                return self._native_failed(spec, args, exc)
            if out is not None:  # a tensor, or a tvm-ffi array of them
                return out if type(out) is torch.Tensor else tuple(out)
        return self._python_path(spec, args)

    def _python_path(self, spec: OpSpec, args: tuple) -> torch.Tensor:
        call = spec.prepare(*args)
        if call.problem is None:
            return call.result
        key = (spec.name, call.device, call.problem)
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launcher(spec, call.device, call.problem)
        out = launcher(call.args)
        kernel = self._warm_kernels.get(key)
        if kernel is not None:
            self._warm_up(spec, args, call, kernel)
        return out

    def _native_failed(self, spec: OpSpec, args: tuple, exc: Exception) -> torch.Tensor:
        """A native call raised. Its signature once ran on the Python path, so run it there: if
        that raises too, the failure is the call's (a full device, a device error) and is the
        user's to see; if not, the operator's recipe does not fit its kernel, and the operator
        keeps the Python path from now on."""
        out = self._python_path(spec, args)
        if self._warm_ops.pop(spec.name, None) is not None:
            self._warm_refused.add(spec.name)
            log.warning("tileops: %s leaves the native warm path, where it failed (%s: %s); "
                        "its calls take the Python path", spec.name, type(exc).__name__, exc)
        return out

    def _warm_up(self, spec: OpSpec, args: tuple, call: Any, kernel: Any) -> None:
        """Hand a call the Python path just ran to the native warm path, where the spec says how
        its kernel runs it."""
        if spec.name in self._warm_refused:
            return
        made = spec.warm_recipe(args, call, kernel)
        if made is None:
            return
        op = self._warm_ops.get(spec.name, len(self._warm_ops))
        if native.register(op, *made, args):
            self._warm_ops[spec.name] = op

    def choice(self, spec: OpSpec, target: Target, problem: tuple) -> Choice:
        """Resolve (and remember) the configuration for a problem, without compiling."""
        key = (spec.name, target.key, problem)
        choice = self.choices.get(key)
        if choice is None:
            choice = self.resolver.resolve(spec, target, problem)
            self.choices[key] = choice
        return choice

    def runs_baseline(self, spec: OpSpec, target: Target, problem: tuple) -> bool:
        """Whether a call of `problem` runs the baseline: its record says the baseline wins and
        the spec dispatches it for this problem."""
        return (self.choice(spec, target, problem).use_baseline
                and spec.dispatches_baseline(problem, target))

    def _launcher(self, spec: OpSpec, device: torch.device, problem: tuple) -> Launcher:
        target = _target.target_of(device)
        reason = spec.unsupported_reason(target)
        if reason:
            raise NotImplementedError(reason)
        choice = self.choice(spec, target, problem)
        if choice.source == "default":
            choice = self._tuned_on_first_use(spec, target, device, problem) or choice
        if self.runs_baseline(spec, target, problem):
            launcher: Launcher = spec.launch_baseline
        else:
            kernel = self._compile_choice(spec, target, problem, choice)
            launcher = functools.partial(spec.launch, kernel)
            if native.runs(kernel):
                self._warm_kernels[(spec.name, device, problem)] = kernel
        log.debug("%s %s on %s: %s config %s", spec.name, spec.problem_label(problem),
                  target.describe(), choice.source, choice.config)
        self._launchers[(spec.name, device, problem)] = launcher
        return launcher

    def _tuned_on_first_use(self, spec: OpSpec, target: Target, device: torch.device,
                            problem: tuple) -> Choice | None:
        """The record a first-use search made (`tileops.autotune`), when it is on and ran."""
        tuning = autotune.policy()
        if tuning is None or autotune.capturing(device):
            return None
        if not autotune.tune(spec, target, device, problem, tuning):
            return None
        self.reset()  # re-read the user database, which holds the new record
        return self.choice(spec, target, problem)

    def _compile_choice(self, spec: OpSpec, target: Target, problem: tuple, choice: Choice) -> Any:
        try:
            return compile_kernel(spec, problem, choice.config, target)
        except Exception as e:
            if choice.source in ("default", "override"):
                raise
            # A database record whose config no longer builds must not break the user's call.
            warnings.warn(f"{spec.name}: configuration {choice.config} from {choice.source} "
                          f"failed to build ({type(e).__name__}: {e}); using the default",
                          TuningDatabaseWarning, stacklevel=4)
            config = spec.default_config(problem, target)
            self.choices[(spec.name, target.key, problem)] = Choice(config, "default", False)
            return compile_kernel(spec, problem, config, target)

    def reset(self) -> None:
        """Forget resolved configurations and re-read databases and overrides on the next call."""
        self.resolver.close()
        self._launchers.clear()
        self.choices.clear()
        self._warm_kernels.clear()
        self._warm_ops.clear()
        self._warm_refused.clear()
        native.clear()
        _target.clear_cache()


_lock = threading.Lock()
_kernels: dict[tuple, Any] = {}
DISPATCHER = Dispatcher()


def reset() -> None:
    """Re-read databases, `TILEOPS_*` overrides and target detection on the next call."""
    DISPATCHER.reset()
