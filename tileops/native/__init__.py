"""The native warm path: a call that matches, exactly, one the Python dispatcher already validated
and launched runs its kernel from `warm.cc`, without `prepare`, the launcher lookup or the Python
allocation of its outputs.

The module is built with tvm-ffi's C++ toolchain (the system C++ compiler, tvm-ffi's headers) once
per machine, in the background from the first call that could use it (calls take the Python path
until it is ready), and cached under `TVM_FFI_CACHE_DIR` (default `~/.cache/tvm-ffi`) by a hash
of the source, as Triton caches its launchers. Where it cannot be built (no compiler), calls
keep the Python path and the `tileops` logger says why, once.

What the Python path must hand over (`register`): the kernel, a tvm-ffi function, and the
`Recipe` of its arguments. The key of an entry is what the Python path read from the call: each
tensor's dtype, device, shape, strides and 16-byte alignment, each other argument's type and
value. Nothing else is checked on the native path, so a spec gives a recipe only where that key
decides the call (autograd, for one, must be routed before dispatch, as `tileops.gemm` does).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch

log = logging.getLogger("tileops")

# How a kernel argument is made from the call (warm.cc's `Kind`).
INPUT, INPUT_SWAPPED, OUTPUT, SCRATCH, INPUT_WORDS = 0, 1, 2, 3, 4


class Buffer(NamedTuple):
    """A buffer the native path allocates at each call: an output (`returned`) or scratch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    returned: bool = True


class Recipe(NamedTuple):
    """The kernel's arguments, in order, each (kind, index): (INPUT, i) the call's argument i,
    (INPUT_SWAPPED, i) that 2-D tensor with its dimensions swapped (`w.t()` passed as `w`),
    (INPUT_WORDS, i) that 2-D byte tensor, contiguous, read as int32 words (`.view(torch.int32)`),
    (OUTPUT, j) or (SCRATCH, j) buffer j. The returned buffers come back in order: one alone,
    several as a tuple."""

    args: tuple[tuple[int, int], ...]
    buffers: tuple[Buffer, ...]


_SOURCE = Path(__file__).with_name("warm.cc")
_lock = threading.Lock()
_module: Any = None
_building: threading.Thread | None = None
_unavailable = False


def _build() -> None:
    global _module, _unavailable
    try:
        import tvm_ffi.cpp

        _module = tvm_ffi.cpp.load("tileops_warm", cpp_files=[str(_SOURCE)])
    except Exception as exc:  # a missing compiler or headers: keep the Python path
        _unavailable = True
        log.warning("tileops: the native warm path is unavailable (%s); calls take the Python "
                    "path", str(exc).strip().splitlines()[-1][:200])


def module(wait: bool = True) -> Any:
    """The built module, or None where it cannot be built. The first use starts the build (a
    few seconds, once per machine); without `wait`, None until it is done: calls meanwhile take
    the Python path, as if the module were not there."""
    global _building
    if _module is not None or _unavailable:
        return _module
    with _lock:
        if _building is None:
            _building = threading.Thread(target=_build, name="tileops-native-build", daemon=True)
            _building.start()
    if wait:
        _building.join()
    return _module


def runs(kernel: Any) -> bool:
    """Whether the native path can call a compiled kernel as `launch` gets it: a tvm-ffi function
    (CUDA kernels' entry functions), bare or inside an adapter that keeps it as `.kernel` and
    adds buffers (`ops.host.WorkspaceAdapter`). TileLang's other execution backends (the CPU's)
    are not."""
    import tvm_ffi

    return isinstance(getattr(kernel, "kernel", kernel), tvm_ffi.Function)


def register(op: int, kernel: Any, recipe: Recipe, args: tuple) -> bool:
    """Remember that calls like `args` to operator number `op` run `kernel` by `recipe`; False
    while the module is being built, or where it cannot be."""
    mod = module(wait=False)
    if mod is None:
        return False
    header: list[Any] = [len(recipe.args)]
    for kind, index in recipe.args:
        header += [kind, index]
    header.append(len(recipe.buffers))
    for buf in recipe.buffers:
        header += [buf.dtype, int(buf.returned), len(buf.shape), *buf.shape]
    return bool(mod.register_call(op, kernel, len(header), *header, *args))


def clear() -> None:
    """Forget every entry (the dispatcher's configurations changed)."""
    if _module is not None:
        _module.clear()
