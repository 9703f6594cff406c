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
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence, Union

import numpy as np

from gradstats.fpanalysis.granularity import GRANULARITIES, granularity_layout, granularity_of
from gradstats.fpanalysis.training import FLUSH_BOUND
from gradstats.plan import Plan, PlanEntry, Prediction, Provenance, Rule
from gradstats.plan._shared import shared_work
from gradstats.plan._statistics import Steps, gather, layer_moments
from gradstats.plan.config import RecommendConfig
from gradstats.plan.noise_budget import bound_and_repair, log_bound
from gradstats.plan.noise_prediction import NOISE_BOUND
from gradstats.run import as_run
from gradstats.scheme import Scheme

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
        cfg = _bits_auto(bits, cfg)
    else:
        cfg = {**cfg, "bits": _bits_list(bits)[0]}
    with shared_work():        # the wider rungs' plans and the checks read the same rows: each computed once
        plan, = _plans(run, **cfg).values()
    return plan


#: what ``bits="auto"`` chooses from, fewest bits per value first (``(granularity, bits)``): MXFP4
#: (4.25 bits with its E8M0 block scales), NVFP4 (4.5), 6 and 8 bits per tensor, MXFP8 (8.25); and
#: after them full precision
AUTO_LADDER: tuple[tuple[str, int], ...] = (("mx", 4), ("nvfp4", 4), ("tensor", 6), ("tensor", 8), ("mx", 8))


def _bits_auto(bits: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``recommend(bits="auto")`` as the settings of :func:`_plans`: the first rung of :data:`AUTO_LADDER`,
    bounded, with the other rungs as its wider options (each recommended on its own: checked, not
    bounded), so that per layer the bound takes the first rung, and the sparsity in it, that it allows."""
    if bits != "auto":
        raise ValueError(f"bits must be an int (a width, 3..16) or 'auto' (per layer the fewest bits the "
                         f"noise bound allows), got {bits!r}")
    if cfg["noise_bound"] is None:
        raise ValueError("bits='auto' asks for the fewest bits the noise bound allows: give a noise_bound "
                         f"(default {NOISE_BOUND}), or a width as bits")
    if cfg["granularity"] != "tensor" or cfg["candidates"] not in (None, "ocp"):
        raise ValueError("bits='auto' chooses among the formats hardware has (MXFP4, NVFP4, 6 and 8 bits per "
                         "tensor, MXFP8): leave granularity and candidates out, or give a width as bits")
    (g, b), *rungs = AUTO_LADDER
    return {**cfg, "bits": [b], "granularity": g, "candidates": "ocp", "ladder": tuple(rungs), "auto": True}


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
    with shared_work():        # the widths share the rows' thresholds, laws and predictions: each computed once
        return _plans(run, bits=bits, **RecommendConfig.resolve(config, "recommend_each", **options).options())


def _plans(run: Any, *, bits: Sequence[int], sparsity: float | str | None, granularity: str | int,
           rounding: str | None, steps: Steps, threshold_rule: str | None, candidates: Any,
           layers: str | Sequence[str] | None, format_rule: str, objective: str, bias_bound: float | None,
           flush_bound: float | None, output_layer: str | bool | None, prune_at: str | bool | None,
           check: bool, noise_bound: float | None, ladder: Sequence[tuple[Any, int]] | None = None,
           auto: bool = False) -> dict[int, Plan]:
    """:func:`recommend_each`, stage after stage: the options checked (:func:`_settings`) and the
    wider options the noise bound may take (:func:`_wider`: the ``(granularity, bits)`` rungs of
    ``ladder``, by default the 8-bit plan behind a narrower width); the run's layers, their moments
    and pruning thresholds (:func:`gradstats.plan._statistics.gather`); then per width the formats,
    the plan, and the plan bounded and repaired. ``auto``: the plan is ``bits="auto"``'s (so named in
    the logs and in its provenance)."""
    from gradstats import fpanalysis, pruning
    from gradstats._version import __version__  # noqa: F401 - provenance

    again = dict(sparsity=sparsity, rounding=rounding, steps=steps, threshold_rule=threshold_rule, layers=layers,
                 format_rule=format_rule, objective=objective, bias_bound=bias_bound, flush_bound=flush_bound,
                 output_layer=output_layer, prune_at=prune_at, check=check)
    s = _settings(bits=bits, sparsity=sparsity, granularity=granularity, rounding=rounding,
                  threshold_rule=threshold_rule, candidates=candidates, layers=layers, format_rule=format_rule,
                  objective=objective, bias_bound=bias_bound, prune_at=prune_at, noise_bound=noise_bound)
    r = as_run(run)
    wider = _wider(r, s.widths, ladder, candidates, noise_bound, again)
    st = gather(r, layers=layers, output_layer=output_layer, prune_at=s.prune_at, steps=steps,
                sparsity=s.sparsity, threshold_rule=s.threshold_rule)
    mom, thr, block_size, cands = st.mom, st.threshold, s.layout.block_size, s.candidates
    n = len(mom.layers)
    plans: dict[int, Plan] = {}
    for b in s.widths:
        plan_name = "recommend(bits='auto')" if auto else (     # in the logs
            f"recommend(bits={b}" + (f", sparsity={sparsity!r}" if sparsity is not None else "")
            + (f", granularity={s.granularity!r}" if s.granularity != "tensor" else "") + ")")
        # the formats: per layer the format, its scale and predicted error (and rounding, scale shift,
        # bias and flushed fraction where the training objective chooses them)
        b_round = s.rounding or ("stochastic" if b <= 6 else "nearest")
        roundings, shifts, bias, flushed = [b_round] * n, [0] * n, [None] * n, [None] * n
        if s.training:
            fmts_ = cands if isinstance(cands, list) else fpanalysis.preset_formats(cands, b, granularity="tensor")
            tc = fpanalysis.choose_for_training(
                b, mu=mom.mu, sigma=mom.sigma, p0=mom.p0, amax=mom.amax, numel=mom.numel,
                candidates=[f for f in fmts_ if f.bits == b] or fmts_,
                roundings=[s.rounding] if s.rounding else _ROUNDINGS, bias_bound=s.bias_bound,
                flush_bound=flush_bound, threshold=np.where(np.isfinite(thr), thr, 0.0) if s.sparsity else None,
                names=mom.layers)
            fmts, scales, errors = list(tc.format), np.asarray(tc.scale), np.asarray(tc.error)
            roundings, shifts = list(tc.rounding), [int(k) for k in tc.scale_shift]
            bias, flushed = [float(v) for v in tc.bias], [float(v) for v in tc.flushed]
            b_round = max(set(roundings), key=roundings.count)     # the plan's default: the common one
            biased = [f"  {mom.layers[i]}: best {tc.bias[i]:+.3f} with {fmts[i]}, {roundings[i]} rounding"
                      for i in range(n) if not tc.feasible[i]]
            if biased:
                log.warning("%s: for %d layer(s) no %d-bit format keeps the predicted magnitude bias within %g; "
                            "each is planned with its least biased choice%s:\n%s", plan_name, len(biased), b,
                            s.bias_bound, ", which the check on the samples then tests" if check else "",
                            "\n".join(biased))
        elif format_rule == "histogram":       # each layer's binade histogram and maximum
            picks = [fpanalysis.best_format_from_stats(b, row, candidates=s.candidates_of(b), rounding=b_round)
                     for row in mom.rows]
            fmts, scales, errors = [c.format for c in picks], np.array([c.scale for c in picks]), \
                np.array([c.error for c in picks])
        else:
            # the closed forms in mu and sigma; per-tensor scales are chosen for each tensor given its
            # observed maximum: the lognormal's tail beyond amax does not exist in the data, and without
            # this condition the MSE-optimal scale of a wide layer chases it and flushes every real value
            res = fpanalysis.best_format(b, mu=mom.mu, sigma=mom.sigma, p0=mom.p0, candidates=s.candidates_of(b),
                                         granularity=s.layout, rounding=b_round, names=mom.layers,
                                         numel=mom.numel, **({} if block_size is not None else {"amax": mom.amax}))
            fmts = res.format if isinstance(res.format, list) else [res.format]    # one layer: a scalar
            scales, errors = (np.atleast_1d(np.asarray(v, dtype=np.float64)) for v in (res.scale, res.error))
        # the plan: the shared settings as defaults, one entry per layer with what it was predicted to do
        defaults = Rule(scale="amax" if (block_size or s.training) else "lognormal", rounding=b_round,
                        block_size=block_size, scale_format=s.layout.scale_format_name, sparsity=s.sparsity,
                        threshold_rule=s.threshold_rule, **s.recipe)
        entries = [PlanEntry(name, format=fmts[i], predicted=Prediction(
            error=_fmt(errors[i]), sparsity=_fmt(st.sparsity[i]), mu=float(mom.mu[i]), sigma=float(mom.sigma[i]),
            p0=float(mom.p0[i]), scale=_fmt(scales[i]) if block_size is None else None, threshold=_fmt(thr[i]),
            amax=_fmt(mom.amax[i]), bias=bias[i], flushed=flushed[i]),
            **({"rounding": roundings[i]} if roundings[i] != b_round else {}),
            **({"scale_shift": shifts[i]} if shifts[i] else {})) for i, name in enumerate(mom.layers)]
        gen = (f"recommend(bits={b}, sparsity={sparsity!r}, granularity={s.granularity!r}, "
               f"rounding={s.rounding!r}, steps={st.steps!r}, threshold_rule={s.threshold_rule!r}"
               + (f", format_rule={format_rule!r}" if format_rule != "lognormal" else "")
               + f", objective={objective!r}"
               + (f", flush_bound={flush_bound!r}" if s.training else "")
               + f", candidates={cands if isinstance(cands, str) else [str(c) for c in cands]!r}"
               + (f", noise_bound={noise_bound!r})" if sparsity is not None else ")"))
        plans[b] = Plan(entries, defaults, Provenance.now(source=str(r.path), generator=gen, steps=mom.steps),
                        output_layer=st.output_layer, prune_at=s.prune_at if s.sparsity is not None else None)
        # bounded and repaired: the formats (its own, or the wider ones) and sparsities the noise bound
        # allows, each rule checked on the calibration steps
        pool = (cands if isinstance(cands, list) else fpanalysis.preset_formats(
            cands, b, granularity="tensor" if block_size is None else s.granularity)) if check else None
        if pool is not None and wider[b].plans:      # the wider options are checked in the mixed plan
            pool = list(dict.fromkeys([*pool, *wider[b].formats]))
        plans[b] = bound_and_repair(plans[b], r, st.check_steps, noise_bound, bounded=s.sparsity is not None or
                                    noise_bound is not None, pool=pool, bias_bound=s.bias_bound,
                                    flush_bound=flush_bound, ladder=wider[b].plans)
        # each pruned entry's predicted threshold at the sparsity the plan grants it: the bound may lower the
        # one asked for (0.99 for "auto"), and what explain shows and the exports hand to training code must
        # be the threshold of the rule that is enforced
        rules = plans[b].resolve(r, strict=False) if s.threshold_rule != "exact" else {}    # exact: none
        at = {name: i for i, name in enumerate(mom.layers)}
        granted = [(k, e) for k, e in enumerate(plans[b].entries) if not e.is_pattern and e.layer in at
                   and isinstance(e.predicted, Prediction) and e.layer in rules and rules[e.layer].sparsity is not None]
        if granted:
            now = pruning.threshold(np.array([rules[e.layer].sparsity for _, e in granted], dtype=np.float64),
                                    [mom.rows[at[e.layer]] for _, e in granted], threshold_rule=s.threshold_rule)
            entries = list(plans[b].entries)
            for (k, e), a in zip(granted, np.asarray(now, dtype=np.float64)):
                entries[k] = dataclasses.replace(e, predicted=dataclasses.replace(e.predicted, threshold=_fmt(a)))
            plans[b] = dataclasses.replace(plans[b], entries=tuple(entries))
        if plans[b].noise_bound is not None:
            log_bound(plan_name, plans[b])
        if auto and plans[b].provenance is not None:     # named as asked, once the check named it by its rung
            plans[b] = dataclasses.replace(plans[b], provenance=dataclasses.replace(
                plans[b].provenance, generator="recommend(bits='auto', " + gen.split("(", 1)[1]))
    if layers is None:
        from gradstats.layers import log_unplanned

        log_unplanned(log, "gradstats.recommend", plans[s.widths[0]].unplanned(r))
    return plans


@dataclass(frozen=True)
class _Settings:
    """:func:`recommend`'s options checked and resolved (:func:`_settings`)."""

    widths: list[int]
    sparsity: float | None          # requested of every pruned layer; ``"auto"``: :data:`AUTO_SPARSITY`
    granularity: Any                # plain: a block preset's extras and the candidates' layout resolved
    layout: Scheme                  # its block layout (:func:`granularity_layout`)
    recipe: dict[str, Any]          # the rule fields a block preset adds (its Hadamard transform)
    rounding: str | None            # None: the objective chooses
    threshold_rule: str
    candidates: Union[str, list[Any]]
    bias_bound: float
    prune_at: str | None
    training: bool                  # the training objective applies: per-tensor scales, lognormal model

    def candidates_of(self, bits: int) -> Union[str, list[Any]]:
        """The candidates the MSE choice ranks for ``bits``: a preset's name as it is, or the formats of that
        width of a list (one without any is a ``ValueError``)."""
        if not isinstance(self.candidates, list):
            return self.candidates
        mine = [c for c in self.candidates if c.bits == bits]
        if not mine:
            raise ValueError(f"candidates hold no {bits}-bit format (given: {[str(c) for c in self.candidates]})")
        return mine


def _settings(*, bits: Sequence[int], sparsity: float | str | None, granularity: Any, rounding: str | None,
              threshold_rule: str | None, candidates: Any, layers: Any, format_rule: str, objective: str,
              bias_bound: float | None, prune_at: str | bool | None, noise_bound: float | None) -> _Settings:
    """:func:`recommend`'s options checked, each error naming the fix, and resolved to what the stages
    read (the run is not read yet).

    Example:
        >>> s = _settings(bits=[4], sparsity="auto", granularity="nvfp4_training", rounding=None,
        ...               threshold_rule=None, candidates="ocp", layers=None, format_rule="lognormal",
        ...               objective="training", bias_bound=None, prune_at=None, noise_bound=0.02)
        >>> s.sparsity, s.granularity, s.rounding, s.recipe, s.layout.block_size, s.prune_at, s.training
        (0.99, 'nvfp4', 'stochastic', {'hadamard': 16}, 16, 'auto', False)
    """
    from gradstats import fpanalysis
    from gradstats.plan._plan import default_prune_at

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
    if format_rule not in FORMAT_RULES:
        raise ValueError(f"format_rule must be one of {list(FORMAT_RULES)}, got {format_rule!r}")
    granularity, recipe = granularity_recipe(granularity)
    if rounding is None and recipe.get("rounding"):
        rounding = recipe.pop("rounding")
    recipe.pop("rounding", None)
    granularity = _candidate_granularity(candidates, granularity)
    layout = granularity_layout(granularity)
    cands = _candidates(fpanalysis, candidates, widths, granularity)
    if format_rule == "histogram" and layout.block_size is not None:
        raise ValueError("format_rule='histogram' chooses per-tensor formats and scales; block-scaled plans "
                         "(granularity='mx', 'nvfp4' or a block size) use format_rule='lognormal'")
    return _Settings(widths=widths, sparsity=sparsity, granularity=granularity, layout=layout, recipe=recipe,
                     rounding=rounding, threshold_rule=threshold_rule, candidates=cands, bias_bound=bias_bound,
                     prune_at=default_prune_at(prune_at, layers is None),
                     training=objective == "training" and layout.block_size is None and format_rule == "lognormal")


class _Wider(NamedTuple):
    """The wider options of a width under the noise bound, and the hardware formats (per tensor) of every
    width they use: the check's other choices for their rules (none without a check)."""

    plans: Sequence[Plan]
    formats: list[Any]


def _wider(r: Any, widths: Sequence[int], ladder: Sequence[tuple[Any, int]] | None, candidates: Any,
           noise_bound: float | None, kw: dict[str, Any]) -> dict[int, _Wider]:
    """Per width, the wider options of every layer under the noise bound, each recommended on its own
    (not bounded; checked where the bound chooses it): the ``(granularity, bits)`` rungs of ``ladder``
    (the hardware formats), or else the 8-bit plan behind a width under 8 bits (:func:`_fallback`);
    none without a bound, and none unchecked from a run without noise records (whose plans the bound drops:
    :func:`gradstats.plan.noise_budget.bound_plan`). ``kw``: the other options of the plan they widen."""
    if noise_bound is None or (not kw["check"] and r.table("noise").empty):
        return {b: _Wider((), []) for b in widths}
    if ladder is not None:
        rungs = [_plans(r, bits=[b], granularity=g, candidates="ocp", noise_bound=None, **{**kw, "check": False})[b]
                 for g, b in ladder]
        wide = _Wider(rungs, _widths_formats(rungs) if kw["check"] else [])
        return {b: wide for b in widths}
    fallback = _fallback(r, candidates, kw) if any(b < 8 for b in widths) else []
    wide = _Wider(fallback, _widths_formats(fallback) if kw["check"] and fallback else [])
    return {b: wide if b < 8 else _Wider([], []) for b in widths}


def _fallback(r: Any, candidates: Any, kw: dict[str, Any]) -> list[Plan]:
    """The wider option behind a width under 8 bits: the 8-bit plan per tensor (of ``candidates`` where
    they have 8-bit formats, else the hardware formats), not bounded, checked where it is chosen."""
    from gradstats import fpanalysis

    try:
        cands = _candidates(fpanalysis, candidates, [8], "tensor")
        if isinstance(cands, list) and not any(c.bits == 8 for c in cands):
            cands = "ocp"
    except ValueError:
        cands = "ocp"
    return [_plans(r, bits=[8], granularity="tensor", candidates=cands, noise_bound=None, **{**kw, "check": False})[8]]


def _widths_formats(plans: Sequence[Plan]) -> list[Any]:
    """The hardware formats (per tensor) of every width the ``plans`` use: the check's other choices
    for their rules."""
    from gradstats import fpanalysis
    from gradstats.formats import FPFormat

    widths = sorted({e.format.bits for p in plans for e in p.entries if isinstance(e.format, FPFormat)})
    return [f for w in widths for f in fpanalysis.preset_formats("ocp", w, granularity="tensor")]


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
    from gradstats.scheme import names_scheme

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
    from gradstats.scheme import names_scheme

    try:
        out = [Scheme.parse(c).element if names_scheme(c) else FPFormat.parse(c) for c in candidates]
    except TypeError:
        raise ValueError(f"candidates must be one of {list(fpanalysis.CANDIDATE_NAMES)} or a list of formats, "
                         f"got {candidates!r}") from None
    if not out:
        raise ValueError("candidates is empty")
    return out
