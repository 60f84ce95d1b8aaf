"""Host-side helpers of the specs: dtype tables, shared-memory limits, the checks and defaults of
the decode knobs of `gpu_tiles` (swap_ab, split_k), and the calling conventions of compiled
programs (CPU bf16 tensors as their bits, GPU workspaces).

Kept apart from `common`, whose code is part of every kernel's hash: changing how a kernel is
called or which configurations are tried does not change the kernels, so it must not make tuning
records stale. No kernel module imports this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from .. import autotune

V = TypeVar("V")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Shared memory (LDS on AMD, threadgroup memory on Apple) one thread block may use, by arch (bytes).
SMEM_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
              "gfx950": 160 * 1024, "apple": 32 * 1024}


class Once(Generic[V]):
    """What a baseline derives from one call's arguments (a copy, a forward), made on its first
    run and kept: a benchmark times the baseline again and again on one call's arguments, so it
    times the baseline's kernels alone."""

    __slots__ = ("_made", "_value")

    def __init__(self) -> None:
        self._made, self._value = False, None

    def get(self, make: Callable[[], V]) -> V:
        if not self._made:
            self._value, self._made = make(), True
        return self._value


def index_to(device: torch.device, who: str, **tensors: torch.Tensor) -> list[torch.Tensor]:
    """Index tensors (offsets, lengths, page tables) for a call on `device`, which a caller may
    give on the host: there they are checked with no read back from the GPU, and copied over
    without waiting for it (a pinned buffer through a copy of its own first, since its
    asynchronous copy would read whatever the caller writes into it next). Under CUDA-graph
    capture a copy from the host cannot be recorded, so there they must be on the device."""
    out = []
    for name, t in tensors.items():
        if t.device != device:
            if autotune.capturing(device):
                raise RuntimeError(f"{who}: {name} is on the host; inside CUDA-graph capture "
                                   f"pass it on {device} (a copy from the host cannot be "
                                   "captured)")
            t = (t.clone() if t.is_pinned() else t).to(device, non_blocking=True)
        out.append(t)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16, and a readable name for dtypes outside the table."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def smem_limit(arch: str) -> int:
    """Shared memory (bytes) one thread block may use on an arch (`sm_90a`, `gfx942`, `apple`)."""
    if arch.startswith("sm_"):
        return SMEM_LIMIT.get(arch.rstrip("a"), 99 * 1024)
    return SMEM_LIMIT.get(arch, 64 * 1024)  # 64 KiB of LDS on CDNA and RDNA


class BitsAdapter:
    """Calls a CPU kernel with bf16 tensors viewed as their uint16 bit patterns."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.kernel(*(t.view(torch.uint16) if t.dtype is torch.bfloat16 else t for t in tensors))


def check_decode_knobs(M: int, K: int, config: dict, arch: str, min_block_M: int,
                       few_tiles: bool = False) -> str | None:
    """Why a CUDA configuration's `swap_ab` / `split_k` (see `gpu_tiles`) cannot run, or None.

    `min_block_M` is the smallest useful unswapped token tile (64 where only wgmma serves it);
    a token tile larger than the problem's M bucket needs is pruned, as it only adds padding.
    `few_tiles`: the output tiles fill under half the SMs, where K splits at any M.
    """
    bm, bn, bk, threads = config["block_M"], config["block_N"], config["block_K"], config["threads"]
    split, swap = config.get("split_k", 1), config.get("swap_ab", 0)
    if swap and arch.startswith("sm_90") and bn % (64 * (threads // 128)):
        return f"wgmma needs block_N (swap_ab) a multiple of 64 per warpgroup ({threads // 128})"
    if swap and not arch.startswith("sm_90") and not _mma_warp_layout(bn, bm, threads // 32):
        return f"no layout of {threads // 32} mma warps covers the swapped {bn}x{bm} tile"
    if swap and bm * bn * 4 > smem_limit(arch):  # the transposing epilogue tile (fp32)
        return f"swap_ab epilogue tile {bm * bn * 4 // 1024} KiB > {smem_limit(arch) // 1024} KiB"
    if bm > max(M, 16 if swap else min_block_M):
        return f"block_M {bm} is more rows than M <= {M} needs"
    if swap and bm < 16 and bm < M:  # a second token tile would stream the weight again
        return f"block_M {bm} below 16 only where M <= {bm} (M = {M})"
    if split > 1:
        k_steps = -(-K // bk)
        if M > 256 and not few_tiles:
            return "split_k is for M <= 256 or tiles filling under half the SMs"
        if k_steps % split or k_steps // split < 2:
            return f"split_k {split} does not divide {k_steps} K steps into >= 2 each"
    return None


def _mma_warp_layout(rows: int, cols: int, warps: int) -> bool:
    """Whether `warps` tile a rows x cols mma tile in whole 16x8 blocks each (the warp partition
    TileLang's T.gemm needs below sm_90)."""
    return any(warps % m == 0 and rows % (16 * m) == 0 and cols % (8 * (warps // m)) == 0
               for m in range(1, warps + 1))


def decode_split_k(N: int, K: int, block_N: int, block_K: int, units: int,
                   powers_of_two: bool = True) -> int:
    """K splits for a decode GEMM: the fewest that give two CTAs per SM, each still walking >= 4
    K steps (the weight is read once either way; more splits only add partials to sum). Powers
    of two, or any divisor of the K steps (45 steps of gpt-oss's K = 2880 split by 3)."""
    tiles, k_steps = -(-N // block_N), -(-K // block_K)
    splits = [s for s in range(1, k_steps + 1) if k_steps % s == 0 and k_steps // s >= 4
              and not (powers_of_two and s & (s - 1))] or [1]
    return next((s for s in splits if tiles * s >= 2 * units), splits[-1])


def units(problem: tuple, config: dict, target: Any) -> dict[str, int]:
    """`Backend.derived` of the persistent programs: the target's SM count, their CTA count.
    (A named function: tuning jobs pickle the spec, and a lambda does not pickle.)"""
    return {"units": target.units}


# Program parameters that are scratch space, allocated by `WorkspaceAdapter` at each call;
# those in ZEROED start at zero (stream-K's flags), the others uninitialised.
WORKSPACES = ("partials", "dequantized", "flags")
ZEROED = ("flags",)

Workspace = tuple[tuple[int | None, ...], torch.dtype, bool]  # shape (None: M), dtype, zeroed


class WorkspaceAdapter:
    """Calls a program whose trailing parameters are workspaces (`WORKSPACES`), allocating them
    at each call. A workspace dimension that is not a constant is M, the dynamic size of these
    programs: the rows of the first argument."""

    def __init__(self, kernel: Any, shapes: list[Workspace]):
        self.kernel, self.shapes = kernel, shapes

    def __call__(self, *args: torch.Tensor) -> None:
        a = args[0]
        rows = a.shape[0]
        self.kernel(*args, *((torch.zeros if zeroed else torch.empty)(
            *[rows if d is None else d for d in shape], dtype=dtype, device=a.device)
            for shape, dtype, zeroed in self.shapes))


def warm_kernel(kernel: Any, rows: int) -> tuple[Any, list] | None:
    """A kernel as `launch` gets it, for the native warm path: the tvm-ffi function, and the
    scratch buffers (`native.Buffer`, not returned) a `WorkspaceAdapter` adds after the launch's
    own arguments, their dynamic dimension `rows`. None where a workspace must start at zero:
    the native path allocates without initialising."""
    from .. import native

    if not isinstance(kernel, WorkspaceAdapter):
        return kernel, []
    if any(zeroed for _, _, zeroed in kernel.shapes):
        return None
    return kernel.kernel, [native.Buffer(tuple(rows if d is None else d for d in shape), dtype,
                                         returned=False) for shape, dtype, _ in kernel.shapes]


def executable(kernel: Any) -> Any:
    """What to call for a compiled TileLang kernel whose every parameter the caller passes.

    `JITKernel.__call__` goes through its tvm-ffi adapter's Python wrapper (loops over the
    parameters to allocate outputs, finds the output device) before the compiled executable; a
    few microseconds per call that decode-sized kernels feel. Our programs have no outputs to
    allocate, so the executable's entry function alone does the same (bound here: calling the
    executable looks it up again at every call). The executable is a TVM `Executable` when the
    kernel was compiled in this process and a loaded runtime module when it came from TileLang's
    disk cache; both run `main`. Other execution backends keep the kernel.
    """
    adapter = getattr(kernel, "adapter", None)
    get = getattr(adapter, "_get_executable", None)
    if get is None or getattr(adapter, "result_idx", None):
        return kernel
    run = get()
    if getattr(type(run), "jit", None) is not None:  # an Executable: its linked runtime module
        run = run.jit()
    return run.main


def gpu_adapter(kernel: Any) -> Any:
    """A compiled GPU program as `launch` calls it: its executable, given the workspaces the
    program declares (split-K partials, a dequantised weight)."""
    func = kernel.prim_func
    shapes = []
    for param in func.params:
        buf = func.buffer_map.get(param)
        if buf is not None and buf.name in WORKSPACES:
            # a constant (IntImm, with a `value`) or the dynamic M (a Var)
            dims = tuple(int(d) if hasattr(d, "value") else None for d in buf.shape)
            shapes.append((dims, getattr(torch, str(buf.dtype)), buf.name in ZEROED))
    run = executable(kernel)
    return WorkspaceAdapter(run, shapes) if shapes else run
