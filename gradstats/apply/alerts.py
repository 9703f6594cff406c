"""The alerts and the fallback of :func:`gradstats.apply`: each call's counts against the plan's
bounds (logged once per layer and kind), and a layer's rule changed a step at a time when its
gradient drifts past a :class:`~gradstats.apply.Fallback`'s bounds.

Example:
    >>> import torch, gradstats
    >>> h = gradstats.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)),
    ...                     gradstats.Plan.uniform(format="e4m3fn", output_layer=False))
    >>> type(h.checks).__name__, h.checks.rules is h.rules          # one rule set, changed by a fallback
    ('Alerts', True)
"""
from __future__ import annotations

import logging
import math
from typing import Any

from gradstats.alarms import Alarm
from gradstats.apply.refresh import LayerState, predict, predicted_share, scale_for
from gradstats.apply.settings import fallback_rule
from gradstats.ops.fused import CompressCounts

log = logging.getLogger("gradstats.apply")


def block_band(predicted: float) -> float:
    """The most of a block rule's entries that may be flushed or clipped before its alert fires: the
    plan's prediction plus ``max(0.5 x prediction, 0.01)`` (three standard errors of the call's count
    are added where it is checked). Block rules are predicted by replaying them on whole blocks of the
    run's samples, exact on their calibration steps, so a larger departure means the gradient moved.

    Example:
        >>> round(block_band(0.004), 4), round(block_band(0.034), 4), round(block_band(0.3), 4)
        (0.014, 0.051, 0.45)
    """
    return predicted + max(0.5 * predicted, 0.01)


def clip_reason(rule: Any) -> str:
    """What the overflow alert tells about a rule whose calls clip more values than its bound: why, and what
    to do (block scales clip by design, per-tensor scales where the scale is too large).

    Example:
        >>> from gradstats.plan import Rule
        >>> "scale='amax'" in clip_reason(Rule(format="e4m3fn")), "by design" in clip_reason(Rule(format="nvfp4"))
        (True, True)
    """
    if rule.block_size is None:
        return ("the scale puts the largest values (or the threshold pruning rounds up to) above the format's "
                "range. Use scale='amax' without a positive scale_shift, or check the plan with plan.verify(run)")
    pruned = (", and pruning puts each small value it keeps at the threshold, often the block's maximum"
              if rule.prunes else "")
    return ("by design, a block scale rounded down puts the values nearest its block's maximum above the format's "
            f"range, by less than one step of the scale (1/16 of the value under NVFP4's E4M3 scales){pruned}. "
            "A plan made by gradstats.recommend predicts this share for each layer, and the alert then holds the "
            "calls to it; check a plan with plan.verify(run)")


class Alerts:
    """The checks of :class:`~gradstats.apply.Applied` (alerts and fallbacks, from the counts of each
    call). It shares the handle's ``rules`` (a fallback changes the rule in force there), the rules as
    planned, its ``fallbacks`` (each change made) and the tracer it logs to."""

    def __init__(self, rules: dict[str, Any], plan_rules: dict[str, Any], config: Any,
                 fallbacks: list[dict[str, Any]], log_to: Any = None) -> None:
        self.rules, self.plan_rules, self.config = rules, plan_rules, config
        self.fallbacks, self.log_to = fallbacks, log_to

    def check(self, name: str, st: LayerState, c: CompressCounts) -> None:
        """The alerts, from the counts and sums the kernel returns anyway: a few scalar operations."""
        rule = self.rules[name]
        if c.nonfinite and "nonfinite" not in st.alerts:
            self._alert(name, st, "nonfinite", (
                f"{c.nonfinite} of the {c.n} values of the incoming gradient are NaN or inf (call {st.seq}): a NaN "
                "or overflowing loss upstream (check the loss, the learning rate, the loss scale); the plan "
                "cannot do what it says on them"))
        planned = self.plan_rules[name].predicted if name in self.plan_rules else None
        if rule.quantizes and self.config.overflow_bound is not None and "overflow" not in st.alerts and c.saturated:
            pred = getattr(planned, "overflow", None)
            # block scales clip some blocks' maxima by design (by at most 1/16 for NVFP4's e4m3 scales):
            # the plan's prediction (replayed on whole blocks) and the band of block_band; per-tensor scales:
            # the bound, or the prediction if larger
            bound = (max(self.config.overflow_bound, block_band(pred or 0.0)) if rule.block_size is not None
                     else max(self.config.overflow_bound, pred or 0.0))
            sat = (c.saturated - c.nonfinite) / c.n
            if sat > bound + 3 * math.sqrt(max(bound, 1.0 / c.n) / c.n):
                self._alert(name, st, "overflow", (
                    f"{sat:.2%} of the values were clipped at {rule.format}'s maximum (call {st.seq}; bound "
                    f"{bound:g}{', the plan predicted ' + format(pred, '.2%') if pred else ''}): {clip_reason(rule)}"))
        pred_fl = getattr(planned, "flushed", None)
        if rule.quantizes and pred_fl is not None and "drift" not in st.alerts and c.underflow:
            fl = c.underflow / c.n
            # block rules: predicted on whole blocks, exact on the calibration steps (block_band); per-tensor
            # rules: from the statistics, twice the prediction plus 0.01
            band = block_band(pred_fl) if rule.block_size is not None else 2 * pred_fl + 0.01
            if fl > band + 3 * math.sqrt(band / c.n):
                self._alert(name, st, "drift", (
                    f"{fl:.2%} of the values were flushed to zero by rounding (call {st.seq}), where the plan "
                    f"predicted {pred_fl:.2%} on its calibration steps: the gradient has moved since (its spread "
                    "or scale changed). Recalibrate: trace a few steps of this part of the training and "
                    "recommend again, or apply(..., fallback='widen')"))
        if self.config.bias_bound is not None and "gain" not in st.alerts and c.norm2 > 0 and math.isfinite(c.dot):
            gs = st.gain_sums
            gs[0] += c.dot
            gs[1] += c.norm2
            gs[2] += max(c.noise2, 0.0)
            b = self.config.bias_bound
            cum_gain, cum_se = gs[0] / gs[1], math.sqrt(gs[2]) / gs[1]
            # One call: off 1 by more than the bound beyond five standard errors of its own draws. All calls
            # so far, for a shrinkage too small to show in any one call but sustained: beyond the bound by two
            # standard errors of all their draws, and off 1 by five. Unbiased pruning and stochastic rounding
            # (gain 1 in expectation) are then never tested at less than five standard errors (the bound adds
            # b / se more as the calls accumulate), and a gain of 0.985 at 0.4% per call fires at the 3rd call
            # (five standard errors beyond the bound: the 16th).
            for g_, limit, se, what in ((c.gain, b + 5 * c.gain_se, c.gain_se, "in this call"),
                                        (cum_gain, max(b + 2 * cum_se, 5 * cum_se), cum_se, "over all calls so far")):
                if abs(g_ - 1) > limit:
                    self._alert(name, st, "gain", (
                        f"the gradient's magnitude gain <out, g>/<g, g> is {g_:.3f} {what} (call {st.seq}; bound "
                        f"1 +- {b:g}, standard error {se:.3g}): the plan "
                        f"{'shrinks' if g_ < 1 else 'inflates'} this layer's gradient systematically ("
                        f"{c.saturated / c.n:.2%} clipped, {c.underflow / c.n:.2%} flushed). Use "
                        "rounding='stochastic' and scale='amax', or check the plan with plan.verify(run)"))
                    break
        if c.zeros == c.n:
            st.zero_run += 1
            if self.config.zero_calls is not None and st.zero_run >= self.config.zero_calls and "zero_gradient" not in st.alerts:
                self._alert(name, st, "zero_gradient", (
                    f"the gradient leaving it was all zeros for {st.zero_run} calls in a row (call {st.seq}): "
                    "nothing reaches this layer's weights or the layers before it. Check the incoming "
                    "gradient, the format's range at this scale, or the low-precision kernel"))
        else:
            st.zero_run = 0
        if (c.underflow and self.config.underflow_bound is not None and "underflow" not in st.alerts
                and rule.rounding != "stochastic"):      # stochastic flushes are unbiased: noise, not shrinkage
            nonzero_in = c.n - (c.zeros - c.pruned - c.underflow)    # the non-zero values of the input
            b = self.config.underflow_bound
            if c.underflow > b * nonzero_in + 3 * math.sqrt(max(b, 1.0 / nonzero_in) * nonzero_in):
                where = (f"with blocks of {rule.block_size}" if rule.block_size is not None
                         else f"at scale 2^{math.log2(st.scale):g}")
                self._alert(name, st, "underflow", (
                    f"{c.underflow / nonzero_in:.1%} of the layer's non-zero values were flushed to zero by "
                    f"rounding to nearest {rule.format} {where} (call {st.seq}; bound {self.config.underflow_bound}): "
                    "a systematic shrinkage of this layer's gradient. Use rounding='stochastic', a larger "
                    "scale (scale='amax'), or a format with more exponent bits"))
        if rule.prunes and self.config.sparsity_margin is not None and "sparsity" not in st.alerts:
            n = c.n
            floor = max(rule.sparsity, (c.zeros - c.pruned - c.underflow) / n)   # target, or zeros on arrival
            excess = c.zeros / n - floor
            if excess > self.config.sparsity_margin + 1.5 / math.sqrt(n):
                cause = (f"the format flushed {c.underflow / n:.1%} of the entries: raise the scale, use "
                         "rounding='stochastic', or lower the target" if 2 * c.underflow >= excess * n else
                         "the threshold model misses this layer's distribution: try threshold_rule='histogram'"
                         if rule.threshold_rule != "histogram" else
                         "the gradient changed since the threshold was refreshed: refresh more often "
                         "(refresh_every) or use ema=None")
                self._alert(name, st, "sparsity", (
                    f"achieved sparsity {c.zeros / n:.3f} exceeds the target {rule.sparsity:g} by {excess:.3f} "
                    f"(margin {self.config.sparsity_margin:g}; call {st.seq}): {cause}"))

    def _alert(self, name: str, st: LayerState, kind: str, msg: str) -> None:
        st.alerts[kind] = msg
        log.warning("gradstats.apply: layer %r: %s", name, msg)
        if self.log_to is not None:
            self.log_to.log_rows("applied_alerts", [Alarm(kind, name, msg, seq=st.seq).alert_row()])

    def drift(self, name: str, st: LayerState, c: CompressCounts, err: float) -> str:
        """Compare the call with its bounds; after ``patience`` drifting calls in a row, change the
        layer's rule by the next applicable action. Returns the action taken, or ``""``."""
        fb, rule = self.config.fallback, self.rules[name]
        n = c.n
        reasons: list[tuple[str, str]] = []               # (what it involves, text)
        reaching = n - c.zeros + c.underflow               # non-zero entries that reached the rounding
        if rule.quantizes and reaching > 0:
            if fb.underflow is not None and c.underflow > fb.underflow * reaching:
                reasons.append(("format", f"{c.underflow / reaching:.1%} of the non-zero values reaching the "
                                          f"rounding flushed to zero, predicted "
                                          f"{predicted_share(st, rule, st.predicted_underflow):.1%} "
                                          f"(bound {fb.underflow:g})"))
            if fb.saturation is not None and c.saturated > fb.saturation * reaching:
                reasons.append(("format", f"{c.saturated / reaching:.2%} of them saturated, predicted "
                                          f"{predicted_share(st, rule, st.predicted_overflow):.2%} "
                                          f"(bound {fb.saturation:g})"))
        if rule.prunes and fb.sparsity is not None and math.isfinite(st.predicted_sparsity):
            floor = max(st.predicted_sparsity, (c.zeros - c.pruned - c.underflow) / n)
            excess = c.zeros / n - floor
            if excess > fb.sparsity + 1.5 / math.sqrt(n):
                kind = "format" if rule.quantizes and 2 * c.underflow >= excess * n else "pruning"
                reasons.append((kind, f"achieved sparsity {c.zeros / n:.3f} above the predicted "
                                      f"{floor:.3f} by {excess:.3f} (bound {fb.sparsity:g})"))
        if (fb.error is not None and math.isfinite(err) and math.isfinite(st.predicted_error)
                and err > fb.error * st.predicted_error):
            reasons.append(("format" if rule.quantizes else "pruning",
                            f"relative error {err:.3g}, {err / max(st.predicted_error, 1e-300):.3g} times the "
                            f"predicted {st.predicted_error:.3g} (bound {fb.error:g}x)"))
        if not reasons:
            st.fallback_run = 0
            return ""
        st.fallback_run += 1
        if st.fallback_run < fb.patience:
            return ""
        kinds = {k for k, _ in reasons}
        for i, action in enumerate(fb.actions):
            if i in st.fallback_done:
                continue
            new = fallback_rule(action, rule, kinds)
            if new is not None:
                break
        else:
            return ""                                      # the ladder is used up for this drift
        st.fallback_done.append(i)
        st.fallback_run = 0
        self.rules[name] = new
        if new.quantizes and new.block_size is None and not math.isnan(st.mu):
            st.scale = scale_for(new, st)
        elif not new.quantizes:
            st.scale = 1.0
        predict(new, st, n)
        reason = "; ".join(t for _, t in reasons)
        row = {"layer": name, "seq": st.seq, "action": action, "reason": reason,
               "from_format": None if rule.format is None else str(rule.format), "from_rounding": rule.rounding,
               "from_sparsity": rule.sparsity if rule.prunes else None,
               "to_format": None if new.format is None else str(new.format), "to_rounding": new.rounding,
               "to_sparsity": new.sparsity if new.prunes else None}
        self.fallbacks.append(row)
        log.warning("gradstats.apply: layer %r: fallback %r at call %d after %d drifting call(s): %s. Was %s; "
                    "now %s", name, action, st.seq, fb.patience, reason, rule.describe(), new.describe())
        if self.log_to is not None:
            self.log_to.log_rows("applied_fallbacks", [row])
        return action
