"""The backward of `flash_attention_varlen`: dq, dk and dv over a packed batch, what its autograd
backward runs.

The problem key, its buckets and syntax are the forward's (`VarlenProblem`). The call
(`prepare`) takes the forward's inputs, its output and lse, the gradient of out and, when lse
was used too, its gradient; it returns (dq, dk, dv) in the inputs' dtype, zero for key rows no
sequence holds. The offsets are not read back: the forward validated them (or was told not to),
and the kernel clamps them into the tensors as the forward's does. A `softmax_scale` other than
1/sqrt(head_dim) is folded into q as the forward folds it.

The kernels run over the (sequence, KV block) list of `varlen.tile_list(..., keys=True)`, made
on the device each call (no read back: capturable), or on the host from offsets given there. On
CUDA (sm_90) the kernel is the dense backward's (`backward_kernels.ragged_gpu_program`: its hand
schedules, head_dim 64 and 128), and the baseline flash-attn 2's varlen backward as torch ships
it, on the statistics of its own forward (made once per call's arguments); on the CPU the
baseline is the dense gradients (`backward.attention_grads`) of each sequence in the inputs'
dtype.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ...spec import Backend, Call, Config, check_scale, pow2_bucket
from ...target import Target
from ..host import DTYPE_NAMES, DTYPE_SIZES, BitsAdapter, Once, dtype_name, index_to
from . import backward_kernels
from .backward import CUDA_HEAD_DIMS, attention_grads
from .backward import _check_cuda as _check_dense_cuda
from .varlen import (
    _NOT_HOPPER,
    AttentionVarlenSpec,
    TiledKernel,
    VarlenProblem,
    _check_offsets,
    _per_sequence,
    _tiled,
    host_tile_list,
    tile_list,
)

_WHO = "flash_attention_varlen backward"


def _gpu_program(*key: Any, block_M: int, block_N: int, **config: Any) -> Any:
    return _tiled(backward_kernels.ragged_gpu_program(*key, block_M=block_M, block_N=block_N,
                                                      **config), block_M, block_N)


def _cpu_program(*key: Any, block_M: int, block_N: int) -> Any:
    return _tiled(backward_kernels.cpu_ragged_program(*key, block_M=block_M, block_N=block_N),
                  block_M, block_N)


def _check_cuda(problem: VarlenProblem, config: Config, target: Target) -> str | None:
    """The dense backward's limits (sm_90, head_dim, shared memory, registers, wgmma rows), and
    a hand schedule: the zeroing of rows past a sequence is a step of theirs."""
    if config.get("overlap", 0) not in (1, 2):
        return "the packed backward runs the hand schedules only (overlap 1 or 2)"
    return _check_dense_cuda(problem, config, target)


class FlashVarlenBackward(Once):
    """The CUDA baseline: flash-attn 2's varlen backward (`aten._flash_attention_backward`) on
    the output, log-sum-exp and RNG state of its own varlen forward, made once per call's
    arguments."""

    __slots__ = ()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
            cu_k: torch.Tensor, max_q: int, max_k: int, grad_out: torch.Tensor,
            causal: bool) -> tuple[torch.Tensor, ...]:
        out, lse, seed, offset, _ = self.get(lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False))
        return torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed, offset)


class AttentionVarlenBackwardSpec(AttentionVarlenSpec):
    name = "attention_varlen_backward"
    aliases = ("flash_attention_varlen_backward",)
    function = ("torch.autograd.grad(tileops.flash_attention_varlen(q, k, v, cu_seqlens_q, "
                "cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, "
                "softmax_scale=None), (q, k, v), grad)")
    baseline_name = ("flash-attn 2 varlen backward (torch's SDPA flash backend); on the CPU the "
                     "dense gradients of each sequence (torch)")
    kernel_module = backward_kernels.__name__
    backends = {"cpu": Backend(_cpu_program, lambda k: TiledKernel(k, BitsAdapter(k))),
                "cuda": Backend(_gpu_program, TiledKernel, check=_check_cuda)}
    products = 5  # S, dP, dV, dK, dQ (FlashAttention's count: 2.5x the forward's FLOPs)
    unsupported = {"metal": f"{_WHO} has no Metal kernel",
                   "hip": f"{_WHO} has no HIP kernel",
                   **{f"cuda:sm_{major}": _NOT_HOPPER for major in (5, 6, 7, 8, 1)}}

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                max_seqlen_k: int, out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                causal: bool = False, softmax_scale: float | None = None,
                grad_lse: torch.Tensor | None = None) -> Call:
        self._check_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        self._check_results(q, out, grad_out, lse, grad_lse)
        (Tq, Hq, D), (Tk, Hkv, _) = q.shape, k.shape
        if q.is_cuda and D not in CUDA_HEAD_DIMS:
            raise NotImplementedError(f"{_WHO}: head_dim {D} has no CUDA kernel yet (allowed: "
                                      f"{', '.join(map(str, CUDA_HEAD_DIMS))}); the forward "
                                      "runs it, so call it under torch.no_grad()")
        # Offsets the caller gave on the host (the forward's, saved as given): checked there and
        # the KV-block list made there, with no read back.
        offsets = (_check_offsets(cu_seqlens_q, cu_seqlens_k, Tq, Tk, max_seqlen_q, max_seqlen_k)
                   if cu_seqlens_q.device != q.device else None)
        cu_seqlens_q, cu_seqlens_k = index_to(q.device, _WHO, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k)
        q, k, v, out, grad_out, lse = (t.contiguous() for t in (q, k, v, out, grad_out, lse))
        ratio = 1.0
        if softmax_scale is not None and softmax_scale != D ** -0.5:
            ratio = check_scale(softmax_scale, _WHO) * D ** 0.5
            q = q * ratio
        problem = VarlenProblem(pow2_bucket(Tq), pow2_bucket(Tk), pow2_bucket(max_seqlen_q),
                                pow2_bucket(max_seqlen_k), Hq, Hkv, D, bool(causal),
                                DTYPE_NAMES[q.dtype])
        # flash-attn's backward takes no gradient of the log-sum-exp
        flash = FlashVarlenBackward() if q.is_cuda and grad_lse is None else None
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float().contiguous()
        return Call(q.device, problem, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, out, grad_out, lse, grad_lse,
                                        bool(causal), ratio, flash, offsets))

    @staticmethod
    def _check_results(q: torch.Tensor, out: Any, grad_out: Any, lse: Any, grad_lse: Any) -> None:
        """out and grad_out shaped like q in its dtype, lse and grad_lse (heads_q, tokens_q)."""
        for name, t in (("out", out), ("grad_out", grad_out), ("lse", lse),
                        ("grad_lse", grad_lse)):
            if t is None and name == "grad_lse":
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{_WHO}: {name} must be a tensor, got {type(t).__name__}")
            if t.device != q.device:
                raise ValueError(f"{_WHO}: {name} is on {t.device}, q on {q.device}")
            like = q.shape if name in ("out", "grad_out") else (q.shape[1], q.shape[0])
            if tuple(t.shape) != tuple(like):
                raise ValueError(f"{_WHO}: {name} must be shaped {tuple(like)}, got "
                                 f"{tuple(t.shape)}")
        if out.dtype is not q.dtype or grad_out.dtype is not q.dtype:
            raise TypeError(f"{_WHO}: out and grad_out must have q's dtype "
                            f"{dtype_name(q.dtype)}")
        if lse.dtype is not torch.float32:
            raise TypeError(f"{_WHO}: lse must be float32 (the forward's), got "
                            f"{dtype_name(lse.dtype)}")

    def launch(self, kernel: TiledKernel, args: tuple,
               out: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """Run the kernel on a KV-block list made for its tile sizes; `out`, when given, is the
        triple (dq, dk, dv) of buffers to write."""
        q, k, v, cu_q, cu_k, _, _, o, grad_out, lse, grad_lse, causal, ratio, _, offsets = args
        if out is None:
            out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        Tq, Hq, D = q.shape
        rows = -(-Tq // 4) * 4  # 16-byte rows for the statistics' TMA loads
        lse2, delta = torch.empty((2, Hq, rows), dtype=torch.float32, device=q.device)
        dq_acc = torch.empty((Hq, Tq, D), dtype=torch.float32, device=q.device)
        if offsets is not None:
            tiles = host_tile_list(*offsets, kernel.block_M, kernel.block_N, causal,
                                   keys=True).to(q.device, non_blocking=True)
        else:
            tiles = tile_list(cu_q, cu_k, k.shape[0], kernel.block_M, kernel.block_N, causal,
                              keys=True)
        kernel(q, k, v, cu_q, cu_k, tiles, o, grad_out, lse, grad_lse, lse2, delta, dq_acc, *out)
        if ratio != 1.0:
            out[0].mul_(ratio)
        return out

    def launch_baseline(self, args: tuple) -> tuple[torch.Tensor, ...]:
        q, k, v, cu_q, cu_k, max_q, max_k, _, grad_out, _, grad_lse, causal, ratio, flash, _ = args
        if flash is not None:
            dq, dk, dv = flash.run(q, k, v, cu_q, cu_k, max_q, max_k, grad_out, causal)
            return (dq * ratio if ratio != 1.0 else dq), dk, dv
        dq, dk, dv = per_sequence_grads(q, k, v, cu_q, cu_k, grad_out, causal,
                                        q.shape[2] ** -0.5, torch.float32, grad_lse)
        return (dq * ratio).to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    def dispatches_baseline(self, problem: VarlenProblem, target: Any) -> bool:
        return False

    def reported_beside(self, args: tuple) -> dict[str, Any]:
        return {}

    def make_inputs(self, problem: VarlenProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        """The forward's inputs, its output and lse (fp32 math), and a random output
        gradient."""
        q, k, v, cu_q, cu_k, max_q, max_k, causal = super().make_inputs(problem, device, seed,
                                                                         sizes)
        out, lse = _per_sequence(q, k, v, cu_q, cu_k, causal, torch.float32)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        grad_out = torch.randn(q.shape, generator=gen, device=device).to(q.dtype)
        return (q, k, v, cu_q, cu_k, max_q, max_k, out.to(q.dtype), grad_out, lse, causal)

    def reference(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) in float64, sequence by sequence."""
        q, k, v, cu_q, cu_k, _, _, _, grad_out, _, causal = inputs[:11]
        scale = inputs[11] if len(inputs) > 11 and inputs[11] is not None else q.shape[2] ** -0.5
        grad_lse = inputs[12] if len(inputs) > 12 else None
        return per_sequence_grads(q, k, v, cu_q, cu_k, grad_out, causal, scale, torch.float64,
                                  grad_lse)

    def bytes_moved(self, problem: VarlenProblem) -> float:
        Tq, Tk, _, _, Hq, Hkv, D, _, dtype = problem
        return (4 * Tq * Hq * D + 4 * Tk * Hkv * D) * DTYPE_SIZES[dtype] + 4 * Hq * Tq


def per_sequence_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, grad_out: torch.Tensor, causal: bool, scale: float,
                       dtype: torch.dtype, grad_lse: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention_grads` of each packed sequence in `dtype`; zeros where no sequence is (and for
    a sequence with no query or no key)."""
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    for (a, b), (c, d) in zip(itertools.pairwise(cu_q.tolist()),
                              itertools.pairwise(cu_k.tolist()), strict=True):
        if b == a or d == c:
            continue
        h = None if grad_lse is None else grad_lse[None, :, a:b]
        g = attention_grads(q[None, a:b], k[None, c:d], v[None, c:d], grad_out[None, a:b], causal,
                            scale, dtype, h)
        dq[a:b], dk[c:d], dv[c:d] = (x[0] for x in g)
    return dq, dk, dv


ATTENTION_VARLEN_BACKWARD = AttentionVarlenBackwardSpec()
