"""The MLA decode GPU program lowers for CUDA sm_90a without the hardware (and compiles with nvcc)."""

from __future__ import annotations

import shutil

import pytest
from test_codegen import H200

from tileops.dispatch import lower
from tileops.ops.mla import MLA_DECODE


@pytest.mark.parametrize(("problem_text", "splits"),
                         [("B1xS32768xH128", 32), ("B4xS1000xH16xQ2", 4), ("B132xS4096xH128", 1)])
def test_mla_lowers_to_wgmma_on_sm90a(problem_text, splits):
    problem = MLA_DECODE.parse_problem(problem_text, "bfloat16")
    config = MLA_DECODE.default_config(problem, H200)
    assert config["num_splits"] == splits
    src = lower(MLA_DECODE.build(problem, config, H200), H200).kernel_source
    assert "wgmma" in src
    assert "int batch" in src  # batch is a dynamic dimension of the kernel


def test_every_cuda_config_is_checked_or_lowers():
    problem = MLA_DECODE.parse_problem("B132xS8192xH128", "bfloat16")
    configs = list(MLA_DECODE.configs(problem, H200))
    assert configs and all(c["threads"] * 128 >= c["block_H"] * 512 for c in configs)
    assert MLA_DECODE.default_config(problem, H200) in configs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_mla_compiles_with_nvcc():
    problem = MLA_DECODE.parse_problem("B2xS4096xH64xQ2", "float16")
    lower(MLA_DECODE.build(problem, MLA_DECODE.default_config(problem, H200), H200), H200,
          device_compile=True)
