"""The Transformer Engine target of :meth:`gradstats.plan.Plan.export` (``"te"``): a debug config
for NVIDIA's nvdlfw-inspect, the tool through which Transformer Engine (TE) lets a YAML file
change and watch, layer by layer, what its low-precision recipes do.

One section per layer, matched by a regex on the layer's name (``(^|\\.)NAME$``: the name, with
any prefix a wrapper adds):

- a layer the plan quantises to FP8 (``e4m3fn``, ``e5m2``; per tensor, or MX blocks of 32 with
  E8M0 scales): TE's ``FakeQuant`` on the ``gradient`` tensor of the two backward GEMMs
  (``dgrad``, ``wgrad``) with the matching ``quant_format`` (``FP8E4M3``, ``FP8E5M2``,
  ``MXFP8E4M3``, ``MXFP8E5M2``). FakeQuant quantises and dequantises the gradient and runs those
  GEMMs in high precision: the plan's numerics per layer, not FP8's speed (TE's recipes choose one
  gradient format for every layer; a per-layer choice is what FakeQuant is for);
- a layer the plan quantises to NVFP4 (``e2m1fn`` in blocks of 16 with E4M3 scales; the
  ``"nvfp4_training"`` preset): quantised by TE's own NVFP4 recipe (``NVFP4BlockScaling``, which the
  training runs under: the document's ``"recipe"`` says with which ``disable_rht`` and
  ``disable_stochastic_rounding``, one setting for every layer), with ``LogNvfp4TensorStats``
  (``underflows%``, ``mse``) of its gradient. TE's recipe is the published one: stochastic rounding
  of the gradient, a 16-point random Hadamard transform of the wgrad operands (its own sign vector),
  the dgrad operand quantised along the channels without it;
- a layer the plan leaves in high precision (the output layer, a rule without a format):
  ``DisableQuantizationGEMM`` for ``dgrad`` and ``wgrad``, so that its gradient GEMMs stay in
  high precision whatever the recipe (NVFP4's too);
- on both: ``LogTensorStats`` of the gradient (``min``, ``max``, ``mean``, ``std``, ``cur_amax``,
  ``dynamic_range``, and with blocks ``max_blockwise_dynamic_range``), every step.

What TE cannot express is reported, as for the other targets: formats other than FP8 and NVFP4
(FP6, other FP4 blocks), convolutions (TE quantises its Linear-type modules),
pruning, stochastic rounding, lognormal and fixed scales, scale shifts (TE's current scaling maps
the amax onto the format's maximum exactly, with a scale that is not a power of two), and the
E8M0 rounding rule of MX blocks (TE's MXFP8 quantiser applies its own).

With ``path=`` the document is written as the YAML file nvdlfw-inspect reads (:func:`te_yaml`).

The names, keys and values are those of TE's ``transformer_engine/debug/features`` (TE 2.x:
``FakeQuant``, ``DisableQuantizationGEMM``, ``LogTensorStats``, ``LogNvfp4TensorStats``) and of
``transformer_engine.common.recipe.NVFP4BlockScaling``; nvdlfw-inspect checks the feature names when it
loads the file, TE the keys and values when a layer first calls them.
"""
from __future__ import annotations

import re
from typing import Any

from gradstats.plan._rules import Rule
from gradstats.plan.export.base import EXPORT_SCHEMA, EXPORT_VERSION, Exporter, Resolved, register

#: the namespace TE registers its debug features under
TE_NAMESPACE = "transformer_engine"
#: the GEMMs (of TE's fprop, dgrad, wgrad) that consume the neural gradient
TE_GRADIENT_GEMMS = ("dgrad", "wgrad")
#: FakeQuant's quant_format per scheme layout (:attr:`gradstats.scheme.Scheme.layout`: a format per tensor, or an MX preset)
TE_FAKE_QUANT = {"e4m3fn": "FP8E4M3", "e5m2": "FP8E5M2", "mxfp8_e4m3": "MXFP8E4M3", "mxfp8_e5m2": "MXFP8E5M2"}
#: the statistics of the gradient each section logs (TE's LogTensorStats; plus the largest
#: per-block dynamic range where the plan has blocks)
TE_LOG_STATS = ("min", "max", "mean", "std", "cur_amax", "dynamic_range")
#: the statistics of an NVFP4 layer's quantised gradient (TE's LogNvfp4TensorStats)
TE_NVFP4_STATS = ("underflows%", "mse")
#: torch's convolutions: no TE counterpart
_CONVOLUTIONS = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")


def layer_regex(name: str) -> str:
    """The ``layer_name_regex_pattern`` of a layer: its name at the end, after any prefix.

    Example:
        >>> import re
        >>> bool(re.search(layer_regex("blocks.0.fc1"), "model.blocks.0.fc1")), bool(re.search(layer_regex("fc1"), "fc10"))
        (True, False)
    """
    return r"(^|\.)" + re.escape(name) + "$"


def _log(block: int | None) -> dict[str, Any]:
    stats: list[Any] = list(TE_LOG_STATS)
    if block is not None:
        stats.append({"max_blockwise_dynamic_range": {"block_size": int(block), "dims": 1}})
    return {"enabled": True, "tensors": ["gradient"], "stats": stats, "freq": 1}


def _is_nvfp4(r: Rule | None) -> bool:
    """Whether ``r`` quantises to NVFP4 blocks (e2m1fn, 16, E4M3 scales), with or without a Hadamard transform."""
    return r is not None and r.scheme is not None and r.scheme.layout.replace(hadamard=None).preset == "nvfp4"


def nvfp4_recipe(rules: Any) -> dict[str, Any] | None:
    """TE's ``NVFP4BlockScaling`` settings for the NVFP4 rules among ``rules`` (None if there are
    none): the random Hadamard transform and stochastic rounding on where any NVFP4 layer has them
    (TE sets them for every layer at once; the layers that differ are listed under ``dropped``).

    Example:
        >>> nvfp4_recipe([Rule(format="nvfp4_training")])
        {'recipe': 'NVFP4BlockScaling', 'disable_rht': False, 'disable_stochastic_rounding': False}
    """
    nv = [r for r in rules if _is_nvfp4(r)]
    if not nv:
        return None
    return {"recipe": "NVFP4BlockScaling", "disable_rht": not any(r.hadamard == 16 for r in nv),
            "disable_stochastic_rounding": not any(r.rounding == "stochastic" for r in nv)}


def _nvfp4_notes(r: Rule, recipe: dict[str, Any]) -> list[str]:
    notes = []
    if r.hadamard not in (None, 16):
        notes.append(f"hadamard {r.hadamard}: TE's random Hadamard transform is 16-point")
    if not recipe["disable_rht"] and r.hadamard is None:
        notes.append("no Hadamard transform: TE's NVFP4 recipe (disable_rht=False, for every layer) rotates g along "
                     "the tokens for the wgrad GEMM")
    if r.hadamard is not None:
        notes.append("the dgrad GEMM: TE quantises g along the channels without the rotation, where the plan feeds "
                     "both GEMMs its one rotated-quantised g; TE's sign vector is its own")
    sr = not recipe["disable_stochastic_rounding"]
    if (r.rounding == "stochastic") != sr:
        notes.append(f"rounding {r.rounding!r}: TE's NVFP4 recipe (disable_stochastic_rounding={not sr}, for every "
                     f"layer) rounds g {'stochastically' if sr else 'to nearest'}")
    notes.append("TE's NVFP4 recipe also quantises the layer's forward input and weight (16x16 weight blocks)")
    return notes


def te_section(name: str, r: Rule | None, types: tuple[str, ...] | None, skipped: dict[str, str],
               dropped: dict[str, list[str]], recipe: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The section of one layer (``r`` None: a layer the plan leaves in high precision), or None
    with the reason in ``skipped``; ``recipe``: :func:`nvfp4_recipe` of the plan's rules."""
    if types and any(t in _CONVOLUTIONS for t in types):
        skipped[name] = (f"{types[0]}: Transformer Engine quantises its Linear-type modules (te.Linear, "
                         "LayerNormLinear, LayerNormMLP...), not convolutions")
        return None
    features: dict[str, Any]
    notes: list[str] = []
    block = None
    if r is None or r.format is None:
        features = {"DisableQuantizationGEMM": {"enabled": True, "gemms": list(TE_GRADIENT_GEMMS)}}
    elif _is_nvfp4(r):
        block = r.block_size
        notes += _nvfp4_notes(r, recipe or nvfp4_recipe([r]) or {})
        features = {"LogNvfp4TensorStats": {"enabled": True, "tensors": ["gradient"], "stats": list(TE_NVFP4_STATS),
                                            "freq": 1}}
    else:
        block = r.block_size
        fmt = TE_FAKE_QUANT.get(str(r.scheme.layout)) if r.scheme is not None else None
        if fmt is None:
            what = f"{r.format}" + (f" in blocks of {block} ({r.scale_format} scales)" if block else " per tensor")
            skipped[name] = (f"{what}: Transformer Engine's FakeQuant has FP8E4M3, FP8E5M2 per tensor and "
                             "MXFP8E4M3, MXFP8E5M2 (blocks of 32, E8M0) only; its NVFP4 recipe e2m1fn in blocks "
                             "of 16 with e4m3 scales")
            return None
        features = {"FakeQuant": {"enabled": True, "gemms": list(TE_GRADIENT_GEMMS), "tensors": ["gradient"],
                                  "quant_format": fmt}}
        if block is None:
            if r.scale != "amax":
                notes.append(f"scale rule {r.scale!r}: TE scales each step's gradient by its amax")
            else:
                notes.append("amax scale: TE maps the amax onto the format's maximum exactly (a scale that is "
                             "not a power of two)" + (f"; scale_shift {r.scale_shift} dropped" if r.scale_shift else ""))
        elif r.scale_rounding not in (None, "floor"):
            notes.append(f"scale_rounding {r.scale_rounding!r}: TE's MXFP8 quantiser rounds its E8M0 scales its "
                         "own way")
        if r.rounding != "nearest":
            notes.append(f"rounding {r.rounding!r}: TE's FakeQuant rounds to nearest")
    if r is not None and r.prunes:
        notes.append(f"sparsity {r.sparsity} ({r.threshold_rule} threshold): Transformer Engine does not prune "
                     "gradients")
    if notes:
        dropped[name] = notes
    features["LogTensorStats"] = _log(block)
    return {"enabled": True, "layers": {"layer_name_regex_pattern": layer_regex(name)}, TE_NAMESPACE: features}


def section_name(i: int, name: str) -> str:
    """A YAML key for layer ``name`` (the i-th section): ``gradstats_3_blocks_0_fc1``."""
    return f"gradstats_{i}_" + re.sub(r"\W+", "_", name).strip("_")


def to_yaml(config: dict[str, Any], header: list[str]) -> str:
    """The config as YAML (PyYAML), after ``header`` lines as comments."""
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - PyYAML comes with the te extra
        raise ImportError("the 'te' export writes YAML through PyYAML: pip install pyyaml "
                          "(or pip install 'gradstats[te]')") from e
    head = "".join(f"# {line}\n" for line in header)
    return head + yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100)


@register
class TransformerEngineExporter(Exporter):
    """A Transformer Engine debug config for nvdlfw-inspect, written as YAML."""

    name = "te"
    aliases = ("transformer_engine",)
    target = "transformer_engine"
    help = "Transformer Engine's debug config for nvdlfw-inspect (YAML)"

    def body(self, plan: Any, model: Any, resolved: list[Resolved], skipped: dict[str, str],
             dropped: dict[str, list[str]]) -> dict[str, Any]:
        from gradstats.layers import module_candidates

        rules: dict[str, Rule | None] = {name: r for name, r, _ in resolved}
        out = plan.output_layer_of(model) if model is not None else (
            plan.output_layer if plan.output_layer not in (None, "auto") else None)
        if out is not None and out not in rules:
            rules[out] = None              # the plan leaves it in high precision
        types = dict(module_candidates(model)) if model is not None else {}
        recipe = nvfp4_recipe(rules.values())
        config: dict[str, Any] = {}
        for name, r in rules.items():
            sec = te_section(name, r, types.get(name), skipped, dropped, recipe)
            if sec is not None:
                config[section_name(len(config), name)] = sec
        return {"config": config, "skipped": skipped, "dropped": dropped,
                **({"recipe": recipe} if recipe is not None else {})}

    def text(self, doc: dict[str, Any]) -> str:
        return te_yaml(doc)


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
    rec = doc.get("recipe")
    if rec is not None:
        nv = [sec["layers"]["layer_name_regex_pattern"] for sec in doc["config"].values()
              if "LogNvfp4TensorStats" in sec[TE_NAMESPACE]]
        head.append(f"NVFP4 layers ({len(nv)}): train under te.autocast(recipe=transformer_engine.common.recipe."
                    f"NVFP4BlockScaling(disable_rht={rec['disable_rht']}, disable_stochastic_rounding="
                    f"{rec['disable_stochastic_rounding']})); the DisableQuantizationGEMM layers stay in high precision")
    head.append("use: nvdlfw_inspect.api.initialize(config_file=THIS_FILE, feature_dirs=[TE's "
                "transformer_engine/debug/features])")
    return to_yaml(doc["config"], head)
