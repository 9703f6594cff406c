"""torchao: the model converted with a plan's torchao training configs (:func:`convert`), and the
configs themselves (:func:`to_torchao`, :meth:`gradstats.Plan.to_torchao`; made by
:mod:`gradstats.plan.export.torchao_objects`, whose docstring says what is mapped and what is not).

Example:
    >>> import torch, gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> m = convert(model, gradstats.Plan.uniform(format="e5m2", scale="amax"), emulate=True)
    >>> type(m[0]).__name__, type(m[2]).__name__          # the output layer stays as it was
    ('Float8Linear', 'Linear')
"""
from __future__ import annotations

from typing import Any

from torch import nn

from gradstats.plan.export.torchao_objects import (
    FLOAT8_RECIPES,
    RECIPES,
    recipe_overrides,
    recipe_table,
    to_torchao,
    torchao_float8,
)

__all__ = ["RECIPES", "FLOAT8_RECIPES", "convert", "recipe_overrides", "recipe_table", "to_torchao"]


def convert(model: nn.Module, plan: Any, *, emulate: bool = False, strict: bool = False,
            recipe: str = "tensorwise") -> nn.Module:
    """Convert ``model``'s planned linear layers with torchao's own API, in place as torchao does
    (``torchao.float8.convert_to_float8_training`` for float8 configs,
    ``torchao.quantization.quantize_`` for MXFP8 and NVFP4 ones), and return it; ``recipe`` as
    :func:`to_torchao`. Example: see the module."""
    f8 = torchao_float8()
    from gradstats.wrappers import unwrap

    root = unwrap(model)
    for config, keep in to_torchao(plan, root, emulate=emulate, strict=strict, recipe=recipe):
        if isinstance(config, f8.Float8LinearConfig):
            f8.convert_to_float8_training(root, config=config, module_filter_fn=keep)
        else:
            from torchao.quantization import quantize_

            quantize_(root, config, filter_fn=keep)
    return model
