"""The plain JSON target of :meth:`gradstats.plan.Plan.export` (``"json"``): per layer the format
(canonical name and its defining numbers), the scale rule and a scale any code can use, rounding,
blocks, the Hadamard transform (its size and signs, :mod:`gradstats.ops.hadamard`) and pruning: plain
data with no gradstats types.

Example:
    >>> from gradstats.plan import Plan, PlanEntry
    >>> plan = Plan([PlanEntry("fc", format="e4m3fn", scale="amax")])
    >>> plan.export("json")["layers"]["fc"]["torch_dtype"]
    'float8_e4m3fn'
"""
from __future__ import annotations

from typing import Any

from gradstats.ops.hadamard import signs
from gradstats.plan._rules import Rule, amax_scale
from gradstats.plan.export.base import Exporter, Resolved, register


def _plain_scale(r: Rule) -> float | None:
    if r.format is None:
        return None
    if r.scale == "amax" and r.block_size is None and r.predicted is not None and r.predicted.amax:
        return float(r.scale_for(amax=r.predicted.amax))      # at the statistics it was planned on
    if r.scale == "fixed":
        return r.scale_value
    if r.scale == "lognormal" and r.predicted is not None and r.predicted.scale is not None:
        s = r.predicted.scale
        if r.predicted.amax is not None and r.predicted.amax > 0:
            s = max(s, amax_scale(r.format, r.predicted.amax))  # the floor of Rule.scale_for
        return s
    return None


def _json_layer(r: Rule) -> dict[str, Any]:
    f = r.format
    spec = None
    if f is not None:
        spec = {k: v for k, v in f.to_dict().items()
                if k in ("bits", "exp_bits", "man_bits", "bias", "special", "subnormals", "max",
                         "min_normal", "min_subnormal")}
    td = f.torch_dtype if f is not None else None
    p = r.predicted
    return {
        "format": None if f is None else str(f),
        "format_spec": spec,
        "torch_dtype": None if td is None else str(td).removeprefix("torch."),
        "scale_rule": r.scale if f is not None else None,
        "scale_shift": r.scale_shift if f is not None and r.scale == "amax" else None,
        "scale": _plain_scale(r) if f is not None else None,
        "rounding": r.rounding if f is not None else None,
        "block_size": r.block_size,
        "scale_format": r.scale_format,
        "scale_rounding": None if r.scheme is None else r.scheme.scale_rounding,
        "hadamard": None if r.scheme is None else r.scheme.hadamard,
        "hadamard_signs": None if r.scheme is None or r.scheme.hadamard is None else list(signs(r.scheme.hadamard)),
        "scheme": None if r.scheme is None else str(r.scheme),
        "sparsity": r.sparsity,
        "threshold_rule": r.threshold_rule if r.sparsity is not None else None,
        "threshold": None if p is None or r.sparsity is None else p.threshold,
        "predicted": None if p is None else p.to_dict(),
    }


@register
class JSONExporter(Exporter):
    """Plain data per layer, for any code (no gradstats types)."""

    name = "json"
    target = "json"
    help = "plain data per layer (no gradstats types)"

    def body(self, plan: Any, model: Any, resolved: list[Resolved], skipped: dict[str, str],
             dropped: dict[str, list[str]]) -> dict[str, Any]:
        return {"layers": {name: _json_layer(r) for name, r, _ in resolved}}
