"""A plan as real torchao training configs (:meth:`gradstats.Plan.to_torchao`; the model converted
with them: :func:`gradstats.integrations.torchao.convert`).

:func:`to_torchao` turns the plan's ``export("torchao")`` mapping (``docs/plan-format.md``) into
``(config, module_filter_fn)`` pairs, one per distinct config, which ``convert`` applies with
torchao's own API. Only what torchao expresses is mapped:

* per-tensor float8 (``Float8LinearConfig``, applied by ``convert_to_float8_training``): casts of
  ``grad_output`` (the neural gradient) in both backward GEMMs, dynamic scales from each step's
  amax rounded to a power of two (gradstats' ``"amax"`` scale rule, bit for bit); torchao keeps
  its defaults for the forward casts (input and weight to e4m3fn);
* MX blocks (``MXFP8TrainingOpConfig``, applied by ``torchao.quantization.quantize_``): e4m3fn in
  blocks of 32 with E8M0 scales, the plan's ``scale_rounding`` as torchao's
  ``ScaleCalculationMode`` (``floor``, ``rceil``, ``even``, ``ceil``; bit for bit);
* NVFP4 blocks (``NVFP4TrainingConfig``, applied by ``quantize_``, which swaps in its
  ``NVFP4Linear``): e2m1fn in blocks of 16 with E4M3 scales under a float32 tensor scale, stochastic
  rounding and a 16-point random Hadamard transform for the grad_weight GEMM -- the
  ``"nvfp4_training"`` preset -- with gradstats' sign vector as ``rht_sign_vector`` (the same rotation
  matrix). torchao runs it with Triton kernels on CUDA (SM100) only: no emulation on the CPU.

Pruning, rounding other than torchao's, other scale rules and formats without a float8 dtype are
listed as dropped or skipped (a ``UserWarning``; ``strict=True`` raises).

torchao's named float8 recipes (``Float8LinearConfig.from_recipe_name``) and what each can keep
of a plan are in :data:`RECIPES`: a per-tensor ``e4m3fn``/``e5m2`` plan with ``"amax"`` scales is
the ``tensorwise`` recipe with the plan's gradient dtype and power-of-two scales (the default,
``recipe="tensorwise"``: :func:`recipe_overrides` says which fields differ from the recipe);
``recipe="rowwise"`` or ``"rowwise_with_gw_hp"`` takes torchao's recipe as it is on the planned
layers and lists what of the plan it changes. :func:`recipe_table` says per layer which
torchao recipe keeps the plan's meaning, if one does.

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
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["RECIPES", "FLOAT8_RECIPES", "recipe_overrides", "recipe_table", "to_torchao"]

#: torchao's training recipes a plan maps to, by name (``Float8LinearConfig.from_recipe_name`` for
#: the float8 ones): what each does to the neural gradient ``g`` (``grad_output``: ``granularity``,
#: ``dtype``, ``power_of_2`` scales, ``grad_weight`` GEMM in float8 or high precision; the tests
#: check these against the installed torchao), which plan fields it keeps and which it cannot.
RECIPES: dict[str, dict[str, Any]] = {
    "tensorwise": {
        "granularity": "tensorwise", "dtype": "float8_e5m2", "power_of_2": False, "grad_weight": "float8",
        "keeps": "format e5m2 (e4m3fn by setting the two grad_output casts' dtype), scale 'amax' with "
                 "scale_shift 0 (by round_scales_to_power_of_2=True: torchao's power-of-two amax scale is "
                 "gradstats' 'amax' rule), format null (the backward GEMMs' casts disabled)",
        "cannot": "scale 'lognormal' or 'fixed', scale_shift != 0, rounding other than 'nearest', sparsity, "
                  "blocks"},
    "rowwise": {
        "granularity": "axiswise", "dtype": "float8_e4m3fn", "power_of_2": True, "grad_weight": "float8",
        "keeps": "format e4m3fn, rounding 'nearest'",
        "cannot": "one scale per tensor or per block (it scales each row of g for the grad_input GEMM and "
                  "each column for the grad_weight GEMM: two casts of g, where a plan has one), format e5m2, "
                  "sparsity; it casts the forward rowwise too"},
    "rowwise_with_gw_hp": {
        "granularity": "axiswise", "dtype": "float8_e4m3fn", "power_of_2": True, "grad_weight": "high precision",
        "keeps": "format e4m3fn and rounding 'nearest' in the grad_input GEMM",
        "cannot": "one scale per tensor or per block (a scale per row of g), the grad_weight GEMM's cast (it "
                  "keeps g in high precision there), format e5m2, sparsity; it casts the forward rowwise too"},
    "mxfp8": {
        "keeps": "format e4m3fn in blocks of 32 with e8m0 scales and their scale_rounding (torchao's "
                 "ScaleCalculationMode: floor, rceil, even, ceil), bit for bit, in both backward GEMMs",
        "cannot": "other block sizes or element formats, rounding other than 'nearest', sparsity; it casts the "
                  "forward input and weight to MXFP8 too (MXFP8TrainingOpConfig)"},
    "nvfp4": {
        "keeps": "format e2m1fn in blocks of 16 with e4m3 scales under a float32 tensor scale, stochastic rounding "
                 "and hadamard 16 (the 'nvfp4_training' preset; NVFP4TrainingConfig(rht_sign_vector=gradstats' "
                 "signs): the same rotation) for the grad_weight GEMM",
        "cannot": "rounding other than 'stochastic', no Hadamard transform or another size, sparsity, the plan's one "
                  "quantised g in the grad_input GEMM (torchao quantises g along the channels there, without the "
                  "rotation), float32 quantisation (torchao casts to bfloat16 first); it casts the forward input "
                  "and weight to NVFP4 too, needs dims that are multiples of 128, and runs on CUDA SM100 only "
                  "(no emulation)"},
}
#: the float8 recipes ``to_torchao(recipe=...)`` builds from
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def torchao_float8() -> Any:
    try:
        import torchao.float8 as f8
    except ImportError as exc:                          # pragma: no cover - depends on the environment
        raise ImportError("a plan as torchao objects needs torchao (pip install torchao)") from exc
    return f8


def _cast(f8: Any, d: dict[str, Any]) -> Any:
    if d["scaling_type"] == "disabled":
        return f8.CastConfig(scaling_type=f8.ScalingType.DISABLED)
    return f8.CastConfig(scaling_type=f8.ScalingType(d["scaling_type"]),
                         scaling_granularity=f8.ScalingGranularity(d["scaling_granularity"]),
                         target_dtype=getattr(torch, d["target_dtype"]))


def _mx_shapes(configs: dict[str, Any], model: Any, strict: bool, emulate: bool = False) -> dict[str, Any]:
    """The configs without the MXFP8 layers whose features torchao cannot block by 32 (it casts
    the input along ``in_features`` and the gradient along ``out_features``), the NVFP4 layers whose
    features are not multiples of 128 (its Triton GEMMs' tiles) and, with ``emulate``, every NVFP4
    layer (torchao has no emulated NVFP4 training), listed once."""
    bad = {}
    if emulate:
        bad = {n: "torchao's NVFP4 training has no emulated GEMMs (KernelPreference.TRITON only, CUDA SM100)"
               for n, c in configs.items() if c.get("recipe") == "nvfp4"}
    modules: dict[str, Any] = {}
    if isinstance(model, nn.Module):
        from gradstats.wrappers import unwrap

        modules = dict(unwrap(model).named_modules())
    for name, cfg in configs.items():
        m = modules.get(name)
        need = {"mxfp8": cfg.get("block_size"), "nvfp4": 128}.get(cfg.get("recipe"))
        if need and m is not None and name not in bad:
            dims = (getattr(m, "in_features", 0), getattr(m, "out_features", 0))
            if any(d % need for d in dims):
                what = "MXFP8 casts" if cfg["recipe"] == "mxfp8" else "NVFP4 GEMMs (the tokens of a step too)"
                bad[name] = (f"in_features {dims[0]} and out_features {dims[1]} must be multiples of "
                             f"{need} for torchao's {what}")
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


def _nvfp4_config(cfg: dict[str, Any]) -> Any:
    try:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
        from torchao.quantization.quantize_.common import KernelPreference
    except ImportError as exc:                          # pragma: no cover - depends on the torchao release
        raise ImportError("this plan's NVFP4 layers need torchao's NVFP4 training "
                          "(torchao.prototype.moe_training.nvfp4_training, torchao >= 0.18)") from exc
    return NVFP4TrainingConfig(kernel_preference=KernelPreference[cfg["kernel_preference"].upper()],
                               rht_sign_vector=tuple(int(v) for v in cfg["rht_sign_vector"]))


def recipe_overrides(cfg: dict[str, Any], recipe: str = "tensorwise") -> tuple[dict[str, Any], list[str]]:
    """``(overrides, notes)``: the ``Float8LinearConfig`` fields that make torchao's ``recipe``
    (``Float8LinearConfig.from_recipe_name``) the float8 config ``cfg`` of a plan's torchao export,
    and what of the plan the recipe does not keep (empty for ``tensorwise``, which keeps a
    per-tensor plan; for the rowwise recipes the overrides only disable the gradient casts of a
    layer the plan leaves in high precision).

    Example:
        >>> import gradstats, torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> cfg = gradstats.Plan.uniform(format="e5m2", scale="amax").export("torchao", m)["configs"]["0"]
        >>> sorted(recipe_overrides(cfg)[0]), recipe_overrides(cfg, "rowwise")[1][0][:22]
        (['round_scales_to_power_of_2'], 'per-tensor scale of g:')
    """
    f8 = torchao_float8()
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"recipe must be one of torchao's float8 recipes {list(FLOAT8_RECIPES)}, got {recipe!r}")
    base = f8.Float8LinearConfig.from_recipe_name(recipe)
    go = cfg["cast_config_grad_output"]
    if go["scaling_type"] == "disabled":            # the plan keeps this layer's gradient in high precision
        off = f8.CastConfig(scaling_type=f8.ScalingType.DISABLED)
        return {k: off for k in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight",
                                 "cast_config_weight_for_grad_input", "cast_config_input_for_grad_weight")}, []
    dtype = getattr(torch, go["target_dtype"])
    if recipe == "tensorwise":
        want = {k: _cast(f8, v) for k, v in cfg.items() if k.startswith("cast_config_")}
        want["round_scales_to_power_of_2"] = bool(cfg.get("round_scales_to_power_of_2"))
        return {k: v for k, v in want.items() if getattr(base, k) != v}, []
    notes = [f"per-tensor scale of g: torchao's {recipe} recipe scales each row of g (a power of two each)"
             + ("" if recipe == "rowwise_with_gw_hp" else " for the grad_input GEMM and each column for the "
                "grad_weight GEMM")]
    if base.cast_config_grad_output.target_dtype != dtype:
        notes.append(f"format {go['target_dtype'].removeprefix('float8_')}: the {recipe} recipe casts g to "
                     f"{str(base.cast_config_grad_output.target_dtype).removeprefix('torch.float8_')}")
    if base.cast_config_grad_output_for_grad_weight.scaling_type is f8.ScalingType.DISABLED:
        notes.append(f"the {recipe} recipe keeps g in high precision for the grad_weight GEMM")
    notes.append(f"the {recipe} recipe casts the forward input and weight rowwise too")
    return {}, notes


def recipe_table(plan: Any, model: Any) -> Any:
    """Per layer of the plan resolved on ``model``: which torchao recipe (:data:`RECIPES`) keeps
    the plan's meaning for its gradient (``recipe``: ``"tensorwise"``, ``"mxfp8"``, ``"nvfp4"`` or None),
    whether exactly (``exact``: nothing of the gradient's treatment dropped), and the notes of
    what is not kept. A ``pandas.DataFrame``; warns nothing (the table is the report).

    Example:
        >>> import gradstats, torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        >>> recipe_table(gradstats.Plan.uniform(format="e5m2", scale="amax"), m)[["layer", "recipe", "exact"]]
          layer      recipe  exact
        0     0  tensorwise   True
    """
    import warnings

    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        doc = plan.export("torchao", model)
    rows = []
    for name in [*doc["configs"], *doc["skipped"]]:
        cfg = doc["configs"].get(name)
        if cfg is None:
            notes = [doc["skipped"][name]]
            rows.append((name, None, False, notes))
            continue
        notes = [n for n in doc["dropped"].get(name, []) if "forward" not in n]
        rows.append((name, cfg.get("recipe", "tensorwise"), not notes, notes))
    return pd.DataFrame(rows, columns=["layer", "recipe", "exact", "notes"])


def to_torchao(plan: Any, model: Any, *, emulate: bool = False, strict: bool = False, recipe: str = "tensorwise"
               ) -> list[tuple[Any, Callable[[nn.Module, str], bool]]]:
    """``[(config, module_filter_fn), ...]``: one pair per distinct config of the plan resolved on
    ``model`` (anything :meth:`gradstats.Plan.resolve` takes), a ``Float8LinearConfig``, an
    ``MXFP8TrainingOpConfig`` or an ``NVFP4TrainingConfig``; each filter selects the layers (by their
    names in ``model``) that config is for. ``emulate``: torchao's emulated GEMMs (CPU; NVFP4 layers,
    which torchao cannot emulate, are then skipped and listed). ``recipe``: the torchao float8
    recipe per-tensor layers are built from (:data:`FLOAT8_RECIPES`; ``"tensorwise"`` keeps the
    plan, the rowwise ones list what they change, as :func:`recipe_overrides`). Example: see the
    module."""
    f8 = torchao_float8()
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"recipe must be one of torchao's float8 recipes {list(FLOAT8_RECIPES)}, got {recipe!r}")
    doc = plan.export("torchao", model, strict=strict)
    configs = _mx_shapes(doc["configs"], model, strict, emulate)
    changed: dict[str, list[str]] = {}
    groups: dict[str, list[str]] = {}
    for name, cfg in configs.items():
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(name)
    out = []
    for key, names in groups.items():
        cfg = json.loads(key)
        chosen = frozenset(names)
        if cfg.get("recipe") in ("mxfp8", "nvfp4"):
            built = _mx_config(cfg, emulate) if cfg["recipe"] == "mxfp8" else _nvfp4_config(cfg)
            out.append((built, lambda module, fqn, chosen=chosen: fqn in chosen))
            continue
        overrides, notes = recipe_overrides(cfg, recipe)
        for n in notes:
            for name in names:
                changed.setdefault(name, []).append(n)
        config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), **overrides, emulate=emulate)
        out.append((config, lambda module, fqn, chosen=chosen: fqn in chosen))
    if changed:
        msg = f"export to torchao's {recipe} recipe: not expressible there:\n  " + "\n  ".join(
            f"{n}: {note}" for n, notes in changed.items() for note in dict.fromkeys(notes))
        if strict:
            raise ValueError(msg)
        import warnings

        warnings.warn(msg, stacklevel=2)
    return out


