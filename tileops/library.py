"""Registration of operators as torch custom ops, so they work inside `torch.compile`d code.

Eager calls go straight to the dispatcher (the custom-op dispatcher path costs microseconds per
call); code being compiled calls `torch.ops.tileops.<op>`, which the compiler sees as one opaque
node with a fake (shape-only) implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .dispatch import DISPATCHER
from .spec import OpSpec

_LIBRARY = torch.library.Library("tileops", "DEF")


def register(spec: OpSpec, schema: str, fake: Callable[..., torch.Tensor]):
    """Define `tileops::<spec.name>` with `schema`, backed by the dispatcher; return the op."""
    _LIBRARY.define(f"{spec.name}{schema}")

    def impl(*args):
        return DISPATCHER(spec, *args)

    _LIBRARY.impl(spec.name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tileops::{spec.name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.tileops, spec.name)
