"""MLA decode (DeepSeek-V2/V3 multi-head latent attention) over a paged cache, as FlashMLA does it.

q (batch, s_q, h_q, 576) attends to the first `cache_seqlens[b]` rows of a paged cache
kv_cache (num_blocks, 64, 1, 576) through block_table (batch, max_blocks); values are the first
512 channels of the cache rows. Returns out (batch, s_q, h_q, 512) in q's dtype and the natural
log-sum-exp of the scaled scores, lse (batch, h_q, s_q) fp32. With s_q = 2 (multi-token
prediction) token t sees keys j < seqlen - (s_q - 1 - t).

Problem key: (batch, seqlen bucket, h_q, s_q, dtype); the bucket is the next power of two at or
above the longest sequence of the batch (taken as at least s_q and at most 64 * max_blocks). The
compiled kernel depends only on (h_q, s_q, dtype) and the configuration: batch, cache size, table
width and the lengths are run-time values, so a serving loop whose batch changes compiles at most
one kernel per distinct configuration (in practice per num_splits the heuristic or the database
picks).

The kernels read every length on the device and clamp what they read (kernels.py), so the longest
length only chooses the configuration, never the result, and the host need not know it exactly.
Where it comes from (`_longest`), in order: `MlaMetadata` (`mla_metadata`, made once per decode
step: no device read in the call), the strict check's read (`validate=True`), the table width
(64 * max_blocks, the bound the kernels clamp to) while a CUDA graph is being captured, and
otherwise one read of `cache_seqlens.max()`.

The problem text of `parse_problem` is `B<batch>xS<seqlen>xH<h_q>` with an optional `xQ<s_q>`,
e.g. `B64xS4096xH128` or `B4xS1000xH16xQ2`.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple

import torch

from ... import autotune
from ...spec import Backend, Call, Config, OpSpec, Space, check_scale, pow2_bucket, refuse_grad
from ...target import Target, target_of
from ..common import LOG2E
from ..host import DTYPE_SIZES, DTYPES, dtype_name, smem_limit
from . import kernels
from .kernels import D_LATENT, D_QK, PAGE
from .plan import MlaPlan, balanced_plan, parts_for

SUPPORTED = {"cuda": ("float16", "bfloat16"), "cpu": ("float32", "float16", "bfloat16")}
HEADS = (16, 32, 64, 128)
S_Q = (1, 2)
_ACCEPTED = {(DTYPES[name], kind == "cuda") for kind, names in SUPPORTED.items() for name in names}


class MlaProblem(NamedTuple):
    batch: int
    seqlen: int  # bucket of the longest sequence (a power of two)
    h_q: int
    s_q: int
    dtype: str


class MlaMetadata(NamedTuple):
    """What the `mla_decode` calls of one decode step need to choose their kernel without reading
    the device (FlashMLA's `get_mla_metadata` plays this part there); made by `mla_metadata`.

    `seqlen_bucket`, the power of two at or above the longest length, is all the kernel choice
    needs; holding the bucket rather than the length keeps the metadata of the steps of one bucket
    equal (a `torch.compile`d caller is not recompiled per length). It chooses the configuration
    only: a call whose lengths outgrow it still attends to every key (the kernels read the lengths
    on the device), with a configuration chosen for shorter sequences. `batch`, `h_q`, `s_q` must
    match the call's q. `plan` is the step's split-KV plan, balanced by keys over the device's
    SMs (plan.py): made on the device with no read back, and valid for every layer of the step.
    """

    seqlen_bucket: int
    batch: int
    h_q: int
    s_q: int
    plan: MlaPlan | None = None


def mla_metadata(cache_seqlens: torch.Tensor, h_q: int, s_q: int = 1, *,
                 max_seqlen: int | None = None) -> MlaMetadata:
    """The metadata of one decode step, to pass to each layer's `mla_decode(..., metadata=md)`:
    the kernel's key and the step's split-KV plan (`MlaMetadata`).

    Reads `cache_seqlens.max()` back to the host once (a synchronisation), unless the caller
    knows the longest length on the host already and passes `max_seqlen` (serving engines track
    lengths on the CPU): then nothing is read, and it may be called inside CUDA-graph capture
    (the plan is made by device ops from the lengths).
    """
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32:
        raise TypeError("mla_metadata: cache_seqlens must be an int32 tensor, got "
                        + (dtype_name(cache_seqlens.dtype) if isinstance(cache_seqlens, torch.Tensor)
                           else type(cache_seqlens).__name__))
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] < 1:
        raise ValueError(f"mla_metadata: cache_seqlens must be (batch >= 1,); got "
                         f"{tuple(cache_seqlens.shape)}")
    if h_q not in HEADS or s_q not in S_Q:
        raise ValueError(f"mla_metadata: h_q = {h_q}, s_q = {s_q}; supported h_q {HEADS}, "
                         f"s_q {S_Q}")
    if max_seqlen is None:
        if autotune.capturing(cache_seqlens.device):
            raise RuntimeError("mla_metadata reads cache_seqlens.max() back to the host, which "
                               "CUDA-graph capture forbids: call it before the capture, or pass "
                               "max_seqlen")
        max_seqlen = int(cache_seqlens.max())
    elif isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"mla_metadata: max_seqlen must be an int >= 0, got {max_seqlen!r}")
    plan = balanced_plan(cache_seqlens, None, _parts(cache_seqlens.device, h_q, s_q))
    return MlaMetadata(pow2_bucket(max(max_seqlen, 1)), cache_seqlens.shape[0], h_q, s_q, plan)


def _parts(device: torch.device, h_q: int, s_q: int) -> int:
    return parts_for(target_of(device).units or 1, s_q * h_q)


class MlaArgs(NamedTuple):
    """What `prepare` hands to the launch: tensors as the kernel takes them and the exp2 scale."""

    q: torch.Tensor  # (batch, s_q * h_q, 576) view of q
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    scale_log2: float  # softmax_scale * log2(e): the kernels exponentiate in base 2
    s_q: int
    h_q: int
    max_keys: int  # a bound on every clamped length, known on the host: the keys the baseline
    # gathers (the longest length where it was read, else 64 * max_blocks)
    plan: MlaPlan | None  # the step's (metadata's); None: made by a kernel that walks one


class _MlaKernel:
    """A compiled MLA program with its calling convention: it allocates the split-KV partial
    buffers (fp32) and, on the CPU target, passes bf16 tensors as their uint16 bits. Programs
    that walk a plan (the seesaw, the CPU form) take it after the lengths, and a slot per segment
    (at most batch + parts); the others a partial per split of each sequence."""

    def __init__(self, kernel: Any, cpu: bool):
        self.kernel, self.cpu = kernel, cpu
        buffers = {b.name: b for b in kernel.prim_func.buffer_map.values()}
        self.planned = "parts" in buffers
        self.num_splits = 0 if self.planned else int(buffers["O_part"].shape[2])

    def __call__(self, args: MlaArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
        q = args.q
        B, rows, _ = q.shape
        kv = args.kv_cache
        if self.planned:
            plan = args.plan if args.plan is not None else balanced_plan(
                args.cache_seqlens, args.block_table.shape[1], _parts(q.device, args.h_q,
                                                                      args.s_q))
            slots = B + plan.parts.shape[0]
            o_part = torch.empty(slots, rows, D_LATENT, dtype=torch.float32, device=q.device)
            l_part = torch.empty(slots, rows, dtype=torch.float32, device=q.device)
        else:
            o_part = torch.empty(B, rows, self.num_splits, D_LATENT, dtype=torch.float32,
                                 device=q.device)
            l_part = torch.empty(B, rows, self.num_splits, dtype=torch.float32, device=q.device)
            plan = ()
        if self.cpu and q.dtype is torch.bfloat16:
            q, kv, out = q.view(torch.uint16), kv.view(torch.uint16), out.view(torch.uint16)
        self.kernel(q, kv, args.block_table, args.cache_seqlens, *plan, args.scale_log2, o_part,
                    l_part, out, lse)


def _cuda_default(problem: MlaProblem, target: Target, space: Space) -> Config:
    """On sm_90 the seesaw schedule over the plan balanced by keys (which fills the machine at
    every batch and mix of lengths); elsewhere 64 query rows per CTA and enough KV splits to fill
    the machine (`default_splits`)."""
    if target.is_hopper:
        return {"block_H": 64, "block_N": 64, "num_stages": 2,
                "threads": kernels.SEESAW_THREADS, "num_splits": 1}
    ctas = problem.batch * -(-(problem.s_q * problem.h_q) // 64)
    # Two stages of 64 keys take 226 KiB of shared memory: sm_90's budget, not sm_80's.
    block_N = 64 if smem_limit(target.arch) >= 226 * 1024 else 32
    return {"block_H": 64, "block_N": block_N, "num_stages": 2, "threads": 256,
            "num_splits": default_splits(ctas, problem.seqlen, block_N, target.units or 132)}


def _check_cuda(problem: MlaProblem, config: Config, target: Target) -> str | None:
    """Shared memory, output accumulators per thread, splits longer than the keys."""
    bh, bn, threads = config["block_H"], config["block_N"], config["threads"]
    if threads == kernels.SEESAW_THREADS:
        if not target.is_hopper:
            return "the seesaw schedule (384 threads) is sm_90's: TMA, wgmma, setmaxnreg"
        if (bh, bn, config["num_stages"]) != (64, 64, 2):
            return "the seesaw schedule (384 threads) takes 64 rows, 64-key blocks in 2 buffers"
        if config["num_splits"] != 1:
            return "the seesaw schedule (384 threads) takes its splits from the plan"
    # Q, the pipelined key/value tiles, P; and about 2 KiB of barriers and alignment.
    smem = (bh * D_QK + config["num_stages"] * bn * D_QK + bh * bn) * 2 + 2048
    if smem > smem_limit(target.arch):
        return f"shared memory {smem // 1024} KiB > {smem_limit(target.arch) // 1024} KiB"
    if bh * D_LATENT // threads > 128:
        return f"{bh * D_LATENT // threads} output accumulators per thread (> 128 registers)"
    if config["num_splits"] > 1 and config["num_splits"] * bn > 2 * problem.seqlen:
        return f"{config['num_splits']} splits of {bn} keys for {problem.seqlen} keys"
    return None


# The kernels of each target kind (`MlaDecodeSpec.unsupported` says why hip and sm_8x have none).
# The cpu default is constant: configs/mla_decode.toml holds it beside its space.
BACKENDS = {"cpu": Backend(kernels.cpu_program, functools.partial(_MlaKernel, cpu=True)),
            "cuda": Backend(kernels.gpu_program, functools.partial(_MlaKernel, cpu=False),
                            check=_check_cuda, default=_cuda_default)}


class MlaDecodeSpec(OpSpec):
    name = "mla_decode"
    function = ("tileops.mla_decode(q, kv_cache, block_table, cache_seqlens, *, "
                "softmax_scale=None, head_dim_v=512, metadata=None, validate=False)")
    problem_syntax = "B<batch>xS<seqlen>xH<h_q>[xQ<s_q>], e.g. B64xS4096xH128 or B4xS1000xH16xQ2"
    dtypes = SUPPORTED
    Problem = MlaProblem
    bucketed = ("seqlen",)
    dynamic = ("batch", "seqlen")
    categorical = ("h_q", "s_q", "dtype")
    baseline_name = "torch (gather pages, matmul, softmax)"
    unsupported = {"hip": "TileLang's layout inference rejects the softmax row vectors against "
                          "the output accumulator's layout on gfx942",
                   "cuda:sm_8": "TileLang's software pipeline planner (used below sm_90) rejects "
                                "the key tile being written twice per step (the load, and the "
                                "zeroing of rows past the sequence's end)"}
    kernel_module = kernels.__name__
    backends = BACKENDS

    # ---- problems -------------------------------------------------------------------------------
    def prepare(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                cache_seqlens: torch.Tensor, softmax_scale: float | None = None,
                head_dim_v: int = D_LATENT, validate: bool = False,
                metadata: MlaMetadata | None = None) -> Call:
        try:
            B, s_q, h_q, d = q.shape
            _, page, h_kv, d_kv = kv_cache.shape
            ok = (d == D_QK and d_kv == D_QK and page == PAGE and h_kv == 1 and B >= 1
                  and kv_cache.shape[0] >= 1
                  and head_dim_v == D_LATENT and h_q in HEADS and s_q in S_Q
                  and kv_cache.dtype is q.dtype and (q.dtype, q.is_cuda) in _ACCEPTED
                  and block_table.dtype is torch.int32 and cache_seqlens.dtype is torch.int32
                  and block_table.dim() == 2 and block_table.shape[0] == B
                  and block_table.shape[1] >= 1 and cache_seqlens.shape == (B,)
                  and kv_cache.device == q.device == block_table.device == cache_seqlens.device
                  and kv_cache.is_contiguous() and (q.is_cuda or q.is_cpu)
                  and not ((q.requires_grad or kv_cache.requires_grad)
                           and torch.is_grad_enabled()))
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            _refuse(q, kv_cache, block_table, cache_seqlens, head_dim_v)
        block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()
        if metadata is not None:
            metadata = _checked_metadata(metadata, B, h_q, s_q, q.device)
        if softmax_scale is None:
            softmax_scale = D_QK ** -0.5
        elif not check_scale(softmax_scale, "mla_decode") > 0:  # the kernels take the row max
            raise ValueError(f"mla_decode: softmax_scale must be positive, got {softmax_scale}")
        longest, read = _longest(kv_cache, block_table, cache_seqlens, s_q, validate, metadata)
        width = block_table.shape[1] * PAGE  # what the kernels clamp every length to
        problem = MlaProblem(B, pow2_bucket(max(s_q, min(longest, width))), h_q, s_q,
                             dtype_name(q.dtype))
        args = MlaArgs(q.contiguous().view(B, s_q * h_q, D_QK), kv_cache, block_table,
                       cache_seqlens, float(softmax_scale) * LOG2E, s_q, h_q,
                       min(max(read, 0), width) if read is not None else width,
                       None if metadata is None else metadata.plan)
        return Call(q.device, problem, args)

    def parse_exact(self, text: str, dtype: str) -> MlaProblem:
        match = re.fullmatch(r"\s*B(\d+)xS(\d+)xH(\d+)(?:xQ(\d+))?\s*", text, re.IGNORECASE)
        if not match:
            raise ValueError(f"bad MLA decode problem {text!r}: expected B<batch>xS<seqlen>xH<h_q> "
                             "with an optional xQ<s_q>, e.g. B64xS4096xH128 or B4xS1000xH16xQ2")
        if dtype not in DTYPES:
            raise ValueError(f"bad dtype {dtype!r} for mla_decode: expected one of "
                             f"{', '.join(DTYPES)}")
        B, S, H = (int(match.group(i)) for i in (1, 2, 3))
        s_q = int(match.group(4) or 1)
        if B < 1 or H not in HEADS or s_q not in S_Q or s_q > S:
            raise ValueError(f"bad MLA decode problem {text!r}: batch >= 1, h_q in {HEADS}, "
                             f"s_q in {S_Q} and seqlen >= s_q")
        return MlaProblem(B, S, H, s_q, dtype)

    def serving_args(self, inputs: tuple) -> tuple:
        """`inputs` with the step's metadata, as a serving engine passes them to every layer."""
        q, _, _, cache_seqlens = inputs
        md = mla_metadata(cache_seqlens, q.shape[2], q.shape[1])
        return (*inputs, None, D_LATENT, False, md)

    # ---- configuration --------------------------------------------------------------------------
    def check_config(self, problem: MlaProblem, config: Config, target: Target) -> str | None:
        if PAGE % config["block_N"]:
            return f"block_N {config['block_N']} does not divide the page size {PAGE}"
        return super().check_config(problem, config, target)

    def dispatches_baseline(self, problem: MlaProblem, target: Target) -> bool:
        """Never: the baseline is torch gathering each sequence's pages for two matmuls, what
        the kernels are measured against, 3-40x slower than them at every suite shape on the
        H200; a problem far from every record runs the default tile (on sm_90 the seesaw)."""
        return False

    # ---- kernels --------------------------------------------------------------------------------
    def launch(self, kernel: Any, args: tuple, out: tuple | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the kernel; `out` is an (out, lse) pair of buffers to write, as the baseline returns.
        """
        q = args.q
        B, rows, _ = q.shape
        if out is None:
            out = (q.new_empty(B, args.s_q, args.h_q, D_LATENT),
                   torch.empty(B, args.h_q, args.s_q, dtype=torch.float32, device=q.device))
        kernel(args, out[0].view(B, rows, D_LATENT), out[1])
        return out

    def launch_baseline(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv, table, seqlens, scale_log2, s_q, h_q, max_keys, _ = args
        B = q.shape[0]
        pages = -(-max_keys // PAGE)
        table, seqlens = clamped(kv, table, seqlens)
        used = torch.arange(pages, device=q.device) * PAGE < seqlens[:, None]
        ids = torch.where(used, table[:, :pages], 0)
        k = kv[ids].view(B, pages * PAGE, D_QK)  # gather each sequence's pages, in order
        scores = torch.matmul(q, k.transpose(1, 2)).float() * (scale_log2 / LOG2E)
        mask = _visible(seqlens, pages * PAGE, s_q, h_q)
        scores.masked_fill_(~mask, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
        # A row that sees no key: zeros, as the kernels give (softmax would give NaN).
        p = torch.softmax(scores, dim=-1).masked_fill_(torch.isneginf(lse)[..., None], 0)
        p = p.to(q.dtype)
        out = torch.matmul(p, k[..., :D_LATENT])
        return (out.view(B, s_q, h_q, D_LATENT),
                lse.view(B, s_q, h_q).transpose(1, 2).contiguous())

    # ---- inputs, reference, roofline ------------------------------------------------------------
    def make_inputs(self, problem: MlaProblem, device: torch.device, seed: int = 0,
                    sizes: dict[str, int] | None = None) -> tuple:
        """Lengths vary within the longest one's last page (the FLOP and byte models count
        `seqlen` keys per sequence: exact to within 64 keys), the first sequence the longest; each
        sequence's pages are scattered over the cache by a random permutation; table entries past
        a sequence's pages hold -1 (never read)."""
        B, s_q = problem.batch, problem.s_q
        longest = (sizes or {}).get("seqlen", problem.seqlen)
        gen = torch.Generator(device=device).manual_seed(seed)
        lo = max(s_q, longest - PAGE + 1)
        seqlens = torch.randint(lo, longest + 1, (B,), generator=gen, device=device,
                                dtype=torch.int32)
        seqlens[0] = longest
        return paged_inputs(seqlens, problem.h_q, s_q, problem.dtype, gen)

    def reference(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return reference(*inputs)

    def flops(self, problem: MlaProblem) -> float:
        return 2.0 * problem.batch * problem.s_q * problem.h_q * problem.seqlen * (D_QK + D_LATENT)

    def bytes_moved(self, problem: MlaProblem) -> float:
        """The cache rows read (seqlen per sequence, each 576 wide) plus q and out."""
        B, S, h_q, s_q = problem.batch, problem.seqlen, problem.h_q, problem.s_q
        return (B * S * D_QK + B * s_q * h_q * (D_QK + D_LATENT)) * DTYPE_SIZES[problem.dtype]

    def tolerance(self, problem: MlaProblem) -> float:
        return 1e-5 if problem.dtype == "float32" else 1e-2


def paged_inputs(seqlens: torch.Tensor, h_q: int, s_q: int, dtype: str,
                 gen: torch.Generator) -> tuple:
    """Random (q, kv_cache, block_table, cache_seqlens) for the given lengths (int32, on the
    device the inputs go to): each sequence's pages scattered over the cache by a random
    permutation, table entries past a sequence's pages -1 (never read)."""
    device, B = seqlens.device, seqlens.shape[0]
    width = -(-int(seqlens.max()) // PAGE)
    counts = (seqlens + PAGE - 1) // PAGE
    num_blocks = int(counts.sum()) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    table = torch.full((B, width), -1, dtype=torch.int32, device=device)
    used = torch.arange(width, device=device) < counts[:, None]
    table[used] = perm[:int(counts.sum())]
    q = torch.randn((B, s_q, h_q, D_QK), generator=gen, device=device).to(DTYPES[dtype])
    kv = torch.randn((num_blocks, PAGE, 1, D_QK), generator=gen, device=device).to(DTYPES[dtype])
    return (q, kv, table, seqlens)


def default_splits(ctas: int, seqlen: int, block_N: int, units: int) -> int:
    """KV splits per sequence: enough CTAs to fill the machine once, each with >= 4 key blocks."""
    if ctas >= units:
        return 1
    want = -(-units // ctas)
    most = max(1, seqlen // (4 * block_N))
    return 1 << (min(want, most, 32).bit_length() - 1)


def reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
              cache_seqlens: torch.Tensor, softmax_scale: float | None = None,
              head_dim_v: int = D_LATENT, validate: bool = False,
              metadata: MlaMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64 on q's device: each sequence's pages gathered into a contiguous K,
    plain softmax. Lengths and page ids are clamped as the kernels clamp them (kernels.py), so a
    bad table has a defined result."""
    scale = D_QK ** -0.5 if softmax_scale is None else softmax_scale
    B, s_q, h_q, _ = q.shape
    block_table, cache_seqlens = clamped(kv_cache, block_table, cache_seqlens)
    out = torch.empty((B, s_q, h_q, D_LATENT), dtype=torch.float64, device=q.device)
    lse = torch.empty((B, h_q, s_q), dtype=torch.float64, device=q.device)
    for b, n in enumerate(cache_seqlens.tolist()):
        k = kv_cache[block_table[b, :-(-n // PAGE)].long()].reshape(-1, D_QK)[:n].double()
        s = torch.einsum("thd,jd->thj", q[b].double(), k) * scale
        keys = torch.arange(n, device=q.device)
        for t in range(s_q):
            s[t, :, keys >= n - (s_q - 1 - t)] = -math.inf
        row_lse = torch.logsumexp(s, dim=-1)
        lse[b] = row_lse.T
        p = torch.softmax(s, dim=-1).masked_fill_(row_lse[..., None] == -math.inf, 0.0)
        out[b] = p @ k[:, :D_LATENT]  # a row that sees no key: zeros (NaN stays NaN)
    return out, lse


def clamped(kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The table and lengths as the kernels read them (`kernels.page_of`, `kernels.seq_len`):
    page ids in [0, num_blocks), lengths in [0, 64 * max_blocks]; torch ops, no synchronisation.
    """
    return (block_table.clamp(0, kv_cache.shape[0] - 1),
            cache_seqlens.clamp(0, block_table.shape[1] * PAGE))


def _visible(seqlens: torch.Tensor, n: int, s_q: int, h_q: int) -> torch.Tensor:
    """(batch, s_q * h_q, n) mask of the keys each query row sees (the causal rule for s_q > 1)."""
    token = torch.arange(s_q * h_q, device=seqlens.device) // h_q
    limit = seqlens[:, None] - (s_q - 1 - token)[None, :]
    return torch.arange(n, device=seqlens.device)[None, None, :] < limit[:, :, None]


def _longest(kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
             s_q: int, validate: bool, metadata: MlaMetadata | None) -> tuple[int, int | None]:
    """The longest length (or its bucket) the problem key is made from, and the longest length
    read from the device (None: nothing was read). The order is the module docstring's."""
    if validate:
        if autotune.capturing(cache_seqlens.device):
            raise RuntimeError("mla_decode: validate=True reads the table and lengths back to the "
                               "host, which CUDA-graph capture forbids; validate outside the "
                               "graph, or capture with validate=False (the kernels clamp every "
                               "length and page id, so a bad table reads nothing outside the "
                               "cache)")
        read = _check_table(kv_cache, block_table, cache_seqlens, s_q)
        return (metadata.seqlen_bucket if metadata is not None else read), read
    if metadata is not None:
        return metadata.seqlen_bucket, None
    if autotune.capturing(cache_seqlens.device):
        return block_table.shape[1] * PAGE, None
    read = int(cache_seqlens.max())
    return read, read


def _checked_metadata(metadata: Any, B: int, h_q: int, s_q: int, device: torch.device
                      ) -> MlaMetadata:
    """`metadata` as an MlaMetadata (the custom op hands it over as its ints and plan tensors),
    made for a call of this batch, h_q and s_q: metadata of another step or model is a mistake.
    """
    given = metadata
    if type(metadata) is not MlaMetadata:  # the common case skips the conversion: every layer
        try:
            metadata = MlaMetadata(*metadata)
        except TypeError:
            metadata = None
    if metadata is None or type(metadata.seqlen_bucket) is not int or metadata.seqlen_bucket < 0:
        raise TypeError("mla_decode: metadata must be what tileops.mla_metadata returns, got "
                        f"{given!r}")
    if metadata[1:4] != (B, h_q, s_q):
        raise ValueError(f"mla_decode: metadata was made for batch {metadata.batch}, h_q "
                         f"{metadata.h_q}, s_q {metadata.s_q}; this call has batch {B}, h_q "
                         f"{h_q}, s_q {s_q}")
    plan = metadata.plan
    if plan is not None and not (
            isinstance(plan, MlaPlan) and isinstance(plan.parts, torch.Tensor)
            and isinstance(plan.seqs, torch.Tensor) and plan.parts.dtype == torch.int32
            and plan.seqs.dtype == torch.int32 and plan.parts.dim() == 2
            and plan.parts.shape[0] >= 1 and plan.parts.shape[1] == kernels.PART_FIELDS
            and tuple(plan.seqs.shape) == (B, kernels.SEQ_FIELDS)
            and plan.parts.device == plan.seqs.device == device
            and plan.parts.is_contiguous() and plan.seqs.is_contiguous()):
        raise TypeError(f"mla_decode: metadata.plan must be the plan tileops.mla_metadata makes "
                        f"for this batch of {B} on {device}")
    return metadata


def _check_table(kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                 s_q: int) -> int:
    """The longest sequence, after checking the lengths and the table entries they use (the
    strict mode, `validate=True`): one reduction over the table and one device-to-host copy of
    four numbers, a synchronisation."""
    num_blocks, width = kv_cache.shape[0], block_table.shape[1]
    used = (torch.arange(width, device=block_table.device) * PAGE)[None, :] < cache_seqlens[:, None]
    ids = torch.where(used, block_table, 0)
    longest, shortest, top, bottom = torch.stack(
        [cache_seqlens.max(), cache_seqlens.min(), ids.max(), ids.min()]).tolist()
    if shortest < s_q:
        raise ValueError(f"mla_decode: cache_seqlens holds {shortest}; every sequence needs at "
                         f"least s_q = {s_q} cached rows (the new tokens included)")
    if longest > width * PAGE:
        raise ValueError(f"mla_decode: cache_seqlens holds {longest} but block_table has "
                         f"{width} pages of {PAGE} rows ({width * PAGE}) per sequence")
    if top >= num_blocks or bottom < 0:
        bad = top if top >= num_blocks else bottom
        raise ValueError(f"mla_decode: block_table entry {bad} used by a sequence is outside the "
                         f"cache's {num_blocks} blocks")
    return longest


def _refuse(q: Any, kv: Any, table: Any, seqlens: Any, head_dim_v: Any) -> None:
    """Raise the clear error for a call that `prepare`'s fast checks rejected."""
    tensors = {"q": q, "kv_cache": kv, "block_table": table, "cache_seqlens": seqlens}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mla_decode: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 4 or q.shape[-1] != D_QK:
        raise ValueError(f"mla_decode: q must be (batch, s_q, h_q, {D_QK}); got "
                         f"{tuple(q.shape)}")
    B, s_q, h_q, _ = q.shape
    if kv.dim() != 4 or tuple(kv.shape[1:]) != (PAGE, 1, D_QK):
        raise ValueError(f"mla_decode: kv_cache must be (num_blocks, {PAGE}, 1, {D_QK}); got "
                         f"{tuple(kv.shape)}")
    if B < 1:
        raise ValueError("mla_decode: empty batch")
    if kv.shape[0] < 1:
        raise ValueError("mla_decode: kv_cache has no blocks")
    if h_q not in HEADS or s_q not in S_Q:
        raise ValueError(f"mla_decode: h_q = {h_q}, s_q = {s_q}; supported h_q {HEADS}, "
                         f"s_q {S_Q}")
    if head_dim_v != D_LATENT:
        raise ValueError(f"mla_decode: head_dim_v must be {D_LATENT}, got {head_dim_v}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError("mla_decode: tensors on different devices: "
                         + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"mla_decode runs on CUDA and CPU tensors, not {q.device.type}")
    if kv.dtype != q.dtype:
        raise TypeError(f"mla_decode: q is {dtype_name(q.dtype)} but kv_cache is "
                        f"{dtype_name(kv.dtype)}; both must have the same dtype")
    kind = "cuda" if q.is_cuda else "cpu"
    if dtype_name(q.dtype) not in SUPPORTED.get(kind, ()):
        raise TypeError(f"mla_decode on {q.device.type}: dtype {dtype_name(q.dtype)} is not "
                        f"supported (allowed: {', '.join(SUPPORTED[kind])})")
    for name, t in (("block_table", table), ("cache_seqlens", seqlens)):
        if t.dtype != torch.int32:
            raise TypeError(f"mla_decode: {name} must be int32, got {dtype_name(t.dtype)}")
    if table.dim() != 2 or table.shape[0] != B or table.shape[1] < 1:
        raise ValueError(f"mla_decode: block_table must be (batch={B}, max_blocks >= 1); got "
                         f"{tuple(table.shape)}")
    if tuple(seqlens.shape) != (B,):
        raise ValueError(f"mla_decode: cache_seqlens must be (batch={B},); got "
                         f"{tuple(seqlens.shape)}")
    if not kv.is_contiguous():
        raise ValueError("mla_decode: kv_cache must be contiguous (copying a cache per call "
                         "would cost more than the attention)")
    refuse_grad("mla_decode", q=q, kv_cache=kv)
    raise ValueError(f"mla_decode: unsupported inputs q {tuple(q.shape)} {q.dtype} on {q.device}")


MLA_DECODE = MlaDecodeSpec()
