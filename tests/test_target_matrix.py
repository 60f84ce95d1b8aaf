"""The platform matrix: every operator on every GPU target we cannot run here, by code generation.

For each (operator, target) `MATRIX` says what happens, and the tests check exactly that:

* LOWERS: the default configuration for a small problem is in the target's space and passes
  `check_config`, and the generated source uses the target's matrix instructions (`MARKERS`);
* REFUSED: the spec declares no kernel for the target (its kind, or its kind and arch where
  TileLang fails to lower the program: the spec's `unsupported` says why), and a call on that
  target raises `NotImplementedError` with that reason before anything is compiled.

A spec declares how each kind's kernels are made in one table, `OpSpec.backends` (one `Backend`
per kind, beside one space per kind in configs/<op>.toml); the tests below check that `build` and
`adapt` take the table's entry and that a kind with none is refused like an unsupported target.

The README's Platforms table is this matrix.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

from tileops.dispatch import DISPATCHER, lower
from tileops.ops import SPECS
from tileops.spec import _spaces
from tileops.target import KINDS, Target

TARGETS = {
    "sm_90a": Target("cuda", "sm_90a", "H200", 132),
    "sm_80": Target("cuda", "sm_80", "A100", 108),
    "gfx942": Target("hip", "gfx942", "MI300X", 304),
    "gfx1100": Target("hip", "gfx1100", "RX 7900 XTX", 96),
    "metal": Target("metal", "apple", "Apple GPU"),
}
MARKERS = {"sm_90a": "wgmma", "sm_80": "mma", "gfx942": "mfma", "gfx1100": "wmma",
           "metal": "simdgroup"}

# The smallest problems (spec syntax, dtype) whose default tiles still take the tensor-core path.
PROBLEMS = {
    "gemm": ("128x256x256", "float16"),
    "mxfp4_gemm": ("16x256x256", "bfloat16"),
    "mxfp4_gemm_packed": ("16x256x256", "bfloat16"),
    "attention": ("1x128x128x32x8x128:causal", "bfloat16"),
    "attention_backward": ("1x128x128x32x8x128:causal", "bfloat16"),
    "attention_varlen": ("128x128x32x8x128:causal", "bfloat16"),
    "attention_varlen_backward": ("128x128x32x8x128:causal", "bfloat16"),
    "attention_paged": ("1x128x256x32x8x128x128:causal", "bfloat16"),
    "mla_decode": ("B1xS128xH16", "bfloat16"),
}

LOWERS, REFUSED = "lowers", "refused"
MATRIX = {
    #              sm_90a  sm_80    gfx942   gfx1100  metal
    "gemm":       (LOWERS, LOWERS,  LOWERS,  LOWERS,  LOWERS),
    "mxfp4_gemm": (LOWERS, LOWERS,  LOWERS,  LOWERS,  LOWERS),
    "mxfp4_gemm_packed": (LOWERS, REFUSED, REFUSED, REFUSED, REFUSED),  # RS wgmma: sm_90 only
    "attention":  (LOWERS, LOWERS,  LOWERS,  REFUSED, REFUSED),
    "attention_varlen": (LOWERS, REFUSED, REFUSED, REFUSED, REFUSED),  # TMA, async wgmma: sm_90
    "attention_backward": (LOWERS, REFUSED, REFUSED, REFUSED, REFUSED),  # TMA reduce-add: sm_90
    "attention_varlen_backward": (LOWERS, REFUSED, REFUSED, REFUSED, REFUSED),  # as the dense one
    "attention_paged": (LOWERS, REFUSED, REFUSED, REFUSED, REFUSED),
    "mla_decode": (LOWERS, REFUSED, REFUSED, REFUSED, REFUSED),
}


def _cases(outcome: str) -> list:
    return [pytest.param(op, name, id=f"{op}-{name}")
            for op, row in MATRIX.items()
            for name, entry in zip(TARGETS, row, strict=True) if entry == outcome]


def problem(op: str) -> tuple:
    text, dtype = PROBLEMS[op]
    return SPECS[op].parse_problem(text, dtype)


@functools.cache
def _source(op: str, name: str, overrides: tuple) -> str:
    spec, target = SPECS[op], TARGETS[name]
    config = {**spec.default_config(problem(op), target), **dict(overrides)}
    assert spec.check_config(problem(op), config, target) is None
    return lower(spec.build(problem(op), config, target), target).kernel_source


def source(op: str, name: str, **overrides) -> str:
    """The generated device code for the default config (with `overrides`); memoised."""
    return _source(op, name, tuple(sorted(overrides.items())))


def test_the_matrix_covers_every_operator_and_target():
    assert set(MATRIX) == set(SPECS) == set(PROBLEMS)
    assert all(len(row) == len(TARGETS) for row in MATRIX.values())


@pytest.mark.parametrize(("op", "name"), _cases(LOWERS))
def test_default_config_lowers_to_the_matrix_instructions(op, name):
    spec, target, p = SPECS[op], TARGETS[name], problem(op)
    assert spec.unsupported_reason(target) is None
    config = spec.default_config(p, target)
    assert set(config) == set(spec.space(target))
    assert spec.check_config(p, config, target) is None
    assert MARKERS[name] in source(op, name).lower()


def _no_compile(*args):
    raise AssertionError("a refused target reached compilation")


@pytest.mark.parametrize(("op", "name"), _cases(REFUSED))
def test_target_is_refused_with_a_reason(op, name, monkeypatch):
    from tileops import dispatch

    spec, target = SPECS[op], TARGETS[name]
    reason = spec.unsupported_reason(target)
    assert reason and target.kind in reason and op in reason
    # A call on that target (its tensors simulated on the CPU) is refused before any compile.
    monkeypatch.setattr(dispatch._target, "target_of", lambda device: target)
    monkeypatch.setattr(dispatch, "compile_kernel", _no_compile)
    inputs = spec.make_inputs(problem(op), torch.device("cpu"))
    with pytest.raises(NotImplementedError, match=re.escape(reason)):
        DISPATCHER(spec, *inputs)


K_PACK_OPS = [op for op, spec in SPECS.items()
              if spec.unsupported_reason(TARGETS["gfx942"]) is None
              and "k_pack" in spec.space(TARGETS["gfx942"])]


def test_every_operator_on_gfx942_varies_k_pack():
    served = [op for op, spec in SPECS.items() if spec.unsupported_reason(TARGETS["gfx942"]) is None]
    assert served == K_PACK_OPS


@pytest.mark.parametrize("op", K_PACK_OPS)
def test_k_pack_changes_the_mfma_program(op):
    one, two = source(op, "gfx942", k_pack=1), source(op, "gfx942", k_pack=2)
    assert "mfma" in two.lower() and one != two


# ---- the per-kind table ------------------------------------------------------------------------
BY_KIND = {"cuda": TARGETS["sm_90a"], "hip": TARGETS["gfx942"], "metal": TARGETS["metal"],
           "cpu": Target("cpu", "x86_64", "CPU", 2), "ascend": Target("ascend", "910B", "NPU")}


@pytest.mark.parametrize("op", SPECS)
def test_each_kind_with_a_space_has_a_backend_and_no_other(op):
    spec = SPECS[op]
    assert set(spec.backends) == set(_spaces(op)), "configs/<op>.toml and the spec's backends"
    assert set(KINDS) == set(BY_KIND)
    served = {kind for kind in KINDS if spec.unsupported_reason(BY_KIND[kind]) is None}
    assert served <= set(spec.backends)


@pytest.mark.parametrize(("op", "kind"), [(op, kind) for op, spec in SPECS.items()
                                          for kind in spec.backends
                                          if spec.unsupported_reason(BY_KIND[kind]) is None])
def test_build_and_adapt_take_the_kinds_backend(op, kind, monkeypatch):
    """`build` calls the table's program with the problem's program arguments, the configuration
    and what the backend derives; `adapt` wraps with the table's adapter."""
    spec, target = SPECS[op], BY_KIND[kind]
    p = spec.parse_problem(*PROBLEMS[op])
    config = spec.default_config(p, target)
    calls = []
    backend = dataclasses.replace(
        spec.backends[kind], program=lambda *a, **kw: calls.append((a, kw)) or "program",
        adapt=lambda kernel: ("adapted", kernel))
    monkeypatch.setattr(spec, "backends", {**spec.backends, kind: backend})
    assert spec.build(p, config, target) == "program"
    (args, kwargs), = calls
    assert args == spec.program_args(p)
    derived = backend.derived(p, config, target) if backend.derived else {}
    assert kwargs == {**config, **derived}
    assert spec.adapt("kernel", target) == ("adapted", "kernel")


def test_a_kind_without_a_backend_is_refused_before_compiling(monkeypatch):
    from tileops import dispatch

    spec, target = SPECS["gemm"], TARGETS["metal"]
    monkeypatch.setattr(spec, "backends", {k: v for k, v in spec.backends.items() if k != "metal"})
    reason = spec.unsupported_reason(target)
    assert reason == "gemm has no kernel for metal targets yet (its spec declares no metal backend)"
    p = problem("gemm")
    for call in (lambda: spec.build(p, {}, target), lambda: spec.default_config(p, target),
                 lambda: spec.check_config(p, {}, target), lambda: spec.adapt(None, target)):
        with pytest.raises(ValueError, match=re.escape(reason)):
            call()
    monkeypatch.setattr(dispatch._target, "target_of", lambda device: target)
    monkeypatch.setattr(dispatch, "compile_kernel", _no_compile)
    with pytest.raises(NotImplementedError, match=re.escape(reason)):
        DISPATCHER(spec, *spec.make_inputs(p, torch.device("cpu")))


@pytest.mark.parametrize("op", SPECS)
def test_kernel_key_drops_exactly_the_dynamic_fields(op):
    """Every bucketed field is dynamic in the kernel; what is left keys compiled kernels."""
    spec = SPECS[op]
    dynamic = spec.bucketed if spec.dynamic is None else spec.dynamic
    assert set(spec.bucketed) <= set(dynamic) <= set(spec.Problem._fields)
    p = spec.parse_problem(*PROBLEMS[op])
    assert spec.kernel_key(p) == tuple(getattr(p, f) for f in spec.Problem._fields
                                       if f not in dynamic)


def test_attention_and_mla_kernels_serve_every_batch_and_length():
    attention, mla = SPECS["attention"], SPECS["mla_decode"]
    assert attention.kernel_key(attention.Problem(8, 4096, 2048, 32, 8, 128, True, "bfloat16")) \
        == (32, 8, 128, True, "bfloat16")
    assert mla.kernel_key(mla.Problem(64, 4096, 128, 2, "bfloat16")) == (128, 2, "bfloat16")
