"""The torchao target of :meth:`gradstats.plan.Plan.export` (``"torchao"``, alias ``"torchao.float8"``).

Per ``nn.Linear`` layer: for per-tensor float8 a ``Float8LinearConfig``-like dict with the casts
of ``grad_output`` (the neural gradient) for the two backward GEMMs; for MX blocks (32 values,
E8M0 scales, e4m3fn elements) torchao's MXFP8 training recipe (``{"recipe": "mxfp8",
"scale_calculation_mode": ...}``); for NVFP4 blocks (16 values, E4M3 scales under a float32 tensor
scale, e2m1fn elements) torchao's NVFP4 training recipe (``NVFP4TrainingConfig``: ``{"recipe":
"nvfp4", "kernel_preference": "triton", "rht_sign_vector": [...]}``, the signs of gradstats' Hadamard
transform, :func:`gradstats.ops.hadamard.signs`). Only what torchao can express is mapped; the rest is
reported (see ``docs/plan-format.md`` for the mapping and how to build the torchao objects from it).

Example:
    >>> from gradstats.plan import Plan, PlanEntry
    >>> plan = Plan([PlanEntry("fc", format="e4m3fn", scale="amax")])
    >>> plan.export("torchao", {"fc": "Linear"})["configs"]["fc"]["cast_config_grad_output"]
    {'scaling_type': 'dynamic', 'scaling_granularity': 'tensorwise', 'target_dtype': 'float8_e4m3fn'}
"""
from __future__ import annotations

from typing import Any

from gradstats.ops.hadamard import signs
from gradstats.plan._rules import Rule
from gradstats.plan.export.base import Exporter, Resolved, register

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
    layout = r.scheme.layout.replace(hadamard=None).preset if r.scheme is not None else None
    if layout == "nvfp4":
        return _torchao_nvfp4_layer(name, r, dropped)
    if r.hadamard is not None:
        skipped[name] = (f"hadamard {r.hadamard} with {r.format} in blocks of {r.block_size} ({r.scale_format} "
                         "scales): torchao rotates the gradient in its NVFP4 training recipe only (e2m1fn, blocks "
                         "of 16, e4m3 scales)")
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


#: what torchao 0.18's NVFP4 training recipe does to the neural gradient g and what the plan's
#: emulation of it (one quantised g for both backward GEMMs, :func:`gradstats.quantize`) does otherwise
_NVFP4_GRAD_INPUT = ("grad_input GEMM: torchao quantises g along the channels without the rotation (stochastic "
                     "rounding), where the plan feeds both GEMMs its one rotated-quantised g")
_NVFP4_BF16 = "torchao casts g (and its rotation) to bfloat16 before quantising; the plan quantises float32"
_NVFP4_FORWARD = ("torchao's NVFP4 recipe also casts the forward input (along the features, and rotated along the "
                  "tokens for grad_weight) and the weight (16x16 blocks) to NVFP4, and needs in_features, "
                  "out_features and the tokens of a step to be multiples of 128 (Triton kernels, CUDA SM100)")


def _torchao_nvfp4_layer(name: str, r: Rule, dropped: dict[str, list[str]]) -> dict[str, Any]:
    """An NVFP4 rule as torchao's NVFP4 training recipe (``NVFP4TrainingConfig``): e2m1fn in blocks of
    16 with E4M3 scales under a float32 tensor scale, stochastic rounding of the gradient, and a
    16-point random Hadamard transform of both grad_weight operands along the tokens, with the plan's
    sign vector (gradstats' fixed one, :func:`gradstats.ops.hadamard.signs`). Fields the plan sets
    otherwise are listed in ``dropped``."""
    notes: list[str] = []
    if r.rounding != "stochastic":
        notes.append(f"rounding {r.rounding!r}: torchao's NVFP4 training rounds g stochastically in both "
                     "backward GEMMs")
    if r.hadamard is None:
        notes.append("no Hadamard transform: torchao's NVFP4 training casts a 16-point random Hadamard rotation of "
                     "g (and of the input) along the tokens for the grad_weight GEMM")
    elif r.hadamard != 16:
        notes.append(f"hadamard {r.hadamard}: torchao's random Hadamard transform is 16-point")
    else:
        notes.append(_NVFP4_GRAD_INPUT)
    notes.append(_NVFP4_BF16)
    if r.prunes:
        notes.append(f"sparsity {r.sparsity} ({r.threshold_rule} threshold): torchao does not prune gradients")
    notes.append(_NVFP4_FORWARD)
    dropped[name] = notes
    return {"recipe": "nvfp4", "kernel_preference": "triton", "rht_sign_vector": list(signs(16))}


@register
class TorchaoExporter(Exporter):
    """torchao.float8 (per-tensor float8), torchao's MXFP8 and NVFP4 training recipes, per ``nn.Linear``."""

    name = "torchao"
    aliases = ("torchao.float8",)
    target = "torchao.float8"
    needs_types = True
    help = "torchao.float8 casts (and MXFP8, NVFP4 training recipes) per nn.Linear"

    def body(self, plan: Any, model: Any, resolved: list[Resolved], skipped: dict[str, str],
             dropped: dict[str, list[str]]) -> dict[str, Any]:
        configs = {}
        for name, r, types in resolved:
            cfg = _torchao_layer(name, r, types, skipped, dropped)
            if cfg is not None:
                configs[name] = cfg
        return {"configs": configs, "skipped": skipped, "dropped": dropped}
