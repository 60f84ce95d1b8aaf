"""The provenance every tuning record carries: where, with what, for which kernel source."""

from __future__ import annotations

from typing import Any

import torch

from ..spec import OpSpec
from ..target import Target
from ..version import __version__


def toolkit_version() -> str:
    return torch.version.cuda or getattr(torch.version, "hip", None) or ""


def provenance(spec: OpSpec, target: Target) -> dict[str, Any]:
    """Record fields that identify the target, the software versions and the kernel source."""
    import tilelang

    return {
        "op": spec.name,
        "target_kind": target.kind,
        "arch": target.arch,
        "device": target.device,
        "units": target.units,
        "tileops_version": __version__,
        "tilelang_version": tilelang.__version__,
        "torch_version": torch.__version__,
        "toolkit_version": toolkit_version(),
        "space_hash": spec.space_hash(target),
        "kernel_hash": spec.kernel_hash(),
    }
