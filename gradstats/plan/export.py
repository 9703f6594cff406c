"""Exports of a plan, resolved per layer, for other code and other stacks (:meth:`Plan.export`).

``"json"``: per layer the format (canonical name and its defining numbers), the scale rule and
a scale any code can use, rounding, blocks and pruning: plain data with no gradstats types.

``"torchao"``: the torchao counterpart per ``nn.Linear`` layer: for per-tensor float8 a
``Float8LinearConfig``-like dict with the casts of ``grad_output`` (the neural gradient) for the
two backward GEMMs; for MX blocks (32 values, E8M0 scales, e4m3fn elements) torchao's MXFP8
training recipe (``{"recipe": "mxfp8", "scale_calculation_mode": ...}``). Only what torchao can
express is mapped; the rest is reported (see ``docs/plan-format.md`` for the mapping and how to
build the torchao objects from it).

``"te"``: a Transformer Engine debug config for nvdlfw-inspect (one section per layer: FakeQuant
of the gradient to the layer's FP8 format, or its gradient GEMMs kept in high precision, and the
gradient's statistics logged; :mod:`gradstats.plan._export_te`), written as YAML with ``path=``.

What a target cannot express is reported once, as a ``UserWarning`` (``warnings.warn``): a
lossy export the caller asked for, which they may have to make up for in their own code
(``strict=True`` makes it a ``ValueError``). It is not logged as well, so it shows once with
logging configured too (``logging.captureWarnings(True)`` routes it into logging).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradstats.plan._rules import Rule, amax_scale

if TYPE_CHECKING:  # pragma: no cover
    from gradstats.plan._plan import Plan

#: targets of :meth:`gradstats.plan.Plan.export`
EXPORT_TARGETS = ("json", "torchao", "te")
#: schema name and version of an export document
EXPORT_SCHEMA = "gradstats.plan.export"
EXPORT_VERSION = 1
#: float8 dtypes torchao.float8 casts to (fnuz: ROCm)
TORCHAO_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
#: MX block scale roundings torchao's MXFP8 training takes (its ScaleCalculationMode), by gradstats' name
TORCHAO_MX_SCALE_ROUNDINGS = ("floor", "rceil", "even", "ceil")

_ALIASES = {"json": "json", "torchao": "torchao", "torchao.float8": "torchao", "te": "te",
            "transformer_engine": "te"}


def _resolved(plan: "Plan", model: Any, need_types: bool) -> list[tuple[str, Rule, tuple[str, ...] | None]]:
    from gradstats.layers import module_candidates

    if model is None:
        pats = [e.layer for e in plan.entries if e.is_pattern]
        if pats:
            raise ValueError(f"the plan has pattern entries {pats}: pass model= (an nn.Module, a Run, or a "
                             "mapping name -> class name) to resolve them to layer names")
        if need_types:
            raise ValueError("this export needs each layer's module type: pass model= (an nn.Module, a Run, "
                             "or a mapping name -> class name)")
        model = list(dict.fromkeys(e.layer for e in plan.entries))
    types = dict(module_candidates(model))
    return [(name, rule, types.get(name)) for name, rule, _ in plan._resolve(model, strict=True)]


def _plain_scale(r: Rule) -> float | None:
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
        "scale_rounding": (r.scale_rounding or "floor") if r.scale_format == "e8m0" else None,
        "sparsity": r.sparsity,
        "threshold_rule": r.threshold_rule if r.sparsity is not None else None,
        "threshold": None if p is None or r.sparsity is None else p.threshold,
        "predicted": None if p is None else p.to_dict(),
    }


def _cast(dtype: str | None) -> dict[str, Any]:
    if dtype is None:
        return {"scaling_type": "disabled"}
    return {"scaling_type": "dynamic", "scaling_granularity": "tensorwise", "target_dtype": dtype}


def _torchao_layer(name: str, r: Rule, types: tuple[str, ...] | None,
                   skipped: dict[str, str], dropped: dict[str, list[str]]) -> dict[str, Any] | None:
    if not types or "Linear" not in types:
        skipped[name] = (f"torchao.float8 converts nn.Linear modules only; {name!r} is a "
                         f"{types[0] if types else 'module of unknown type'}")
        return None
    notes: list[str] = []
    if r.format is None:
        dtype = None
    elif r.block_size is not None:
        return _torchao_mx_layer(name, r, skipped, dropped)
    else:
        td = r.format.torch_dtype
        dtype = None if td is None else str(td).removeprefix("torch.")
        if dtype not in TORCHAO_DTYPES:
            skipped[name] = (f"format {r.format} has no torchao.float8 counterpart (it casts to "
                             f"{', '.join(TORCHAO_DTYPES[:2])}; fnuz on ROCm)")
            return None
        if r.scale != "amax":
            notes.append(f"scale rule {r.scale!r}: torchao scales dynamically by the step's amax "
                         "(rounded to a power of two)")
        elif r.scale_shift:
            notes.append(f"scale_shift {r.scale_shift}: torchao maps the step's amax to the format's "
                         "maximum (no shift)")
        if r.rounding != "nearest":
            notes.append(f"rounding {r.rounding!r}: torchao casts round to nearest")
    if r.prunes:
        notes.append(f"sparsity {r.sparsity} ({r.threshold_rule} threshold): torchao.float8 does not prune "
                     "gradients")
    if notes:
        dropped[name] = notes
    cfg: dict[str, Any] = {"cast_config_grad_output": _cast(dtype),
                           "cast_config_grad_output_for_grad_weight": _cast(dtype)}
    if dtype is None:
        # torchao needs both operands of a GEMM in float8 or both in high precision
        cfg["cast_config_weight_for_grad_input"] = _cast(None)
        cfg["cast_config_input_for_grad_weight"] = _cast(None)
    cfg["round_scales_to_power_of_2"] = True
    return cfg


def _torchao_mx_layer(name: str, r: Rule, skipped: dict[str, str], dropped: dict[str, list[str]]
                      ) -> dict[str, Any] | None:
    """A block-scaled rule as torchao's MXFP8 training recipe (``MXFP8TrainingOpConfig``): blocks
    of 32 along the contraction dimension, E8M0 scales, e4m3fn elements, in both backward GEMMs."""
    if r.scale_format == "e4m3":
        skipped[name] = ("NVFP4 blocks (E4M3 scales): torchao's NVFP4 training (NVFP4TrainingConfig) always "
                         "rounds the gradient stochastically and casts a random Hadamard rotation of it for the "
                         "grad_weight GEMM, not the plan's quantisation of the gradient")
        return None
    if r.block_size != 32 or r.scale_format != "e8m0" or str(r.format) != "e4m3fn":
        skipped[name] = (f"{r.format} in blocks of {r.block_size} ({r.scale_format} scales): torchao's MX "
                         "training (MXFP8) casts gradients to e4m3fn in blocks of 32 with E8M0 scales only")
        return None
    mode = r.scale_rounding or "floor"
    notes: list[str] = []
    if r.rounding != "nearest":
        notes.append(f"rounding {r.rounding!r}: torchao's MX casts round to nearest")
    if r.prunes:
        notes.append(f"sparsity {r.sparsity} ({r.threshold_rule} threshold): torchao does not prune gradients")
    notes.append("torchao's MXFP8 recipe also casts the forward input and weight to MXFP8 e4m3fn")
    dropped[name] = notes
    return {"recipe": "mxfp8", "scale_calculation_mode": mode, "block_size": 32, "elem_dtype": "float8_e4m3fn",
            "wgrad_with_hp": False}


def export(plan: "Plan", target: str, model: Any = None, *, path: str | os.PathLike[str] | None = None,
           strict: bool = False) -> dict[str, Any]:
    """See :meth:`gradstats.plan.Plan.export`."""
    if target not in _ALIASES:
        raise ValueError(f"unknown export target {target!r}; expected one of {list(EXPORT_TARGETS)}")
    target = _ALIASES[target]
    resolved = _resolved(plan, model, need_types=target == "torchao")
    prov = None if plan.provenance is None else plan.provenance.to_dict()
    skipped: dict[str, str] = {}
    dropped: dict[str, list[str]] = {}
    if target == "json":
        doc: dict[str, Any] = {"schema": EXPORT_SCHEMA, "version": EXPORT_VERSION, "target": "json",
                               "provenance": prov,
                               "layers": {name: _json_layer(r) for name, r, _ in resolved}}
    elif target == "te":
        from gradstats.layers import module_candidates
        from gradstats.plan._export_te import section_name, te_section

        rules: dict[str, Rule | None] = {name: r for name, r, _ in resolved}
        out = plan.output_layer_of(model) if model is not None else (
            plan.output_layer if plan.output_layer not in (None, "auto") else None)
        if out is not None and out not in rules:
            rules[out] = None              # the plan leaves it in high precision
        types = dict(module_candidates(model)) if model is not None else {}
        config = {}
        for name, r in rules.items():
            sec = te_section(name, r, types.get(name), skipped, dropped)
            if sec is not None:
                config[section_name(len(config), name)] = sec
        doc = {"schema": EXPORT_SCHEMA, "version": EXPORT_VERSION, "target": "transformer_engine",
               "provenance": prov, "config": config, "skipped": skipped, "dropped": dropped}
    else:
        configs = {}
        for name, r, types in resolved:
            cfg = _torchao_layer(name, r, types, skipped, dropped)
            if cfg is not None:
                configs[name] = cfg
        doc = {"schema": EXPORT_SCHEMA, "version": EXPORT_VERSION, "target": "torchao.float8",
               "provenance": prov, "configs": configs, "skipped": skipped, "dropped": dropped}
    if skipped or dropped:
        lines = [f"{n}: skipped ({why})" for n, why in skipped.items()]
        lines += [f"{n}: {note}" for n, notes in dropped.items() for note in notes]
        msg = f"export to {doc['target']}: not expressible there:\n  " + "\n  ".join(lines)
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)        # once: not also through logging
    if path is not None:
        from gradstats.run import atomic_write_bytes

        atomic_write_bytes(Path(path), (te_yaml(doc) if target == "te" else
                                        json.dumps(doc, indent=2, allow_nan=False) + "\n").encode())
    return doc


def te_yaml(doc: dict[str, Any]) -> str:
    """A ``"te"`` export document as the YAML file nvdlfw-inspect reads: its sections, after comments
    that say where the plan came from and what Transformer Engine could not express
    (``gradstats export PLAN --to te`` prints it).

    Example:
        >>> from gradstats.plan import Plan
        >>> doc = Plan.uniform(format="e5m2").export("te", {"fc": "Linear"})
        >>> te_yaml(doc).splitlines()[0]
        '# Transformer Engine debug config (nvdlfw-inspect) from a gradstats plan (gradstats.plan.export v1)'
    """
    from gradstats.plan._export_te import to_yaml

    prov = doc.get("provenance") or {}
    head = [f"Transformer Engine debug config (nvdlfw-inspect) from a gradstats plan ({EXPORT_SCHEMA} v{EXPORT_VERSION})"]
    if prov:
        head.append(f"plan: {prov.get('generator') or ''} from {prov.get('source') or 'unknown'}".rstrip())
    for what, per in (("skipped", {n: [why] for n, why in doc["skipped"].items()}), ("dropped", doc["dropped"])):
        by_note: dict[str, list[str]] = {}
        for n, notes in per.items():
            for note in notes:
                by_note.setdefault(note, []).append(n)
        head += [f"{what} at {', '.join(names)}: {note}" for note, names in by_note.items()]
    head.append("use: nvdlfw_inspect.api.initialize(config_file=THIS_FILE, feature_dirs=[TE's "
                "transformer_engine/debug/features])")
    return to_yaml(doc["config"], head)
