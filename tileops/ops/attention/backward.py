"""FlashAttention backward: dQ, dK and dV of `tileops.flash_attention`, what its autograd
backward runs (`torch.autograd` and `torch.compile` alike).

The problem key, its buckets and its command-line syntax are the forward's (`AttentionProblem`):
a backward record is found by the same key as the forward call that made the graph. The call
(`prepare`) takes the forward's inputs and results, q, k, v, out and lse, with the gradient of
out and, when lse was used too, its gradient; it returns (dq, dk, dv) in the inputs' dtype. A
`softmax_scale` other than 1/sqrt(head_dim) is folded into q as the forward folds it, and the
factor applied again to dq.

The baseline is cuDNN's SDPA backward (`aten._scaled_dot_product_cudnn_attention_backward`) on
the output and log-sum-exp of cuDNN's own forward, which it makes once per call's arguments
(`SdpaBackward`): a benchmark then times the backward alone. Where cuDNN cannot run the problem
(the bottom-right causal mask of seqlen_q != seqlen_kv, the CPU) it is torch autograd through
`scaled_dot_product_attention`, its forward made once as well.
"""

from __future__ import annotations

from typing import Any

import torch

from ...spec import Backend, Call, Config, check_scale, empty_call
from ...target import Target
from ..host import DTYPE_NAMES, DTYPE_SIZES, BitsAdapter, Once, dtype_name, smem_limit
from . import backward_kernels
from .spec import (
    _ACCEPTED,
    _NO_METAL,
    HEAD_DIMS,
    AttentionProblem,
    AttentionSpec,
    _attention,
    _future,
    key_lengths,
)

_WHO = "flash_attention backward"
_BEFORE_SM90 = "the backward's dQ reduce-add is a TMA store, which sm_90 brings"


class SdpaBackward(Once):
    """The baseline's forward, made at most once per call's arguments, and its backward run on
    it: cuDNN's backward called directly where it takes the problem, else torch autograd through
    SDPA's graph (kept, `retain_graph`)."""

    __slots__ = ()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
            causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
        qt, kt, vt, gt = (t.transpose(1, 2) for t in (q, k, v, grad_out))
        kind, state = self.get(lambda: self._forward(qt, kt, vt, causal, scale))
        if kind == "cudnn":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset = state
            grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                gt, qt, kt, vt, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
                causal, scale=scale)
        else:
            out, leaves = state
            grads = torch.autograd.grad(out, leaves, gt, retain_graph=True)
        return tuple(g.transpose(1, 2) for g in grads)

    @staticmethod
    def _forward(qt, kt, vt, causal: bool, scale: float) -> tuple[str, tuple]:
        Sq, Skv = qt.shape[2], kt.shape[2]
        if qt.is_cuda and not (causal and Sq != Skv):
            try:
                out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
                    torch.ops.aten._scaled_dot_product_cudnn_attention(
                        qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
                return "cudnn", (out, lse, cum_q, cum_k, max_q, max_k, seed, offset)
            except RuntimeError:  # a problem cuDNN does not take: autograd below
                pass
        leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]
        mask = None
        if causal and Sq != Skv:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(Sq, Skv)
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                enable_gqa=qt.shape[1] != kt.shape[1])
        return "autograd", (out, leaves)


# On CUDA the dK and dV accumulators of a program instance live in registers: at head_dim 256
# those of 64 keys alone would take 256 per thread of one warpgroup.
CUDA_HEAD_DIMS = (64, 128)


def _check_cuda(problem: AttentionProblem, config: Config, target: Target) -> str | None:
    """sm_90 (the dQ reduce-add is TMA's), shared memory, accumulator registers, wgmma rows."""
    if not target.is_hopper:
        return "the backward's dQ reduce-add is a TMA store (sm_90)"
    bm, bn, D = config["block_M"], config["block_N"], problem.head_dim
    if D not in CUDA_HEAD_DIMS:
        return f"head_dim {D}: no CUDA kernel (dK and dV would not fit in registers)"
    threads, stages = config["threads"], config["num_stages"]
    esize = DTYPE_SIZES[problem.dtype]
    # K and V; Q and dO per stage; dS^T; the fp32 dQ tile of the reduce-add (two, overlap 2)
    dq_tiles = 2 if config.get("overlap") == 2 else 1
    smem = (2 * bn * D + 2 * stages * bm * D + bn * bm) * esize + dq_tiles * bm * D * 4
    limit = smem_limit(target.arch)
    if smem > limit:
        return f"shared memory {smem // 1024} KiB > {limit // 1024} KiB"
    regs = (2 * bn * D + 2 * bn * bm) // threads  # dK and dV, S^T and dP^T accumulators
    if regs > 192:
        return f"{regs} accumulator registers per thread (> 192)"
    if bn % (64 * (threads // 128)):
        return f"wgmma needs block_N a multiple of 64 per warpgroup ({threads // 128})"
    return None


BACKENDS = {"cpu": Backend(backward_kernels.cpu_program, BitsAdapter),
            "cuda": Backend(backward_kernels.gpu_program, check=_check_cuda)}


class AttentionBackwardSpec(AttentionSpec):
    name = "attention_backward"
    aliases = ("flash_attention_backward",)
    function = ("torch.autograd.grad(tileops.flash_attention(q, k, v, *, causal=False, "
                "softmax_scale=None), (q, k, v), grad)")
    baseline_name = "cuDNN SDPA backward (torch autograd through SDPA where cuDNN cannot run it)"
    kernel_module = backward_kernels.__name__
    backends = BACKENDS
    products = 5  # S, dP, dV, dK, dQ (FlashAttention's count: 2.5x the forward's FLOPs)
    unsupported = {"metal": _NO_METAL, **{f"cuda:sm_{major}": _BEFORE_SM90 for major in "78"}}

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                grad_out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                softmax_scale: float | None = None, grad_lse: torch.Tensor | None = None
                ) -> Call:
        self._check(q, k, v, out, grad_out, lse, grad_lse)
        if not (q.numel() and k.numel()):  # no query or no key: no gradient flows
            return empty_call(q.device, (q.new_zeros(q.shape), k.new_zeros(k.shape),
                                         v.new_zeros(v.shape)))
        B, Sq, Hq, D = q.shape
        if q.is_cuda and D not in CUDA_HEAD_DIMS:
            raise NotImplementedError(f"{_WHO}: head_dim {D} has no CUDA kernel yet (allowed: "
                                      f"{', '.join(map(str, CUDA_HEAD_DIMS))}); the forward "
                                      "runs it, so call it under torch.no_grad()")
        Skv, Hkv = k.shape[1], k.shape[2]
        q, k, v, out, grad_out, lse = (t.contiguous() for t in (q, k, v, out, grad_out, lse))
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float().contiguous()
        ratio = 1.0
        if softmax_scale is not None and softmax_scale != D ** -0.5:
            ratio = check_scale(softmax_scale, _WHO) * D ** 0.5
            q = q * ratio  # as the forward folds it: the kernels bake in 1/sqrt(head_dim)
        problem = AttentionProblem(B, *key_lengths(Sq, Skv, causal), Hq, Hkv, D, bool(causal),
                                   DTYPE_NAMES[q.dtype])
        return Call(q.device, problem, (q, k, v, out, grad_out, lse, grad_lse, bool(causal),
                                        ratio, SdpaBackward()))

    def _check(self, q: Any, k: Any, v: Any, out: Any, grad_out: Any, lse: Any,
               grad_lse: Any) -> None:
        """Refuse what the kernels cannot take with the error that says why. The forward's
        rules hold for q, k and v (`AttentionSpec._validate`); out and grad_out must be like q, lse
        and grad_lse (batch, heads_q, seqlen_q)."""
        tensors = {"q": q, "k": k, "v": v, "out": out, "grad_out": grad_out, "lse": lse}
        if grad_lse is not None:
            tensors["grad_lse"] = grad_lse
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{_WHO}: {name} must be a tensor, got {type(t).__name__}")
        try:
            (B, Sq, Hq, D), (Bk, Skv, Hkv, Dk) = q.shape, k.shape
            ok = (k.shape == v.shape and Bk == B and Dk == D and D in HEAD_DIMS and B and Sq
                  and Skv and Hq and Hkv and Hq % Hkv == 0 and q.dtype is k.dtype is v.dtype
                  and (q.dtype, q.is_cuda) in _ACCEPTED and q.device == k.device == v.device)
        except ValueError:
            ok = False
        if not ok:
            with torch.no_grad():
                super()._validate(q, k, v)
        for name in ("out", "grad_out"):
            t = tensors[name]
            if t.shape != q.shape or t.device != q.device:
                raise ValueError(f"{_WHO}: {name} must be shaped like q {tuple(q.shape)} on "
                                 f"{q.device}; got {tuple(t.shape)} on {t.device}")
            if t.dtype is not q.dtype:
                raise TypeError(f"{_WHO}: {name} has dtype {dtype_name(t.dtype)}, q "
                                f"{dtype_name(q.dtype)}; they must match")
        rows = (q.shape[0], q.shape[2], q.shape[1])
        for name in ("lse", "grad_lse"):
            t = tensors.get(name)
            if t is not None and (tuple(t.shape) != rows or t.device != q.device
                                  or not t.is_floating_point()):
                raise ValueError(f"{_WHO}: {name} must be a float tensor (batch, heads_q, "
                                 f"seqlen_q) = {rows} on {q.device}; got {tuple(t.shape)} "
                                 f"{dtype_name(t.dtype)} on {t.device}")
        if lse.dtype is not torch.float32:
            raise TypeError(f"{_WHO}: lse must be float32 (the forward's), got "
                            f"{dtype_name(lse.dtype)}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values()):
            raise RuntimeError(f"{_WHO} has no backward of its own (no double backward): call "
                               "it under torch.no_grad(), or differentiate once "
                               "(create_graph=False)")

    def launch(self, kernel, args: tuple, out: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """Run the kernel; `out`, when given, is the triple (dq, dk, dv) of buffers to write."""
        q, k, v, o, grad_out, lse, grad_lse, _, ratio, _ = args
        if out is None:
            out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        B, Sq, Hq, D = q.shape
        rows = -(-Sq // 4) * 4  # a 16-byte row stride for the kernel's TMA loads
        lse2, delta = torch.empty((2, B, Hq, rows), dtype=torch.float32, device=q.device)
        dq_acc = torch.empty((B, Hq, Sq, D), dtype=torch.float32, device=q.device)
        kernel(q, k, v, o, grad_out, lse, grad_lse, lse2, delta, dq_acc, *out)
        if ratio != 1.0:
            out[0].mul_(ratio)  # d/dq of the forward's q * ratio
        return out

    def launch_baseline(self, args: tuple) -> tuple[torch.Tensor, ...]:
        q, k, v, _, grad_out, _, _, causal, ratio, baseline = args
        dq, dk, dv = baseline.run(q, k, v, grad_out, causal, q.shape[3] ** -0.5)
        return (dq * ratio if ratio != 1.0 else dq), dk, dv

    def dispatches_baseline(self, problem: AttentionProblem, target: Target) -> bool:
        """Never: the baseline's backward needs its own forward (cuDNN's statistics, or SDPA's
        graph), which a call would make again each time."""
        return False

    def reported_beside(self, args: tuple) -> dict[str, Any]:
        return {}

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: AttentionProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        """The forward's random inputs, its output and lse (fp32 math, out rounded to the
        dtype) and a random output gradient."""
        q, k, v, causal = super().make_inputs(problem, device, seed, sizes)
        out, lse = _attention(q, k, v, causal, q.shape[3] ** -0.5, torch.float32)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        grad_out = torch.randn(q.shape, generator=gen, device=device).to(q.dtype)
        return (q, k, v, out.to(q.dtype), grad_out, lse, causal)

    def reference(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) in float64 from q, k, v and the output gradient (what out, lse and
        grad_lse would be exactly)."""
        q, k, v, _, grad_out, _, causal = inputs[:7]
        scale = inputs[7] if len(inputs) > 7 and inputs[7] is not None else q.shape[3] ** -0.5
        grad_lse = inputs[8] if len(inputs) > 8 else None
        return attention_grads(q, k, v, grad_out, causal, scale, torch.float64, grad_lse)

    def bytes_moved(self, problem: AttentionProblem) -> float:
        """q, out, grad_out read and dq written; k, v read and dk, dv written; lse read."""
        B, Sq, Skv, Hq, Hkv, D, _, dtype = problem
        return (4 * B * Sq * Hq * D + 4 * B * Skv * Hkv * D) * DTYPE_SIZES[dtype] + 4 * B * Hq * Sq


def attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                    causal: bool, scale: float, dtype: torch.dtype,
                    grad_lse: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of plain softmax attention in `dtype` on q's device, by KV head and query chunk
    as `spec._attention` computes the forward; rows that see no key give zero gradients."""
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dq = torch.empty((B, Sq, Hq, D), dtype=dtype, device=q.device)
    dk = torch.zeros((B, Skv, Hkv, D), dtype=dtype, device=q.device)
    dv = torch.zeros((B, Skv, Hkv, D), dtype=dtype, device=q.device)
    hidden = _future(Sq, Skv, q.device) if causal else None
    rows = max(1, (1 << 24) // (group * Skv))
    for b in range(B):
        for h in range(Hkv):
            heads = slice(h * group, (h + 1) * group)
            kd, vd = k[b, :, h].to(dtype), v[b, :, h].to(dtype)
            for i in range(0, Sq, rows):
                qc = q[b, i:i + rows, heads].to(dtype).transpose(0, 1)  # (group, rows, D)
                go = grad_out[b, i:i + rows, heads].to(dtype).transpose(0, 1)
                s = qc @ kd.T * scale
                if causal:
                    s.masked_fill_(hidden[i:i + rows], float("-inf"))
                lse = torch.logsumexp(s, dim=-1, keepdim=True)
                p = torch.exp(s - lse).masked_fill_(lse == float("-inf"), 0.0)
                dp = go @ vd.T
                o = p @ vd
                delta = (go * o).sum(-1, keepdim=True)
                if grad_lse is not None:
                    delta = delta - grad_lse[b, heads, i:i + rows, None].to(dtype)
                ds = p * (dp - delta) * scale
                dq[b, i:i + rows, heads] = (ds @ kd).transpose(0, 1)
                dk[b, :, h] += torch.einsum("gqk,gqd->kd", ds, qc)
                dv[b, :, h] += torch.einsum("gqk,gqd->kd", p, go)
    return dq, dk, dv


ATTENTION_BACKWARD = AttentionBackwardSpec()
