"""torchao: a plan as real torchao training configs, and the model converted with them.

:meth:`gradstats.Plan.to_torchao` (this module's :func:`to_torchao`) turns the plan's
``export("torchao")`` mapping (``docs/plan-format.md``) into ``(config, module_filter_fn)``
pairs, one per distinct config; :func:`convert` applies them with torchao's own API and returns
the model. Only what torchao expresses is mapped:

* per-tensor float8 (``Float8LinearConfig``, applied by ``convert_to_float8_training``): casts of
  ``grad_output`` (the neural gradient) in both backward GEMMs, dynamic scales from each step's
  amax rounded to a power of two (gradstats' ``"amax"`` scale rule, bit for bit); torchao keeps
  its defaults for the forward casts (input and weight to e4m3fn);
* MX blocks (``MXFP8TrainingOpConfig``, applied by ``torchao.quantization.quantize_``): e4m3fn in
  blocks of 32 with E8M0 scales, the plan's ``scale_rounding`` as torchao's
  ``ScaleCalculationMode`` (``floor``, ``rceil``, ``even``, ``ceil``; bit for bit).

Pruning, stochastic rounding, other scale rules, NVFP4 blocks (torchao has no NVFP4 training
config) and formats without a float8 dtype are listed as dropped or skipped (a ``UserWarning``;
``strict=True`` raises).

``emulate=True`` runs the low-precision GEMMs in high precision on the dequantised values
(torchao's emulation, which works on the CPU): what the tests use to check that the input
gradient torchao computes is ``quantize(g) @ quantize(W)`` with gradstats' formats and scales.
Emulated MXFP8 computes the weight gradient in high precision (``wgrad_with_hp=True``): torchao's
cast for that GEMM is a CUDA kernel.

Example:
    >>> import torch, gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> plan = gradstats.Plan.uniform(format="e5m2", scale="amax")
    >>> pairs = to_torchao(plan, model, emulate=True)
    >>> len(pairs), pairs[0][0].cast_config_grad_output.target_dtype
    (1, torch.float8_e5m2)
    >>> m = convert(model, plan, emulate=True)
    >>> type(m[0]).__name__, type(m[2]).__name__          # the output layer stays as it was
    ('Float8Linear', 'Linear')
"""
from __future__ import annotations

import json
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["to_torchao", "convert"]


def _torchao() -> Any:
    try:
        import torchao.float8 as f8
    except ImportError as exc:                          # pragma: no cover - depends on the environment
        raise ImportError("gradstats.integrations.torchao needs torchao (pip install torchao)") from exc
    return f8


def _cast(f8: Any, d: dict[str, Any]) -> Any:
    if d["scaling_type"] == "disabled":
        return f8.CastConfig(scaling_type=f8.ScalingType.DISABLED)
    return f8.CastConfig(scaling_type=f8.ScalingType(d["scaling_type"]),
                         scaling_granularity=f8.ScalingGranularity(d["scaling_granularity"]),
                         target_dtype=getattr(torch, d["target_dtype"]))


def _mx_shapes(configs: dict[str, Any], model: Any, strict: bool) -> dict[str, Any]:
    """The configs without the MXFP8 layers whose features torchao cannot block by 32 (it casts
    the input along ``in_features`` and the gradient along ``out_features``), listed once."""
    if not isinstance(model, nn.Module):
        return configs
    from gradstats.wrappers import unwrap

    modules = dict(unwrap(model).named_modules())
    bad = {}
    for name, cfg in configs.items():
        m = modules.get(name)
        if cfg.get("recipe") == "mxfp8" and m is not None:
            dims = (getattr(m, "in_features", 0), getattr(m, "out_features", 0))
            if any(d % cfg["block_size"] for d in dims):
                bad[name] = (f"in_features {dims[0]} and out_features {dims[1]} must be multiples of "
                             f"{cfg['block_size']} for torchao's MXFP8 casts")
    if bad:
        msg = "export to torchao: not expressible there:\n  " + "\n  ".join(f"{n}: skipped ({w})" for n, w in bad.items())
        if strict:
            raise ValueError(msg)
        import warnings

        warnings.warn(msg, stacklevel=3)
    return {n: c for n, c in configs.items() if n not in bad}


def _mx_config(cfg: dict[str, Any], emulate: bool) -> Any:
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference
    except ImportError as exc:                          # pragma: no cover - depends on the torchao release
        raise ImportError("this plan's MX layers need torchao's MXFP8 training "
                          "(torchao.prototype.moe_training, torchao >= 0.17)") from exc
    return MXFP8TrainingOpConfig(
        kernel_preference=KernelPreference.EMULATED if emulate else KernelPreference.AUTO,
        scale_calculation_mode=ScaleCalculationMode[cfg["scale_calculation_mode"].upper()],
        wgrad_with_hp=bool(cfg["wgrad_with_hp"] or emulate))


def to_torchao(plan: Any, model: Any, *, emulate: bool = False, strict: bool = False
               ) -> list[tuple[Any, Callable[[nn.Module, str], bool]]]:
    """``[(config, module_filter_fn), ...]``: one pair per distinct config of the plan resolved on
    ``model`` (anything :meth:`gradstats.Plan.resolve` takes), a ``Float8LinearConfig`` or an
    ``MXFP8TrainingOpConfig``; each filter selects the layers (by their names in ``model``) that
    config is for. ``emulate``: torchao's emulated GEMMs (CPU). Example: see the module."""
    f8 = _torchao()
    doc = plan.export("torchao", model, strict=strict)
    configs = _mx_shapes(doc["configs"], model, strict)
    groups: dict[str, list[str]] = {}
    for name, cfg in configs.items():
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(name)
    out = []
    for key, names in groups.items():
        cfg = json.loads(key)
        chosen = frozenset(names)
        if cfg.get("recipe") == "mxfp8":
            out.append((_mx_config(cfg, emulate), lambda module, fqn, chosen=chosen: fqn in chosen))
            continue
        kw = {k: _cast(f8, v) for k, v in cfg.items() if k.startswith("cast_config_")}
        config = f8.Float8LinearConfig(**kw, round_scales_to_power_of_2=bool(cfg.get("round_scales_to_power_of_2")),
                                       emulate=emulate)
        out.append((config, lambda module, fqn, chosen=chosen: fqn in chosen))
    return out


def convert(model: nn.Module, plan: Any, *, emulate: bool = False, strict: bool = False) -> nn.Module:
    """Convert ``model``'s planned linear layers with torchao's own API, in place as torchao does
    (``torchao.float8.convert_to_float8_training`` for float8 configs,
    ``torchao.quantization.quantize_`` for MXFP8 ones), and return it. Example: see the module."""
    f8 = _torchao()
    from gradstats.wrappers import unwrap

    root = unwrap(model)
    for config, keep in to_torchao(plan, root, emulate=emulate, strict=strict):
        if isinstance(config, f8.Float8LinearConfig):
            f8.convert_to_float8_training(root, config=config, module_filter_fn=keep)
        else:
            from torchao.quantization import quantize_

            quantize_(root, config, filter_fn=keep)
    return model
