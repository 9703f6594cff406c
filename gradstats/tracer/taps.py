"""Capture points that ``torch.compile`` traces: how :func:`gradstats.trace` and :func:`gradstats.apply`
see a compiled model's gradients without breaking its graph.

In eager mode a forward hook registers a tensor hook on the module's output (the tracer's and
apply's usual path). Inside a graph that dynamo traces, that hook and the Python it runs would break
the graph at every module, and dynamo would then compile each module's frame on its own and again for
each module of another shape, ``groups`` or name (until its recompile limit, when the model falls
back to eager, 100x slower than either). Under compilation the hooks instead put a *tap* on the
output: an identity in the forward pass whose backward passes the gradient to one of two custom
operators,

* ``gradstats::observe(x, slot)``, which hands ``x`` to the Python callback registered under
  ``slot`` (the tracer's statistics and samples) and returns nothing, and
* ``gradstats::transform(g, slot)``, which returns what the callback makes of ``g`` (apply's
  compressed gradient),

both opaque to the compiler (it calls them, it does not trace them) and registered as *ordered
effects*, so that they are neither removed nor reordered: the callbacks run in the order eager
execution would run them, with the same random draws. A slot is an integer constant of the graph;
everything that changes from step to step (which steps are sampled, thresholds, scales) is decided
inside the callback when it runs, so nothing guards on it and nothing recompiles. Callbacks of a
released slot (a removed tracer or plan) do nothing (``observe``) or return the gradient unchanged
(``transform``).

Example:
    >>> import torch
    >>> seen = []
    >>> slot = register(lambda g: seen.append(float(g.sum())))
    >>> x = torch.ones(3, requires_grad=True)
    >>> (grad_tap(x * 2, slot) * 5).sum().backward()
    >>> seen, x.grad.tolist()
    ([15.0], [10.0, 10.0, 10.0])
    >>> release(slot)
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

#: callbacks by slot: ``observe`` calls them for their effect, ``transform`` for the tensor they return
_CALLBACKS: dict[int, Callable[[torch.Tensor], Optional[torch.Tensor]]] = {}
_SLOTS = itertools.count()


def register(callback: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> int:
    """A new slot whose tap calls ``callback`` (see the module's docstring).

    Example:
        >>> s = register(lambda t: None); isinstance(s, int)
        True
        >>> release(s)
    """
    if not callable(callback):
        raise ValueError(f"a tap's callback must be callable, got {type(callback).__name__}")
    slot = next(_SLOTS)
    _CALLBACKS[slot] = callback
    return slot


def release(slot: int) -> None:
    """Forget ``slot``'s callback: a compiled graph that still calls it gets a no-op (``observe``)
    or the gradient unchanged (``transform``)."""
    _CALLBACKS.pop(slot, None)


@torch.library.custom_op("gradstats::observe", mutates_args=())
def _observe(x: torch.Tensor, slot: int) -> None:
    fn = _CALLBACKS.get(slot)
    if fn is not None:
        fn(x)


@_observe.register_fake
def _observe_fake(x: torch.Tensor, slot: int) -> None:
    return None


@torch.library.custom_op("gradstats::transform", mutates_args=())
def _transform(g: torch.Tensor, slot: int) -> torch.Tensor:
    fn = _CALLBACKS.get(slot)
    out = fn(g) if fn is not None else None
    if out is None or out is g:                  # an operator's output may not alias its input
        return g.clone(memory_format=torch.contiguous_format)
    return out.contiguous()                      # the strides the compiler was promised (below)


@_transform.register_fake
def _transform_fake(g: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty(g.shape, dtype=g.dtype, device=g.device)


def _order_effects() -> bool:
    """Register both operators as ordered effects (not removed though ``observe``'s result is
    unused; not reordered against each other). False where this torch lacks the registry: a
    compiled graph may then drop ``observe`` (a warning says so when a tap is first traced)."""
    try:
        from torch._library.effects import EffectType

        for name in ("gradstats::observe", "gradstats::transform"):
            torch.library._register_effectful_op(name, EffectType.ORDERED)
        return True
    except (ImportError, AttributeError, RuntimeError) as exc:      # pragma: no cover - other torch versions
        log.debug("gradstats: ordered effects not available (%s)", exc)
        return False


ORDERED = _order_effects()


class _GradTap(torch.autograd.Function):
    """The identity forward; backward hands the gradient to ``observe`` or ``transform``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot: int, transform: bool) -> torch.Tensor:
        ctx.slot, ctx.transform = slot, transform
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.transform:
            return torch.ops.gradstats.transform(g, ctx.slot), None, None
        torch.ops.gradstats.observe(g, ctx.slot)
        return g, None, None


def grad_tap(x: torch.Tensor, slot: int, transform: bool = False) -> torch.Tensor:
    """``x`` unchanged, its gradient observed (or, ``transform=True``, replaced) by ``slot``'s
    callback in the backward pass. Traceable by dynamo without a graph break.

    Example:
        >>> s = register(lambda g: g * 0)
        >>> x = torch.ones(2, requires_grad=True)
        >>> grad_tap(x * 3, s, transform=True).sum().backward(); x.grad.tolist()
        [0.0, 0.0]
        >>> release(s)
    """
    return _GradTap.apply(x, slot, transform)


def observe(x: torch.Tensor, slot: int) -> None:
    """Hand ``x`` (detached) to ``slot``'s callback now, in the forward pass; traceable."""
    torch.ops.gradstats.observe(x.detach(), slot)


def replace_first_grad_tensor(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``output`` (a tensor, or a tuple or list holding tensors, nested) with its first floating
    tensor that requires grad replaced by ``fn`` of it (the tensor :func:`gradstats.tracer.first_grad_tensor`
    picks); None where it holds none (a forward hook's "output unchanged").

    Example:
        >>> a, b = torch.ones(1), torch.ones(1, requires_grad=True)
        >>> out = replace_first_grad_tensor((a, [b]), lambda t: t * 2)
        >>> out[0] is a, out[1][0].tolist()
        (True, [2.0])
    """
    if isinstance(output, torch.Tensor):
        return fn(output) if (output.requires_grad and output.is_floating_point()) else None
    if isinstance(output, (list, tuple)) and type(output) in (list, tuple):
        for i, item in enumerate(output):
            new = replace_first_grad_tensor(item, fn)
            if new is not None:
                items = list(output)
                items[i] = new
                return type(output)(items)
    return None
