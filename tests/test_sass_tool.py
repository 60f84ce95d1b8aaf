"""benchmarks/sass.py: the SASS summary parser, and the whole tool where cuobjdump is installed."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_tool", ROOT / "benchmarks" / "sass.py")
sass_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_tool)

SASS = """
	code for sm_90a
		Function : gemm_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;          /* 0x00000a00ff017b82 */
                                                                  /* 0x000ff00000000800 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;  /* 0x01e0 */
        /*0020*/              @!P0 BRA 0x5a0 ;                    /* 0xfffffffc00f08947 */
        /*0030*/               @P1 STL.64 [R1], R2 ;              /* 0x0 */
        /*0040*/                   NOP ;                          /* 0x0 */
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;  /* 0x0 */
"""
RESOURCES = """
Resource usage:
 Function gemm_kernel:
  REG:168 STACK:0 SHARED:2048 LOCAL:8 CONSTANT[0]:920 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_summary_counts_instructions_by_family():
    (kernel,) = sass_tool.summarise(SASS, RESOURCES).values()
    assert kernel["resources"]["REG"] == 168 and kernel["resources"]["LOCAL"] == 8
    assert kernel["instructions"] == 5  # NOP and the encoding-only lines are not counted
    assert dict(kernel["families"]) == {"HGMMA": 1, "STL": 1, "WARPGROUP": 1}


def test_a_cuda_tool_is_found_in_a_pip_wheels_bin(tmp_path, monkeypatch):
    # NVIDIA's wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) install into the `nvidia`
    # namespace package's cu*/bin/, which is not on PATH.
    tool = tmp_path / "nvidia" / "cu99" / "bin" / "tileops-test-tool"
    tool.parent.mkdir(parents=True)
    tool.write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert sass_tool.cuda_tool("tileops-test-tool") == str(tool)
    assert sass_tool.cuda_tool("tileops-no-such-tool") is None


@pytest.mark.skipif(not (shutil.which("cuobjdump") and shutil.which("nvcc")),
                    reason="needs nvcc and cuobjdump")
def test_sass_of_the_default_gemm_has_hopper_mma():
    out = subprocess.run([sys.executable, "benchmarks/sass.py", "--op", "gemm", "--shape",
                          "256x256x256"], cwd=ROOT, check=True, capture_output=True, text=True,
                         timeout=600).stdout
    assert "HGMMA" in out and "registers" in out
