"""Per-layer plans: validation, precedence, resolution against models and runs, JSON, exports."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradstats
from gradstats.formats import FPFormat
from gradstats.plan import CONV_LINEAR_TYPES, INHERIT, SCHEMA_VERSION, Plan, PlanEntry, Prediction, Provenance, Rule
from gradstats.zoo.models import build_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plan-format.md"


def _docs_example() -> dict:
    text = DOCS.read_text()
    return json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))


def _conv_linear(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]


# --------------------------------------------------------------------------- rules
def test_rule_defaults_and_properties():
    r = Rule()
    assert (r.format, r.scale, r.rounding, r.sparsity, r.threshold_rule, r.scale_shift) == (
        None, "lognormal", "nearest", None, "histogram", 0)
    assert r.is_identity and not r.quantizes and not r.prunes
    assert Rule(sparsity=0.0).is_identity  # a zero target prunes nothing
    r = Rule(format="fp8_e4m3fn", sparsity=0.85, rounding="stochastic")
    assert r.format == FPFormat(4, 3, special="fn") and r.quantizes and r.prunes
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.sparsity = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("kw, msg", [
    ({"format": "banana"}, "unknown format 'banana'"),
    ({"format": "e9m9"}, "format 'e9m9': FPFormat: e9m9 is wider than float32"),
    ({"format": "fp6_e4m3"}, "prefix says 6 bits"),
    ({"scale": "minmax"}, "unknown scale rule 'minmax'"),
    ({"rounding": "up"}, "unknown rounding 'up'"),
    ({"sparsity": 1.0}, "sparsity must lie in [0, 1)"),
    ({"sparsity": -0.1}, "sparsity must lie in [0, 1)"),
    ({"sparsity": float("nan")}, "sparsity must be finite"),
    ({"sparsity": "0.5"}, "sparsity must be a number"),
    ({"threshold_rule": "topk"}, "unknown threshold_rule 'topk'"),
    ({"scale": "fixed"}, "scale 'fixed' needs a scale_value"),
    ({"scale": "fixed", "scale_value": 0.0}, "scale_value must lie in (0, inf]"),
    ({"scale_value": 2.0}, "scale_value is used by scale 'fixed' only"),
    ({"block_size": 32}, "set scale to 'amax'"),
    ({"block_size": 0, "scale": "amax"}, "block_size must be a positive int"),
    ({"scale_format": "e4m3"}, "scale_format applies to block scaling only"),
    ({"block_size": 16, "scale": "amax", "scale_format": "ue4m3"}, "unknown scale_format"),
    ({"predicted": {"error": -1.0}}, "error must lie in [0, inf]"),
    ({"predicted": {"sigm": 1.0}}, "unknown key 'sigm'"),
])
def test_rule_validation_errors(kw, msg):
    with pytest.raises(ValueError) as exc:
        Rule(**kw)
    assert msg in str(exc.value)


def test_a_rule_made_again_is_checked_as_given():
    """Rules made again with the same fields reuse their checked values (one check per distinct rule), keyed by
    value and type: a field equal to a valid one but of another type is still checked, and still refused."""
    r1 = Rule(format="e2m1fn", scale="amax", block_size=1, sparsity=0.5)
    r2 = Rule(format="e2m1fn", scale="amax", block_size=1, sparsity=0.5)
    assert r1 == r2 and r2.scale_format == "e8m0" and r2.scheme == r1.scheme
    assert isinstance(r2.format, FPFormat) and r2.sparsity == 0.5
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        Rule(format="e2m1fn", scale="amax", block_size=True, sparsity=0.5)      # True == 1, but not an int
    assert Rule(format="e2m1fn", scale="amax", block_size=1, sparsity=np.float64(0.5)).sparsity == 0.5
    assert Rule(predicted={"error": 0.1}).predicted.error == 0.1            # a dict field: checked, not kept


def test_block_rule_defaults_to_mx_scale():
    r = Rule(format="e2m1fn", scale="amax", block_size=32)
    assert r.scale_format == "e8m0"
    assert r.scheme == gradstats.Scheme(FPFormat.parse("e2m1fn"), block_size=32, scale_format="e8m0", rounding="nearest")
    with pytest.raises(ValueError, match="no per-tensor scale"):
        r.scale_for(amax=1.0)
    assert Rule().scheme is None


def test_rule_kwargs_drive_quantize_exactly():
    """The rule's scheme plus scale_for give values of the format after unscaling."""
    rule = Rule(format="e3m2fn", scale="amax", rounding="stochastic")
    g = torch.randn(4096).mul(3).exp() * 1e-6
    s = rule.scale_for(amax=float(g.abs().max()))
    q = gradstats.quantize(g, rule.scheme, scale=s)
    values = set((FPFormat.parse("e3m2fn").values()).tolist())
    assert set((q.double() * s).tolist()) <= values
    assert float((g * s).abs().max()) <= rule.format.max


@settings(max_examples=60, deadline=None)
@given(amax=st.floats(1e-30, 1e30), name=st.sampled_from(["e4m3", "e5m2", "e3m2fn", "e2m1fn", "e4m3fn"]))
def test_amax_scale_is_the_largest_fitting_power_of_two(amax, name):
    rule = Rule(format=name, scale="amax")
    s = rule.scale_for(amax=amax)
    m, e = math.frexp(s)
    assert m == 0.5  # a power of two
    assert amax * s <= rule.format.max < amax * s * 2


def test_scale_for_edge_cases():
    r = Rule(format="e5m2", scale="amax")
    assert r.scale_for(amax=0.0) == 1.0 and r.scale_for(amax=float("nan")) == 1.0
    with pytest.raises(ValueError, match="needs amax"):
        r.scale_for()
    with pytest.raises(ValueError, match="needs mu= and sigma="):
        Rule(format="e5m2").scale_for(amax=1.0)
    assert Rule(format="e5m2", scale="fixed", scale_value=3.0).scale_for() == 3.0


# --------------------------------------------------------------------------- entries
def test_entry_fields_inherit_unless_set():
    e = PlanEntry("fc", format="e5m2", sparsity=None)
    assert e.rounding is INHERIT and e.overrides == {"format": FPFormat(5, 2), "sparsity": None}
    assert not e.is_pattern and PlanEntry("fc*").is_pattern and PlanEntry("re:fc[0-9]").is_pattern
    assert PlanEntry("layer[12].conv?").is_pattern
    assert e.to_dict() == {"layer": "fc", "format": "e5m2", "sparsity": None}
    assert "INHERIT" not in repr(e) and "format=FPFormat('e5m2')" in repr(e)


@pytest.mark.parametrize("kw, msg", [
    ({"layer": ""}, "layer must be a non-empty"),
    ({"layer": 3}, "layer must be a non-empty"),
    ({"layer": "re:(unclosed"}, "bad regular expression"),
    ({"layer": "fc", "types": []}, "types must be a non-empty list"),
    ({"layer": "fc", "format": "nope"}, "layer entry 'fc': unknown format 'nope'"),
])
def test_entry_validation_errors(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        PlanEntry(**kw)


def test_entry_matching():
    assert PlanEntry("layers.*").matches("layers.0.conv1")
    assert PlanEntry("layers.*").matches("layers.0")  # containers too, like trace(layers=...)
    assert not PlanEntry("*").matches("")  # never the model itself
    assert PlanEntry("re:fc\\d").matches("fc2") and not PlanEntry("re:fc\\d").matches("fc2x")
    assert PlanEntry("fc").matches("fc") and not PlanEntry("fc").matches("fc1")
    lin = PlanEntry("*", types=["Linear"])
    assert lin.matches("x", [c.__name__ for c in nn.LazyLinear.__mro__])
    assert not lin.matches("x", ["Conv2d", "_ConvNd", "Module"])
    with pytest.raises(ValueError, match="selects module types"):
        lin.matches("x")


# --------------------------------------------------------------------------- precedence
def test_precedence_exact_over_patterns_later_over_earlier():
    plan = Plan([
        PlanEntry("b", format="e5m2"),                 # exact, listed first
        PlanEntry("*", format="e4m3", sparsity=0.5),
        PlanEntry("b*", format="e3m2fn", rounding="stochastic"),
        PlanEntry("b", sparsity=None),                 # a second exact entry: field-wise
    ], defaults={"threshold_rule": "normal"})
    r = plan.resolve(["a", "b", "bb"])
    assert list(r) == ["a", "b", "bb"]
    assert (str(r["a"].format), r["a"].sparsity, r["a"].rounding) == ("e4m3", 0.5, "nearest")
    # b: '*' then 'b*' (patterns, in order), then both exact entries
    assert (str(r["b"].format), r["b"].sparsity, r["b"].rounding) == ("e5m2", None, "stochastic")
    assert (str(r["bb"].format), r["bb"].sparsity, r["bb"].rounding) == ("e3m2fn", 0.5, "stochastic")
    assert all(rule.threshold_rule == "normal" for rule in r.values())


def test_unmatched_modules_are_not_planned_and_unmatched_patterns_fail():
    plan = Plan([PlanEntry("fc*", sparsity=0.5), PlanEntry("conv9", format="e5m2")])
    with pytest.raises(ValueError) as exc:
        plan.resolve(["fc1", "fc2", "conv1"])
    assert "layer pattern 'conv9' matches no module" in str(exc.value) and "'conv1'" in str(exc.value)
    with pytest.warns(UserWarning, match="conv9"):
        got = plan.resolve(["fc1", "fc2", "conv1"], strict=False)
    assert list(got) == ["fc1", "fc2"]


def test_invalid_combinations_are_caught_early_or_at_resolution():
    # each entry completed by the defaults must be valid on its own ...
    with pytest.raises(ValueError, match=r"layers\[1\] \('fc'\) with the defaults: .*set scale to 'amax'"):
        Plan([PlanEntry("*", scale="amax"), PlanEntry("fc", block_size=32)])
    plan = Plan([PlanEntry("*", scale="amax"), PlanEntry("fc", scale="amax", block_size=32)])
    assert plan.resolve(["fc", "x"])["fc"].block_size == 32
    # ... and a cascade that combines badly is reported with the module and its entries
    plan = Plan([PlanEntry("f*", scale="fixed", scale_value=2.0), PlanEntry("fc", scale="lognormal")])
    with pytest.raises(ValueError, match=r"module 'fc' \(entries \['f\*', 'fc'\]\): scale_value is used by"):
        plan.resolve(["fc"])


# --------------------------------------------------------------------------- real models and runs
@pytest.mark.parametrize("name", ["cnn", "resnet20", "transformer", "mlp"])
def test_uniform_plans_every_conv_and_linear_layer(name):
    model = build_model(name)
    plan = Plan.uniform(format="e3m2fn", sparsity=0.85, rounding="stochastic", scale="lognormal")
    rules = plan.resolve(model)
    # the study's placement: the output layer (the logits) stays in full precision, unpruned
    out = gradstats.pruning.allocation.output_layer(model)
    assert out == _conv_linear(model)[-1] and plan.output_layer_of(model) == out
    assert list(rules) == _conv_linear(model)[:-1]
    # ... and pruning goes where the gradient enters a BatchNorm (the convolutions of the CNN and
    # ResNet-20); models without BatchNorm are pruned on every planned layer
    bn_fed = {"cnn": ["conv1", "conv2"], "resnet20": [n for n in _conv_linear(model) if "conv" in n or "shortcut" in n],
              "transformer": None, "mlp": None}[name]
    assert plan.pruned_layers_of(model) == bn_fed
    for n, r in rules.items():
        pruned = bn_fed is None or n in bn_fed
        assert r == Rule(format="e3m2fn", sparsity=0.85 if pruned else None, rounding="stochastic"), n
    every = Plan.uniform(format="e3m2fn", output_layer=False).resolve(model)
    assert list(every) == _conv_linear(model)
    # the defaults follow what trains: stochastic rounding at the amax scale up to 6 bits
    d = Plan.uniform(format="e3m2fn").defaults
    assert (d.rounding, d.scale, d.threshold_rule) == ("stochastic", "amax", "histogram")
    d8 = Plan.uniform(format="e4m3fn").defaults
    assert (d8.rounding, d8.scale) == ("nearest", "lognormal")
    assert Plan.from_dict(plan.to_dict()).output_layer == "auto"


def test_uniform_with_layers_and_ddp_style_wrapper():
    model = build_model("resnet20")
    plan = Plan.uniform(format="e5m2", layers=["layers.*.conv1", "fc"])
    names = list(plan.resolve(model))
    assert names == [n for n in _conv_linear(model) if n.endswith("conv1") and n.startswith("layers.")] + ["fc"]
    wrapped = type("DistributedDataParallel", (nn.Module,), {})()
    wrapped.module = model
    assert list(plan.resolve(wrapped)) == names
    with pytest.raises(ValueError, match="layers is empty"):
        Plan.uniform(layers=[])


def test_resolve_against_a_run_and_mappings(tmp_path):
    model = build_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradstats.trace(model, tmp_path / "run", layers=["conv1", "fc*", "bn1"]) as tracer:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 1, 28, 28)).logsumexp(1).mean().backward()
            opt.step()
            tracer.step()
    run = gradstats.open_run(tmp_path / "run")
    plan = Plan.uniform(format="e4m3")
    # bn1 is traced but not conv/linear; fc2, the output layer, is left in full precision
    assert list(plan.resolve(run)) == ["conv1", "fc1"]
    assert list(Plan.uniform(format="e4m3", output_layer=False).resolve(run)) == ["conv1", "fc1", "fc2"]
    assert list(plan.resolve({"a": "Linear", "b": nn.ReLU(), "c": nn.Conv1d})) == ["c"]
    assert list(plan.with_entries(PlanEntry("fc2", format="e5m2")).resolve(run)) == ["conv1", "fc1", "fc2"]
    with pytest.raises(ValueError, match="selects module types"):
        plan.resolve(["conv1"])
    with pytest.raises(ValueError, match="resolve a plan against"):
        plan.resolve(42)


def test_docs_example_loads_and_resolves_as_documented():
    plan = Plan.from_dict(_docs_example())
    rules = plan.resolve(build_model("cnn"))
    assert list(rules) == ["conv1", "conv2", "fc1", "fc2"]
    assert (str(rules["conv1"].format), rules["conv1"].scale, rules["conv1"].sparsity) == ("e5m2", "lognormal", None)
    assert (str(rules["conv2"].format), rules["conv2"].sparsity) == ("e4m3", 0.85)
    assert (rules["fc2"].format, rules["fc2"].sparsity) == (None, 0.85)
    fc1 = rules["fc1"]
    assert (str(fc1.format), fc1.scale, fc1.scale_value, fc1.rounding, fc1.sparsity) == \
        ("e4m3fn", "fixed", 4096.0, "stochastic", 0.85)
    assert plan.provenance.steps == (299, 299)


# --------------------------------------------------------------------------- JSON
def _rich_plan() -> Plan:
    return Plan([
        PlanEntry("*", types=CONV_LINEAR_TYPES),
        PlanEntry("re:layers\\.\\d+\\.0\\.conv1", rounding="stochastic"),
        PlanEntry("conv1", format="e5m2", scale="fixed", scale_value=0.125, sparsity=None,
                  predicted=Prediction(error=1.5e-3, mu=-12.25, sigma=2.5, p0=0.0, scale=1024.0)),
        PlanEntry("fc", format="e2m1fn", scale="amax", block_size=16, scale_format="e4m3",
                  threshold_rule="exact"),
    ], defaults=Rule(format="e4m3", sparsity=0.85),
        provenance=Provenance.now(source="runs/x", generator="test", steps=(3, 9)))


def test_save_load_round_trip(tmp_path):
    plan = _rich_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back == plan
    assert back.resolve(build_model("resnet20")) == plan.resolve(build_model("resnet20"))
    doc = json.loads(path.read_text())
    assert doc["schema"] == "gradstats.plan" and doc["version"] == SCHEMA_VERSION
    assert doc["layers"][2] == {"layer": "conv1", "format": "e5m2", "scale": "fixed", "scale_value": 0.125,
                                "sparsity": None, "predicted": {"error": 1.5e-3, "mu": -12.25, "sigma": 2.5,
                                                                "p0": 0.0, "scale": 1024.0}}
    assert doc["provenance"]["source"] == "runs/x" and doc["provenance"]["created"].endswith("Z")


_format_names = st.sampled_from([None, "e4m3", "e5m2", "e4m3fn", "e3m2fn", "e2m3fn", "e2m1fn", "e4m3b11fnuz",
                                 "e3m3_nosub", "bf16"])


@st.composite
def _entries(draw):
    kw = {}
    if draw(st.booleans()):
        kw["format"] = draw(_format_names)
    if draw(st.booleans()):
        kw["sparsity"] = draw(st.one_of(st.none(), st.floats(0.0, 0.999)))
    if draw(st.booleans()):
        kw["rounding"] = draw(st.sampled_from(["nearest", "stochastic", "toward_zero"]))
    if draw(st.booleans()):
        kw["threshold_rule"] = draw(st.sampled_from(["lognormal", "naive_lognormal", "normal", "laplace", "exact"]))
    if draw(st.booleans()):
        kw["scale"], kw["scale_value"] = "fixed", draw(st.floats(1e-30, 1e30))
    if draw(st.booleans()):
        kw["predicted"] = Prediction(error=draw(st.floats(0, 1)), sigma=draw(st.floats(0.01, 10)),
                                     mu=draw(st.floats(-80, 10)))
    layer = draw(st.sampled_from(["fc1", "fc*", "re:fc\\d", "conv?", "net.[13]"]))
    return PlanEntry(layer, **kw)


@settings(max_examples=40, deadline=None)
@given(entries=st.lists(_entries(), max_size=6), fmt=_format_names)
def test_json_round_trip_property(entries, fmt):
    plan = Plan(entries, defaults=Rule(format=fmt))
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back == plan
    names = ["fc1", "fc2", "conv1", "net.1", "net.3"]
    assert back.resolve(names, strict=False) == plan.resolve(names, strict=False)


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d.update(extra=1), "plan: unknown key 'extra'"),
    (lambda d: d["layers"][1].update(formt="e5m2"), "layers[1]: unknown key 'formt'"),
    (lambda d: d["defaults"].update(sparsty=0.5), "defaults: unknown key 'sparsty'"),
    (lambda d: d["defaults"].update(predicted={}), "defaults: unknown key 'predicted'"),
    (lambda d: d["provenance"].update(host="x"), "provenance: unknown key 'host'"),
    (lambda d: d["layers"][2]["predicted"].update(cosine=1.0), "layers[2]: layer entry 'fc2': predicted: unknown key 'cosine'"),
    (lambda d: d["layers"][1].update(format="e4m3fnx"), "layers[1]: layer entry 'conv1': unknown format 'e4m3fnx'"),
    (lambda d: d["layers"][1].update(scale="optimal"), "unknown scale rule 'optimal'"),
    (lambda d: d["layers"][3].update(rounding="even"), "unknown rounding 'even'"),
    (lambda d: d["defaults"].update(sparsity=1.5), "defaults: sparsity must lie in [0, 1)"),
    (lambda d: d.update(version=2), "plan schema version 2 is newer than this gradstats reads"),
    (lambda d: d.update(version=0), "bad plan schema version 0"),
    (lambda d: d.update(version="1"), "bad plan schema version '1'"),
    (lambda d: d.pop("version"), "bad plan schema version None"),
    (lambda d: d.update(schema="other"), "not a gradstats plan"),
    (lambda d: d["layers"][0].pop("layer"), "layers[0]: missing the 'layer' key"),
    (lambda d: d.update(layers={"a": 1}), "'layers' must be a list"),
])
def test_load_errors_name_the_file_place_and_problem(tmp_path, edit, msg):
    doc = _docs_example()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as exc:
        Plan.load(path)
    assert str(path) in str(exc.value) and msg in str(exc.value)


def test_load_missing_file_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no plan file"):
        Plan.load(tmp_path / "none.json")
    (tmp_path / "p.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(tmp_path / "p.json")


def test_plan_accepts_dicts_and_checks_types():
    plan = Plan([{"layer": "fc", "format": "e5m2"}], defaults={"rounding": "stochastic"}, provenance=None)
    assert plan.entries == (PlanEntry("fc", format="e5m2"),) and plan.defaults.rounding == "stochastic"
    with pytest.raises(ValueError, match="entries must be a list"):
        Plan("fc")
    with pytest.raises(ValueError, match=r"layers\[0\]: expected a PlanEntry"):
        Plan([3])
    with pytest.raises(ValueError, match="ISO 8601"):
        Provenance(created="yesterday")
    with pytest.raises(ValueError, match="steps must be"):
        Provenance(steps=(5, 2))


# --------------------------------------------------------------------------- views and exports
def test_to_dataframe_per_entry_and_per_module():
    plan = Plan.from_dict(_docs_example())
    df = plan.to_dataframe()
    assert list(df["layer"]) == ["*", "conv1", "fc2", "fc1"]
    assert list(df["match"]) == ["glob", "exact", "exact", "exact"]
    assert pd.isna(df.loc[2, "format"]) and df.loc[2, "sigma"] == 1.2
    per = plan.to_dataframe(build_model("cnn"))
    assert list(per["layer"]) == ["conv1", "conv2", "fc1", "fc2"]
    assert per.loc[0, "entries"] == [0, 1] and per.loc[2, "scale_value"] == 4096.0
    assert per["bits"].tolist()[:3] == [8, 8, 8] and pd.isna(per["bits"][3])


def test_export_json(tmp_path):
    plan = _rich_plan()
    model = build_model("resnet20")
    doc = plan.export("json", model, path=tmp_path / "e.json")
    assert json.loads((tmp_path / "e.json").read_text()) == doc
    assert list(doc["layers"]) == _conv_linear(model)
    c1 = doc["layers"]["conv1"]
    assert (c1["format"], c1["torch_dtype"], c1["scale_rule"], c1["scale"], c1["sparsity"]) == \
        ("e5m2", "float8_e5m2", "fixed", 0.125, None)
    assert c1["format_spec"]["max"] == 57344.0 and c1["format_spec"]["exp_bits"] == 5
    fc = doc["layers"]["fc"]
    assert (fc["format"], fc["block_size"], fc["scale_format"], fc["scale"], fc["threshold_rule"]) == \
        ("e2m1fn", 16, "e4m3", None, "exact")
    other = doc["layers"]["layers.0.0.conv2"]
    assert (other["format"], other["torch_dtype"], other["scale_rule"], other["sparsity"]) == \
        ("e4m3", None, "lognormal", 0.85)
    # without a model only exact names can be exported
    with pytest.raises(ValueError, match="pattern entries"):
        plan.export("json")
    exact = Plan([PlanEntry("a", format="e4m3fn", scale="lognormal",
                            predicted=Prediction(scale=256.0))])
    assert exact.export("json")["layers"]["a"]["scale"] == 256.0
    with pytest.raises(ValueError, match="unknown export target 'onnx'"):
        exact.export("onnx")


def test_export_torchao():
    model = nn.Sequential()
    model.add_module("conv", nn.Conv2d(1, 2, 3))
    for name in ("a", "b", "c", "d", "e"):
        model.add_module(name, nn.Linear(2, 2))
    plan = Plan([PlanEntry("a", format="e5m2", scale="amax"),
                 PlanEntry("b", format="e4m3fn", rounding="stochastic", sparsity=0.5),
                 PlanEntry("c", format=None, sparsity=0.9),
                 PlanEntry("d", format="e4m3"),       # ieee e4m3 (max 240): no torch dtype
                 PlanEntry("e", format="e4m3fn", scale="amax", block_size=32, scale_rounding="rceil"),
                 PlanEntry("f", format="e5m2", scale="amax", block_size=32),
                 PlanEntry("conv", format="e5m2")])
    model.add_module("f", nn.Linear(2, 2))
    with pytest.warns(UserWarning, match="not expressible"):
        doc = plan.export("torchao", model)
    assert doc["target"] == "torchao.float8" and sorted(doc["configs"]) == ["a", "b", "c", "e"]
    # MX e4m3fn blocks of 32: torchao's MXFP8 training recipe, with the plan's scale rounding
    assert doc["configs"]["e"] == {"recipe": "mxfp8", "scale_calculation_mode": "rceil", "block_size": 32,
                                   "elem_dtype": "float8_e4m3fn", "wgrad_with_hp": False}
    assert any("forward input and weight" in s for s in doc["dropped"]["e"])
    dyn = {"scaling_type": "dynamic", "scaling_granularity": "tensorwise"}
    assert doc["configs"]["a"] == {"cast_config_grad_output": {**dyn, "target_dtype": "float8_e5m2"},
                                   "cast_config_grad_output_for_grad_weight": {**dyn, "target_dtype": "float8_e5m2"},
                                   "round_scales_to_power_of_2": True}
    assert doc["configs"]["b"]["cast_config_grad_output"]["target_dtype"] == "float8_e4m3fn"
    off = {"scaling_type": "disabled"}
    assert doc["configs"]["c"] == {"cast_config_grad_output": off, "cast_config_grad_output_for_grad_weight": off,
                                   "cast_config_weight_for_grad_input": off,
                                   "cast_config_input_for_grad_weight": off, "round_scales_to_power_of_2": True}
    assert set(doc["skipped"]) == {"conv", "d", "f"} and "nn.Linear modules only" in doc["skipped"]["conv"]
    assert "no torchao.float8 counterpart" in doc["skipped"]["d"] and "e4m3fn in blocks of 32" in doc["skipped"]["f"]
    assert "a" not in doc["dropped"]
    assert any("stochastic" in s for s in doc["dropped"]["b"]) and any("sparsity 0.5" in s for s in doc["dropped"]["b"])
    assert any("lognormal" in s for s in doc["dropped"]["b"])
    assert any("does not prune" in s for s in doc["dropped"]["c"])
    with pytest.raises(ValueError, match="not expressible"):
        plan.export("torchao", model, strict=True)
    clean = Plan([PlanEntry("a", format="e5m2", scale="amax")])
    assert clean.export("torchao.float8", model, strict=True)["skipped"] == {}
    with pytest.raises(ValueError, match="needs each layer's module type"):
        clean.export("torchao")



def test_lossy_export_says_so_once(caplog, recwarn):
    """What an export drops is one UserWarning, not also a log record (seen twice otherwise)."""
    import logging

    model = nn.Sequential()
    model.add_module("a", nn.Linear(2, 2))
    plan = Plan([PlanEntry("a", format="e4m3fn", rounding="stochastic", sparsity=0.5)])
    with caplog.at_level(logging.DEBUG):
        doc = plan.export("torchao", model)
    assert doc["dropped"]["a"]
    shown = [w for w in recwarn.list if "not expressible" in str(w.message)]
    assert len(shown) == 1 and shown[0].category is UserWarning and shown[0].filename == __file__
    assert [r for r in caplog.records if "not expressible" in r.getMessage()] == []

def test_lognormal_scale_outside_float32_falls_back_to_the_amax_scale():
    """A very wide layer's population optimum lies below 2**-126; with the tensor's maximum known
    the rule takes the amax scale (the floor that governs anyway) instead of failing mid-training."""
    from gradstats.plan import Rule, amax_scale

    r = Rule(format="e2m3fn")
    with pytest.raises(ValueError, match="outside"):
        r.scale_for(mu=-5.0, sigma=9.0)
    assert r.scale_for(mu=-5.0, sigma=9.0, amax=3e-2) == amax_scale(r.format, 3e-2) == 128.0


def test_scale_shift_is_relative_to_the_running_amax():
    r = Rule(format="e3m2fn", scale="amax", scale_shift=-2)
    assert r.scale_for(amax=1.0) == Rule(format="e3m2fn", scale="amax").scale_for(amax=1.0) / 4
    assert r.scale_for(amax=1e-3) == Rule(format="e3m2fn", scale="amax").scale_for(amax=1e-3) / 4
    assert Rule.from_dict(r.to_dict()) == r if hasattr(Rule, "from_dict") else r.to_dict()["scale_shift"] == -2
    with pytest.raises(ValueError, match="scale_shift"):
        Rule(format="e3m2fn", scale="lognormal", scale_shift=1)
    with pytest.raises(ValueError, match="scale_shift"):
        Rule(format="e3m2fn", scale="amax", scale_shift=1.5)
    plan = Plan([PlanEntry("a", format="e4m3fn", scale="amax", scale_shift=-1)])
    again = Plan.from_dict(plan.to_dict())
    assert again.resolve(["a"])["a"].scale_shift == -1


# --------------------------------------------------------------------------- prune_at
def test_prune_at_keeps_pruning_where_the_gradient_enters_a_batchnorm():
    model = build_model("cnn")
    plan = Plan.uniform(format="e4m3fn", sparsity=0.85)
    assert plan.prune_at == "auto"
    rules = plan.resolve(model)
    assert {n: r.sparsity for n, r in rules.items()} == {"conv1": 0.85, "conv2": 0.85, "fc1": None}
    assert str(rules["fc1"].format) == "e4m3fn"                 # quantised, not pruned
    # pruning alone: a layer left with nothing to do is not planned
    assert list(Plan.uniform(sparsity=0.85).resolve(model)) == ["conv1", "conv2"]
    # an entry naming a layer exactly and setting sparsity still prunes it
    named = plan.with_entries(PlanEntry("fc1", sparsity=0.5)).resolve(model)
    assert named["fc1"].sparsity == 0.5
    # no restriction: False, a named selection, a plan of entries, a list target
    assert all(r.sparsity == 0.85 for r in Plan.uniform(sparsity=0.85, prune_at=False).resolve(model).values())
    assert Plan.uniform(sparsity=0.85, layers=["conv1", "fc1"]).prune_at is None
    assert Plan([PlanEntry("*", sparsity=0.5)]).prune_at is None
    assert plan.pruned_layers_of(["conv1", "fc1"]) is None
    # strict: only the BatchNorm inputs, none on a model without them
    strict = Plan.uniform(sparsity=0.85, prune_at="batchnorm_inputs")
    assert strict.resolve(build_model("mlp")) == {}
    assert list(Plan.uniform(sparsity=0.85).resolve(build_model("mlp")))       # auto: everywhere
    # without pruning nothing is recorded; the document keeps it
    assert Plan.uniform(format="e4m3fn").prune_at is None
    assert Plan.from_dict(plan.to_dict()) == plan and plan.to_dict()["prune_at"] == "auto"
    with pytest.raises(ValueError, match="prune_at must be one of"):
        Plan([], prune_at="everywhere")


# --------------------------------------------------------------------------- explaining, views
class _Proj(nn.Module):
    """A matmul layer of a type gradstats does not know (not registered)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) / n ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_a_recommended_plan_explains_the_layers_it_leaves_out_as_uniform_does(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), _Proj(16), nn.Linear(16, 4))
    with gradstats.trace(model, tmp_path / "run", sample_every=None) as tr:
        for _ in range(2):
            model(torch.randint(0, 10, (32,))).square().mean().backward()
            tr.step()
    plan = gradstats.recommend(tmp_path / "run", bits=8)
    why = dict(zip(*plan.explain(model)[["layer", "why"]].T.values))
    uniform = dict(zip(*Plan.uniform(format="e4m3fn").explain(model)[["layer", "why"]].T.values))
    assert why["0"].startswith("an embedding") and why["2"].startswith("a normalisation")
    assert "register_matmul_type(_Proj)" in why["3"]
    assert {k: why[k] for k in "023"} == {k: uniform[k] for k in "023"}
    assert "no entry of the plan selects it" not in why.values()
    # a plan whose entries name layers by hand still says that none names the layer
    named = Plan([PlanEntry("1", format="e4m3fn")])
    assert named.explain(model).set_index("layer").loc["2", "why"] == "no entry of the plan selects it"


def test_a_plan_made_for_another_model_says_so():
    plan = gradstats.recommend(gradstats.zoo.data.data_dir() / "sample-run", bits=8)   # the CNN's conv1, conv2, fc1
    model = build_model("transformer")
    with pytest.warns(UserWarning, match="seems made for another model") as rec:
        assert plan.resolve(model, strict=False) == {}
    text = str(rec[0].message)
    assert "3 of its 3 entries" in text and "'conv1'" in text and "'blocks.0.attn.q_proj'" in text
    assert len(text) < 400                                # a few names, not every module
    with pytest.raises(ValueError, match="seems made for another model"):
        plan.resolve(model)
    # one entry of three missing is a typo to name, not another model
    with pytest.warns(UserWarning, match="layer pattern 'fc9' matches no module"):
        Plan([PlanEntry("conv1", format="e4m3fn"), PlanEntry("conv2", format="e4m3fn"),
              PlanEntry("fc9", format="e4m3fn")]).resolve(build_model("cnn"), strict=False)


def test_to_dataframe_shows_the_sparsity_applied_and_why():
    run = gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run")
    plan = gradstats.recommend(run, bits=8, sparsity=0.85)
    assert plan.prune_at == "auto" and plan.pruned_layers_of(run) == ["conv1", "conv2"]
    for df in (plan.to_dataframe(), plan.to_dataframe(run)):
        df = df.set_index("layer")
        assert df.loc["conv1", "sparsity"] == 0.85 and df.loc["conv1", "sparsity_note"] == ""
        assert pd.isna(df.loc["fc1", "sparsity"])                  # prune_at never prunes fc1
        assert df.loc["fc1", "sparsity_note"].startswith("not pruned: prune_at='auto'")
    assert plan.resolve(run)["fc1"].sparsity is None               # what the views say is what applies
    # an entry naming a layer and its sparsity is pruned wherever it is
    named = plan.with_entries(PlanEntry("fc1", sparsity=0.5)).to_dataframe(run).set_index("layer")
    assert named.loc["fc1", "sparsity"] == 0.5 and named.loc["fc1", "sparsity_note"] == ""
    # a pattern plan says that prune_at decides per layer, and the model resolves it
    note = Plan.uniform(format="e4m3fn", sparsity=0.85).to_dataframe()["sparsity_note"][0]
    assert "prune_at='auto'" in note and "to_dataframe(model)" in note


# ----------------------------------------------------------------------------- schemes as formats
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "nvfp4"])
def test_rule_and_uniform_plan_take_a_scheme(name):
    from gradstats.scheme import Scheme

    s = Scheme.parse(name)
    r = Rule(format=name)
    assert r.scheme == s and r.format == s.element and r.block_size == s.block_size
    assert r.scale == "amax" and r.scale_format == s.scale_format_name and r.scale_rounding is None
    assert r == Rule(format=str(s.element), scale="amax", block_size=s.block_size, scale_format=s.scale_format_name)
    assert r.scheme.to_dict() == s.to_dict()
    plan = Plan.uniform(format=name)
    assert plan.defaults.scheme.replace(rounding="nearest") == s
    assert Plan.from_dict(json.loads(plan.to_json())).defaults == plan.defaults
    assert PlanEntry("fc", format=s).overrides["block_size"] == s.block_size


def test_rule_scheme_with_changes_and_contradictions():
    r = Rule(format="mxfp8_e4m3:scale_rounding=rceil:rounding=stochastic")
    assert (r.scale_rounding, r.rounding, r.block_size) == ("rceil", "stochastic", 32)
    assert Rule(format="e4m3fn").scheme == __import__("gradstats").Scheme("e4m3fn")
    assert Rule().scheme is None
    with pytest.raises(ValueError, match="format 'nvfp4' sets block_size 16; block_size 32 contradicts it"):
        Rule(format="nvfp4", block_size=32)
    with pytest.raises(ValueError, match="layer entry 'fc': format 'mxfp4' sets scale 'amax'"):
        PlanEntry("fc", format="mxfp4", scale="fixed")
