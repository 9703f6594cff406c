"""A diagnostic that predicts the accuracy a gradient format costs: weight-gradient alignment.

A convolution (or linear layer) whose output feeds a BatchNorm in training mode is invariant to
scaling each output channel's weights: ``L(t w_c, t b_c) = L(w_c, b_c)``. Differentiating in
``t`` at 1, and since the bias gradient is exactly zero behind the batch mean,
``<w_c, dL/dw_c> = 0``: the exact weight gradient of every channel is orthogonal to its weights.
Low-precision neural gradients break that structure in proportion to the bias they introduce:
measured on the CNN, round-to-nearest e3m2fn at the MSE-optimal scale raised
``|cos(w_c, dW_c)|`` from 0.000 to about 0.3, while stochastic rounding and e4m1fn kept it below
0.05 (``docs/fpanalysis.md``, "Training-aware choice"). The cosine needs no reference gradient:
one backward pass under the plan shows it.

Example:
    >>> import torch
    >>> from gradstats.fpanalysis import batchnorm_inputs, weight_gradient_alignment
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
    ...                           torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    >>> x = torch.randn(8, 1, 8, 8)
    >>> batchnorm_inputs(net, x)
    ['0']
    >>> net(x).square().mean().backward()
    >>> a = weight_gradient_alignment(net, ["0"])
    >>> bool(a.mean_abs_cos["0"] < 1e-4)
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from gradstats.layers import batchnorm_inputs  # noqa: F401 - re-exported: the layers this diagnostic is for

__all__ = ["batchnorm_inputs", "weight_gradient_alignment", "AlignmentResult"]

_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


@dataclass(frozen=True)
class AlignmentResult:
    """Per layer, the ``|cos(w_c, dL/dw_c)|`` of each output channel ``c``.

    Attributes:
        layers: the layers measured, in model order.
        cos: layer -> array of one ``|cos|`` per output channel (NaN where the weights or the
            gradient of the channel are zero).
        mean_abs_cos, max_abs_cos: layer -> the mean and the largest over its channels.
    """

    layers: list[str]
    cos: dict[str, np.ndarray] = field(repr=False)

    @property
    def mean_abs_cos(self) -> dict[str, float]:
        return {n: float(np.nanmean(c)) if np.isfinite(c).any() else math.nan for n, c in self.cos.items()}

    @property
    def max_abs_cos(self) -> dict[str, float]:
        return {n: float(np.nanmax(c)) if np.isfinite(c).any() else math.nan for n, c in self.cos.items()}

    def to_dataframe(self) -> Any:
        """One row per layer: ``layer``, ``channels``, ``mean_abs_cos``, ``max_abs_cos``."""
        import pandas as pd

        mean, mx = self.mean_abs_cos, self.max_abs_cos
        return pd.DataFrame([{"layer": n, "channels": int(self.cos[n].size), "mean_abs_cos": mean[n],
                              "max_abs_cos": mx[n]} for n in self.layers])

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "cos": {n: self.cos[n].tolist() for n in self.layers},
                "mean_abs_cos": self.mean_abs_cos, "max_abs_cos": self.max_abs_cos}

    def plot(self, **kw: Any) -> Any:
        """Per layer, the channels' ``|cos|`` and their mean
        (:func:`gradstats.plots.fpanalysis.plot_weight_alignment`)."""
        from gradstats.plots.fpanalysis import plot_weight_alignment

        return plot_weight_alignment(self, **kw)


def weight_gradient_alignment(model: nn.Module, layers: Optional[Sequence[str]] = None) -> AlignmentResult:
    """``|cos(w_c, dL/dw_c)|`` per output channel of each layer in ``layers`` (default: every
    convolution and linear layer with a weight gradient), read from ``weight.grad`` after a
    backward pass (under :func:`gradstats.apply` for the plan's effect). For the layers
    :func:`batchnorm_inputs` names the exact value is 0; a compressed gradient that keeps it
    near 0 keeps the weight gradient's structure, one that raises it biases the update.

    Example:
        >>> import torch
        >>> lin = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> lin(torch.ones(1, 3)).sum().backward()
        >>> weight_gradient_alignment(lin).layers
        ['0']
    """
    from gradstats.wrappers import named_layers

    if not isinstance(model, nn.Module):
        raise ValueError(f"weight_gradient_alignment needs a torch.nn.Module, got {type(model).__name__}")
    mods = dict(named_layers(model))
    if layers is None:
        layers = [n for n, m in mods.items() if isinstance(m, _LAYERS) and m.weight.grad is not None]
        if not layers:
            raise ValueError("no convolution or linear layer has a weight gradient: run a backward pass "
                             "first (or name the layers)")
    cos: dict[str, np.ndarray] = {}
    for n in layers:
        m = mods.get(n)
        if m is None:
            raise ValueError(f"layer {n!r} is not a module of the model (names as in named_layers)")
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.grad is None:
            raise ValueError(f"layer {n!r} has no weight gradient: run a backward pass first")
        a = w.detach().reshape(w.shape[0], -1).double()
        b = w.grad.detach().reshape(w.shape[0], -1).double()
        den = a.norm(dim=1) * b.norm(dim=1)
        c = ((a * b).sum(dim=1).abs() / den).numpy()
        c[(den == 0).numpy()] = math.nan
        cos[n] = c
    return AlignmentResult(layers=list(layers), cos=cos)
