"""tileops: autotuned TileLang operators, dispatched to the best known kernel for each target."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .autotune import set_autotune
from .dispatch import reset
from .ops import SPECS, get_spec
from .ops.attention import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from .ops.gemm import gemm
from .ops.mla import MlaMetadata, mla_decode, mla_metadata
from .ops.mxfp4 import PrepackedMxfp4, dequantize_mxfp4, mxfp4_gemm, prepack_mxfp4, quantize_mxfp4
from .target import Target, target_of
from .version import __version__

# An install maps `tileops.tuner` to the repository's top-level tuner/ (pyproject's package-dir);
# a source checkout used without installing it (PYTHONPATH=checkout) finds it there too.
_CHECKOUT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec(f"{__name__}.tuner") is None \
        and (_CHECKOUT / "tuner" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))

__all__ = ["SPECS", "MlaMetadata", "PrepackedMxfp4", "Target", "__version__", "dequantize_mxfp4",
           "flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache", "gemm",
           "get_spec", "mla_decode", "mla_metadata", "mxfp4_gemm", "prepack_mxfp4",
           "quantize_mxfp4", "reset", "set_autotune", "target_of", "tune"]


def tune(op: str, shapes: str | Sequence[str], *, device: str = "auto", trials: int = 32,
         dtype: str | None = None, db: str | None = None, quiet: bool = False,
         **options: Any) -> Any:
    """Tune problems of an operator and record the winners, as `tileops-tune` does.

    `shapes` are problems in the operator's syntax (`tileops ops` lists it), e.g.
    `tileops.tune("gemm", ["1x4096x4096", "16x4096x4096"], device="cpu", dtype="float32")`.
    Other options are the command's long options with underscores (`timeout=60`,
    `sampler="random"`, `space='{"block_M": [16]}'`). Returns the tuner's `Outcome`: `.results`
    (one `tileops.tuner.sweep.Result` per problem, `.decision` holding what was recorded),
    `.checks` (the dispatch checks), `.unrecorded` and `.code`, the command's exit code. A
    mistake raises `tileops.tuner.errors.UsageError`. Later calls in this process dispatch the
    new records.
    """
    from .tuner.cli import tune_python  # the tuner (optuna, child processes) only when asked

    return tune_python(op, shapes, device=device, trials=trials, dtype=dtype, db=db,
                       quiet=quiet, **options)
