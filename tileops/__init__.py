"""tileops: autotuned TileLang operators, dispatched to the best known kernel for each target."""

from __future__ import annotations

from .dispatch import reset
from .ops import SPECS, get_spec
from .ops.gemm import gemm
from .target import Target, target_of
from .version import __version__

__all__ = ["SPECS", "Target", "__version__", "gemm", "get_spec", "reset", "target_of"]
