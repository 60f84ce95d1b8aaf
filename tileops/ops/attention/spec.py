"""FlashAttention forward: O = softmax(Q K^T * scale + causal mask) V and its log-sum-exp.

Problem key: (batch, seqlen_q bucket, seqlen_kv bucket, heads_q, heads_kv, head_dim, causal,
dtype). Both sequence lengths are bucketed by `pow2_bucket` and, like batch, are dynamic in the
compiled kernel: one kernel per (heads, head_dim, causal, dtype, config) serves every batch and
length, so a new length never recompiles. Batch stays in the key unbucketed (tuning records for
batch 1 and 8 may differ) but not in the kernel.

Command-line syntax (`parse_problem`, `tileops-tune --shape`): `BxSQxSKVxHQxHKVxD`, with `:causal`
appended for the causal mask, e.g. `8x4096x4096x32x8x128:causal`; `BxSxHxD` is the short form for
seqlen_q = seqlen_kv and heads_q = heads_kv.

The kernels bake in the default scale 1/sqrt(head_dim); a call with another `softmax_scale` scales
q by the ratio first (one elementwise pass over q, rounded in q's dtype). `launch` takes its `out`
buffer as the pair (O, LSE), the shape of what it returns.

The baseline returns (O, LSE) like the kernels. On CUDA it is cuDNN attention
(`BASELINE_BACKENDS`), called as `aten._scaled_dot_product_cudnn_attention` with the lse computed
in the same pass (grouped K/V heads natively: bit for bit the output of K and V repeated, in the
same time, on the H200); for causal calls with seqlen_q < seqlen_kv (chunked prefill), whose
bottom-right mask torch's cuDNN call cannot align, it is the memory-efficient kernel
(`aten._efficient_attention_forward`, bottom-right mask and lse in one pass, KV heads repeated for
GQA). A record's verdict on one of these kernels says nothing of another: problems that would run
different baselines are not comparable (`distance`). So that a key tells them apart, a causal call
with fewer queries than keys whose lengths share a bucket (1000 against 1020) takes the next
bucket of keys (1024 x 2048, `key_lengths`): it never borrows an equal-length record's verdict.
Elsewhere it is
`torch.nn.functional.scaled_dot_product_attention` on the (batch, heads, seq, dim) transposes
with `enable_gqa` and a lower-right causal mask, plus a second pass for the lse that SDPA does not
return.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import torch

from ...spec import (
    Backend,
    Call,
    Config,
    OpSpec,
    Space,
    check_scale,
    empty_call,
    pow2_bucket,
    refuse_grad,
)
from ...target import Target
from ..host import (
    DTYPE_NAMES,
    DTYPE_SIZES,
    DTYPES,
    BitsAdapter,
    Once,
    dtype_name,
    smem_limit,
    units,
)
from . import kernels

SUPPORTED = {"cuda": ("float16", "bfloat16"), "cpu": ("float32", "float16", "bfloat16")}
HEAD_DIMS = (64, 128, 256)
_ACCEPTED = {(DTYPES[name], kind == "cuda") for kind, names in SUPPORTED.items() for name in names}
_NO_METAL = ("flash_attention has no Metal kernel: TileLang cannot lower its row reductions "
             "(online softmax) for Metal")


# The SDPA backends (`torch.nn.attention.SDPBackend` names) the baseline may use on CUDA: the
# hook to set when comparing against another backend (e.g. ["FLASH_ATTENTION"]).
BASELINE_BACKENDS = ["CUDNN_ATTENTION"]


class AttentionProblem(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str


def key_lengths(seqlen_q: int, seqlen_kv: int, causal: bool) -> tuple[int, int]:
    """The key's length buckets: each length's `pow2_bucket`, the keys' one bucket higher for a
    causal call with fewer queries than keys in the queries' bucket, so the key is chunked too."""
    bq, bkv = pow2_bucket(seqlen_q), pow2_bucket(seqlen_kv)
    return (bq, 2 * bkv) if causal and seqlen_q < seqlen_kv and bq == bkv else (bq, bkv)


def _chunked(problem: AttentionProblem) -> bool:
    """Causal with fewer queries than keys (chunked prefill): the bottom-right mask."""
    return problem.causal and problem.seqlen_q < problem.seqlen_kv


class RepeatedKV(Once):
    """K and V with their heads repeated up to the query heads, made at most once per call, for
    the memory-efficient baseline (it takes equal head counts). A benchmark times the baseline
    again and again on one call's arguments, so it times the kernel alone: the strongest form of
    the baseline for grouped heads; dispatch, which would pay the copy at every call, does not run
    it for them (`dispatches_baseline`)."""

    __slots__ = ()

    def of(self, kt: torch.Tensor, vt: torch.Tensor, group: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
        if group == 1:
            return kt, vt
        return self.get(lambda: (kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)))


def _cuda_default(problem: AttentionProblem, target: Target, space: Space) -> Config:
    """On sm_90 the warp-specialised schedule (`overlap` 2) over 128-key blocks: at head_dim 128
    128 query rows in two K/V stages, persistent CTAs where the queries are short (<= 2048) or
    causal; at head_dim 64 up to 1024 queries the same tile persistent, above three consumer
    warpgroups of 64 rows in one stage, not persistent. On an H100 the attention suite went from
    0.84x to 0.98x of cuDNN on geometric mean with it (benchmarks/NOTES.md).

    Elsewhere, and at head_dim 256: two K/V stages at head_dim 128 take 192 KiB, so one stage
    below sm_90; at head_dim 256, 64-key blocks in one stage."""
    D, causal, short = problem.head_dim, problem.causal, problem.seqlen_q <= 2048
    if target.is_hopper and D <= 128:
        # 192 x 128 at head_dim 64: 128 accumulator registers of 160 (`_check_gpu`); a second
        # stage or persistent CTAs lost up to 10% with it and won at most 2% in the H100 grids
        # above 1024 queries, and up to 1024 the 128-row tile's persistent CTAs win
        wide = D <= 64 and problem.seqlen_q > 1024
        persistent = not wide and (causal or short)
        return {"block_M": 192 if wide else 128, "block_N": 128, "num_stages": 1 if wide else 2,
                "threads": 384 if wide else 256, "overlap": 2, "pingpong": 0,
                "persistent": int(persistent)}
    if D <= 128:
        stages = 2 if smem_limit(target.arch) >= 192 * 1024 else 1
        return {"block_M": 128, "block_N": 128, "num_stages": stages, "threads": 256,
                "overlap": 0, "pingpong": 0, "persistent": 0}
    return {"block_M": 128, "block_N": 64, "num_stages": 1, "threads": 256, "overlap": 0,
            "pingpong": 0, "persistent": 0}


def _check_gpu(problem: AttentionProblem, config: Config, target: Target) -> str | None:
    """The schedules' own rules, shared memory, accumulator registers and wgmma row blocks."""
    bm, bn, D = config["block_M"], config["block_N"], problem.head_dim
    threads, stages = config["threads"], config["num_stages"]
    overlap = config.get("overlap", 0)
    if overlap == 1 and stages != 2:
        return "overlap 1 schedules its own two-stage pipeline (num_stages 2 only)"
    if overlap == 2 and not target.is_hopper:
        return "overlap 2 is warp-specialised for sm_90 (TMA producer, asynchronous wgmma)"
    if config.get("persistent") and overlap != 2:
        return "persistent walks its tiles in the warp-specialised schedule (overlap 2 only)"
    if config.get("pingpong") and (overlap == 1 or threads != 256 or not target.is_hopper):
        return ("pingpong alternates two wgmma consumer warpgroups (sm_90, overlap 0 or 2, "
                "256 threads)")
    esize = DTYPE_SIZES[problem.dtype]
    # Q and O tiles, plus K and V tiles per pipeline stage (overlap 2: one V tile more).
    kv_tiles = 2 * max(stages, 1) + (overlap == 2)
    smem = (2 * bm * D + kv_tiles * bn * D) * esize
    limit = smem_limit(target.arch)
    if smem > limit:
        return f"shared memory {smem // 1024} KiB > {limit // 1024} KiB"
    regs = (bm * D + bm * bn + bm * bn // 2) // threads  # O and S accumulators, P
    # Warp-specialised consumers get 240 registers (setmaxnreg), 160 in three warpgroups (by
    # TileLang too at overlap 0), of which the accumulators may take all but 32 for sm_90a to
    # compile them without spills (128 x 192 at head_dim 128: 208 of 240; 192 x 128: 128 of 160
    # at head_dim 64, 160 spill at 128)
    ws = overlap == 2 or threads > 256
    limit = kernels.consumer_nreg(threads) - 32 if ws else 192
    if regs > limit:
        return f"{regs} accumulator registers per thread (> {limit})"
    if target.is_hopper and bm % (64 * (threads // 128)) != 0:
        return f"wgmma needs block_M a multiple of 64 per warpgroup ({threads // 128})"
    return None


def _check_cuda(problem: AttentionProblem, config: Config, target: Target) -> str | None:
    """`_check_gpu`, and below sm_90 what mma and TileLang's software pipeline planner fail to
    lower (checked on sm_80)."""
    reason = _check_gpu(problem, config, target)
    if reason or target.is_hopper:
        return reason
    bm, threads = config["block_M"], config["threads"]
    if bm < 16 * (threads // 32):
        return f"mma needs 16 query rows per warp: block_M {bm} < {threads // 32} x 16"
    if config["num_stages"] > 1 and not config.get("overlap"):
        return "below sm_90 the KV loop pipelines through overlap 1, not num_stages > 1"
    return None


# The kernels of each target kind; there is no Metal kernel (`AttentionSpec.unsupported`). The
# cpu and hip defaults are constant: configs/attention.toml holds them beside their spaces.
BACKENDS = {"cpu": Backend(kernels.cpu_program, BitsAdapter),
            "cuda": Backend(kernels.gpu_program, check=_check_cuda, default=_cuda_default,
                            derived=units),
            "hip": Backend(kernels.gpu_program, check=_check_gpu)}


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call with no query or no key: empty, or where queries see no key, as
    every such query's row, zeros and a log-sum-exp of -inf."""
    B, Sq, Hq, _ = q.shape
    return q.new_zeros(q.shape), q.new_full((B, Hq, Sq), -math.inf, dtype=torch.float32)


class AttentionSpec(OpSpec):
    name = "attention"
    aliases = ("flash_attention",)
    function = ("tileops.flash_attention(q, k, v, *, causal=False, softmax_scale=None, "
                "return_lse=False)")
    problem_syntax = ("BxSQxSKVxHQxHKVxD[:causal] or BxSxHxD[:causal], e.g. "
                      "8x4096x4096x32x8x128:causal")
    dtypes = SUPPORTED
    Problem = AttentionProblem
    bucketed = ("seqlen_q", "seqlen_kv")
    dynamic = ("batch", "seqlen_q", "seqlen_kv")
    categorical = ("heads_q", "heads_kv", "head_dim", "causal", "dtype")
    baseline_name = "torch scaled_dot_product_attention (cuDNN on CUDA)"
    kernel_module = kernels.__name__
    backends = BACKENDS
    unsupported = {"metal": _NO_METAL,
                   "hip:gfx11": "TileLang's layout inference for RDNA's WMMA fragments conflicts "
                                "between the scores and the probabilities (S and P) in the "
                                "softmax loop"}

    # ---- problems -------------------------------------------------------------------------------
    def bucket(self, problem: AttentionProblem) -> AttentionProblem:
        Sq, Skv = key_lengths(problem.seqlen_q, problem.seqlen_kv, problem.causal)
        return problem._replace(seqlen_q=Sq, seqlen_kv=Skv)

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                softmax_scale: float | None = None) -> Call:
        try:
            (B, Sq, Hq, D), (Bk, Skv, Hkv, Dk) = q.shape, k.shape
            dtype = q.dtype
            ok = (k.shape == v.shape and Bk == B and Dk == D and D in HEAD_DIMS and B and Sq
                  and Skv and Hq and Hkv and Hq % Hkv == 0 and dtype is k.dtype and dtype is v.dtype
                  and (dtype, q.is_cuda) in _ACCEPTED and q.device == k.device == v.device
                  and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1
                  and not ((q.requires_grad or k.requires_grad or v.requires_grad)
                           and torch.is_grad_enabled()))
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            self._validate(q, k, v)
            return empty_call(q.device, _empty_result(q))
        # The kernels index (b, s, h, d) densely: copy other layouts.
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
        if softmax_scale is not None and softmax_scale != D ** -0.5:
            # The kernels bake in 1/sqrt(head_dim); another scale is folded into q.
            q = q * (check_scale(softmax_scale, "flash_attention") * D ** 0.5)
        problem = AttentionProblem(B, *key_lengths(Sq, Skv, causal), Hq, Hkv, D, bool(causal),
                                   DTYPE_NAMES[dtype])
        return Call(q.device, problem, (q, k, v, bool(causal), RepeatedKV()))

    def _validate(self, q: Any, k: Any, v: Any) -> None:
        """Raise the clear error for a call that `prepare`'s fast checks rejected; return only
        where the call is valid but a size is 0: no query or no key (`_empty_result`)."""
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            raise TypeError("flash_attention expects tensors q, k, v; got "
                            f"{', '.join(type(t).__name__ for t in (q, k, v))}")
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("flash_attention expects 4-D q (batch, seqlen_q, heads_q, head_dim) "
                             f"and k, v (batch, seqlen_kv, heads_kv, head_dim); got {shapes}")
        if q.device.type == "mps":
            raise ValueError(_NO_METAL)
        if not q.device == k.device == v.device:
            raise ValueError(f"flash_attention: q, k, v on different devices ({q.device}, "
                             f"{k.device}, {v.device})")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"flash_attention: q, k, v have dtypes {dtype_name(q.dtype)}, "
                            f"{dtype_name(k.dtype)}, {dtype_name(v.dtype)}; they must match")
        kind = "cuda" if q.is_cuda else "cpu"
        if kind not in SUPPORTED or q.device.type not in ("cuda", "cpu"):
            raise ValueError(f"flash_attention runs on CUDA and CPU tensors, not {q.device}")
        if dtype_name(q.dtype) not in SUPPORTED[kind]:
            raise TypeError(f"flash_attention on {kind}: dtype {dtype_name(q.dtype)} is not "
                            f"supported (allowed: {', '.join(SUPPORTED[kind])})")
        if k.shape != v.shape:
            raise ValueError(f"flash_attention: k and v shapes differ ({shapes})")
        (B, Sq, Hq, D), (Bk, Skv, Hkv, Dk) = q.shape, k.shape
        if Bk != B:
            raise ValueError(f"flash_attention: batch sizes differ ({shapes})")
        if Dk != D:
            raise ValueError(f"flash_attention: head dims differ ({shapes})")
        if D not in HEAD_DIMS:
            raise ValueError(f"flash_attention: head_dim {D} is not supported (allowed: "
                             f"{', '.join(map(str, HEAD_DIMS))})")
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"flash_attention: heads_q ({Hq}) must be a multiple of heads_kv "
                             f"({Hkv}), which must be >= 1")
        refuse_grad("flash_attention", q=q, k=k, v=v)
        if min(B, Sq, Skv, Hq) == 0:
            return
        raise ValueError("flash_attention: the last dimension (head_dim) of q, k and v must be "
                         "contiguous (stride 1); strides are "
                         f"{q.stride()}, {k.stride()}, {v.stride()}")

    def parse_exact(self, text: str, dtype: str) -> AttentionProblem:
        match = re.fullmatch(r"\s*(\d+(?:x\d+){3}|\d+(?:x\d+){5})(:causal)?\s*", text)
        if not match:
            raise ValueError(f"bad attention shape {text!r}: expected BxSQxSKVxHQxHKVxD or "
                             "BxSxHxD, optionally followed by :causal")
        if dtype not in DTYPES:
            raise ValueError(f"bad dtype {dtype!r} for flash_attention: expected one of "
                             f"{', '.join(DTYPES)}")
        sizes = [int(x) for x in match.group(1).split("x")]
        if len(sizes) == 4:
            B, S, H, D = sizes
            sizes = [B, S, S, H, H, D]
        B, Sq, Skv, Hq, Hkv, D = sizes
        if min(sizes) < 1 or Hq % Hkv or D not in HEAD_DIMS:
            raise ValueError(f"bad attention shape {text!r}: sizes must be >= 1, heads_q a "
                             f"multiple of heads_kv and head_dim one of {HEAD_DIMS}")
        return AttentionProblem(B, Sq, Skv, Hq, Hkv, D, match.group(2) is not None, dtype)

    def launch(self, kernel, args: tuple, out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the kernel; `out`, when given, is the pair (O, LSE) of buffers to write."""
        q, k, v, *_ = args
        if out is None:
            B, Sq, Hq, _ = q.shape
            out = (torch.empty_like(q),
                   torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device))
        kernel(q, k, v, out[0], out[1])
        return out

    def distance(self, a: AttentionProblem, b: AttentionProblem) -> float | None:
        """None between a chunked-prefill problem (causal, fewer queries than keys) and one that
        is not: on CUDA they run different baselines (memory-efficient, cuDNN), and the tile
        kernel's work differs in shape (a trapezoid, not a triangle)."""
        if _chunked(a) != _chunked(b):
            return None
        return super().distance(a, b)

    def dispatches_baseline(self, problem: AttentionProblem, target: Target) -> bool:
        """Not for chunked prefill with grouped heads on CUDA: the memory-efficient kernel takes
        K and V repeated to the query heads, a copy its timing makes once (`RepeatedKV`) and a
        call would make every time (such copies took cuDNN's own time again and more at batch 32
        x 1024 tokens, 32 query and 8 KV heads, on the H200). cuDNN takes grouped heads natively."""
        return not (target.kind == "cuda" and problem.heads_q != problem.heads_kv
                    and _chunked(problem))

    def launch_baseline(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, causal, repeated = args
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        Sq, Skv = q.shape[1], k.shape[1]
        lower_right = causal and Sq != Skv  # SDPA's is_causal aligns top-left; ours bottom-right
        if q.is_cuda and not lower_right and "CUDNN_ATTENTION" in BASELINE_BACKENDS:
            # cuDNN attention, called directly: the public SDPA does not return the lse.
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qt, kt, vt, None, True, 0.0, causal, False)[:2]
            return out.transpose(1, 2), lse.reshape(q.shape[0], q.shape[2], Sq)
        if q.is_cuda and lower_right and Sq < Skv:
            # Chunked prefill. cuDNN through torch aligns the mask top-left only; the
            # memory-efficient kernel masks bottom-right (custom_mask_type 2) and returns the lse
            # in the same pass. (With Sq > Skv its rows past the first Sq - Skv do not follow
            # that alignment: measured on the H200, so those calls keep the masked SDPA below.)
            kt, vt = repeated.of(kt, vt, q.shape[2] // k.shape[2])
            out, lse = torch.ops.aten._efficient_attention_forward(
                q, kt.transpose(1, 2), vt.transpose(1, 2), None, None, None, None, None, 0.0, 2,
                True)[:2]
            return out, lse[:, :, :Sq]
        mask = None
        if lower_right:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(Sq, Skv)
        kwargs = {"attn_mask": mask, "is_causal": causal and mask is None,
                  "enable_gqa": q.shape[2] != k.shape[2]}
        if q.is_cuda and mask is None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend[name] for name in BASELINE_BACKENDS]):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs)
        if lower_right and Sq > Skv:  # SDPA gives NaN rows where we give zeros: queries
            out[:, :, :Sq - Skv] = 0  # i < Sq - Skv see no key
        # A second pass for the lse (fp32, chunked): this path's time includes it.
        _, lse = _attention(q, k, v, causal, q.shape[3] ** -0.5, torch.float32, need_out=False)
        return out.transpose(1, 2), lse

    def reported_beside(self, args: tuple) -> dict[str, Any]:
        """SDPA's flash backend (grouped heads natively), where it can run the problem: CUDA, and
        no bottom-right causal mask it would need as a tensor."""
        q, k, v, causal, _ = args
        if not q.is_cuda or (causal and q.shape[1] != k.shape[1]):
            return {}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def flash() -> torch.Tensor:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])

        return {"sdpa_flash": flash}

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: AttentionProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        sizes = sizes or {}
        Sq, Skv = sizes.get("seqlen_q", problem.seqlen_q), sizes.get("seqlen_kv", problem.seqlen_kv)
        B, Hq, Hkv, D = problem.batch, problem.heads_q, problem.heads_kv, problem.head_dim
        gen = torch.Generator(device=device).manual_seed(seed)  # on the device: fast
        dtype = DTYPES[problem.dtype]
        q, k, v = (torch.randn(B, S, H, D, generator=gen, device=device).to(dtype)
                   for S, H in ((Sq, Hq), (Skv, Hkv), (Skv, Hkv)))
        return (q, k, v, problem.causal)

    def reference(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(O, LSE) in float64; rows with no visible key: O = 0, LSE = -inf."""
        q, k, v, causal = inputs[:4]
        scale = inputs[4] if len(inputs) > 4 and inputs[4] is not None else q.shape[3] ** -0.5
        return _attention(q, k, v, causal, scale, torch.float64)

    # Matrix products over each visible (query, key) pair: Q K^T and P V (the backward's five).
    products = 2

    def flops(self, problem: AttentionProblem) -> float:
        B, Sq, Skv, Hq, _, D, causal, _ = problem
        return 2.0 * self.products * B * Hq * D * _visible_pairs(Sq, Skv, causal)

    def bytes_moved(self, problem: AttentionProblem) -> float:
        B, Sq, Skv, Hq, Hkv, D, _, dtype = problem
        return (2 * B * Sq * Hq * D + 2 * B * Skv * Hkv * D) * DTYPE_SIZES[dtype] + 4 * B * Hq * Sq

    def tolerance(self, problem: AttentionProblem) -> float:
        return 1e-5 if problem.dtype == "float32" else 1e-2

    def check_sizes(self, problem: AttentionProblem) -> list[dict[str, int]]:
        """Also unequal lengths both ways within the buckets: more queries than keys leaves
        causal rows that see no key, fewer shifts the mask's diagonal, and both put the last KV
        and query blocks part past the edge (how the `overlap` schedule's race first showed,
        at (1000, 999), (129, 1000) and (1000, 129))."""
        sizes = super().check_sizes(problem)
        Sq, Skv = problem.seqlen_q, problem.seqlen_kv
        if Skv > 2:
            sizes.append({"seqlen_kv": Skv // 2 + 1})
        if Sq > 2:
            sizes.append({"seqlen_q": Sq // 2 + 1})
        return sizes


def _future(Sq: int, Skv: int, device: torch.device) -> torch.Tensor:
    """The keys each query may not see under the bottom-right-aligned causal mask."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Skv, device=device)[None, :]
    return j > i + (Skv - Sq)


def _visible_pairs(Sq: int, Skv: int, causal: bool) -> float:
    """(query, key) pairs the mask leaves: Sq * Skv, or about half of Sq^2 when causal."""
    if not causal:
        return float(Sq * Skv)
    # Query i sees min(Skv, max(0, i + Skv - Sq + 1)) keys.
    first = max(0, Sq - Skv)  # queries before this see nothing
    n = Sq - first
    lo, hi = first + Skv - Sq + 1, Sq - 1 + Skv - Sq + 1
    return float((lo + hi) * n / 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               dtype: torch.dtype, need_out: bool = True) -> tuple[torch.Tensor | None,
                                                                   torch.Tensor]:
    """Plain softmax attention in `dtype` on q's device, by KV head and query chunk (the scores
    of a chunk stay under ~32M elements, so long sequences fit in memory); (O, LSE)."""
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    out = torch.empty((B, Sq, Hq, D), dtype=dtype, device=q.device) if need_out else None
    lse = torch.empty((B, Hq, Sq), dtype=dtype, device=q.device)
    hidden = _future(Sq, Skv, q.device) if causal else None
    rows = max(1, (1 << 25) // (group * Skv))
    for b in range(B):
        for h in range(Hkv):
            heads = slice(h * group, (h + 1) * group)
            kd, vd = k[b, :, h].to(dtype), v[b, :, h].to(dtype)
            for i in range(0, Sq, rows):
                s = torch.einsum("qgd,kd->gqk", q[b, i:i + rows, heads].to(dtype), kd) * scale
                if causal:
                    s.masked_fill_(hidden[i:i + rows], float("-inf"))
                chunk_lse = torch.logsumexp(s, dim=-1)
                lse[b, heads, i:i + rows] = chunk_lse
                if need_out:  # a row that sees no key (lse -inf) gets zeros; NaN stays NaN
                    p = torch.exp(s - chunk_lse[..., None]).masked_fill_(
                        chunk_lse[..., None] == float("-inf"), 0.0)
                    out[b, i:i + rows, heads] = (p @ vd).transpose(0, 1)
    return out, lse


ATTENTION = AttentionSpec()
