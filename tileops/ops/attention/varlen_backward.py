"""The backward of `flash_attention_varlen`: dq, dk and dv over a packed batch, what its autograd
backward runs.

The problem key, its buckets and syntax are the forward's (`VarlenProblem`). The call
(`prepare`) takes the forward's inputs, its output and lse, the gradient of out and, when lse
was used too, its gradient; it returns (dq, dk, dv) in the inputs' dtype, zero for key rows no
sequence holds. The offsets are not read back: the forward validated them (or was told not to),
and the kernel clamps them into the tensors as the forward's does. A `softmax_scale` other than
1/sqrt(head_dim) is folded into q as the forward folds it.

There is a CPU kernel only so far (`backward_kernels.cpu_ragged_program`); the baseline is the
dense gradients (`backward.attention_grads`) of each sequence in the inputs' dtype.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ...spec import Backend, Call, check_scale, pow2_bucket
from ..host import DTYPE_NAMES, DTYPE_SIZES, BitsAdapter, dtype_name
from . import backward_kernels
from .backward import attention_grads
from .varlen import AttentionVarlenSpec, VarlenProblem, _per_sequence

_WHO = "flash_attention_varlen backward"


class AttentionVarlenBackwardSpec(AttentionVarlenSpec):
    name = "attention_varlen_backward"
    aliases = ("flash_attention_varlen_backward",)
    function = ("torch.autograd.grad(tileops.flash_attention_varlen(q, k, v, cu_seqlens_q, "
                "cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, "
                "softmax_scale=None), (q, k, v), grad)")
    baseline_name = "dense attention gradients of each sequence (torch)"
    kernel_module = backward_kernels.__name__
    backends = {"cpu": Backend(backward_kernels.cpu_ragged_program, BitsAdapter)}
    products = 5  # S, dP, dV, dK, dQ (FlashAttention's count: 2.5x the forward's FLOPs)
    unsupported = {"metal": f"{_WHO} has no Metal kernel",
                   "hip": f"{_WHO} has no HIP kernel",
                   "cuda": f"{_WHO} has no CUDA kernel yet (the dense flash_attention has one)"}

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                max_seqlen_k: int, out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                causal: bool = False, softmax_scale: float | None = None,
                grad_lse: torch.Tensor | None = None) -> Call:
        self._check_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        self._check_results(q, out, grad_out, lse, grad_lse)
        (Tq, Hq, D), (Tk, Hkv, _) = q.shape, k.shape
        q, k, v, out, grad_out, lse = (t.contiguous() for t in (q, k, v, out, grad_out, lse))
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float().contiguous()
        ratio = 1.0
        if softmax_scale is not None and softmax_scale != D ** -0.5:
            ratio = check_scale(softmax_scale, _WHO) * D ** 0.5
            q = q * ratio
        problem = VarlenProblem(pow2_bucket(Tq), pow2_bucket(Tk), pow2_bucket(max_seqlen_q),
                                pow2_bucket(max_seqlen_k), Hq, Hkv, D, bool(causal),
                                DTYPE_NAMES[q.dtype])
        return Call(q.device, problem, (q, k, v, cu_seqlens_q, cu_seqlens_k, out, grad_out, lse,
                                        grad_lse, bool(causal), ratio))

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

    def launch(self, kernel, args: tuple, out: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """Run the kernel; `out`, when given, is the triple (dq, dk, dv) of buffers to write."""
        q, k, v, cu_q, cu_k, o, grad_out, lse, grad_lse, _, ratio = args
        if out is None:
            out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        Tq, Hq, D = q.shape
        rows = -(-Tq // 4) * 4  # the dense kernel's 16-byte rows, kept for one launch layout
        lse2, delta = torch.empty((2, Hq, rows), dtype=torch.float32, device=q.device)
        dq_acc = torch.empty((Hq, Tq, D), dtype=torch.float32, device=q.device)
        kernel(q, k, v, cu_q, cu_k, o, grad_out, lse, grad_lse, lse2, delta, dq_acc, *out)
        if ratio != 1.0:
            out[0].mul_(ratio)
        return out

    def launch_baseline(self, args: tuple) -> tuple[torch.Tensor, ...]:
        q, k, v, cu_q, cu_k, _, grad_out, _, grad_lse, causal, ratio = args
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
