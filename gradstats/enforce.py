"""Enforce a per-layer :class:`~gradstats.plan.Plan` on neural gradients during training.

``gradstats.apply(model, plan)`` makes the neural gradient ``g = dL/dy`` at each planned
layer's output pass through the layer's rule in the backward pass, before it flows on to
earlier layers and into that layer's own weight gradient: stochastic pruning at the threshold
of the rule's sparsity target, then rounding to its format at its scale. Per layer it keeps the
running mean and std of ``ln|g|``, the zero fraction and ``amax`` (one fused reduction per
refresh: :func:`gradstats.stats.tensor_stats_vector`), refreshes thresholds and scales every
``refresh_every`` gradients, and records what each call achieved (sparsity, underflow,
saturation) beside what the model predicted.

Example:
    >>> import torch, gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> plan = gradstats.Plan.uniform(format="e3m2fn", sparsity=0.8)
    >>> with gradstats.apply(model, plan) as applied:
    ...     model(torch.randn(32, 16)).square().mean().backward()
    >>> sorted(applied.to_dataframe()["layer"])
    ['0', '2']
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import pandas as pd
import torch
from torch import nn

from .compress import prune_quantize
from .stats import SCALAR_FIELDS, tensor_stats_vector, vector_to_stats

log = logging.getLogger(__name__)

_F = {name: i for i, name in enumerate(SCALAR_FIELDS)}


@dataclass
class _LayerState:
    """Running statistics and current settings of one planned layer."""

    seq: int = 0                    # gradients processed so far
    mu: float = math.nan            # running mean of ln|g|
    m2: float = math.nan            # running mean of ln^2|g|
    p0: float = 0.0                 # running zero fraction
    amax: float = math.nan          # running max |g|
    rms: float = math.nan           # running sqrt(E g^2) (normal-model thresholds)
    mean_abs: float = math.nan      # running E|g| (Laplace-model thresholds)
    threshold: float = 0.0
    predicted_sparsity: float = math.nan
    row: Optional[dict] = None      # the latest statistics row (threshold_rule="histogram")
    scale: float = 1.0

    @property
    def sigma(self) -> float:
        return math.sqrt(max(self.m2 - self.mu * self.mu, 0.0))


def _stats_update(st: _LayerState, v: torch.Tensor, ema: Optional[float]) -> None:
    """Fold one statistics vector into the running state (EMA, or replace when ema is None)."""
    s = v[: len(SCALAR_FIELDS)].tolist()
    n, nz, nf = s[_F["n"]], s[_F["n_zero"]], s[_F["n_nonfinite"]]
    m = n - nz - nf
    fin = n - nf
    if m <= 0:
        return
    new = {"mu": s[_F["sum_ln_abs"]] / m, "m2": s[_F["sum_ln_abs_sq"]] / m, "p0": nz / max(n, 1),
           "amax": s[_F["max_abs"]], "rms": math.sqrt(s[_F["sum_sq"]] / fin),
           "mean_abs": s[_F["sum_abs"]] / fin}
    for k, val in new.items():
        old = getattr(st, k)
        if ema is None or math.isnan(old):
            setattr(st, k, val)
        else:
            setattr(st, k, ema * old + (1 - ema) * val)


class Applied:
    """The handle :func:`apply` returns: removes the hooks (``.remove()``, or use it as a
    context manager) and holds what was done (``.history``, ``.to_dataframe()``,
    ``.summary()``).

    Each record: ``layer``, ``seq`` (the layer's gradient count), ``n``, ``format``,
    ``scale``, ``target_sparsity``, ``threshold``, ``predicted_sparsity`` (the threshold
    rule's model at the running statistics), ``achieved_sparsity``, ``pruned_fraction``,
    ``underflow_fraction``, ``overflow_fraction``, ``mu``, ``sigma``, ``p0``, ``amax``.
    """

    def __init__(self, model: nn.Module, plan: Any, *, refresh_every: int = 1,
                 ema: Optional[float] = None, log_to: Any = None, seed: int = 0,
                 sync_stats: bool = False, record: bool = True) -> None:
        from .plan import Plan

        if not isinstance(model, nn.Module):
            raise ValueError(f"apply() needs a torch.nn.Module as model, got {type(model).__name__}")
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a gradstats.Plan or the path of a saved plan, got "
                             f"{type(plan).__name__}")
        if not isinstance(refresh_every, int) or isinstance(refresh_every, bool) or refresh_every < 1:
            raise ValueError(f"refresh_every must be a positive int (1 = every gradient), got {refresh_every!r}")
        if ema is not None and not (0.0 <= ema < 1.0):
            raise ValueError(f"ema must be None or a decay in [0, 1), got {ema}")
        if log_to is not None and not hasattr(log_to, "log_rows"):
            raise ValueError("log_to must be a gradstats.Tracer (attached to the run to log into)")
        root = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
        self.plan = plan
        self.rules = {n: r for n, r in plan.resolve(root).items() if not r.is_identity}
        self.refresh_every = refresh_every
        self.ema = ema
        self.log_to = log_to
        self.sync_stats = sync_stats
        self.record = record
        self.generator = torch.Generator().manual_seed(seed)
        self.history: list[dict[str, Any]] = []
        self.state = {n: _LayerState() for n in self.rules}
        modules = dict(root.named_modules())
        self._handles = [modules[n].register_forward_hook(self._forward_hook(n)) for n in self.rules]

    # -- lifecycle
    def remove(self) -> None:
        """Remove every hook: the model trains exactly as without the plan again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # -- hooks
    def _forward_hook(self, name: str) -> Callable[..., None]:
        from .tracer import _first_grad_tensor

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not (torch.is_grad_enabled() and module.training):
                return
            out = _first_grad_tensor(output)
            if out is not None:
                out.register_hook(lambda g: self._compress(name, g))
        return hook

    def _refresh(self, name: str, g: torch.Tensor, refresh: bool) -> None:
        from . import pruning

        rule, st = self.rules[name], self.state[name]
        need_stats = refresh or (rule.quantizes and rule.scale == "amax" and rule.block_size is None)
        if need_stats:   # the histogram rule reads the binade counts; the others the moments alone
            v = tensor_stats_vector(g, full=rule.prunes and rule.threshold_rule == "histogram")
            if self.sync_stats and torch.distributed.is_available() and torch.distributed.is_initialized():
                v = _all_reduce_stats(v)
            _stats_update(st, v, self.ema)
            if refresh and rule.prunes and rule.threshold_rule == "histogram":
                st.row = vector_to_stats(v)
        if refresh and rule.prunes and not math.isnan(st.mu):
            if rule.threshold_rule == "exact":
                st.threshold = float(pruning.exact_threshold(g, rule.sparsity, stochastic=True))
                st.predicted_sparsity = rule.sparsity
            elif rule.threshold_rule == "histogram":     # model-free, from the binade histogram
                st.threshold = float(pruning.threshold(rule.sparsity, st.row, model="histogram"))
                st.predicted_sparsity = float(pruning.expected_sparsity(st.threshold, st.row, model="histogram"))
            else:
                kw = {"mu": st.mu, "sigma": max(st.sigma, 1e-6), "p0": min(st.p0, 1 - 1e-9)}
                if rule.threshold_rule == "normal":
                    kw = {"scale": st.rms, "p0": kw["p0"]}
                elif rule.threshold_rule == "laplace":
                    kw = {"scale": st.mean_abs, "p0": kw["p0"]}
                # conditioned on the running maximum and mean |g|: no threshold above the data
                cond = ({"amax": st.amax, "mean_abs": st.mean_abs}
                        if st.amax > 0 and math.isfinite(st.amax) and st.mean_abs <= st.amax else {})
                st.threshold = float(pruning.threshold(rule.sparsity, model=rule.threshold_rule, **kw, **cond))
                model = "lognormal" if rule.threshold_rule == "naive_lognormal" else rule.threshold_rule
                if cond and st.threshold >= st.amax:   # every entry below: exact on the tensor
                    st.predicted_sparsity = 1.0 - st.mean_abs / st.threshold
                elif st.threshold > 0 and model == rule.threshold_rule:
                    st.predicted_sparsity = rule.sparsity  # the threshold solves the model for it (1e-9)
                else:
                    st.predicted_sparsity = float(pruning.expected_sparsity(st.threshold, model=model, **kw))
        if rule.quantizes and rule.block_size is None and not math.isnan(st.mu):
            if rule.scale == "amax" or (refresh and rule.scale == "lognormal") or rule.scale == "fixed":
                st.scale = rule.scale_for(mu=st.mu, sigma=max(st.sigma, 1e-6), amax=st.amax)

    @torch.compiler.disable
    def _compress(self, name: str, g: torch.Tensor) -> torch.Tensor:
        rule, st = self.rules[name], self.state[name]
        refresh = st.seq % self.refresh_every == 0
        with torch.no_grad():
            self._refresh(name, g, refresh)
            out, counts = prune_quantize(
                g, st.threshold if rule.prunes else 0.0, rule.format, scale=st.scale,
                rounding=rule.rounding, generator=self.generator, block_size=rule.block_size)
        if self.record:
            n = max(counts.n, 1)
            rec = {"layer": name, "seq": st.seq, "n": counts.n,
                   "format": None if rule.format is None else str(rule.format),
                   "scale": st.scale if rule.quantizes and rule.block_size is None else math.nan,
                   "target_sparsity": rule.sparsity if rule.prunes else math.nan,
                   "threshold": st.threshold if rule.prunes else math.nan,
                   "predicted_sparsity": st.predicted_sparsity if rule.prunes else math.nan,
                   "achieved_sparsity": counts.zeros / n, "pruned_fraction": counts.pruned / n,
                   "underflow_fraction": counts.underflow / n, "overflow_fraction": counts.saturated / n,
                   "mu": st.mu, "sigma": st.sigma, "p0": st.p0, "amax": st.amax}
            self.history.append(rec)
            if self.log_to is not None:
                self.log_to.log_rows("applied", [rec])
        st.seq += 1
        return out.to(g.dtype)

    # -- results
    def to_dataframe(self) -> pd.DataFrame:
        """Every recorded call, one row each (see the class docstring for the columns)."""
        return pd.DataFrame(self.history)

    def summary(self) -> pd.DataFrame:
        """Per layer: calls, format, mean target, predicted and achieved sparsity, mean
        underflow and overflow fractions, last mu and sigma (of ln|g|)."""
        df = self.to_dataframe()
        if df.empty:
            return df
        agg = df.groupby("layer", sort=False).agg(
            calls=("seq", "size"), format=("format", "last"), target_sparsity=("target_sparsity", "mean"),
            predicted_sparsity=("predicted_sparsity", "mean"), achieved_sparsity=("achieved_sparsity", "mean"),
            underflow_fraction=("underflow_fraction", "mean"), overflow_fraction=("overflow_fraction", "mean"),
            mu=("mu", "last"), sigma=("sigma", "last"))
        order = [n for n in self.rules if n in agg.index]            # model order
        return agg.loc[order].reset_index()

    def to_dict(self) -> dict[str, Any]:
        """The plan, the settings and the per-layer summary as plain data."""
        return {"plan": self.plan.to_dict(), "refresh_every": self.refresh_every, "ema": self.ema,
                "summary": self.summary().to_dict("records")}

    def __repr__(self) -> str:
        return f"Applied(layers={list(self.rules)}, calls={len(self.history)})"


def _all_reduce_stats(v: torch.Tensor) -> torch.Tensor:
    """Combine one statistics vector over the ranks: sums and counts add, the max is a max and
    the min a min. The top magnitudes, which apply does not read, are left out (NaN)."""
    import torch.distributed as dist

    from .stats import TOP_K

    v = v.clone()
    imax, imin = _F["max_abs"], _F["min_abs"]
    mx, mn = v[imax: imax + 1].clone(), v[imin: imin + 1].clone()
    dist.all_reduce(v)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    dist.all_reduce(mn, op=dist.ReduceOp.MIN)
    v[imax], v[imin] = mx[0], mn[0]
    v[-TOP_K:] = math.nan
    return v


def apply(model: nn.Module, plan: Union[Any, str, os.PathLike], *, refresh_every: int = 1,
          ema: Optional[float] = None, log_to: Any = None, seed: int = 0,
          sync_stats: bool = False, record: bool = True) -> Applied:
    """Enforce ``plan`` on the neural gradients of ``model`` in the backward pass.

    Args:
        model: the model (a DDP wrapper is looked through); every pattern of the plan must
            match one of its modules.
        plan: a :class:`gradstats.Plan` or the path of a saved plan.
        refresh_every: recompute each layer's statistics, threshold and (``"lognormal"``)
            scale every this many gradients of that layer; ``"amax"`` scales follow every step.
        ema: decay of an exponential moving average of the statistics (None: the latest).
        log_to: a :class:`gradstats.Tracer`; each call's record goes into its run's
            ``"applied"`` table (``open_run(path).table("applied")``).
        seed: seed of the random draws of stochastic pruning and rounding.
        sync_stats: under ``torch.distributed``, all-reduce the statistics so every rank uses
            the same thresholds and scales.
        record: keep per-call records (``Applied.history``).

    Eval mode and ``torch.no_grad`` are untouched; each call of a module reused in one step,
    and each micro-batch of gradient accumulation, is compressed on its own.

    Example:
        >>> import torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> handle = gradstats.apply(model, gradstats.Plan.uniform(format="e4m3fn", scale="amax"))
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> handle.remove(); handle.summary()["format"].tolist()
        ['e4m3fn']
    """
    return Applied(model, plan, refresh_every=refresh_every, ema=ema, log_to=log_to, seed=seed,
                   sync_stats=sync_stats, record=record)
