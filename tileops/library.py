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


def register(spec: OpSpec, schema: str, fake: Callable[..., torch.Tensor],
             autograd: tuple[Callable, Callable] | None = None,
             impl: Callable[..., torch.Tensor] | None = None):
    """Define `tileops::<spec.name>` with `schema`, backed by the dispatcher; return the op.

    `autograd` is the operator's (setup_context, backward), as `torch.library.register_autograd`
    takes them. Without one, the fake implementation refuses inputs that require grad (as
    `spec.prepare` does in eager calls): a compiled graph would drop the gradients. `impl` maps
    the schema's arguments to the dispatcher's where they differ (a weight object as tensors)."""
    _LIBRARY.define(f"{spec.name}{schema}")

    if impl is None:
        def impl(*args):
            return DISPATCHER(spec, *args)

    signature = inspect.signature(fake)

    def checked_fake(*args, **kwargs):
        refuse_grad(spec.name, **signature.bind(*args, **kwargs).arguments)
        return fake(*args, **kwargs)

    _LIBRARY.impl(spec.name, impl, "CompositeExplicitAutograd")
    name = f"tileops::{spec.name}"
    torch.library.register_fake(name, fake if autograd else checked_fake, lib=_LIBRARY)
    if autograd:
        setup_context, backward = autograd
        torch.library.register_autograd(name, backward, setup_context=setup_context,
                                        lib=_LIBRARY)
    return getattr(torch.ops.tileops, spec.name)
