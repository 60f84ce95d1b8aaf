"""GEMM's default configurations on every target kind: in the kind's space and valid. Lowering on
each GPU target (and k_pack on MFMA) is checked by the platform matrix, test_target_matrix.py."""

from __future__ import annotations

import pytest

from tileops.ops.gemm import GEMM
from tileops.target import Target

P = GEMM.Problem(256, 1024, 1024, "float16", "nk", "float16")


@pytest.mark.parametrize("kind", ["cuda", "hip", "metal", "cpu"])
def test_default_config_is_in_the_space_and_valid(kind):
    target = Target(kind, {"cuda": "sm_90a", "hip": "gfx942", "metal": "apple", "cpu": "x86_64"}[kind],
                    "sim", 100)
    config = GEMM.default_config(P, target)
    assert set(config) == set(GEMM.space(target))
    assert GEMM.check_config(P, config, target) is None
