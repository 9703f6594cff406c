"""Enforce a per-layer :class:`~gradstats.plan.Plan` on neural gradients during training.

``gradstats.apply(model, plan)`` makes the neural gradient ``g = dL/dy`` at each planned
layer's output pass through the layer's rule in the backward pass, before it flows on to
earlier layers and into that layer's own weight gradient: stochastic pruning at the threshold
of the rule's sparsity target, then rounding to its format at its scale. Per layer it keeps the
running mean and std of ``ln|g|``, the zero fraction and ``amax`` (one fused reduction per
refresh: :func:`gradstats.stats.tensor_stats_vector`), refreshes thresholds and scales every
``refresh_every`` gradients, and records what each call achieved (sparsity, underflow,
saturation) beside what the model predicted.

It also watches for a plan that silently destroys a layer's gradient and warns once per layer
and kind (logger ``gradstats.enforce``, level WARNING; listed in ``Applied.summary()["alerts"]``):
achieved sparsity above the target by more than :data:`SPARSITY_MARGIN`, more than
:data:`UNDERFLOW_BOUND` of the non-zero values flushed to zero by the format, and a gradient
that is all zeros for :data:`ZERO_CALLS` calls in a row. ``Applied.state_dict()`` and
``load_state_dict()`` checkpoint everything that decides the next output, so a training resumed
from a checkpoint repeats the uninterrupted one bit for bit.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import pandas as pd
import torch
from torch import nn

from .compress import CompressCounts, prune_quantize
from .stats import SCALAR_FIELDS, tensor_stats_vector, vector_to_stats
from .wrappers import named_layers, unwrap

log = logging.getLogger(__name__)

_F = {name: i for i, name in enumerate(SCALAR_FIELDS)}

#: Alert "sparsity": the achieved sparsity of a call exceeds the layer's target (or the zero
#: fraction its gradient arrived with, if larger) by more than this, beyond sampling noise
#: (three standard deviations of ``n`` keep-or-zero draws, at most ``1.5 / sqrt(n)``). The
#: threshold rules hit their targets within about 0.03 (docs/apply.md), so a larger excess is the
#: format flushing what pruning kept, or a threshold model that does not fit the layer.
SPARSITY_MARGIN = 0.05
#: Alert "underflow": more than this fraction of the non-zero values that reach the rounding
#: are flushed to zero by the format. Flushing most non-zero values is a systematic shrinkage of
#: the layer's weight gradient (the bias accuracy loss ranked with); see docs/apply.md.
UNDERFLOW_BOUND = 0.5
#: Alert "zero_gradient": the gradient leaving the layer was all zeros for this many calls in
#: a row (nothing reaches its weights: the symptom of a broken low-precision kernel or scale).
ZERO_CALLS = 3
#: the kinds of alert, in the order ``Applied.summary()`` lists them
ALERT_KINDS = ("sparsity", "underflow", "zero_gradient")
#: version of the layout of :meth:`Applied.state_dict`
STATE_VERSION = 1
#: the _LayerState fields a state dict carries (``row`` is only read on the refresh that sets it)
_STATE_FIELDS = ("seq", "mu", "m2", "p0", "amax", "rms", "mean_abs", "threshold",
                 "predicted_sparsity", "scale", "zero_run")


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
    zero_run: int = 0               # consecutive calls whose output was all zeros
    alerts: dict[str, str] = field(default_factory=dict)   # kind -> message of each alert fired

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
    ``.summary()``, ``.alerts``); ``state_dict()`` / ``load_state_dict()`` checkpoint it.

    Each record: ``layer``, ``seq`` (the layer's gradient count), ``n``, ``format``,
    ``scale``, ``target_sparsity``, ``threshold``, ``predicted_sparsity`` (the threshold
    rule's model at the running statistics), ``achieved_sparsity``, ``pruned_fraction``,
    ``underflow_fraction``, ``overflow_fraction``, ``mu``, ``sigma``, ``p0``, ``amax``.
    """

    def __init__(self, model: nn.Module, plan: Any, *, refresh_every: int = 1,
                 ema: Optional[float] = None, log_to: Any = None, seed: int = 0,
                 sync_stats: bool = False, record: bool = True,
                 sparsity_margin: Optional[float] = SPARSITY_MARGIN,
                 underflow_bound: Optional[float] = UNDERFLOW_BOUND,
                 zero_calls: Optional[int] = ZERO_CALLS) -> None:
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
        if sparsity_margin is not None and not (0.0 <= sparsity_margin < 1.0):
            raise ValueError(f"sparsity_margin must be None (no check) or in [0, 1), got {sparsity_margin!r}")
        if underflow_bound is not None and not (0.0 <= underflow_bound < 1.0):
            raise ValueError(f"underflow_bound must be None (no check) or a fraction in [0, 1), got "
                             f"{underflow_bound!r}")
        if zero_calls is not None and (not isinstance(zero_calls, int) or isinstance(zero_calls, bool)
                                       or zero_calls < 1):
            raise ValueError(f"zero_calls must be None (no check) or a positive int, got {zero_calls!r}")
        root = unwrap(model)            # DDP, DataParallel, FSDP, torch.compile: the user's names
        self.plan = plan
        self.rules = {n: r for n, r in plan.resolve(root).items() if not r.is_identity}
        self.refresh_every = refresh_every
        self.ema = ema
        self.log_to = log_to
        self.sync_stats = sync_stats
        self.record = record
        self.sparsity_margin = sparsity_margin
        self.underflow_bound = underflow_bound
        self.zero_calls = zero_calls
        self.generator = torch.Generator().manual_seed(seed)
        self.history: list[dict[str, Any]] = []
        self.state = {n: _LayerState() for n in self.rules}
        modules = dict(named_layers(root))
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
        if counts.n:
            self._check(name, st, counts)
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

    def _check(self, name: str, st: _LayerState, c: CompressCounts) -> None:
        """The alerts, from the counts the kernel returns anyway: a few integer operations."""
        if c.zeros == c.n:
            st.zero_run += 1
            if self.zero_calls is not None and st.zero_run >= self.zero_calls and "zero_gradient" not in st.alerts:
                self._alert(name, st, "zero_gradient", (
                    f"the gradient leaving it was all zeros for {st.zero_run} calls in a row (call {st.seq}): "
                    "nothing reaches this layer's weights or the layers before it. Check the incoming "
                    "gradient, the format's range at this scale, or the low-precision kernel"))
        else:
            st.zero_run = 0
        rule = self.rules[name]
        if c.underflow and self.underflow_bound is not None and "underflow" not in st.alerts:
            reaching = c.n - c.zeros + c.underflow          # non-zero entries that reached the rounding
            if c.underflow > self.underflow_bound * reaching:
                where = (f"with blocks of {rule.block_size}" if rule.block_size is not None
                         else f"at scale 2^{math.log2(st.scale):g}")
                self._alert(name, st, "underflow", (
                    f"{c.underflow / reaching:.1%} of the non-zero values reaching {rule.format} {where} "
                    f"were flushed to zero (call {st.seq}; bound {self.underflow_bound}): "
                    "a systematic shrinkage of this layer's gradient. Use rounding='stochastic', a larger "
                    "scale (scale='amax'), or a format with more exponent bits"))
        if rule.prunes and self.sparsity_margin is not None and "sparsity" not in st.alerts:
            n = c.n
            floor = max(rule.sparsity, (c.zeros - c.pruned - c.underflow) / n)   # target, or zeros on arrival
            excess = c.zeros / n - floor
            if excess > self.sparsity_margin + 1.5 / math.sqrt(n):
                cause = (f"the format flushed {c.underflow / n:.1%} of the entries: raise the scale, use "
                         "rounding='stochastic', or lower the target" if 2 * c.underflow >= excess * n else
                         "the threshold model misses this layer's distribution: try threshold_rule='histogram'")
                self._alert(name, st, "sparsity", (
                    f"achieved sparsity {c.zeros / n:.3f} exceeds the target {rule.sparsity:g} by {excess:.3f} "
                    f"(margin {self.sparsity_margin:g}; call {st.seq}): {cause}"))

    def _alert(self, name: str, st: _LayerState, kind: str, msg: str) -> None:
        st.alerts[kind] = msg
        log.warning("gradstats.apply: layer %r: %s", name, msg)

    @property
    def alerts(self) -> dict[str, dict[str, str]]:
        """Per layer that raised any: ``{kind: message}`` of the alerts fired (each at most once;
        kinds in :data:`ALERT_KINDS`)."""
        return {n: dict(st.alerts) for n, st in self.state.items() if st.alerts}

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the next output, as plain data (tensors, numbers, strings,
        lists, dicts: ``torch.load(..., weights_only=True)`` reads it back): per layer the call
        counter, running statistics, threshold, scale and alert state, and the random generator
        (every random draw of apply, on any device, comes from this one CPU generator). Saved
        beside the model's and optimizer's state dicts, a resumed training repeats the
        uninterrupted one bit for bit. The per-call records (``history``) are not included:
        with ``log_to=`` they are in the run; a resumed handle's history starts empty and its
        ``seq`` values continue.

        Example:
            >>> import torch, gradstats
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
            >>> plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5, rounding="stochastic")
            >>> a = gradstats.apply(model, plan)
            >>> model(torch.randn(4, 8)).sum().backward()
            >>> b = gradstats.apply(torch.nn.Sequential(torch.nn.Linear(8, 8)), plan)
            >>> b.load_state_dict(a.state_dict()); b.state["0"].seq
            1
        """
        return {
            "version": STATE_VERSION,
            "generator": self.generator.get_state(),
            "refresh_every": self.refresh_every,
            "ema": self.ema,
            "layers": {n: {**{k: getattr(st, k) for k in _STATE_FIELDS},
                           "alerts": dict(st.alerts)} for n, st in self.state.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (on a handle of the same plan's layers).

        A ``ValueError`` names the layers that differ; different ``refresh_every`` or ``ema``
        settings are accepted with a warning (the resumed training then is not the same one).
        """
        sd = state_dict
        if not isinstance(sd, dict) or "layers" not in sd or "generator" not in sd:
            raise ValueError("load_state_dict expects what Applied.state_dict() returned (a dict with "
                             f"'layers' and 'generator'), got {type(sd).__name__}"
                             + (f" with keys {sorted(sd)}" if isinstance(sd, dict) else ""))
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"state dict version {sd.get('version')!r} is not {STATE_VERSION}, the one this "
                             "gradstats writes and reads")
        layers = sd["layers"]
        missing = [n for n in self.state if n not in layers]
        extra = [n for n in layers if n not in self.state]
        if missing or extra:
            raise ValueError(f"the state dict is of other layers than this handle's plan: layers of the plan "
                             f"missing from it: {missing}; layers in it the plan does not enforce on this "
                             f"model: {extra}. Load it into apply() of the plan and model it was saved from")
        for k in ("refresh_every", "ema"):
            if sd.get(k) != getattr(self, k):
                log.warning("gradstats.apply: the state dict was saved with %s=%r, this handle uses %r: the "
                            "resumed training will not repeat the saved one", k, sd.get(k), getattr(self, k))
        gen = sd["generator"]
        if not isinstance(gen, torch.Tensor) or gen.dtype != torch.uint8:
            raise ValueError(f"state dict 'generator' must be a torch.uint8 tensor (Generator.get_state()), "
                             f"got {type(gen).__name__}")
        states = {}
        for n, d in layers.items():
            bad = [k for k in _STATE_FIELDS if k not in d]
            if bad:
                raise ValueError(f"state dict entry of layer {n!r} lacks {bad}")
            st = _LayerState(**{k: d[k] for k in _STATE_FIELDS})
            st.seq, st.zero_run = int(st.seq), int(st.zero_run)
            st.alerts = {str(k): str(v) for k, v in d.get("alerts", {}).items()}
            states[n] = st
        self.generator.set_state(gen.clone())
        self.state = states

    # -- results
    def to_dataframe(self) -> pd.DataFrame:
        """Every recorded call, one row each (see the class docstring for the columns)."""
        return pd.DataFrame(self.history)

    def summary(self) -> pd.DataFrame:
        """Per layer: calls, format, mean target, predicted and achieved sparsity, mean
        underflow and overflow fractions, last mu and sigma (of ln|g|), and ``alerts``: the
        kinds of alert that fired for the layer (``"sparsity, underflow"``; ``""`` if none)."""
        df = self.to_dataframe()
        if df.empty:
            return df
        agg = df.groupby("layer", sort=False).agg(
            calls=("seq", "size"), format=("format", "last"), target_sparsity=("target_sparsity", "mean"),
            predicted_sparsity=("predicted_sparsity", "mean"), achieved_sparsity=("achieved_sparsity", "mean"),
            underflow_fraction=("underflow_fraction", "mean"), overflow_fraction=("overflow_fraction", "mean"),
            mu=("mu", "last"), sigma=("sigma", "last"))
        order = [n for n in self.rules if n in agg.index]            # model order
        out = agg.loc[order].reset_index()
        out["alerts"] = [", ".join(k for k in ALERT_KINDS if k in self.state[n].alerts) for n in order]
        return out

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
          sync_stats: bool = False, record: bool = True,
          sparsity_margin: Optional[float] = SPARSITY_MARGIN,
          underflow_bound: Optional[float] = UNDERFLOW_BOUND,
          zero_calls: Optional[int] = ZERO_CALLS) -> Applied:
    """Enforce ``plan`` on the neural gradients of ``model`` in the backward pass.

    Args:
        model: the model (DDP, DataParallel, FSDP and ``torch.compile`` wrappers are looked
            through: :func:`gradstats.wrappers.unwrap`); every pattern of the plan must match
            one of its modules.
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
        sparsity_margin: warn when a call's achieved sparsity exceeds the layer's target by
            more than this (beyond sampling noise); None: no check.
        underflow_bound: warn when more than this fraction of the non-zero values reaching
            the rounding are flushed to zero; None: no check.
        zero_calls: warn when a layer's enforced gradient is all zeros this many calls in a
            row; None: no check.

    Each alert is logged once per layer and kind (logger ``gradstats.enforce``, WARNING) and
    listed in ``Applied.summary()["alerts"]`` and ``Applied.alerts``. To resume a training
    exactly, checkpoint ``Applied.state_dict()`` with the model and optimizer and load it into
    the new handle (``load_state_dict``).

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
                   sync_stats=sync_stats, record=record, sparsity_margin=sparsity_margin,
                   underflow_bound=underflow_bound, zero_calls=zero_calls)
