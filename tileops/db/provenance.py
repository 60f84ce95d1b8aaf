"""The provenance every tuning record carries: where, with what, for which kernel source."""

from __future__ import annotations

from typing import Any

import torch

from ..spec import OpSpec, space_hash
from ..target import Target
from ..version import __version__


def toolkit_version() -> str:
    return torch.version.cuda or getattr(torch.version, "hip", None) or ""


def provenance(spec: OpSpec, target: Target, space: dict[str, list[Any]] | None = None
               ) -> dict[str, Any]:
    """Record fields that identify the target, the software versions, the kernel source and the
    space searched (`space`; default: the spec's space for the target)."""
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
        "space_hash": spec.space_hash(target) if space is None else space_hash(space),
        "kernel_hash": spec.kernel_hash(),
    }
