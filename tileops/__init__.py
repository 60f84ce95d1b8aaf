"""tileops: autotuned TileLang operators, dispatched to the best known kernel for each target."""

from __future__ import annotations

from .dispatch import reset
from .ops import SPECS, get_spec
from .ops.attention import flash_attention
from .ops.gemm import gemm
from .ops.mla import mla_decode
from .ops.mxfp4 import dequantize_mxfp4, mxfp4_gemm, quantize_mxfp4
from .target import Target, target_of
from .version import __version__

__all__ = ["SPECS", "Target", "__version__", "dequantize_mxfp4", "flash_attention", "gemm",
           "get_spec", "mla_decode", "mxfp4_gemm", "quantize_mxfp4", "reset", "target_of"]
