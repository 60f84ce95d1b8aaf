"""The "bf16x2" E2M1 decoder (CUDA source in tileops/ops/mxfp4/kernels.py), compiled by nvcc for
the host and checked against the format's reference decoder on every byte and every scale."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from tileops import dequantize_mxfp4
from tileops.ops.mxfp4.kernels import BF16X2_DECODE, BF16X2_SCALE, BF16X2_SOURCE

MAIN = r"""
#include <cstdio>
int main() {
  unsigned short out[8];
  for (unsigned int e = 0; e < 256; ++e)
    for (unsigned int b = 0; b < 256; ++b) {
      DECODE(b * 0x01010101u, SCALE(e), out);  // the byte in each of a word's four places
      fwrite(out, 2, 8, stdout);
    }
}
"""


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
def test_every_byte_and_scale_decodes_exactly(tmp_path):
    source = tmp_path / "decode.cu"
    source.write_text(BF16X2_SOURCE + MAIN.replace("DECODE", BF16X2_DECODE)
                      .replace("SCALE", BF16X2_SCALE))
    subprocess.run(["nvcc", "-o", str(tmp_path / "decode"), str(source)], check=True,
                   capture_output=True, timeout=300)
    raw = subprocess.run([str(tmp_path / "decode")], check=True, capture_output=True).stdout
    got = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).reshape(-1, 8)
    # Row e * 256 + b: 32 elements of byte b under scale e.
    fp4 = torch.arange(256, dtype=torch.uint8).repeat(256).unsqueeze(1).expand(-1, 16)
    scale = torch.arange(256, dtype=torch.uint8).repeat_interleave(256).unsqueeze(1)
    want = dequantize_mxfp4(fp4.contiguous(), scale, torch.bfloat16)[:, :8]
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))  # -0 too
