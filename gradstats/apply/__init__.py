"""Enforce a per-layer :class:`~gradstats.plan.Plan` on neural gradients during training.

``gradstats.apply(model, plan)`` makes the neural gradient ``g = dL/dy`` at each planned
layer's output pass through the layer's rule in the backward pass, before it flows on to
earlier layers and into that layer's own weight gradient: stochastic pruning at the threshold
of the rule's sparsity target, then rounding to its format at its scale. Per layer it keeps the
running mean and std of ``ln|g|``, the zero fraction and ``amax`` (one fused reduction per
refresh: :func:`gradstats.stats.tensor_stats_vector`), refreshes thresholds and scales every
``refresh_every`` gradients, and records what each call achieved (sparsity, underflow,
saturation) beside what the model predicted.

It also watches for a layer that leaves what its plan promised, from the counts and sums the fused
pass returns anyway (:class:`gradstats.ops.fused.CompressCounts`), and warns once per layer and
kind (logger ``gradstats.apply``, level WARNING; listed in ``Applied.summary()["alerts"]`` and, with
``log_to=``, the run's ``"applied_alerts"`` table): non-finite values in the incoming gradient
(a NaN loss), more entries clipped at the format's maximum than :data:`OVERFLOW_BOUND` (or the
plan's own prediction, if larger), a magnitude gain ``<out, g> / <g, g>`` off 1 by more than
:data:`BIAS_BOUND` beyond the call's sampling noise (in one call, or over all calls so far),
rounding to nearest that flushes more than :data:`UNDERFLOW_BOUND` of the non-zero values,
achieved sparsity above the target by more than :data:`SPARSITY_MARGIN`, and a gradient that is
all zeros for :data:`ZERO_CALLS` calls in a row. Beside each call's achieved sparsity,
underflow, saturation (and, when measured, error) it records what the lognormal model predicts
for them at the running statistics; with ``fallback=`` (opt-in, a :class:`Fallback`) a layer
whose gradient drifts past a bound has its rule changed a step at a time (stochastic rounding,
then the next wider format of its family, then full precision), logged and recorded.
``Applied.state_dict()`` and ``load_state_dict()`` checkpoint everything that decides the next
output, the changed rules included, so a training resumed from a checkpoint repeats the
uninterrupted one bit for bit.

A refresh sets each layer's threshold and predicted sparsity with the rule of
:data:`gradstats.pruning.rules.THRESHOLD_RULES` that ``recommend`` uses, its scale with
:meth:`gradstats.plan.Rule.scale_for` (:func:`gradstats.fpanalysis.optimal_scale`) and its
predictions with :func:`gradstats.fpanalysis.composed.predict_one`: the one-layer paths of those
stages, in Python floats.

Example:
    >>> import torch, gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> plan = gradstats.Plan.uniform(format="e3m2fn", sparsity=0.8, layers=["0", "2"])
    >>> with gradstats.apply(model, plan) as applied:
    ...     model(torch.randn(32, 16)).square().mean().backward()
    >>> sorted(applied.to_dataframe()["layer"])
    ['0', '2']
"""
from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any, Callable, Optional, Union

import pandas as pd
import torch
from torch import nn

from gradstats.apply.alerts import Alerts
from gradstats.apply.device import DevicePath
from gradstats.apply.refresh import LayerState, Records, Refresher, record_snapshot, relative_error
from gradstats.apply.settings import (
    _STATE_FIELDS,
    _STATE_FIELDS_V2,
    ALERT_KINDS,
    BIAS_BOUND,
    FALLBACK_ACTIONS,
    FALLBACK_PRESETS,
    OVERFLOW_BOUND,
    SPARSITY_MARGIN,
    STATE_VERSION,
    UNDERFLOW_BOUND,
    ZERO_CALLS,
    ApplyConfig,
    Fallback,
    widen,
)
from gradstats.layers import module_types
from gradstats.ops.engine import active_engine, using
from gradstats.ops.fused import NativeCall, prune_quantize
from gradstats.ops.layout import channel_dim
from gradstats.ops.native import reads_in_place
from gradstats.tracer import taps
from gradstats.tracer.capture import first_grad_tensor
from gradstats.tracer.noise import sending_back
from gradstats.tracer.taps import grad_tap, observe, replace_first_grad_tensor
from gradstats.wrappers import named_layers, unwrap

__all__ = ["apply", "Applied", "ApplyConfig", "Fallback", "widen", "ALERT_KINDS", "BIAS_BOUND", "FALLBACK_ACTIONS",
           "FALLBACK_PRESETS", "OVERFLOW_BOUND", "SPARSITY_MARGIN", "STATE_VERSION", "UNDERFLOW_BOUND", "ZERO_CALLS"]

log = logging.getLogger("gradstats.apply")


class Applied:
    """The handle :func:`apply` returns: removes the hooks (``.remove()``, or use it as a
    context manager) and holds what was done (``.history``, ``.to_dataframe()``,
    ``.summary()``, ``.alerts``); ``state_dict()`` / ``load_state_dict()`` checkpoint it.

    Each record: ``layer``, ``seq`` (the layer's gradient count), ``n``, ``format``,
    ``rounding``, ``scale``, ``target_sparsity``, ``threshold``, ``predicted_sparsity`` (the
    threshold rule's model at the running statistics), ``achieved_sparsity``,
    ``pruned_fraction``, ``underflow_fraction`` and ``predicted_underflow`` (fractions of the
    entries flushed to zero by the rounding), ``overflow_fraction`` and ``predicted_overflow``
    (saturated), ``error`` (``|out - g|^2 / |g|^2``, measured only for a :class:`Fallback` with
    an ``error`` bound; NaN otherwise) and ``predicted_error``, ``fallback`` (the action this
    call triggered, or ``""``), ``mu``, ``sigma``, ``p0``, ``amax``. The predictions are the
    lognormal model's (:func:`gradstats.fpanalysis.composed.predict_one`) at the running statistics, threshold
    and scale.
    """

    def __init__(self, model: nn.Module, plan: Any, config: Optional[ApplyConfig] = None, *,
                 log_to: Any = None) -> None:
        from gradstats.plan import Plan

        if not isinstance(model, nn.Module):
            raise ValueError(f"apply() needs a torch.nn.Module as model, got {type(model).__name__}")
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a gradstats.Plan or the path of a saved plan, got "
                             f"{type(plan).__name__}")
        if config is not None and not isinstance(config, ApplyConfig):
            raise ValueError(f"config must be a gradstats.apply.ApplyConfig or None, got {type(config).__name__}")
        if log_to is not None and not hasattr(log_to, "log_rows"):
            raise ValueError("log_to must be a gradstats.Tracer (attached to the run to log into)")
        #: the options in force (:class:`ApplyConfig`)
        self.config = config if config is not None else ApplyConfig()
        root = unwrap(model)            # DDP, DataParallel, FSDP, torch.compile: the user's names
        self.plan = plan
        self.rules = {n: r for n, r in plan.resolve(root).items() if not r.is_identity}
        if any(e.types is not None for e in plan.entries):      # a selection by type: say what it left
            from gradstats.layers import log_unplanned

            log_unplanned(log, "gradstats.apply", plan.unplanned(root))
        self.plan_rules = dict(self.rules)      # as planned (self.rules: in force, after any fallback)
        #: every rule change a fallback made: dicts of layer, seq, action, reason, from and to rule
        self.fallbacks: list[dict[str, Any]] = []
        self.log_to = log_to
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.state = {n: LayerState() for n in self.rules}
        # its parts, sharing the rules in force and the state: the refresh of each layer's settings, the
        # checks of each call (alerts, fallbacks), the device path, the records
        #: the refresh (:class:`~gradstats.apply.refresh.Refresher`)
        self.refresher = Refresher(self.rules, self.state, self.config)
        #: the alerts and fallbacks (:class:`~gradstats.apply.alerts.Alerts`)
        self.checks = Alerts(self.rules, self.plan_rules, self.config, self.fallbacks, log_to)
        #: the device path (:class:`~gradstats.apply.device.DevicePath`)
        self.device_path = DevicePath(self.refresher, self.config, self._quantize_args, self._account)
        self._records = Records()
        self._calls: dict[str, tuple[Any, Optional[NativeCall]]] = {}   # per layer: (rule, its prepared call)
        modules = dict(named_layers(root))
        self._types = {n: module_types(modules[n]) for n in self.rules}
        # the taps of a compiled model (gradstats.tracer.taps): per layer, the settling and compressing slots
        self._slots = {n: (taps.register(self._settle_now), taps.register(functools.partial(self._on_compiled, n)))
                       for n in self.rules}
        self._handles = [modules[n].register_forward_hook(self._forward_hook(n)) for n in self.rules]

    # -- lifecycle
    def remove(self) -> None:
        """Remove every hook: the model trains exactly as without the plan again."""
        self.settle()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for slots in self._slots.values():
            for slot in slots:
                taps.release(slot)
        self._slots.clear()

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # -- hooks
    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
            if torch.compiler.is_compiling():   # a graph dynamo traces: taps (gradstats.tracer.taps)
                return self._tap_compiled(name, module, output)
            if self.device_path.inflight:     # the device path's last backward: settled here, outside it
                self.settle()
            if not (torch.is_grad_enabled() and module.training):
                return None
            out = first_grad_tensor(output)
            if out is not None:
                out.register_hook(lambda g: None if sending_back() else self._compress_eager(name, g))
            return None
        return hook

    def _tap_compiled(self, name: str, module: nn.Module, output: Any) -> Any:
        """Under ``torch.compile``: the settling tap in the forward pass, and the gradient through
        the layer's ``transform`` tap (:meth:`_compress` when it runs); only constants are read
        here, so the graph neither breaks nor recompiles per layer or step."""
        settle, compress = self._slots[name]
        out = first_grad_tensor(output)
        if out is None:
            return None
        observe(out, settle)
        if not (torch.is_grad_enabled() and module.training):
            return None
        return replace_first_grad_tensor(output, lambda t: grad_tap(t, compress, transform=True))

    def _on_compiled(self, name: str, g: torch.Tensor) -> Optional[torch.Tensor]:
        return None if sending_back() else self._compress(name, g)

    def _settle_now(self, _: torch.Tensor) -> None:
        if self.device_path.inflight:
            self.settle()

    def _compress_with_engine(self, name: str, g: torch.Tensor) -> torch.Tensor:
        if self.config.engine is None:
            return self._compress_on(name, g)
        with using(self.config.engine):
            return self._compress_on(name, g)

    #: the same, opaque to dynamo: what the compiled path's taps call
    _compress = torch.compiler.disable(_compress_with_engine)

    def _compress_eager(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """The eager hook's call: without dynamo's wrapper (7-10 us a call) unless a graph is being traced
        (compiled autograd)."""
        if torch.compiler.is_compiling():
            return self._compress(name, g)
        return self._compress_with_engine(name, g)

    def _compress_on(self, name: str, g: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():       # (a backward pass that builds a graph: create_graph=True)
            with torch.no_grad():
                return self._compress_now(name, g)
        return self._compress_now(name, g)     # (a backward pass runs its hooks with grad mode off)

    def _compress_now(self, name: str, g: torch.Tensor) -> torch.Tensor:
        engine = active_engine(g.device.type)
        if engine == "triton":       # the device path: nothing read back here (apply.device)
            return self.device_path.compress(name, g)
        rule, st = self.rules[name], self.state[name]
        # the C kernels take the gradient as it is: then the call runs them directly (one check here; between
        # the backward's own kernels every torch operation and check costs tens of microseconds)
        flat = engine == "native" and reads_in_place(g)
        k = st.seq - self.config.warmup                       # the call index since the warm-up
        if k < 0:                 # warm-up: the gradient passes unchanged, the statistics follow it
            self.refresher.refresh(name, g, True, flat=flat)
            st.seq += 1
            return g
        refresh = self.refresher.refreshes(k)
        err = math.nan
        self.refresher.refresh(name, g, refresh, flat=flat)
        threshold = st.threshold if rule.prunes else 0.0
        call = self._native_call(name, rule) if flat else None      # (flat: what NativeCall.takes asks of g)
        if call is not None and call.covers(st.scale):
            out, counts = call(g, threshold, st.scale, generator=self.generator)
        else:
            q = self._quantize_args(name, rule, g)
            out, counts = prune_quantize(g, threshold, q.pop("fmt"), scale=st.scale, generator=self.generator, **q)
        if self.config.fallback is not None and self.config.fallback.error is not None and counts.n:
            err = relative_error(out, g)
        self._account(name, rule, st.seq, counts, err, record_snapshot(st))
        st.seq += 1
        return out if out.dtype == g.dtype else out.to(g.dtype)

    def _native_call(self, name: str, rule: Any) -> Optional[NativeCall]:
        """The layer's rule prepared for the fused C kernel (:class:`~gradstats.ops.fused.NativeCall`), made
        again when a fallback changes the rule; None for block scales (their own kernel, through
        :func:`~gradstats.ops.fused.prune_quantize`)."""
        made = self._calls.get(name)
        if made is None or made[0] is not rule:
            call = None if rule.quantizes and rule.scheme.block_size is not None else \
                NativeCall(rule.scheme if rule.quantizes else None)
            made = self._calls[name] = (rule, call)
        return made[1]

    def _quantize_args(self, name: str, rule: Any, g: torch.Tensor) -> dict[str, Any]:
        """The rule's own quantize arguments (format, rounding, blocks and their scales: one home),
        with blocks laid out along the layer's channels, as the data-gradient GEMM reads them
        (:mod:`gradstats.ops.layout`); with a Hadamard transform (``"nvfp4_training"``) along the
        tokens, rotated, as the weight-gradient GEMM reads them (:func:`gradstats.quantize`)."""
        if not rule.quantizes:
            return {"fmt": None, "rounding": rule.rounding}
        q: dict[str, Any] = {"fmt": rule.scheme}
        if rule.scheme.block_size is not None:
            q["block_dim"] = channel_dim(self._types[name], g.dim())
        return q

    def _account(self, name: str, rule: Any, seq: int, counts: Any, err: float, snap: dict[str, float]) -> None:
        """Check one call's counts (alerts, fallback) and record it, with the layer's settings as
        they were when it ran (``snap``; its predictions may be pending, ``snap["pending"]``: they are
        filled in when the records are read, or at once to log them)."""
        st = self.state[name]
        if counts.n:
            self.checks.check(name, st, counts)
        rec = None
        pending = snap.get("pending")
        if self.config.record:       # before a fallback changes the rule (and its scale and predictions)
            n = max(counts.n, 1)
            q = rule.quantizes
            rec = {"layer": name, "seq": seq, "n": counts.n,
                   "format": None if rule.format is None else str(rule.format), "rounding": rule.rounding,
                   "scale": snap["scale"] if q and rule.block_size is None else math.nan,
                   "target_sparsity": rule.sparsity if rule.prunes else math.nan,
                   "threshold": snap["threshold"] if rule.prunes else math.nan,
                   "predicted_sparsity": snap["predicted_sparsity"] if rule.prunes else math.nan,
                   "achieved_sparsity": counts.zeros / n, "pruned_fraction": counts.pruned / n,
                   "underflow_fraction": counts.underflow / n,
                   "predicted_underflow": math.nan if pending is not None else snap["predicted_underflow"] if q else 0.0,
                   "overflow_fraction": counts.saturated / n,
                   "predicted_overflow": math.nan if pending is not None else snap["predicted_overflow"] if q else 0.0,
                   "gain": counts.gain, "gain_se": counts.gain_se, "bias": counts.bias,
                   "nonfinite": counts.nonfinite,
                   "error": counts.error if math.isnan(err) else err,
                   "predicted_error": math.nan if pending is not None else snap["predicted_error"],
                   "fallback": "",
                   "mu": snap["mu"], "sigma": snap["sigma"], "p0": snap["p0"], "amax": snap["amax"]}
        if self.config.fallback is not None and counts.n:
            action = self.checks.drift(name, st, counts, err)
            if rec is not None:
                rec["fallback"] = action
        if rec is not None:          # its predictions computed when the records are read, or now to log them
            self._records.add(rec, pending, rule.quantizes, now=self.log_to is not None)
            if self.log_to is not None:
                self.log_to.log_rows("applied", [rec])

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every recorded call, one dict each (see the class); the predictions of the calls recorded
        since the last read are computed here, once each."""
        return self._records.read()

    @history.setter
    def history(self, records: list[dict[str, Any]]) -> None:
        self._records.reset(records)

    @property
    def device_calls(self) -> int:
        """The calls enforced on the device path so far (their seeds follow from it; checkpointed)."""
        return self.device_path.calls

    def settle(self) -> None:
        """Bring the device path's statistics and counts of every call so far to the host (one wait)
        and solve, check and record them, in order (:meth:`~gradstats.apply.device.DevicePath.settle`); the handle calls it
        itself (next forward, results, checkpoints), and it is harmless to call again."""
        with using(self.config.engine):
            self.device_path.settle()

    @property
    def alerts(self) -> dict[str, dict[str, str]]:
        """Per layer that raised any: ``{kind: message}`` of the alerts fired (each at most once;
        kinds in :data:`ALERT_KINDS`)."""
        self.settle()
        return {n: dict(st.alerts) for n, st in self.state.items() if st.alerts}

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the next output, as plain data (tensors, numbers, strings,
        lists, dicts: ``torch.load(..., weights_only=True)`` reads it back): per layer the call
        counter, running statistics, threshold, scale, predictions, alert state, the fallback
        state and the rule in force (changed by a fallback, it replaces the plan's rule when
        loaded), the fallbacks taken, and the random generator
        (every random draw of apply, on any device, comes from this one CPU generator). Saved
        beside the model's and optimizer's state dicts, a resumed training repeats the
        uninterrupted one bit for bit. The per-call records (``history``) are not included:
        with ``log_to=`` they are in the run; a resumed handle's history starts empty and its
        ``seq`` values continue.

        Example:
            >>> import torch, gradstats
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
            >>> plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5, rounding="stochastic", layers=["0"])
            >>> a = gradstats.apply(model, plan)
            >>> model(torch.randn(4, 8)).sum().backward()
            >>> b = gradstats.apply(torch.nn.Sequential(torch.nn.Linear(8, 8)), plan)
            >>> b.load_state_dict(a.state_dict()); b.state["0"].seq
            1
        """
        self.settle()
        return {
            "version": STATE_VERSION,
            "generator": self.generator.get_state(),
            "device_calls": self.device_calls,
            "refresh_every": _schedule_text(self.config.refresh_every),
            "warmup": self.config.warmup,
            "ema": self.config.ema,
            "fallback": None if self.config.fallback is None else self.config.fallback.to_dict(),
            "fallbacks": [dict(r) for r in self.fallbacks],
            "layers": {n: {**{k: getattr(st, k) for k in _STATE_FIELDS + _STATE_FIELDS_V2},
                           "alerts": dict(st.alerts), "fallback_done": list(st.fallback_done),
                           "rule": self.rules[n].to_dict()} for n, st in self.state.items()},
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
        if sd.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"state dict version {sd.get('version')!r} is not {STATE_VERSION}, the one this "
                             "gradstats writes (or 1, which it reads)")
        layers = sd["layers"]
        missing = [n for n in self.state if n not in layers]
        extra = [n for n in layers if n not in self.state]
        if missing or extra:
            raise ValueError(f"the state dict is of other layers than this handle's plan: layers of the plan "
                             f"missing from it: {missing}; layers in it the plan does not enforce on this "
                             f"model: {extra}. Load it into apply() of the plan and model it was saved from")
        mine = {"refresh_every": _schedule_text(self.config.refresh_every), "warmup": self.config.warmup,
                "ema": self.config.ema, "fallback": None if self.config.fallback is None else self.config.fallback.to_dict()}
        for k, v in mine.items():
            if k == "warmup" and k not in sd and v == 0:
                continue                                   # saved before warmup existed
            if (k in sd or k not in ("fallback", "warmup")) and sd.get(k) != v:
                log.warning("gradstats.apply: the state dict was saved with %s=%r, this handle uses %r: the "
                            "resumed training will not repeat the saved one", k, sd.get(k), v)
        gen = sd["generator"]
        if not isinstance(gen, torch.Tensor) or gen.dtype != torch.uint8:
            raise ValueError(f"state dict 'generator' must be a torch.uint8 tensor (Generator.get_state()), "
                             f"got {type(gen).__name__}")
        from gradstats.plan import Rule

        states, rules = {}, dict(self.plan_rules)
        for n, d in layers.items():
            bad = [k for k in _STATE_FIELDS if k not in d]
            if bad:
                raise ValueError(f"state dict entry of layer {n!r} lacks {bad}")
            st = LayerState(**{k: d[k] for k in _STATE_FIELDS}, **{k: d[k] for k in _STATE_FIELDS_V2 if k in d})
            st.seq, st.zero_run, st.fallback_run = int(st.seq), int(st.zero_run), int(st.fallback_run)
            st.alerts = {str(k): str(v) for k, v in d.get("alerts", {}).items()}
            st.fallback_done = [int(i) for i in d.get("fallback_done", [])]
            if st.fallback_done:                 # a fallback changed this layer's rule: continue with it
                try:
                    rules[n] = Rule(**d["rule"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"state dict entry of layer {n!r}: its rule (changed by a fallback) "
                                     f"does not load: {exc}") from None
            states[n] = st
        self.generator.set_state(gen.clone())
        self.device_path.calls = int(sd.get("device_calls", 0))
        self.state.clear()              # in place: the refresh, the checks and the device path share them
        self.state.update(states)
        self.rules.clear()
        self.rules.update(rules)
        self.fallbacks[:] = [dict(r) for r in sd.get("fallbacks", [])]

    # -- results
    def to_dataframe(self) -> pd.DataFrame:
        """Every recorded call, one row each (see the class docstring for the columns)."""
        self.settle()
        return pd.DataFrame(self.history)

    def summary(self) -> pd.DataFrame:
        """Per layer, predicted beside achieved for each quantity of the whole operator (pruning
        *and* rounding, what leaves the layer; fractions of all entries):

        - ``plan_<q>``: what the plan predicted when it was made (its :class:`~gradstats.plan.Prediction`
          from ``recommend``'s calibration steps; NaN where the plan carries none);
        - ``predicted_<q>``: the lognormal model at this training's running statistics, threshold
          and scale (mean over calls);
        - ``achieved_<q>``: measured on each call (mean over calls);

        for ``sparsity``, ``underflow`` (non-zero values after pruning that rounding flushed to zero),
        ``overflow`` (clipped at the format's maximum), ``gain`` (``<out, g> / <g, g>``: 1 is
        unbiased) and ``error`` (``|out - g|^2 / |g|^2``). Also ``calls``, ``format`` and ``rounding``
        (the last call's rule), ``target_sparsity``, the last ``mu`` and ``sigma`` (of ln|g|),
        ``alerts`` (the kinds that fired, ``"overflow, gain"``; ``""`` if none) and ``fallbacks``
        (the actions a fallback took)."""
        df = self.to_dataframe()
        if df.empty:
            return df
        agg = df.groupby("layer", sort=False).agg(
            calls=("seq", "size"), format=("format", "last"), rounding=("rounding", "last"),
            target_sparsity=("target_sparsity", "mean"),
            predicted_sparsity=("predicted_sparsity", "mean"), achieved_sparsity=("achieved_sparsity", "mean"),
            predicted_underflow=("predicted_underflow", "mean"), achieved_underflow=("underflow_fraction", "mean"),
            predicted_overflow=("predicted_overflow", "mean"), achieved_overflow=("overflow_fraction", "mean"),
            achieved_gain=("gain", "mean"),
            predicted_error=("predicted_error", "mean"), achieved_error=("error", "mean"),
            mu=("mu", "last"), sigma=("sigma", "last"))
        agg["predicted_gain"] = math.nan       # the running model predicts no gain; the plan does
        order = [n for n in self.rules if n in agg.index]            # model order
        out = agg.loc[order].reset_index()
        pred = [self.plan_rules[n].predicted for n in order]

        def plan_col(field_: str) -> list[float]:
            return [math.nan if p is None or getattr(p, field_) is None else float(getattr(p, field_)) for p in pred]

        for q, field_ in (("sparsity", "sparsity"), ("underflow", "flushed"), ("overflow", "overflow"),
                          ("gain", "gain"), ("error", "error")):
            out.insert(out.columns.get_loc(f"predicted_{q}"), f"plan_{q}", plan_col(field_))
        out.insert(out.columns.get_loc("sigma") + 1, "alerts",
                   [", ".join(k for k in ALERT_KINDS if k in self.state[n].alerts) for n in order])
        out["fallbacks"] = [", ".join(r["action"] for r in self.fallbacks if r["layer"] == n) for n in order]
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan, the settings and the per-layer summary as plain data."""
        return {"plan": self.plan.to_dict(), "refresh_every": _schedule_text(self.config.refresh_every),
                "warmup": self.config.warmup, "ema": self.config.ema,
                "fallback": None if self.config.fallback is None else self.config.fallback.to_dict(),
                "fallbacks": [dict(r) for r in self.fallbacks], "summary": self.summary().to_dict("records")}

    def __repr__(self) -> str:
        return f"Applied(layers={list(self.rules)}, calls={len(self.history)})"


def _schedule_text(refresh_every: Union[int, Callable[[int], bool]]) -> Union[int, str]:
    """``refresh_every`` as plain data: the int, or the schedule function's qualified name."""
    if callable(refresh_every):
        return f"schedule:{getattr(refresh_every, '__qualname__', type(refresh_every).__name__)}"
    return refresh_every


def apply(model: nn.Module, plan: Union[Any, str, os.PathLike], *,
          refresh_every: Union[int, Callable[[int], bool]] = 1, warmup: int = 0,
          ema: Optional[float] = None, log_to: Any = None, seed: int = 0,
          sync_stats: bool = False, record: bool = True,
          sparsity_margin: Optional[float] = SPARSITY_MARGIN,
          underflow_bound: Optional[float] = UNDERFLOW_BOUND,
          zero_calls: Optional[int] = ZERO_CALLS,
          fallback: Union[Fallback, str, None] = None,
          overflow_bound: Optional[float] = OVERFLOW_BOUND,
          bias_bound: Optional[float] = BIAS_BOUND, engine: Optional[str] = None,
          config: Optional[ApplyConfig] = None) -> Applied:
    """Enforce ``plan`` on the neural gradients of ``model`` in the backward pass.

    Args:
        model: the model (DDP, DataParallel, FSDP and ``torch.compile`` wrappers are looked
            through: :func:`gradstats.wrappers.unwrap`); every pattern of the plan must match
            one of its modules.
        plan: a :class:`gradstats.Plan` or the path of a saved plan.
        refresh_every: recompute each layer's statistics, threshold and (``"lognormal"``)
            scale every this many gradients of that layer; ``"amax"`` scales follow every step.
            Or a schedule: a function of the call index ``k`` (0 at the first enforced
            gradient) that returns True to refresh, e.g. ``lambda k: k < 100 or k % 10 == 0``
            (every call for 100, then every tenth). The first enforced call always refreshes.
        warmup: each layer's first ``warmup`` gradients pass unchanged (a warm-up) while
            its statistics, threshold and scale follow them (the study trained half an epoch
            before pruning); the plan takes effect at the next one, warm. Warm-up calls are
            not recorded; ``seq`` counts them (the first record has ``seq == warmup``).
        ema: decay of an exponential moving average of the statistics (None: the latest).
        log_to: a :class:`gradstats.Tracer`; each call's record goes into its run's
            ``"applied"`` table (``open_run(path).table("applied")``).
        seed: seed of the random draws of stochastic pruning and rounding.
        sync_stats: under ``torch.distributed``, all-reduce the statistics so every rank uses
            the same thresholds and scales.
        record: keep per-call records (``Applied.history``).
        sparsity_margin: warn when a call's achieved sparsity exceeds the layer's target by
            more than this (beyond sampling noise); None: no check.
        underflow_bound: warn when rounding to nearest flushes more than this fraction of the
            layer's non-zero values to zero (beyond sampling noise; a systematic shrinkage;
            stochastic rounding's flushes are unbiased and not checked); None: no check.
        overflow_bound: warn when more than this fraction of a call's entries are clipped at the
            format's maximum (or more than the plan predicted, if more); None: no check.
        bias_bound: warn when the magnitude gain ``<out, g> / <g, g>`` of a call is off 1 by more than
            this beyond five standard errors, or that of all calls so far beyond two (and by five off
            1: a sustained shrinkage alerts within a few calls); None: no check.
        zero_calls: warn when a layer's enforced gradient is all zeros this many calls in a
            row; None: no check.
        fallback: None (off, the default), a :class:`Fallback`, or a name of
            :data:`FALLBACK_PRESETS` (``"widen"``: the default ladder, stochastic rounding, then
            the next wider format of the family, then full precision): when a layer's gradient
            drifts past the fallback's bounds, change its rule a step at a time (logged, in
            ``Applied.fallbacks``, ``summary()``, the records, the run with ``log_to=``, and the
            state dict).
        engine: the engine of the handle's passes (:data:`gradstats.ops.engine.ENGINES`: ``"native"``,
            ``"torch"``, ``"triton"``); None (default): ``GRADSTATS_ENGINE``'s, else each device's default.
        config: the options above as one value (:class:`ApplyConfig`, what the trainer callbacks
            pass on); keywords given beside it must agree with it.

    Each alert is logged once per layer and kind (logger ``gradstats.apply``, WARNING) and
    listed in ``Applied.summary()["alerts"]`` and ``Applied.alerts``. To resume a training
    exactly, checkpoint ``Applied.state_dict()`` with the model and optimizer and load it into
    the new handle (``load_state_dict``).

    Eval mode and ``torch.no_grad`` are untouched; each call of a module reused in one step,
    and each micro-batch of gradient accumulation, is compressed on its own.

    Example:
        >>> import torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> handle = gradstats.apply(model, gradstats.Plan.uniform(format="e4m3fn", scale="amax", layers=["0"]))
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> handle.remove(); handle.summary()["format"].tolist()
        ['e4m3fn']
    """
    cfg = ApplyConfig.resolve(config, refresh_every=refresh_every, warmup=warmup, ema=ema, seed=seed,
                              sync_stats=sync_stats, record=record, sparsity_margin=sparsity_margin,
                              underflow_bound=underflow_bound, zero_calls=zero_calls, fallback=fallback,
                              overflow_bound=overflow_bound, bias_bound=bias_bound, engine=engine)
    return Applied(model, plan, cfg, log_to=log_to)
