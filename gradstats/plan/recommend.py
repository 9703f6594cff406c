"""Per-layer recommendations from a traced run: :func:`recommend` -> :class:`gradstats.plan.Plan`.

For every planned layer of a run the streamed statistics of its neural gradient (no raw
samples) give ``mu``, ``sigma`` (of ``ln|g|``) and the zero fraction ``p0``
(:func:`gradstats.stats.merge_stats`, :func:`gradstats.stats.lognormal_moments`); from them

- :func:`gradstats.fpanalysis.best_format` picks, per bit width, the format with the smallest
  predicted quantisation error (relative mean squared error) and its optimal power-of-two scale;
- with ``sparsity``, :func:`gradstats.pruning.threshold` gives the pruning threshold of the
  chosen rule and :func:`gradstats.pruning.expected_sparsity` the sparsity it is predicted to
  reach under the lognormal model (the naive rule undershoots; the bell-shaped ones miss).

Everything is vectorised over layers: a run of 100 layers and 5 bit widths takes well under a
second once its statistics are read.

Example:
    >>> import tempfile, torch, gradstats
    >>> from gradstats.plan.recommend import recommend, recommend_each
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> with gradstats.trace(model, tempfile.mkdtemp()) as t:
    ...     for _ in range(3):
    ...         model(torch.randn(64, 8)).logsumexp(1).mean().backward(); t.step()
    >>> plan = recommend(t.path, bits=8, sparsity=0.8)
    >>> sorted(plan.resolve(model)), plan.output_layer, plan.defaults.sparsity   # the logits stay exact
    (['0'], '2', 0.8)
    >>> plans = recommend_each(t.path, bits=[6, 8])
    >>> sorted(plans), plans[6].entries[0].format.bits
    ([6, 8], 6)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Sequence, Union

import numpy as np

from gradstats.fpanalysis.granularity import GRANULARITIES, granularity_layout, granularity_of
from gradstats.fpanalysis.training import FLUSH_BOUND
from gradstats.plan import Plan, PlanEntry, Prediction, Provenance, Rule
from gradstats.plan._statistics import Steps, _Moments, _moments, _select_layers, layer_moments
from gradstats.plan.config import RecommendConfig
from gradstats.plan.noise_budget import bound_and_repair, log_bound
from gradstats.plan.noise_prediction import NOISE_BOUND
from gradstats.run import as_run

log = logging.getLogger(__name__)

__all__ = ["recommend", "recommend_each", "layer_moments", "granularity_recipe", "GRANULARITIES", "FORMAT_RULES"]

#: ``format_rule=`` values: the closed forms in each layer's lognormal fit, or its binade histogram
FORMAT_RULES = ("lognormal", "histogram")
#: what ``sparsity="auto"`` asks for before the noise bound lowers it per layer
AUTO_SPARSITY = 0.99
#: rounding modes the format analysis predicts
from gradstats.formats import PREDICTED_ROUNDINGS as _ROUNDINGS  # noqa: E402


def _bits_list(bits: Any) -> tuple[list[int], bool]:
    if isinstance(bits, (int, np.integer)) and not isinstance(bits, bool):
        return [int(bits)], True
    if isinstance(bits, (list, tuple, range)) and len(bits) > 0 and all(
            isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in bits):
        out = [int(b) for b in bits]
        if len(set(out)) != len(out):
            raise ValueError(f"bits lists a width twice: {out}")
        return out, False
    raise ValueError(f"bits must be an int or a non-empty list of ints (3..16), got {bits!r}")


def _pruning(mom: _Moments, sparsity: float | None, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: the threshold at recommendation time (NaN for 'exact') and the sparsity it is
    predicted to reach: the target for the model-free rules ('exact', 'histogram'), under the
    lognormal model for the others."""
    n = len(mom.layers)
    if sparsity is None:
        return np.full(n, np.nan), np.full(n, np.nan)
    from gradstats import pruning

    if rule == "exact":
        return np.full(n, np.nan), np.maximum(sparsity, mom.p0)
    a = np.asarray(pruning.threshold(np.full(n, float(sparsity)), mom.rows, threshold_rule=rule), dtype=np.float64)
    if rule == "histogram":       # model-free: it aims at the target on the data itself
        return a, np.maximum(float(sparsity), mom.p0)
    pred = pruning.expected_sparsity(a, mu=mom.mu, sigma=mom.sigma, p0=mom.p0)
    return a, np.asarray(pred, dtype=np.float64)


def _fmt(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def recommend(run: Any, config: RecommendConfig | None = None, *, bits: int | str = 8,
              sparsity: float | str | None = None, granularity: str | int = "tensor", rounding: str | None = None,
              steps: Steps = "auto", threshold_rule: str | None = None,
              candidates: str | Iterable[Any] | None = "ocp", layers: str | Sequence[str] | None = None,
              format_rule: str = "lognormal", objective: str = "training", bias_bound: float | None = None,
              flush_bound: float | None = FLUSH_BOUND, output_layer: str | bool | None = None,
              prune_at: str | bool | None = None, check: bool = True,
              noise_bound: float | None = NOISE_BOUND) -> Plan:
    """Recommend a per-layer plan from a traced run's statistics.

    Args:
        run: a :class:`gradstats.run.Run` or the path of a run directory.
        config: the options below as one value (:class:`gradstats.RecommendConfig`); a keyword
            given too must agree with it.
        bits: the format width (:func:`recommend_each` makes one plan per width of a list, from one
            read of the run).
        sparsity: target fraction of zeros in ``[0, 1)`` for every pruned layer (stochastic
            pruning), a ceiling that ``noise_bound`` lowers per layer where needed; ``"auto"``: the
            most the noise bound allows (up to 0.99); None for no pruning.
        noise_bound: the largest noise ratio the plan may add to any planned layer's weight gradient,
            relative to that gradient's own minibatch noise at the run's batch size, as predicted from
            the run (:mod:`gradstats.plan.noise_prediction`: the plan's pruning and rounding at the layer and at the
            layers after it, whose noise flows back). Default :data:`gradstats.noise.NOISE_BOUND`
            (0.02; ``docs/noise.md`` says why); None: not bounded (the requested sparsity on every
            layer, as before). The plan's ``to_dataframe()`` shows per layer the requested and granted
            sparsity, the reason and the predicted ratio (``Plan.noise``). A run traced without noise
            records (``trace(noise=False)``, or an old run) is not bounded, with a warning.
        granularity: ``"tensor"`` (one optimal power-of-two scale per tensor, scale rule
            ``"lognormal"``), ``"mx"`` (blocks of 32, E8M0 scales), ``"nvfp4"`` (blocks of 16,
            E4M3 scales), or a block size N (blocks of N with E8M0 scales), read by
            :func:`gradstats.fpanalysis.granularity.granularity_layout`; block-scaled plans use the
            ``"amax"`` scale rule. Or a block preset of :data:`gradstats.scheme.PRESETS` that brings
            more than its blocks: ``"nvfp4_training"`` (NVFP4 as NVIDIA's NVFP4 pretraining recipe
            quantises gradients: stochastic rounding, a 16-point random Hadamard transform along the
            tokens), whose rounding becomes the default and whose transform every rule carries.
        rounding: ``"nearest"`` or ``"stochastic"`` (the errors are predicted for it), or None
            (default): per layer, what the objective chooses (``objective="training"`` with
            per-tensor scales); otherwise stochastic for 6 bits or fewer, nearest above.
        steps: which statistics, merged: ``"auto"`` (default: up to four steps spread over the run, at
            1/4, 1/2, 3/4 and the end of the steps holding samples, so that drift over training is seen;
            :func:`gradstats.plan.checks.calibration_steps`), ``"latest"`` (each layer's latest step), an
            int, a ``range`` or ``slice``, or a list of steps (:mod:`gradstats.run.select`).
        threshold_rule: the pruning threshold rule; None: the :class:`~gradstats.plan.Rule` default
            (``"histogram"``, the most accurate sort-free rule on real gradients), or
            ``"lognormal"``, ``"naive_lognormal"``, ``"normal"``, ``"laplace"``, ``"exact"``.
        candidates: formats to choose from (:data:`gradstats.fpanalysis.CANDIDATE_PRESETS`):
            ``"ocp"`` (default; None is the same): the formats hardware has, FP8 ``e4m3fn`` and
            ``e5m2``, FP6 ``e2m3fn`` and ``e3m2fn``, FP4 ``e2m1fn``; ``"torchao"`` or ``"te"``:
            those torchao's or Transformer Engine's training recipes use for gradients at this
            ``granularity`` (per tensor: FP8 only; ``"mx"``, ``"nvfp4"``: their block formats);
            ``"any"``: every exponent/mantissa split of each width as a finite ``fn`` format
            (research splits such as ``e2m5fn``, which no hardware or library implements); a
            convention of :func:`gradstats.fpanalysis.candidate_formats` (``"hardware"``,
            ``"fn"``, ``"ieee"``, ``"fnuz"``: every split too); or a list of formats (each width
            chooses among those of its own width). A width the preset has no format of (5 or 7
            bits with ``"ocp"``) is a ``ValueError``.
        layers: None for every traced convolution and linear layer but the output layer, or
            names/globs of traced layers.
        output_layer: with ``layers=None``, the layer left in full precision and unpruned:
            None or ``"auto"`` (the model's output layer, the last traced ``Linear``: the study's
            placement, :func:`gradstats.pruning.allocation.output_layer`), a name, or ``False``
            (plan it too). The plan records it (``Plan.output_layer``).
        prune_at: where ``sparsity`` applies (:attr:`gradstats.Plan.prune_at`): None (default) is
            ``"auto"`` with ``layers=None``: the layers whose output feeds a BatchNorm (the
            study's placement; from the run's layers in call order), or every layer when the
            model has none; with ``layers`` named, every one of them. ``False``: every layer;
            ``"batchnorm_inputs"``: only those. The other layers are quantised and not pruned,
            and their formats are chosen without a threshold. The plan records it.
        format_rule: how formats are chosen (per-tensor scales): ``"lognormal"`` (the closed forms in each
            layer's mu and sigma, given its maximum) or ``"histogram"`` (each layer's binade histogram
            and maximum, :func:`gradstats.fpanalysis.best_format_from_stats`: no lognormal assumption,
            the more accurate pick on real gradients, see ``docs/fpanalysis.md``). Block-scaled plans
            use the lognormal model.
        objective: ``"training"`` (default; per-tensor scales with the lognormal model): per layer
            the format, rounding and scale (relative to the running amax: ``scale="amax"`` with a
            ``scale_shift``) with the least predicted noise whose predicted magnitude bias is within
            ``bias_bound`` (:func:`gradstats.fpanalysis.choose_for_training`; ``docs/fpanalysis.md``,
            "Training-aware choice"): round-to-nearest at the MSE-optimal scale flushes most small
            values of a wide layer, a shrinkage of every weight gradient that costs accuracy.
            ``"mse"``: the smallest relative mean squared error (the earlier criterion). Block-scaled
            plans and ``format_rule="histogram"`` choose by MSE (their bias is not modelled yet) with the
            rounding above.
        bias_bound: the largest predicted ``|bias|`` accepted by the training objective (default
            :data:`gradstats.fpanalysis.BIAS_BOUND`, 0.01).
        flush_bound: the training objective's largest predicted fraction of a layer's non-zero
            gradient values that round-to-nearest may flush to zero (default
            :data:`gradstats.fpanalysis.FLUSH_BOUND`, 0.01; beyond it the layer rounds stochastically):
            the bias bound weighs a flushed value by its size; why flushing costs more than its size (our
            hypothesis, not yet tested: Adam normalises every weight's step, ``docs/RESULTS.md`` 1.4.1).
            None: no such bound.

    With ``check`` (default) every planned layer's rule is checked on each calibration step
    (:mod:`gradstats.plan.checks`): the composed operator, pruning then rounding, predicted from the
    step's statistics and replayed on its stored samples with the plan's seed. A layer whose replay
    clips more than 0.1% of its values, moves the magnitude gain or bias by more than ``bias_bound``,
    or (to nearest) flushes more than ``flush_bound`` of its non-zero values takes the next choice
    (no saturating scale shift, stochastic rounding, the amax scale, another format of the width,
    full precision) and the plan records why; the per-layer table of predicted against replayed is
    the plan's ``checks`` (``gradstats recommend`` prints it).

    Returns a :class:`~gradstats.plan.Plan` whose defaults hold the shared settings (scale rule,
    rounding, blocks, sparsity, threshold rule) and whose entries, one per layer by exact name,
    hold the chosen format and the :class:`~gradstats.plan.Prediction` (error, sparsity, mu,
    sigma, p0, scale, threshold).

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> with gradstats.trace(m, tempfile.mkdtemp()) as t:
        ...     m(torch.randn(32, 16)).exp().sum().backward(); t.step()
        >>> p = recommend(t.path, bits=8, sparsity=0.5, rounding="stochastic", output_layer=False,
        ...               noise_bound=None)
        >>> r = p.resolve(m)["0"]
        >>> r.format.bits, r.rounding, r.scale, r.sparsity, 0.4 < r.predicted.sparsity < 0.6
        (8, 'stochastic', 'amax', 0.5, True)
        >>> bounded = recommend(t.path, bits=8, sparsity=0.5, output_layer=False)   # noise_bound=0.02
        >>> row = bounded.to_dataframe().iloc[0]
        >>> bool(row["sparsity"] <= 0.5 and row["pruning_noise"] <= 0.02), float(row["requested_sparsity"])
        (True, 0.5)
    """
    if isinstance(bits, (list, tuple, range)):
        raise ValueError(f"recommend makes one Plan for one width, got bits={bits!r}; for one plan per width "
                         f"call recommend_each(run, bits={list(bits)!r}), which returns {{bits: Plan}}")
    cfg = RecommendConfig.resolve(
        config, "recommend", sparsity=sparsity, granularity=granularity, rounding=rounding, steps=steps,
        threshold_rule=threshold_rule, candidates=candidates, layers=layers, format_rule=format_rule,
        objective=objective, bias_bound=bias_bound, flush_bound=flush_bound, output_layer=output_layer,
        prune_at=prune_at, check=check, noise_bound=noise_bound).options()
    if isinstance(bits, str):
        if bits != "auto":
            raise ValueError(f"bits must be an int (a width, 3..16) or 'auto' (per layer the fewest bits the "
                             f"noise bound allows), got {bits!r}")
        return _recommend_auto(run, **cfg)
    widths, _ = _bits_list(bits)
    return _plans(run, bits=widths, **cfg)[widths[0]]


#: what ``bits="auto"`` chooses from, fewest bits per value first (``(granularity, bits)``): MXFP4
#: (4.25 bits with its E8M0 block scales), NVFP4 (4.5), 6 and 8 bits per tensor, MXFP8 (8.25); and
#: after them full precision
AUTO_LADDER: tuple[tuple[str, int], ...] = (("mx", 4), ("nvfp4", 4), ("tensor", 6), ("tensor", 8), ("mx", 8))


def _recommend_auto(run: Any, *, granularity: Any, candidates: Any, noise_bound: float | None,
                    **kw: Any) -> Plan:
    """``recommend(bits="auto")``: each rung of :data:`AUTO_LADDER` recommended on its own (checked,
    not bounded), then per layer the first rung, and the sparsity in it, that the noise bound allows."""
    if noise_bound is None:
        raise ValueError("bits='auto' asks for the fewest bits the noise bound allows: give a noise_bound "
                         f"(default {NOISE_BOUND}), or a width as bits")
    if granularity != "tensor" or candidates not in (None, "ocp"):
        raise ValueError("bits='auto' chooses among the formats hardware has (MXFP4, NVFP4, 6 and 8 bits per "
                         "tensor, MXFP8): leave granularity and candidates out, or give a width as bits")
    r = as_run(run)
    rungs = [_plans(r, bits=[b], granularity=g, candidates="ocp", noise_bound=None, **{**kw, "check": False})[b]
             for g, b in AUTO_LADDER[1:]]       # checked once mixed (the base plan's check)
    g, b = AUTO_LADDER[0]
    plan = _plans(r, bits=[b], granularity=g, candidates="ocp", noise_bound=noise_bound, ladder=rungs,
                  label="recommend(bits='auto')", **kw)[b]
    gen = plan.provenance.generator if plan.provenance is not None else ""
    if plan.provenance is not None:
        plan = dataclasses.replace(plan, provenance=dataclasses.replace(
            plan.provenance, generator="recommend(bits='auto', " + gen.split("(", 1)[1]))
    return plan


def recommend_each(run: Any, config: RecommendConfig | None = None, *, bits: Sequence[int],
                   **options: Any) -> dict[int, Plan]:
    """:func:`recommend` for each width of ``bits``: ``{bits: Plan}`` in the order given, the run read
    once. ``config`` and ``options`` are :func:`recommend`'s (a :class:`gradstats.RecommendConfig`, and
    its fields as keywords); ``bits="auto"`` is :func:`recommend`'s alone.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> with gradstats.trace(m, tempfile.mkdtemp()) as t:
        ...     m(torch.randn(32, 16)).exp().sum().backward(); t.step()
        >>> plans = recommend_each(t.path, bits=[8, 4], output_layer=False, noise_bound=None)  # each width as such
        >>> {b: p.resolve(m)["0"].format.bits for b, p in plans.items()}
        {8: 8, 4: 4}
    """
    return _plans(run, bits=bits, **RecommendConfig.resolve(config, "recommend_each", **options).options())


def _plans(run: Any, *, bits: Sequence[int], sparsity: float | str | None, granularity: str | int,
           rounding: str | None, steps: Steps, threshold_rule: str | None, candidates: Any,
           layers: str | Sequence[str] | None, format_rule: str, objective: str, bias_bound: float | None,
           flush_bound: float | None, output_layer: str | bool | None, prune_at: str | bool | None,
           check: bool, noise_bound: float | None, ladder: Sequence[Plan] | None = None,
           label: str | None = None) -> dict[int, Plan]:
    """:func:`recommend_each`; ``ladder``: the wider options of every layer under the noise bound
    (default: the 8-bit plan behind a narrower width, :func:`_fallback`); ``label``: the plan's name
    in the logs."""
    from gradstats import fpanalysis
    from gradstats._version import __version__  # noqa: F401 - provenance

    model = format_rule
    again = dict(sparsity=sparsity, rounding=rounding, steps=steps, threshold_rule=threshold_rule, layers=layers,
                 format_rule=format_rule, objective=objective, bias_bound=bias_bound, flush_bound=flush_bound,
                 output_layer=output_layer, prune_at=prune_at, check=check)
    widths, _ = _bits_list(bits)
    if rounding is not None and rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be None (the objective chooses) or one of {list(_ROUNDINGS)} (the "
                         f"format analysis predicts the error of these), got {rounding!r}")
    if objective not in fpanalysis.OBJECTIVES:
        raise ValueError(f"objective must be one of {list(fpanalysis.OBJECTIVES)}, got {objective!r}")
    if bias_bound is None:
        bias_bound = fpanalysis.BIAS_BOUND
    if threshold_rule is None:
        threshold_rule = Rule().threshold_rule
    if noise_bound is not None and (isinstance(noise_bound, bool) or not isinstance(noise_bound, (int, float))
                                    or not noise_bound > 0):
        raise ValueError(f"noise_bound must be a positive noise ratio (default {NOISE_BOUND}: the noise a plan adds "
                         f"to each weight gradient, against SGD's own) or None (not bounded), got {noise_bound!r}")
    asked = sparsity
    if isinstance(sparsity, str):
        if sparsity != "auto":
            raise ValueError(f"sparsity must be a number in [0, 1), 'auto' or None, got {sparsity!r}")
        if noise_bound is None:
            raise ValueError("sparsity='auto' asks for the most the noise bound allows: give a noise_bound "
                             f"(default {NOISE_BOUND}), or a number as sparsity")
        sparsity = AUTO_SPARSITY
    elif sparsity is not None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be a number in [0, 1), 'auto' or None, got {sparsity!r}")
        sparsity = float(sparsity)
    Rule(threshold_rule=threshold_rule)  # validates the rule name
    if model not in FORMAT_RULES:
        raise ValueError(f"format_rule must be one of {list(FORMAT_RULES)}, got {model!r}")
    granularity, recipe = granularity_recipe(granularity)
    if rounding is None and recipe.get("rounding"):
        rounding = recipe.pop("rounding")
    recipe.pop("rounding", None)
    granularity = _candidate_granularity(candidates, granularity)
    layout = granularity_layout(granularity)
    block_size, scale_format = layout.block_size, layout.scale_format_name
    cands = _candidates(fpanalysis, candidates, widths, granularity)
    if model == "histogram" and block_size is not None:
        raise ValueError("format_rule='histogram' chooses per-tensor formats and scales; block-scaled plans "
                         "(granularity='mx', 'nvfp4' or a block size) use format_rule='lognormal'")
    r = as_run(run)
    skip = None
    default_selection = layers is None
    if layers is None and output_layer is not False:
        from gradstats.layers import output_layer as find_output

        skip = find_output(r) if output_layer in (None, "auto", True) else str(output_layer)
        chosen = [n for n in _select_layers(r, None) if n != skip]
        if not chosen:
            raise ValueError(f"the run at {r.path} traced no convolution or linear layer but its output "
                             f"layer {skip!r}; pass output_layer=False to plan it")
        layers = chosen
    from gradstats.plan._plan import default_prune_at, pruned_layers

    prune_at = default_prune_at(prune_at, default_selection)
    cal_steps = None
    if isinstance(steps, str) and steps == "auto":
        from gradstats.plan.checks import calibration_steps

        cal_steps = calibration_steps(r, _select_layers(r, layers), steps="auto")
        steps = cal_steps
    mom = _moments(r, steps=steps, layers=layers, kind="grad")
    thr, pred_sp = _pruning(mom, sparsity, threshold_rule)
    if sparsity is not None and prune_at is not None:
        where = pruned_layers(prune_at, r)
        if where is not None:                # the layers not pruned: no threshold, no prediction
            off = np.array([n not in set(where) for n in mom.layers])
            thr, pred_sp = np.where(off, np.nan, thr), np.where(off, np.nan, pred_sp)
    training = objective == "training" and block_size is None and model == "lognormal"
    plans: dict[int, Plan] = {}
    for b in widths:
        plan_name = label or (f"recommend(bits={b}" + (f", sparsity={asked!r}" if asked is not None else "")
                     + (f", granularity={granularity!r}" if granularity != "tensor" else "") + ")")   # in the logs
        b_round = rounding or ("stochastic" if b <= 6 else "nearest")
        per_layer: list[dict[str, Any]] = [{} for _ in mom.layers]
        if training:
            numel = np.array([row["numel"] for row in mom.rows], dtype=np.float64)
            fmts_ = cands if isinstance(cands, list) else fpanalysis.preset_formats(cands, b, granularity="tensor")
            tc = fpanalysis.choose_for_training(
                b, mu=mom.mu, sigma=mom.sigma, p0=mom.p0, amax=mom.amax, numel=numel,
                candidates=[f for f in fmts_ if f.bits == b] or fmts_,
                roundings=[rounding] if rounding else _ROUNDINGS, bias_bound=bias_bound, flush_bound=flush_bound,
                threshold=np.where(np.isfinite(thr), thr, 0.0) if sparsity else None, names=mom.layers)
            fmts, scales, errors = list(tc.format), np.asarray(tc.scale), np.asarray(tc.error)
            roundings = list(tc.rounding)
            b_round = max(set(roundings), key=roundings.count)     # the plan's default: the common one
            for i in range(len(mom.layers)):
                per_layer[i] = {"rounding": roundings[i], "scale_shift": int(tc.scale_shift[i]),
                                "bias": float(tc.bias[i]), "flushed": float(tc.flushed[i])}
            biased = [f"  {mom.layers[i]}: best {tc.bias[i]:+.3f} with {fmts[i]}, {roundings[i]} rounding"
                      for i in range(len(mom.layers)) if not tc.feasible[i]]
            if biased:
                log.warning("%s: for %d layer(s) no %d-bit format keeps the predicted magnitude bias within %g; "
                            "each is planned with its least biased choice%s:\n%s", plan_name, len(biased), b,
                            bias_bound, ", which the check on the samples then tests" if check else "",
                            "\n".join(biased))
        else:
            fmts, scales, errors = _choose(fpanalysis, b, mom, rounding=b_round, block_size=block_size,
                                           scale_format=scale_format, candidates=cands, model=model)
        defaults = Rule(scale="amax" if (block_size or training) else "lognormal", rounding=b_round,
                        block_size=block_size, scale_format=scale_format, sparsity=sparsity,
                        threshold_rule=threshold_rule, **recipe)
        entries = []
        for i, name in enumerate(mom.layers):
            extra = per_layer[i]
            pred = Prediction(error=_fmt(errors[i]), sparsity=_fmt(pred_sp[i]), mu=float(mom.mu[i]),
                              sigma=float(mom.sigma[i]), p0=float(mom.p0[i]),
                              scale=_fmt(scales[i]) if block_size is None else None,
                              threshold=_fmt(thr[i]), amax=_fmt(mom.amax[i]),
                              bias=extra.get("bias"), flushed=extra.get("flushed"))
            kw = {}
            if training:
                if extra["rounding"] != b_round:
                    kw["rounding"] = extra["rounding"]
                if extra["scale_shift"]:
                    kw["scale_shift"] = extra["scale_shift"]
            entries.append(PlanEntry(name, format=fmts[i], predicted=pred, **kw))
        gen = (f"recommend(bits={b}, sparsity={asked!r}, granularity={granularity!r}, "
               f"rounding={rounding!r}, steps={steps!r}, threshold_rule={threshold_rule!r}"
               + (f", format_rule={model!r}" if model != "lognormal" else "")
               + f", objective={objective!r}"
               + (f", flush_bound={flush_bound!r}" if training else "")
               + f", candidates={cands if isinstance(cands, str) else [str(c) for c in cands]!r}"
               + (f", noise_bound={noise_bound!r})" if asked is not None else ")"))
        prov = Provenance.now(source=str(r.path), generator=gen, steps=mom.steps)
        plans[b] = Plan(entries, defaults, prov, output_layer=skip,
                        prune_at=prune_at if sparsity is not None else None)
        from gradstats.plan.checks import calibration_steps

        chk = cal_steps or calibration_steps(r, mom.layers, steps=steps)
        pool = (cands if isinstance(cands, list) else fpanalysis.preset_formats(
            cands, b, granularity="tensor" if block_size is None else granularity)) if check else None
        wider = (ladder if ladder is not None else _fallback(r, b, granularity, candidates, again)) \
            if noise_bound is not None else ()
        if pool is not None and wider:      # the wider options are checked in the mixed plan
            pool = list(dict.fromkeys([*pool, *_widths_formats(fpanalysis, wider)]))
        plans[b] = bound_and_repair(plans[b], r, chk, noise_bound, bounded=sparsity is not None or
                                    noise_bound is not None, pool=pool, bias_bound=bias_bound,
                                    flush_bound=flush_bound, ladder=wider)
        plans[b] = _granted_thresholds(plans[b], r, mom, threshold_rule)
        if plans[b].noise_bound is not None:
            log_bound(plan_name, plans[b])
    if default_selection:
        from gradstats.layers import log_unplanned

        log_unplanned(log, "gradstats.recommend", plans[widths[0]].unplanned(r))
    return plans


def _fallback(r: Any, bits: int, granularity: Any, candidates: Any, kw: dict[str, Any]) -> list[Plan]:
    """The wider option behind a width under 8 bits: the 8-bit plan per tensor (of ``candidates`` where
    they have 8-bit formats, else the hardware formats), not bounded, checked where it is chosen."""
    if bits >= 8:
        return []
    from gradstats import fpanalysis

    try:
        cands = _candidates(fpanalysis, candidates, [8], "tensor")
        if isinstance(cands, list) and not any(c.bits == 8 for c in cands):
            cands = "ocp"
    except ValueError:
        cands = "ocp"
    return [_plans(r, bits=[8], granularity="tensor", candidates=cands, noise_bound=None, **{**kw, "check": False})[8]]


def _widths_formats(fpanalysis: Any, plans: Sequence[Plan]) -> list[Any]:
    """The hardware formats (per tensor) of every width the ``plans`` use: the check's other choices
    for their rules."""
    from gradstats.formats import FPFormat

    widths = sorted({e.format.bits for p in plans for e in p.entries if isinstance(e.format, FPFormat)})
    return [f for w in widths for f in fpanalysis.preset_formats("ocp", w, granularity="tensor")]


def _granted_thresholds(plan: Plan, r: Any, mom: _Moments, threshold_rule: str) -> Plan:
    """``plan`` with each pruned entry's predicted threshold at the sparsity the plan grants it. The
    thresholds were first computed at the requested sparsity (0.99 for ``"auto"``), which the noise
    bound may lower: what ``explain`` shows and what the exports hand to training code must be the
    threshold of the rule that is enforced."""
    if threshold_rule == "exact":
        return plan
    from gradstats import pruning

    rules = plan.resolve(r, strict=False)
    at = {n: i for i, n in enumerate(mom.layers)}
    todo = [(k, e) for k, e in enumerate(plan.entries)
            if not e.is_pattern and e.layer in at and isinstance(e.predicted, Prediction)
            and e.layer in rules and rules[e.layer].sparsity is not None]
    if not todo:
        return plan
    sp = np.array([rules[e.layer].sparsity for _, e in todo], dtype=np.float64)
    thr = np.asarray(pruning.threshold(sp, [mom.rows[at[e.layer]] for _, e in todo], threshold_rule=threshold_rule),
                     dtype=np.float64)
    entries = list(plan.entries)
    for (k, e), a in zip(todo, thr):
        entries[k] = dataclasses.replace(e, predicted=dataclasses.replace(e.predicted, threshold=_fmt(a)))
    return dataclasses.replace(plan, entries=tuple(entries))


def granularity_recipe(granularity: Any) -> tuple[Any, dict[str, Any]]:
    """A granularity that names a block preset bringing more than its blocks (``"nvfp4_training"``):
    its plain granularity (``"nvfp4"``) and the rule fields it adds (``hadamard``, and its rounding
    where not nearest); any other granularity unchanged, with none.

    Example:
        >>> granularity_recipe("nvfp4_training"), granularity_recipe("mx")
        (('nvfp4', {'hadamard': 16, 'rounding': 'stochastic'}), ('mx', {}))
    """
    from gradstats.scheme import PRESETS

    key = granularity.strip().lower() if isinstance(granularity, str) else None
    if key is None or key in GRANULARITIES or key not in PRESETS or PRESETS[key].block_size is None:
        return granularity, {}
    s = PRESETS[key]
    base = granularity_of(s)
    if base is None or (s.hadamard is None and s.rounding == "nearest"):
        return granularity, {}
    extra: dict[str, Any] = {"hadamard": s.hadamard} if s.hadamard is not None else {}
    if s.rounding != "nearest":
        extra["rounding"] = s.rounding
    return base, extra


def _candidate_granularity(candidates: Any, granularity: Any) -> Any:
    """The granularity of candidates that are schemes (``["nvfp4"]``, ``["mxfp8_e4m3", "mxfp4"]``):
    their one block layout, which the default ``"tensor"`` gives way to and any other must equal."""
    from gradstats.scheme import Scheme, names_scheme

    if candidates is None or isinstance(candidates, str):
        return granularity
    schemes = [Scheme.parse(c) for c in candidates if names_scheme(c)]
    layouts = {c.block_layout for c in schemes}
    if not layouts:
        return granularity
    bad = [str(c) for c in schemes if c.rounding != "nearest" or c.scale_rounding not in (None, "floor")]
    if len(layouts) > 1 or bad:
        raise ValueError(f"candidates {[str(c) for c in schemes]} must share one block layout and set no rounding "
                         f"({bad or 'layouts differ'}): recommend one layout at a time, and pass rounding= instead")
    layout, = layouts
    g = granularity_of(layout) or (layout.block_size if granularity_layout(layout.block_size) == layout else None)
    if g is None or (granularity != "tensor" and granularity_layout(granularity) != layout):
        raise ValueError(f"candidates {[str(c) for c in schemes]} use {layout.scale_format_name} blocks of "
                         f"{layout.block_size}, which granularity="
                         f"{granularity!r} cannot express or contradicts: leave granularity out, or pick "
                         "candidates of that granularity")
    return g


def _candidates(fpanalysis, candidates: Any, widths: Sequence[int], granularity: Any) -> Union[str, list[Any]]:
    """The checked ``candidates``: a name of :data:`gradstats.fpanalysis.CANDIDATE_NAMES` (None: the
    default preset) with a format of every width at this granularity, or a list of formats."""
    if candidates is None:
        candidates = fpanalysis.DEFAULT_CANDIDATES
    if isinstance(candidates, str):
        for b in widths:                     # raises, naming the widths the preset has
            fpanalysis.preset_formats(candidates, b, granularity=granularity)
        return candidates
    from gradstats.formats import FPFormat
    from gradstats.scheme import Scheme, names_scheme

    try:
        out = [Scheme.parse(c).element if names_scheme(c) else FPFormat.parse(c) for c in candidates]
    except TypeError:
        raise ValueError(f"candidates must be one of {list(fpanalysis.CANDIDATE_NAMES)} or a list of formats, "
                         f"got {candidates!r}") from None
    if not out:
        raise ValueError("candidates is empty")
    return out


def _choose(fpanalysis, bits: int, mom: _Moments, *, rounding: str, block_size: int | None,
            scale_format: str | None, candidates: Any, model: str = "lognormal"):
    """Per layer: the best format of ``bits`` bits, its scale (NaN under block scaling) and its
    predicted error, from :func:`gradstats.fpanalysis.best_format` (or, with
    ``format_rule="histogram"``, :func:`~gradstats.fpanalysis.best_format_from_stats` per layer)."""
    if isinstance(candidates, list):
        from gradstats.formats import FPFormat

        mine = [c for c in (FPFormat.parse(c) for c in candidates) if c.bits == bits]
        if not mine:
            raise ValueError(f"candidates hold no {bits}-bit format (given: {[str(FPFormat.parse(c)) for c in candidates]})")
        candidates = mine
    if model == "histogram":
        picks = [fpanalysis.best_format_from_stats(bits, row, candidates=candidates, rounding=rounding)
                 for row in mom.rows]
        return ([c.format for c in picks], np.array([c.scale for c in picks]),
                np.array([c.error for c in picks]))
    # per-tensor scales are chosen for each tensor given its observed maximum: the lognormal's
    # tail beyond amax does not exist in the data, and without this condition the MSE-optimal
    # scale of a wide layer chases it and flushes every real value to zero
    cond = {"scale_format": scale_format} if block_size is not None else {
        "amax": mom.amax, "numel": np.array([r["numel"] for r in mom.rows], dtype=np.float64)}
    res = fpanalysis.best_format(bits, mu=mom.mu, sigma=mom.sigma, p0=mom.p0, candidates=candidates,
                                 block_size=block_size, rounding=rounding,
                                 names=mom.layers, **cond)
    fmts = res.format
    if not isinstance(fmts, list):  # one layer given as a scalar
        fmts = [fmts]
    return fmts, np.atleast_1d(np.asarray(res.scale, dtype=np.float64)), \
        np.atleast_1d(np.asarray(res.error, dtype=np.float64))
