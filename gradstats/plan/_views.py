"""The tabular views of a :class:`~gradstats.plan.Plan`: :meth:`Plan.explain` (per layer of a model,
what the plan does there and why) and :meth:`Plan.to_dataframe` (per entry, or per resolved module),
each a pandas DataFrame. The :class:`Plan` methods document them; this module computes them."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from gradstats.plan._rules import _DEFAULT_RULE, PlanEntry, Rule
from gradstats.plan._values import Prediction

if TYPE_CHECKING:
    import pandas as pd


def explain(plan: Any, target: Any) -> "pd.DataFrame":
    """:meth:`Plan.explain`."""
    import pandas as pd
    import torch.nn as nn

    from gradstats.layers import LayerRecord, layer_records, run_if_path, why_not_matmul

    target = run_if_path(target)
    rows = []
    resolved = {name: (rule, idx) for name, rule, idx in plan.resolve_entries(target, strict=False)}
    skip = plan.output_layer_of(target)
    pruned = plan.pruned_layers_of(target)
    owners = None
    if isinstance(target, nn.Module):
        from gradstats.wrappers import named_layers

        owners = {n for n, m in named_layers(target) if any(True for _ in m.parameters(recurse=False))}
    if isinstance(target, (list, tuple)):
        records = [LayerRecord(str(n), (), None) for n in target]
    else:
        records = layer_records(target)
    attention = {r.name for r in records if r.is_a("MultiheadAttention")}
    recommended = plan.provenance is not None and str(plan.provenance.generator or "").startswith("recommend")
    for r in records:
        planned = r.name in resolved
        if not planned and owners is not None and r.name not in owners:
            continue
        why = ""
        rule_text = ""
        if planned:
            rule, _ = resolved[r.name]
            rule_text = rule.describe()
            if r.name.rpartition(".")[0] in attention and r.name.endswith(".out_proj"):
                why = ("never called as a module: MultiheadAttention applies its weights itself; the "
                       "attention module's output is this projection's, and planning it covers it")
            elif pruned is not None and r.name not in pruned and plan.defaults.prunes and not rule.prunes:
                why = _not_pruned(plan.prune_at)
        elif r.name == skip:
            why = "the output layer (the logits): left in full precision and unpruned (output_layer=)"
        elif any(_entry_hits(e, r, types=True) for e in plan.entries):
            why = ("its rule leaves the gradient unchanged" if not (pruned is not None and plan.defaults.prunes)
                   else f"its rule only prunes, and prune_at={plan.prune_at!r} prunes where the gradient "
                        "enters a BatchNorm")
        elif r.types and not r.matmul and (any(e.types is not None and _entry_hits(e, r, types=False)
                                               for e in plan.entries) or recommended):
            why = why_not_matmul(r)     # recommend selects the matmul layers, as the default does
        else:
            why = "no entry of the plan selects it"
        rows.append({"layer": r.name, "type": r.types[0] if r.types else None, "planned": planned,
                     "rule": rule_text, "why": why})
    from gradstats.run import Run

    if isinstance(target, Run):        # traced modules whose weights got gradients but were never called
        listed = {row["layer"] for row in rows}
        uncalled = ("never called as a module: its weights are used functionally (e.g. F.linear(x, module.weight)), "
                    "so its gradients cannot be traced or planned; call the module, or trace and plan the module "
                    "that uses its weights")
        for name, type_name in (target.manifest.get("uncalled") or {}).items():
            if name not in listed:
                rows.append({"layer": name, "type": type_name, "planned": False, "rule": "", "why": uncalled})
    return pd.DataFrame(rows, columns=["layer", "type", "planned", "rule", "why"])


def to_dataframe(plan: Any, target: Any = None) -> "pd.DataFrame":
    """:meth:`Plan.to_dataframe`."""
    import pandas as pd

    rows = []
    if target is None:
        for i, e in enumerate(plan.entries):
            r = plan.rule_of([e], f"layers[{i}]")
            note = ""
            if plan.prune_at is not None and r.prunes and (e.is_pattern or "sparsity" not in e.overrides):
                if isinstance(e.predicted, Prediction):     # recommended: a threshold where it prunes
                    if e.predicted.threshold is None:
                        r, note = dataclasses.replace(r, sparsity=None), _not_pruned(plan.prune_at)
                else:
                    note = (f"prune_at={plan.prune_at!r}: pruned where the gradient enters a BatchNorm "
                            "(to_dataframe(model) shows each layer)")
            rows.append({"layer": e.layer, "match": _kind(e), "types": list(e.types) if e.types else None,
                         **_rule_row(r), "sparsity_note": note})
    else:
        for name, r, idx in plan.resolve_entries(target, strict=False):
            dropped = not r.prunes and plan.rule_of([plan.entries[i] for i in idx], name).prunes
            rows.append({"layer": name, "entries": idx, **_rule_row(r),
                         "sparsity_note": _not_pruned(plan.prune_at) if dropped else ""})
    cols = ["layer", "match", "types"] if target is None else ["layer", "entries"]
    cols += [*_rule_row(_DEFAULT_RULE), "sparsity_note"]
    if plan.noise:            # recommend bounded the noise: what each layer asked for, got, and why
        per = {c["layer"]: c for c in plan.noise}
        for row in rows:
            c = per.get(row["layer"], {})
            row.update(requested_sparsity=c.get("requested_sparsity"), sparsity_reason=c.get("sparsity_reason", ""),
                       format_reason=c.get("format_reason", ""), bits_per_value=c.get("bits"),
                       predicted_noise=c.get("predicted_noise"), pruning_noise=c.get("pruning_noise"),
                       noise_bound=plan.noise_bound)
        cols += ["requested_sparsity", "sparsity_reason", "format_reason", "bits_per_value", "predicted_noise",
                 "pruning_noise", "noise_bound"]
    df = pd.DataFrame(rows, columns=cols)
    return df.astype({"bits": "Int64", "block_size": "Int64"})


def _kind(e: PlanEntry) -> str:
    return "regex" if e.layer.startswith("re:") else ("glob" if e.is_pattern else "exact")


def _entry_hits(e: PlanEntry, record: Any, *, types: bool) -> bool:
    """Whether ``e`` selects the layer ``record`` (by name alone with ``types=False``)."""
    if not types or e.types is None:
        return dataclasses.replace(e, types=None).matches(record.name)
    return bool(record.types) and e.matches(record.name, record.types)


def _not_pruned(prune_at: str | None) -> str:
    """Why a layer a rule would prune is left unpruned (``Plan.explain``, ``Plan.to_dataframe``)."""
    return f"not pruned: prune_at={prune_at!r} prunes where the gradient enters a BatchNorm"


def _rule_row(r: Rule) -> dict[str, Any]:
    p = r.predicted or Prediction()
    return {"format": None if r.format is None else str(r.format),
            "bits": None if r.format is None else r.format.bits,
            "scale": r.scale, "scale_value": r.scale_value, "rounding": r.rounding,
            "block_size": r.block_size, "scale_format": r.scale_format, "scale_rounding": r.scale_rounding,
            "hadamard": r.hadamard if r.format is not None else None, "sparsity": r.sparsity,
            "threshold_rule": r.threshold_rule, "mu": p.mu, "sigma": p.sigma, "p0": p.p0,
            "predicted_error": p.error, "predicted_sparsity": p.sparsity,
            "predicted_scale": p.scale, "predicted_threshold": p.threshold}
