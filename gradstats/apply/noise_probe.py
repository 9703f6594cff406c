"""Measure what a plan costs by running it: the noise ratio of each planned layer, directly.

For each of ``B`` batches the exact weight gradients of the planned layers are computed, then the
plan is applied (:func:`gradstats.apply`, every planned layer at once, so what later layers add
reaches the earlier ones) for ``K`` independent draws of its stochastic pruning and rounding:

- added noise: the mean over batches and draws of ``|G_plan - G_exact|^2``;
- SGD's minibatch noise: the variance of ``G_exact`` across the batches (the trace of its
  covariance, ``B - 1`` in the denominator);
- the ratio ``R`` of the two, the quantity :func:`gradstats.predicted_noise` predicts.

The model's parameters and buffers (BatchNorm's running statistics) are as before when it returns,
its gradients are cleared, and random ops in the forward pass (dropout) draw the same values for the
exact and the planned gradients of a batch.

Example:
    >>> import torch, gradstats
    >>> _ = torch.manual_seed(0)
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> batches = [(torch.randn(64, 8), torch.randint(0, 4, (64,))) for _ in range(4)]
    >>> loss = lambda model, b: torch.nn.functional.cross_entropy(model(b[0]), b[1])
    >>> probe = noise_probe(m, batches, gradstats.Plan.uniform(sparsity=0.9, output_layer=False), loss)
    >>> df = probe.to_dataframe()
    >>> list(df["layer"]), bool((df["ratio"] > 0).all())
    (['0', '2'], True)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

from gradstats.plan.noise_prediction import PerLayer

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

__all__ = ["noise_probe", "NoiseProbe"]


@dataclass(frozen=True)
class NoiseProbe(PerLayer):
    """What :func:`noise_probe` measured, per planned layer: ``added`` (mean squared change of the
    weight gradient), ``added_se`` (its standard error over batches), ``minibatch`` (the weight
    gradient's variance across batches), ``ratio`` (``added / minibatch``); and ``batches``,
    ``draws``.

    Example:
        >>> NoiseProbe([{"layer": "fc", "added": 1.0, "added_se": 0.1, "minibatch": 50.0, "ratio": 0.02}],
        ...            4, 2)["fc"]
        0.02
    """

    records: list[dict[str, Any]]
    batches: int
    draws: int
    value = "ratio"

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer: layer, added, added_se, minibatch, ratio."""
        import pandas as pd

        return pd.DataFrame(self.records, columns=["layer", "added", "added_se", "minibatch", "ratio"])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"batches", "draws", "layers": {name: record}}``."""
        return {"batches": self.batches, "draws": self.draws, "layers": self.layers_dict()}


def _weight_grads(modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Per layer, the gradient of the parameters its noise is measured over (as the trace records
    and predicts it, :func:`gradstats.tracer.noise.noise_params`: a Linear's or convolution's weight,
    all of a GRU's parameters), flat, float64."""
    from gradstats.tracer.noise import flat_grad, noise_params

    out = {}
    for name, mod in modules.items():
        g = flat_grad(noise_params(mod), torch.float64)
        if g is not None:
            out[name] = g
    return out


def noise_probe(model: nn.Module, batches: Iterable[Any], plan: Any,
                loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, draws: int = 2,
                seed: int = 0) -> NoiseProbe:
    """Measure the noise ratio of each layer ``plan`` changes (module doc).

    Args:
        model: the model in the state to measure (e.g. the calibration model); left unchanged.
        batches: at least two batches, each passed to ``loss_fn`` as is.
        plan: a :class:`gradstats.Plan` (or the path of a saved one).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (the training loss, its mean over the batch).
        draws: independent draws of the plan's random pruning and rounding per batch.
        seed: seeds the forward passes' random ops and the draws.

    Example:
        >>> import torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 16))
        >>> batches = [torch.randn(32, 4) for _ in range(3)]
        >>> p = noise_probe(m, batches, gradstats.Plan.uniform(sparsity=0.5, output_layer=False),
        ...                 lambda model, x: model(x).exp().mean(), draws=1)
        >>> p.batches, p.draws, p["0"] > 0
        (3, 1, True)
    """
    from gradstats.apply import apply
    from gradstats.plan import Plan
    from gradstats.wrappers import named_layers, unwrap

    if not isinstance(model, nn.Module):
        raise ValueError(f"noise_probe needs a torch.nn.Module as model, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ValueError("loss_fn must be a function loss_fn(model, batch) returning the scalar training loss")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws must be a positive int (draws of the plan per batch), got {draws!r}")
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    batches = list(batches)
    if len(batches) < 2:
        raise ValueError(f"noise_probe needs at least 2 batches to measure the minibatch noise, got {len(batches)}")
    root = unwrap(model)
    rules = plan.resolve(root)      # layers left alone too: what later layers send back reaches them
    layers = dict(named_layers(root))
    modules = {n: layers[n] for n in rules}
    state = {k: v.detach().clone() for k, v in root.state_dict(keep_vars=True).items()}
    saved_grads = {id(p): (p, None if p.grad is None else p.grad.clone()) for p in root.parameters()}

    def run_once(batch: Any, forward_seed: int, draw_seed: int | None) -> dict[str, torch.Tensor]:
        root.load_state_dict(state)
        root.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(forward_seed)
            handle = None if draw_seed is None else apply(
                model, plan, seed=draw_seed, record=False, sparsity_margin=None, underflow_bound=None,
                zero_calls=None, overflow_bound=None, bias_bound=None)
            try:
                loss = loss_fn(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError("loss_fn(model, batch) must return the scalar training loss, got "
                                     f"{type(loss).__name__}")
                loss.backward()
            finally:
                if handle is not None:
                    handle.remove()
        return _weight_grads(modules)

    exact: list[dict[str, torch.Tensor]] = []
    added = {n: [] for n in modules}
    try:
        for b, batch in enumerate(batches):
            g = run_once(batch, seed * 1_000_003 + b, None)
            exact.append(g)
            per_draw = {n: 0.0 for n in modules}
            for k in range(draws):
                gp = run_once(batch, seed * 1_000_003 + b, seed * 7919 + b * 101 + k + 1)
                for n in modules:
                    if n in g and n in gp:
                        per_draw[n] += float((gp[n] - g[n]).square().sum()) / draws
            for n in modules:
                added[n].append(per_draw[n])
    finally:
        root.load_state_dict(state)
        for p, grad in saved_grads.values():
            p.grad = grad
    records = []
    for n in modules:
        gs = [e[n] for e in exact if n in e]
        if len(gs) < 2:
            records.append({"layer": n, "added": math.nan, "added_se": math.nan, "minibatch": math.nan,
                            "ratio": math.nan})
            continue
        stack = torch.stack(gs)
        mb = float((stack - stack.mean(0)).square().sum() / (len(gs) - 1))
        a = torch.tensor(added[n], dtype=torch.float64)
        mean = float(a.mean())
        se = float(a.std() / math.sqrt(len(a))) if len(a) > 1 else math.nan
        records.append({"layer": n, "added": mean, "added_se": se, "minibatch": mb,
                        "ratio": mean / mb if mb > 0 else math.nan})
    return NoiseProbe(records, len(batches), draws)
