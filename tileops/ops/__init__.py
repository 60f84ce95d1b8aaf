"""The operator catalog: every spec, by name."""

from __future__ import annotations

from ..spec import OpSpec
from .attention import ATTENTION
from .gemm import GEMM
from .mla import MLA_DECODE
from .mxfp4 import MXFP4_GEMM

SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (GEMM, MXFP4_GEMM, ATTENTION, MLA_DECODE)}


def get_spec(name: str) -> OpSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown operator {name!r}; available: {', '.join(SPECS)}") from None
