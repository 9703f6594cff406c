"""One home for seeing through training wrappers: DDP, DataParallel, FSDP and ``torch.compile``.

Every stage that names layers (the tracer, plans, :func:`gradstats.apply`) calls
:func:`unwrap` first, so that layer names are always the user's own module names, never
``module.conv1`` or ``_orig_mod.conv1``. A plan made from eager training resolves on the
compiled or DDP-wrapped model, and the other way round.

Example:
    >>> import torch
    >>> from gradstats.wrappers import unwrap
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> unwrap(torch.nn.DataParallel(net)) is net
    True
"""
from __future__ import annotations

from torch import nn

__all__ = ["unwrap", "named_layers", "ROOT_NAME", "WRAPPER_TYPES"]

#: class names of wrappers whose inner model is ``.module`` (DDP, DataParallel, FSDP1)
_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
#: class names of wrappers whose inner model is ``._orig_mod`` (``torch.compile``)
_COMPILE_WRAPPERS = ("OptimizedModule",)
WRAPPER_TYPES = _MODULE_WRAPPERS + _COMPILE_WRAPPERS
#: the layer name of the model itself (``named_modules()`` calls it ``""``), for a root module
#: that owns parameters of its own; ``add_module`` never makes such a name by attribute
ROOT_NAME = "(root)"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside any nesting of DDP, DataParallel, FSDP (1) and ``torch.compile``
    wrappers. FSDP2 (``fully_shard``) and plain models are returned as they are: they keep the
    user's module names.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> unwrap(torch.compile(net)) is net, unwrap(net) is net
        (True, True)
    """
    seen = 0
    while seen < 16:            # wrappers nest (DDP of a compiled model, ...), never this deep
        name = type(model).__name__
        inner = None
        if name in _MODULE_WRAPPERS:
            inner = getattr(model, "module", None)
        elif name in _COMPILE_WRAPPERS:
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
        seen += 1
    return model


def named_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of the user's model (:func:`unwrap` first), in
    ``named_modules()`` order, the model itself named :data:`ROOT_NAME` instead of ``""``:
    the names that runs, plans and :func:`gradstats.apply` use.

    Example:
        >>> import torch
        >>> [n for n, _ in named_layers(torch.compile(torch.nn.Sequential(torch.nn.Linear(2, 2))))]
        ['(root)', '0']
    """
    return [(name or ROOT_NAME, m) for name, m in unwrap(model).named_modules()]
