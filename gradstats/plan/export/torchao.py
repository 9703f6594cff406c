"""The torchao target of :meth:`gradstats.plan.Plan.export` (``"torchao"``, alias ``"torchao.float8"``).

Per ``nn.Linear`` layer: for per-tensor float8 a ``Float8LinearConfig``-like dict with the casts
of ``grad_output`` (the neural gradient) for the two backward GEMMs; for MX blocks (32 values,
E8M0 scales, e4m3fn elements) torchao's MXFP8 training recipe (``{"recipe": "mxfp8",
"scale_calculation_mode": ...}``). Only what torchao can express is mapped; the rest is reported
(see ``docs/plan-format.md`` for the mapping and how to build the torchao objects from it).

Example:
    >>> from gradstats.plan import Plan, PlanEntry
    >>> plan = Plan([PlanEntry("fc", format="e4m3fn", scale="amax")])
    >>> plan.export("torchao", {"fc": "Linear"})["configs"]["fc"]["cast_config_grad_output"]
    {'scaling_type': 'dynamic', 'scaling_granularity': 'tensorwise', 'target_dtype': 'float8_e4m3fn'}
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradstats.plan._rules import Rule
from gradstats.plan.export.base import Exporter, Resolved, register

if TYPE_CHECKING:  # pragma: no cover
    from gradstats.plan._plan import Plan

#: float8 dtypes torchao.float8 casts to (fnuz: ROCm)
TORCHAO_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
#: MX block scale roundings torchao's MXFP8 training takes (its ScaleCalculationMode), by gradstats' name
TORCHAO_MX_SCALE_ROUNDINGS = ("floor", "rceil", "even", "ceil")


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
    layout = r.scheme.layout.preset if r.scheme is not None else None
    if layout == "nvfp4":
        skipped[name] = ("NVFP4 blocks (E4M3 scales): torchao's NVFP4 training (NVFP4TrainingConfig) always "
                         "rounds the gradient stochastically and casts a random Hadamard rotation of it for the "
                         "grad_weight GEMM, not the plan's quantisation of the gradient")
        return None
    if layout != "mxfp8_e4m3":
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


@register
class TorchaoExporter(Exporter):
    """torchao.float8 (per-tensor float8) and torchao's MXFP8 training recipe, per ``nn.Linear``."""

    name = "torchao"
    aliases = ("torchao.float8",)
    target = "torchao.float8"
    needs_types = True
    help = "torchao.float8 casts (and MXFP8 recipes) per nn.Linear"

    def body(self, plan: "Plan", model: Any, resolved: list[Resolved], skipped: dict[str, str],
             dropped: dict[str, list[str]]) -> dict[str, Any]:
        configs = {}
        for name, r, types in resolved:
            cfg = _torchao_layer(name, r, types, skipped, dropped)
            if cfg is not None:
                configs[name] = cfg
        return {"configs": configs, "skipped": skipped, "dropped": dropped}
