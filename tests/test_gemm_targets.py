"""GEMM's GPU tile program on every GPU target we cannot run here: lowered, and the matrix
instructions each target should use checked in the generated source."""

from __future__ import annotations

import pytest

from tileops.dispatch import lower
from tileops.ops.gemm import GEMM
from tileops.target import Target

P = GEMM.Problem(256, 1024, 1024, "float16", "nk", "float16")


def source(target: Target, **overrides) -> str:
    config = dict(GEMM.default_config(P, target), **overrides)
    assert GEMM.check_config(P, config, target) is None
    return lower(GEMM.build(P, config, target), target).kernel_source


@pytest.mark.parametrize(
    ("target", "instruction"),
    [
        (Target("cuda", "sm_90a", "H200", 132), "wgmma"),
        (Target("cuda", "sm_80", "A100", 108), "mma"),
        (Target("hip", "gfx942", "MI300X", 304), "mfma"),
        (Target("hip", "gfx1100", "RX 7900 XTX", 96), "wmma"),
        (Target("metal", "apple", "Apple GPU"), "simdgroup"),
    ],
)
def test_gemm_lowers_with_the_target_matrix_instructions(target, instruction):
    assert instruction in source(target).lower()


def test_k_pack_changes_the_mfma_program():
    mi300 = Target("hip", "gfx942", "MI300X", 304)
    one, two = source(mi300, k_pack=1), source(mi300, k_pack=2)
    assert "mfma" in two.lower() and one != two


@pytest.mark.parametrize("kind", ["cuda", "hip", "metal", "cpu"])
def test_default_config_is_in_the_space_and_valid(kind):
    target = Target(kind, {"cuda": "sm_90a", "hip": "gfx942", "metal": "apple", "cpu": "x86_64"}[kind],
                    "sim", 100)
    config = GEMM.default_config(P, target)
    assert set(config) == set(GEMM.space(target))
    assert GEMM.check_config(P, config, target) is None
