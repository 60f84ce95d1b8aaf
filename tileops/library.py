"""Registration of operators as torch custom ops, so they work inside `torch.compile`d code.

Eager calls go straight to the dispatcher (the custom-op dispatcher path costs microseconds per
call); code being compiled calls `torch.ops.tileops.<op>`, which the compiler sees as one opaque
node with a fake (shape-only) implementation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .dispatch import DISPATCHER
from .spec import OpSpec, refuse_grad

_LIBRARY = torch.library.Library("tileops", "DEF")


def register(spec: OpSpec, schema: str, fake: Callable[..., torch.Tensor]):
    """Define `tileops::<spec.name>` with `schema`, backed by the dispatcher; return the op.

    The fake implementation refuses inputs that require grad (as `spec.prepare` does in eager
    calls): the operators have no backward, and a compiled graph would drop the gradients."""
    _LIBRARY.define(f"{spec.name}{schema}")

    def impl(*args):
        return DISPATCHER(spec, *args)

    signature = inspect.signature(fake)

    def checked_fake(*args, **kwargs):
        refuse_grad(spec.name, **signature.bind(*args, **kwargs).arguments)
        return fake(*args, **kwargs)

    _LIBRARY.impl(spec.name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tileops::{spec.name}", checked_fake, lib=_LIBRARY)
    return getattr(torch.ops.tileops, spec.name)
