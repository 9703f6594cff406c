"""The whole plan under one noise budget: per layer the cheapest format and the largest sparsity
whose predicted noise ratio (:mod:`gradstats.plan.noise_prediction`), counting what the layers after it
send back, keeps every planned layer within ``noise_bound``.

Each planned layer has *options*, cheapest first: the plan's own rule, then the wider rules of a
*ladder* of fallback plans (``recommend`` passes its 8-bit plan behind a 6-bit one; with
``bits="auto"`` MXFP4, NVFP4, 6 bits, 8 bits, MXFP8), and last full precision (the gradient left
alone, no error). :func:`allocate_within_bound` gives each layer the first option whose rounding
alone fits its share of the budget, then the largest sparsity up to the requested one that still
fits. The budget of layer ``l`` is a relative error ``bound * minibatch_l / q2_l`` shared by ``l``
and the planned layers downstream of it (weighted by the measured gains of their noise to ``l``);
layers are served from the output backwards, each taking at most an equal share of what is left
of every budget it draws on, so none is overdrawn. A layer the model cannot predict (no noise
record, or no prediction for any of its options) is kept in full precision, with the reason.

The storage of a value: :attr:`gradstats.scheme.Scheme.bits_per_value` (NVFP4 4.5 bits, MXFP4
4.25, MXFP8 8.25), :data:`FULL_PRECISION_BITS` for a layer left alone.

Example:
    >>> import pandas as pd
    >>> terms = pd.DataFrame({"q2": [1.0], "minibatch": [1.0]}, index=["a"])
    >>> errors = {0: 0.05, 1: 0.004}                 # a 4-bit and an 8-bit option
    >>> out = allocate_within_bound(["a"], {"a": 2}, {}, lambda n, k, s: errors[k], terms, {"a": []}, 0.02)
    >>> out["a"]["option"], out["a"]["format_reason"]
    (1, 'noise bound')
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import numpy as np

from gradstats.noise.terms import downstream, gain_of, gains, noise_terms
from gradstats.plan.noise_prediction import layer_errors, noise_records, recorded_layers, rule_at

if TYPE_CHECKING:
    import pandas as pd

    from gradstats.plan._plan import Plan

log = logging.getLogger(__name__)
#: the run-level facts already logged, so that a run planned many times (one plan per width and
#: sparsity) says each once
_SAID: set[tuple[object, ...]] = set()

__all__ = ["allocate_within_bound", "bound_plan", "bound_and_repair", "bits_of", "FULL_PRECISION",
           "FULL_PRECISION_BITS"]

#: the option index :func:`allocate_within_bound` gives a layer left in full precision
FULL_PRECISION = -1
#: the storage counted for a gradient value left alone (a 16-bit training's gradients)
FULL_PRECISION_BITS = 16.0


def bits_of(rule: Any) -> float:
    """Bits per gradient value under ``rule``: its scheme's :attr:`~gradstats.scheme.Scheme.bits_per_value`,
    :data:`FULL_PRECISION_BITS` without a format.

    Example:
        >>> from gradstats.plan import Rule
        >>> bits_of(Rule(format="nvfp4")), bits_of(Rule(sparsity=0.5))
        (4.5, 16.0)
    """
    scheme = None if rule is None else rule.scheme
    return FULL_PRECISION_BITS if scheme is None else scheme.bits_per_value


def allocate_within_bound(layers: Sequence[str], options: dict[str, int], requested: dict[str, float],
                          error_at: Callable[[str, int, float], float], terms: "pd.DataFrame",
                          down: dict[str, list[str]], bound: float, *,
                          gain: Optional[dict[tuple[str, str], float]] = None,
                          iterations: int = 10) -> dict[str, dict[str, Any]]:
    """Per layer, an option and a sparsity that keep every layer's predicted ratio within ``bound``.

    ``options[layer]``: how many lossy options the layer has (indices ``0..n-1``, cheapest first;
    full precision, :data:`FULL_PRECISION`, is always there after them); ``requested[layer]``: the
    sparsity asked for (absent: not pruned); ``error_at(layer, option, s)``: the option's operator
    error at sparsity ``s`` (increasing in ``s``; NaN where it cannot be predicted). Returns per
    layer ``option``, ``requested``, ``granted``, ``error``, ``format_reason`` and ``sparsity_reason``.

    Example:
        >>> import pandas as pd
        >>> terms = pd.DataFrame({"q2": [1.0, 1.0], "minibatch": [1.0, 1.0]}, index=["a", "b"])
        >>> out = allocate_within_bound(["a", "b"], {"a": 1, "b": 1}, {"a": 0.9, "b": 0.9},
        ...                             lambda n, k, s: s / 10, terms, {"a": ["b"], "b": []}, 0.02)
        >>> round(out["b"]["granted"], 2), round(out["a"]["granted"], 2)
        (0.1, 0.1)
    """
    planned = set(layers)
    contrib = {l: [l] + [m for m in down.get(l, ()) if m in planned] for l in layers}
    budget, used, left = {}, {}, {}
    for l in layers:
        if l in terms.index and terms.loc[l, "q2"] > 0 and terms.loc[l, "minibatch"] > 0:
            budget[l] = bound * float(terms.loc[l, "minibatch"] / terms.loc[l, "q2"])
        else:
            budget[l] = math.nan            # nothing recorded: the layer cannot be predicted
        used[l], left[l] = 0.0, len(contrib[l])
    draws_on = {m: [l for l in layers if m in contrib[l]] for m in layers}
    out: dict[str, dict[str, Any]] = {}
    fixed = [m for m in layers if m not in requested]
    pruned = sorted((m for m in layers if m in requested), key=lambda m: len(down.get(m, ())))
    for m in fixed + pruned:
        want = requested.get(m, 0.0)
        w = {l: (1.0 if l == m else gain_of(gain or {}, m, l)) for l in draws_on[m]}
        share = min(((budget[l] - used[l]) / (left[l] * w[l]) for l in draws_on[m]
                     if w[l] > 0 and math.isfinite(budget[l])), default=math.inf)
        k, s, e = FULL_PRECISION, 0.0, 0.0
        if math.isnan(budget[m]):
            fmt_reason = "no noise record: full precision"
        else:
            fmt_reason = "no prediction: full precision"
            for i in range(options.get(m, 0)):
                e0 = error_at(m, i, 0.0)
                if not math.isfinite(e0):
                    continue
                if e0 <= share:
                    k, e, fmt_reason = i, e0, "requested" if i == 0 else "noise bound"
                    break
                fmt_reason = "noise bound: full precision"
        if k == FULL_PRECISION:
            sp_reason = "full precision" if want > 0 else "not pruned"
        elif want <= 0:
            sp_reason = "not pruned"
        else:
            e_want = error_at(m, k, want)
            if e_want <= share:
                s, e, sp_reason = want, e_want, "requested"
            else:
                lo, hi = 0.0, want
                for _ in range(iterations):
                    mid = 0.5 * (lo + hi)
                    em = error_at(m, k, mid)
                    if em <= share:
                        lo, e = mid, em
                    else:
                        hi = mid
                s, sp_reason = lo, "noise bound"
        for l in draws_on[m]:
            used[l] += w[l] * e
            left[l] -= 1
        out[m] = {"option": k, "requested": want, "granted": s, "error": e, "format_reason": fmt_reason,
                  "sparsity_reason": sp_reason}
    return out


def bound_plan(plan: Any, run: Any, steps: Sequence[int], bound: Optional[float],
               requested: Optional[float] = None, *, solve_for: Optional[float] = None,
               ladder: Sequence[Any] = ()) -> Any:
    """``plan`` with each planned layer's format and sparsity chosen so that its predicted noise
    ratio (the whole plan's: pruning, rounding, and what later layers send back) stays within
    ``bound`` at every planned layer (:func:`allocate_within_bound`), and the plan's ``noise``
    records filled: requested and granted sparsity, ``sparsity_reason``, ``format_reason``,
    ``bits`` (per value), ``numel``, ``predicted_noise`` and ``pruning_noise`` (the part its
    pruning adds over its rounding). ``ladder``: plans of the same run whose rules are the wider
    options of each layer, cheapest first (full precision comes after them). With ``bound=None``
    only the records. ``requested``: the sparsity asked for (default: each rule's). ``solve_for``:
    the bound solved for, when tighter than the ``bound`` recorded (``recommend``, after a repair).

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     for _ in range(2):
        ...         m(torch.randn(64, 8)).logsumexp(1).mean().backward(); t.step()
        >>> p = bound_plan(gradstats.Plan.uniform(sparsity=0.95, output_layer=False), t.path, [0], 1e-3)
        >>> {c["layer"]: c["sparsity"] < 0.95 for c in p.noise}
        {'0': True, '2': True}
    """
    from gradstats.plan._rules import PlanEntry
    from gradstats.plan.checks import step_rows
    from gradstats.run import as_run

    r = as_run(run)
    resolved = [p.resolve(r, strict=False) for p in (plan, *ladder)]
    # each layer's options, cheapest first, and which plan each comes from (0: the plan's own rule); a
    # layer the plan leaves alone (its check repaired it to full precision) keeps the ladder's options
    opts: dict[str, list[Any]] = {}
    origin: dict[str, list[int]] = {}
    for i, rs in enumerate(resolved):
        for n, rule in rs.items():
            if not rule.is_identity:
                opts.setdefault(n, []).append(rule)
                origin.setdefault(n, []).append(i)
    rules = {n: o[0] for n, o in opts.items()}
    if not rules:
        return plan
    rows = step_rows(r, list(rules), steps)
    per_option = [layer_errors({n: o[k] for n, o in opts.items() if k < len(o)}, rows, steps)
                  for k in range(max(len(o) for o in opts.values()))]
    terms = noise_terms(r, list(rules), steps)
    down = downstream(r)
    gain = gains(r)
    want = {n: (requested if requested is not None else rule.sparsity) for n, rule in rules.items() if rule.prunes}
    own = {n: origin[n][0] == 0 for n in rules}       # the first option is the plan's own rule
    if bound is not None and (terms.empty or not down):
        said = ("no records", str(r.path)) in _SAID          # a fact of the run: said once, not once per plan
        (log.debug if said else log.warning)("the run at %s holds no noise records (traced before gradstats "
                                             "recorded them, or with noise=False): plans made from it do not bound "
                                             "their noise; trace again to bound it", r.path)
        _SAID.add(("no records", str(r.path)))
        bound = None

    def error_at(n: str, k: int, s: float) -> float:
        return 0.0 if k == FULL_PRECISION else per_option[k](n, s)

    if bound is None:                 # the plan's own rules, recorded
        rules = {n: rule for n, rule in rules.items() if own[n]}
        if not rules:
            return plan
        chosen = {n: {"option": 0, "requested": want.get(n), "granted": want.get(n, 0.0) or 0.0,
                      "format_reason": "requested", "sparsity_reason": "requested" if n in want else "not pruned"}
                  for n in rules}
    else:
        chosen = allocate_within_bound(list(rules), {n: len(o) for n, o in opts.items()}, want, error_at, terms,
                                       down, float(solve_for if solve_for is not None else bound), gain=gain)
        chosen = _improve(chosen, {n: [bits_of(o) for o in opts[n]] for n in rules}, _numel_of(rows), want,
                          error_at, terms, down, gain, float(solve_for if solve_for is not None else bound))
    for n, c in chosen.items():
        c["requested"] = want.get(n)
        if c["option"] != FULL_PRECISION and not own[n]:    # the plan's own rule failed its check
            c["format_reason"] = "check: a wider format"
    preds = {rec["layer"]: rec for rec in noise_records(lambda n, s: error_at(n, chosen[n]["option"], s),
                                                  {n: chosen[n]["granted"] for n in rules}, terms, down, gain)}

    def rule_of(n: str) -> Any:
        k = chosen[n]["option"]
        return None if k == FULL_PRECISION else rule_at(opts[n][k], chosen[n]["granted"])

    records = [{"layer": n, "requested_sparsity": chosen[n]["requested"], "sparsity": chosen[n]["granted"],
                "sparsity_reason": chosen[n]["sparsity_reason"], "format_reason": chosen[n]["format_reason"],
                "bits": bits_of(rule_of(n)), "numel": _numel(rows.get(n, {})),
                "operator_error": float(preds[n]["error"]), "predicted_noise": _num(preds[n]["noise"]),
                "pruning_noise": _num(preds[n]["pruning_noise"])} for n in rules]
    entries: list[Any] = list(plan.entries)
    extra: list[Any] = []
    if bound is not None:
        by_name = {e.layer: i for i, e in enumerate(entries) if not e.is_pattern}
        for n, c in chosen.items():
            mine = c["option"] == 0 and own[n]
            if mine and (n not in want or c["granted"] >= want[n]):
                continue                      # the plan's own rule, as requested
            if mine:                          # the plan's rule at a lower sparsity
                s = float(c["granted"])
                if n in by_name:
                    e = entries[by_name[n]]
                    pred = e.predicted
                    if pred is not None and dataclasses.is_dataclass(pred):
                        pred = dataclasses.replace(pred, sparsity=s)
                    entries[by_name[n]] = dataclasses.replace(e, sparsity=s, predicted=pred)
                else:
                    extra.append(PlanEntry(n, sparsity=s))
                continue
            new = rule_of(n)                  # a wider option, or full precision: the whole rule
            entry = PlanEntry(n, format=None, sparsity=None, block_size=None, scale_format=None,
                              scale_rounding=None, hadamard=None, predicted=None) if new is None else \
                PlanEntry(n, **{f.name: getattr(new, f.name) for f in dataclasses.fields(new)})
            if n in by_name:
                entries[by_name[n]] = entry
            else:
                extra.append(entry)
    out = dataclasses.replace(plan, entries=tuple(entries), noise_bound=bound, noise=tuple(records))
    return out.with_entries(*extra) if extra else out


def _improve(chosen: dict[str, dict[str, Any]], bits: dict[str, list[float]], numel: dict[str, Optional[int]],
             want: dict[str, float], error_at: Callable[[str, int, float], float], terms: "pd.DataFrame",
             down: dict[str, list[str]], gain: dict[tuple[str, str], float], bound: float,
             iterations: int = 10) -> dict[str, dict[str, Any]]:
    """The allocation of :func:`allocate_within_bound` made greedy-maximal on the whole plan's noise:
    its equal shares leave budget unspent (a layer served early takes at most its share; the rest
    of a budget may go unused), so each layer in turn, the largest first, takes the cheapest option
    and then the largest sparsity up to the requested one with which every layer's predicted ratio,
    compounded (:func:`gradstats.plan.noise_prediction.noise_records`), stays within ``bound``."""
    out = {n: dict(c) for n, c in chosen.items()}
    layers = list(out)
    recordable = recorded_layers(terms, layers)       # in the plan's order (sorted below: ties keep it)
    worst = _worst_ratio(layers, terms, down, gain)

    def fits(trial: dict[str, dict[str, Any]]) -> bool:
        return worst({n: error_at(n, c["option"], c["granted"]) for n, c in trial.items()}) <= bound

    if not fits(out):
        return out
    for n in sorted(recordable, key=lambda n: -(numel.get(n) or 0)):
        c = out[n]
        cur = c["option"]
        here = len(bits[n]) if cur == FULL_PRECISION else cur
        for k in range(here):             # a cheaper option, at no pruning first
            if bits[n][k] >= (FULL_PRECISION_BITS if cur == FULL_PRECISION else bits[n][cur]):
                continue
            if not math.isfinite(error_at(n, k, 0.0)):
                continue
            trial = {**out, n: {**c, "option": k, "granted": 0.0}}
            if fits(trial):
                out[n] = {**trial[n], "error": error_at(n, k, 0.0),
                          "format_reason": "requested" if k == 0 else "noise bound",
                          "sparsity_reason": "noise bound" if want.get(n, 0.0) > 0 else "not pruned"}
                break
        c = out[n]
        s_want = want.get(n, 0.0)
        if c["option"] == FULL_PRECISION or s_want <= 0 or c["granted"] >= s_want:
            continue
        at = lambda s: {**out, n: {**c, "granted": s}}          # noqa: E731
        if fits(at(s_want)):
            s_new, reason = s_want, "requested"
        else:
            lo, hi = c["granted"], s_want
            for _ in range(iterations):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if fits(at(mid)) else (lo, mid)
            s_new, reason = lo, "noise bound"
        if s_new > c["granted"]:
            out[n] = {**c, "granted": s_new, "error": error_at(n, c["option"], s_new), "sparsity_reason": reason}
    return out


def _worst_ratio(layers: Sequence[str], terms: "pd.DataFrame", down: dict[str, list[str]],
                 gain: dict[tuple[str, str], float]) -> Callable[[dict[str, float]], float]:
    """The largest predicted ratio over ``layers`` given each layer's operator error: what
    :func:`gradstats.plan.noise_prediction.noise_records` computes (:func:`~gradstats.plan.noise_prediction.incoming_noise`
    compounded downstream first, times ``q2 / minibatch``), with the table lookups done once, for
    the many trial allocations of :func:`_improve`."""
    planned = set(layers)
    order = sorted(layers, key=lambda n: len(down.get(n, ())))
    edges = {n: [(m, gain_of(gain, m, n)) for m in down.get(n, ()) if m in planned] for n in layers}
    coef = {n: float(terms.loc[n, "q2"] / terms.loc[n, "minibatch"]) for n in layers
            if n in terms.index and terms.loc[n, "minibatch"] > 0}
    compound = bool(gain)

    def worst(errors: dict[str, float]) -> float:
        inc: dict[str, float] = {}
        top = 0.0
        for n in order:
            total = 0.0
            for m, g in edges[n]:
                e = errors[m]
                if math.isfinite(e):
                    total += g * e * ((1.0 + inc.get(m, 0.0)) if compound else 1.0)
            inc[n] = total
            c = coef.get(n)
            if c is not None:
                r = (total + errors[n] * (1.0 + total)) * c
                if r > top:
                    top = r
        return top
    return worst


def _num(v: float) -> Optional[float]:
    return float(v) if v is not None and math.isfinite(v) else None


def _numel_of(rows: dict[str, dict[int, Any]]) -> dict[str, Optional[int]]:
    return {n: _numel(per) for n, per in rows.items()}


def _numel(rows: dict[int, Any]) -> Optional[int]:
    """A layer's element count per call, from its latest statistics row."""
    if not rows:
        return None
    n = rows[max(rows)].get("n")
    return int(n) if n is not None and math.isfinite(float(n)) else None


def bound_and_repair(plan: Plan, r: Any, chk: Sequence[int], noise_bound: float | None, *, bounded: bool,
                     pool: list[Any] | None, bias_bound: float, flush_bound: float | None, rounds: int = 3,
                     ladder: Sequence[Plan] = ()) -> Plan:
    """``plan`` with its formats (its own, or the wider ones of ``ladder``) and sparsities chosen under
    ``noise_bound`` (:func:`gradstats.plan.noise_budget.bound_plan`; the records alone when None), then
    repaired by the check (``pool``: its candidate formats; None: no check), with the noise records
    of the rules as repaired. The allocation is first order in the measured gains, and a repair
    changes what a layer adds: where the plan's predicted noise (compounded, rules as repaired) ends
    over the bound, the bound is solved again a little tighter (the records keep the user's bound)."""
    from gradstats.plan._shared import shared_work

    with shared_work():        # the rounds predict and replay the same operators: each computed once
        out = _rounds(plan, r, chk, noise_bound, bounded=bounded, pool=pool, bias_bound=bias_bound,
                      flush_bound=flush_bound, rounds=rounds, ladder=ladder)
    return _width_reasons(plan, out, r)


def _width_reasons(asked: Plan, out: Plan, r: Any) -> Plan:
    """``out``'s records with ``format_reason`` "requested" only where a layer keeps the width it was
    asked for: a later round starts from the rules the check repaired, which may be a wider option
    the bound chose ("noise bound")."""
    if not out.noise:
        return out
    before, after = asked.resolve(r, strict=False), out.resolve(r, strict=False)
    recs = []
    for c in out.noise:
        n = c["layer"]
        if c.get("format_reason") == "requested" and n in after and n in before and \
                bits_of(after[n]) != bits_of(before[n]):
            c = {**c, "format_reason": "noise bound" if bits_of(after[n]) > bits_of(before[n]) else "check: another format"}
        recs.append(c)
    return dataclasses.replace(out, noise=tuple(recs))


def _rounds(plan: Plan, r: Any, chk: Sequence[int], noise_bound: float | None, *, bounded: bool,
            pool: list[Any] | None, bias_bound: float, flush_bound: float | None, rounds: int,
            ladder: Sequence[Plan]) -> Plan:
    solve_for = noise_bound
    for again in range(rounds):
        out = bound_plan(plan, r, chk, noise_bound, solve_for=solve_for, ladder=ladder) if bounded else plan
        allocated = out
        if pool is not None:
            from gradstats.formats import FPFormat
            from gradstats.plan.checks import repair

            with _quiet("gradstats.plan.checks", again > 0):     # its repairs were logged the first time
                out = repair(out, r, chk, candidates=[FPFormat.parse(c) for c in pool], bias_bound=bias_bound,
                             flush_bound=flush_bound)
            if out.noise:       # the predicted noise of the rules as repaired, both parts
                from gradstats.plan.noise_prediction import predicted_noise

                now = {rec["layer"]: rec for rec in predicted_noise(r, out, steps=chk).records}
                resolved = out.resolve(r, strict=False)
                out = dataclasses.replace(out, noise=tuple(
                    {**c, "predicted_noise": _num(now.get(c["layer"], {}).get("noise", math.nan)),
                     "pruning_noise": _num(now.get(c["layer"], {}).get("pruning_noise", math.nan)),
                     "bits": bits_of(resolved.get(c["layer"]))}
                    for c in out.noise))
        worst = max((c["predicted_noise"] for c in out.noise or () if c.get("predicted_noise") is not None),
                    default=0.0)
        log.debug("noise bound %s solved for %s: worst %s", noise_bound, solve_for, worst)
        if noise_bound is None or solve_for is None or worst <= noise_bound * (1 + 1e-6):
            break
        plan = _carry_repairs(plan, allocated, out, r)     # allocated again with the rules as repaired
        solve_for *= noise_bound / worst * 0.99     # (a margin for the bisection's resolution)
    return out


def _carry_repairs(plan: Plan, allocated: Plan, repaired: Plan, r: Any) -> Plan:
    """``plan`` with the rules the check repaired (``allocated`` -> ``repaired``) as the layers' own
    first choice, at the sparsity ``plan`` asks for: what the next allocation round starts from."""
    before, after = allocated.resolve(r, strict=False), repaired.resolve(r, strict=False)
    asked = plan.resolve(r, strict=False)
    entries = []
    for n, rule in after.items():
        b = before.get(n)
        if b is None or n not in asked or rule.replace(sparsity=b.sparsity, predicted=b.predicted) == b:
            continue
        from gradstats.plan._rules import PlanEntry

        fields = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)}
        entries.append(PlanEntry(n, **{**fields, "sparsity": asked[n].sparsity}))
    if not entries:
        return plan
    mine = {e.layer for e in entries}     # each layer's exact entry replaced, not doubled
    return dataclasses.replace(plan, entries=tuple(e for e in plan.entries if e.is_pattern or e.layer not in mine)
                               + tuple(entries))


def log_bound(plan_name: str, plan: Plan) -> None:
    """One INFO line: what the noise bound changed in ``plan``, and its storage."""
    recs = plan.noise
    cut = [c for c in recs if c["sparsity_reason"] == "noise bound"]
    wider = [c["layer"] for c in recs if c.get("format_reason") == "noise bound"]
    full = [c["layer"] for c in recs if str(c.get("format_reason", "")).endswith("full precision")]
    said = []
    if cut:
        said.append("lowered the sparsity of %d of %d pruned layers (mean granted %.3f)" % (
            len(cut), sum(1 for c in recs if c["requested_sparsity"]),
            float(np.mean([c["sparsity"] for c in recs if c["requested_sparsity"]]))))
    if wider:
        said.append(f"gave {len(wider)} layer(s) a wider format ({', '.join(wider[:4])}{', ...' if len(wider) > 4 else ''})")
    if full:
        said.append(f"left {len(full)} layer(s) in full precision ({', '.join(full[:4])}{', ...' if len(full) > 4 else ''})")
    st = plan.storage()
    tail = "" if st is None else (f"; {st['mean_bits']:.2f} bits per gradient value, "
                                  f"{100 * st['saved_fraction']:.0f}% of the 16-bit gradient bytes saved")
    if said or tail:
        log.info("%s: the noise bound %g %s%s; plan.to_dataframe() shows each layer", plan_name, plan.noise_bound,
                 "; ".join(said) or "changed nothing", tail)


@contextlib.contextmanager
def _quiet(logger: str, on: bool) -> Iterator[None]:
    """Below ERROR, nothing from ``logger`` while ``on``."""
    lg = logging.getLogger(logger)
    level = lg.level
    if on:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(level)
