"""torchao: a plan as real ``torchao.float8`` training configs, and the model converted with them.

:meth:`gradstats.Plan.to_torchao` (this module's :func:`to_torchao`) turns the plan's
``export("torchao")`` mapping (``docs/plan-format.md``) into ``(Float8LinearConfig,
module_filter_fn)`` pairs, one per distinct config; :func:`convert` applies them with torchao's
own ``convert_to_float8_training`` and returns the model. Only what torchao expresses is mapped:
per-tensor float8 casts of ``grad_output`` (the neural gradient) in both backward GEMMs, dynamic
scales from each step's amax rounded to a power of two (gradstats' ``"amax"`` scale rule, bit for
bit); torchao keeps its defaults for the forward casts (input and weight to e4m3fn). Pruning,
stochastic rounding, other scale rules, block scales and formats without a float8 dtype are
listed as dropped or skipped (a ``UserWarning``; ``strict=True`` raises).

``emulate=True`` runs the float8 GEMMs in high precision on the dequantised values (torchao's
emulation, which works on the CPU): what the tests use to check that the input gradient torchao
computes is ``quantize(g) @ quantize(W)`` with gradstats' formats and scales.

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


def to_torchao(plan: Any, model: Any, *, emulate: bool = False, strict: bool = False
               ) -> list[tuple[Any, Callable[[nn.Module, str], bool]]]:
    """``[(Float8LinearConfig, module_filter_fn), ...]``: one pair per distinct config of the plan
    resolved on ``model`` (anything :meth:`gradstats.Plan.resolve` takes); each filter selects the
    layers (by their names in ``model``) that config is for. ``emulate``: torchao's emulated
    float8 GEMMs (CPU). Example: see the module."""
    f8 = _torchao()
    doc = plan.export("torchao", model, strict=strict)
    groups: dict[str, list[str]] = {}
    for name, cfg in doc["configs"].items():
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(name)
    out = []
    for key, names in groups.items():
        cfg = json.loads(key)
        kw = {k: _cast(f8, v) for k, v in cfg.items() if k.startswith("cast_config_")}
        config = f8.Float8LinearConfig(**kw, round_scales_to_power_of_2=bool(cfg.get("round_scales_to_power_of_2")),
                                       emulate=emulate)
        chosen = frozenset(names)
        out.append((config, lambda module, fqn, chosen=chosen: fqn in chosen))
    return out


def convert(model: nn.Module, plan: Any, *, emulate: bool = False, strict: bool = False) -> nn.Module:
    """Convert ``model``'s planned linear layers with ``torchao.float8.convert_to_float8_training``
    (in place, as torchao does) and return it. Example: see the module."""
    f8 = _torchao()
    from gradstats.wrappers import unwrap

    root = unwrap(model)
    for config, keep in to_torchao(plan, root, emulate=emulate, strict=strict):
        f8.convert_to_float8_training(root, config=config, module_filter_fn=keep)
    return model
