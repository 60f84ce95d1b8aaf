"""The MLA decode GPU program lowers for CUDA sm_90a without the hardware (and compiles with nvcc)."""

from __future__ import annotations

import functools
import shutil

import pytest
from test_codegen import H200

from tileops.dispatch import lower
from tileops.ops.mla import MLA_DECODE


@pytest.mark.parametrize("problem_text", ["B1xS32768xH128", "B4xS1000xH16xQ2"])
def test_mla_lowers_to_wgmma_on_sm90a(problem_text):
    problem = MLA_DECODE.parse_problem(problem_text, "bfloat16")
    config = MLA_DECODE.default_config(problem, H200)
    assert config["threads"] == 384 and config["num_splits"] == 1  # the seesaw over the plan
    src = lower(MLA_DECODE.build(problem, config, H200), H200).kernel_source
    assert "wgmma" in src
    # batch, the plan's parts and its partial slots are dynamic dimensions of the kernel
    assert "int batch" in src and "int n_parts" in src and "int slots" in src


def test_the_split_kernel_lowers_on_sm90a():
    problem = MLA_DECODE.parse_problem("B1xS32768xH128", "bfloat16")
    config = {"block_H": 64, "block_N": 64, "num_stages": 2, "threads": 256, "num_splits": 32}
    assert MLA_DECODE.check_config(problem, config, H200) is None
    src = lower(MLA_DECODE.build(problem, config, H200), H200).kernel_source
    assert "wgmma" in src and "int batch" in src and "parts" not in src


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


SEESAW = ("B64xS8192xH128", {"block_H": 64, "block_N": 64, "num_stages": 2, "threads": 384,
                             "num_splits": 1})


@functools.cache
def seesaw_source() -> str:
    problem = MLA_DECODE.parse_problem(SEESAW[0], "bfloat16")
    return lower(MLA_DECODE.build(problem, SEESAW[1], H200), H200).kernel_source


def test_seesaw_schedule_lowers_with_its_roles():
    # threads 384: two consumer warpgroups (240 registers each, the rest's P from registers) and
    # a TMA producer (24), each key block three TMA tiles evicted first.
    problem = MLA_DECODE.parse_problem(SEESAW[0], "bfloat16")
    assert MLA_DECODE.check_config(problem, SEESAW[1], H200) is None
    src = seesaw_source()
    assert src.count("warpgroup_reg_alloc<240>") == 2 and "warpgroup_reg_dealloc<24>" in src
    assert src.count("wgmma_rs") == 2 and src.count("wgmma_ss") == 8  # 2 x 3 Q K^T, 2 P V
    assert src.count("EVICT_FIRST") == 6
    assert "q_empty[0].init(256)" in src  # Q reloaded per segment once both have read it
    assert "mla_decode_kernel_1" in src  # the combine of the split sequences
    # ... launched as the seesaw's programmatic dependent, three 8-warp CTAs an SM; the seesaw
    # lets it launch only as its CTAs exit (an early trigger cost 3% at B64 L4096 h_q 16)
    assert "cudaGridDependencySynchronize" in src and "__launch_bounds__(256, 3)" in src
    assert "cudaTriggerProgrammaticLaunchCompletion" not in src


def test_seesaw_below_64_rows_stores_only_its_rows():
    # h_q 16: the 64-row Q tile comes from the flattened (batch * rows) view, one TMA box; of
    # each warpgroup only the first warp (rows 0-15) stores.
    problem = MLA_DECODE.parse_problem("B64xS4096xH16", "bfloat16")
    config = {"block_H": 64, "block_N": 64, "num_stages": 2, "threads": 384, "num_splits": 1}
    assert MLA_DECODE.check_config(problem, config, H200) is None
    src = lower(MLA_DECODE.build(problem, config, H200), H200).kernel_source
    assert "Q_rows_desc" in src and "(bx * 16));" in src  # the segment's sequence's rows
    assert "if (((int)threadIdx.x) < 32) {" in src and "if (((int)threadIdx.x) < 160) {" in src


@pytest.mark.parametrize(("problem_text", "change", "why"), [
    ("B64xS8192xH16", {"block_H": 32}, "64 rows"),
    ("B64xS8192xH128", {"block_N": 32}, "64-key blocks"),
    ("B64xS8192xH128", {"num_stages": 1}, "2 buffers"),
    ("B64xS8192xH128", {"num_splits": 2}, "splits from the plan"),
])
def test_seesaw_schedule_refuses_what_it_cannot_take(problem_text, change, why):
    problem = MLA_DECODE.parse_problem(problem_text, "bfloat16")
    config = {"block_H": 64, "block_N": 64, "num_stages": 2, "threads": 384, "num_splits": 1}
    assert why in MLA_DECODE.check_config(problem, {**config, **change}, H200)


def test_seesaw_code_does_not_follow_pythons_string_hashing():
    # Generated code is what records and `db restamp` compare, and what the kernel cache keys on:
    # a process with other string hashing than this one must generate the same kernel.
    import os
    import subprocess
    import sys

    script = ("from test_codegen import H200; from tileops.dispatch import lower; "
              "from tileops.ops.mla import MLA_DECODE as S; "
              f"p = S.parse_problem({SEESAW[0]!r}, 'bfloat16'); "
              f"print(lower(S.build(p, {SEESAW[1]!r}, H200), H200).kernel_source, end='')")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                           text=True, cwd=os.path.dirname(__file__),
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    assert other == seesaw_source()
