"""The operator catalog: every spec, by name."""

from __future__ import annotations

from ..spec import OpSpec
from .attention import (
    ATTENTION,
    ATTENTION_BACKWARD,
    ATTENTION_PAGED,
    ATTENTION_VARLEN,
    ATTENTION_VARLEN_BACKWARD,
)
from .gemm import GEMM
from .mla import MLA_DECODE
from .mxfp4 import MXFP4_GEMM, MXFP4_GEMM_PACKED

SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (GEMM, MXFP4_GEMM, MXFP4_GEMM_PACKED,
                                                          ATTENTION, ATTENTION_BACKWARD,
                                                          ATTENTION_VARLEN,
                                                          ATTENTION_VARLEN_BACKWARD,
                                                          ATTENTION_PAGED, MLA_DECODE)}


def get_spec(name: str) -> OpSpec:
    """An operator's spec by its name or one of its aliases (`OpSpec.aliases`)."""
    spec = SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        spec = next((s for s in SPECS.values() if name in s.aliases), None)
    if spec is None:
        names = [n for s in SPECS.values() for n in (s.name, *s.aliases)]
        raise ValueError(f"unknown operator {name!r}; available: {', '.join(names)}")
    return spec
