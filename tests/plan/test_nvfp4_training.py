"""NVFP4 as the field trains it, through a plan: the "nvfp4_training" scheme as a rule (JSON round
trip), enforced by apply on the CPU path and on the device path (the same operator, bit for bit under
one seed), and exported to Transformer Engine (NVFP4 or high precision per layer) and as plain JSON."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import gradstats
from gradstats.ops import random as rng
from gradstats.ops.fused import prune_quantize
from gradstats.ops.hadamard import signs
from gradstats.plan import Plan, PlanEntry, Rule
from gradstats.plan.export import te_yaml


def test_the_rule_spells_the_preset_out_and_round_trips_through_plan_json(tmp_path):
    r = Rule(format="nvfp4_training")
    assert (str(r.format), r.block_size, r.scale_format, r.rounding, r.scale, r.hadamard) == \
        ("e2m1fn", 16, "e4m3", "stochastic", "amax", 16)
    assert r.scheme == gradstats.Scheme.parse("nvfp4_training") and r.scheme.hadamard == 16
    assert r == Rule(format="e2m1fn", scale="amax", block_size=16, scale_format="e4m3", rounding="stochastic",
                     hadamard=16)
    assert r.describe() == "e2m1fn stochastic amax (blocks of 16, e4m3 scales, Hadamard 16); no pruning"
    assert Rule(**r.to_dict()) == r and r.to_dict()["hadamard"] == 16
    plan = Plan.uniform(format="nvfp4_training", sparsity=0.5).with_entries(
        PlanEntry("head", format="nvfp4"), PlanEntry("mid", format="e4m3fn"))
    doc = json.loads(plan.to_json())
    assert doc["defaults"]["hadamard"] == 16 and doc["layers"][-2]["hadamard"] is None
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back.defaults == plan.defaults and back.entries == plan.entries
    rules = back.resolve({"body": "Linear", "head": "Linear", "mid": "Linear"})
    assert rules["body"].hadamard == 16 and rules["head"].hadamard is None     # a scheme sets the field
    assert rules["mid"].hadamard == 16 and str(rules["mid"].scheme.element) == "e4m3fn"   # a format inherits it
    # a plan written before the field existed loads without it
    del doc["defaults"]["hadamard"]
    for e in doc["layers"]:
        e.pop("hadamard", None)
    assert Plan.from_dict(doc).defaults.hadamard is None


@pytest.mark.parametrize("kw, match", [
    (dict(format="e4m3fn", hadamard=16), "set block_size"),
    (dict(format="nvfp4", hadamard=16), "contradicts it"),
    (dict(format="nvfp4_training", hadamard=32), "contradicts it"),
    (dict(format="e2m1fn", scale="amax", block_size=16, hadamard=24), "hadamard must be one of"),
])
def test_a_rule_with_a_bad_hadamard_names_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        Rule(**kw)
    assert Rule(format=None, hadamard=16).is_identity            # inert without a format, as blocks are


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _step(model, x, plan=None, seed=0):
    """One backward pass; returns (gradient at layer 0's output as it reaches the GEMMs, layer 0's
    input, the apply handle). A tensor hook registered after apply's sees what apply returned."""
    seen = {}

    def keep(module, inputs, output):
        seen["x"] = inputs[0]
        output.register_hook(lambda g: seen.__setitem__("g", g))

    handle = gradstats.apply(model, plan, seed=seed) if plan is not None else None
    h = model[0].register_forward_hook(keep)
    model(x).square().mean().backward()
    h.remove()
    if handle is not None:
        handle.settle()
    return seen["g"], seen["x"], handle


def test_apply_changes_the_gradient_as_quantize_does_on_the_cpu_path():
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    g, _, _ = _step(_model(), x)                                   # the gradient without the plan
    plan = Plan.uniform(format="nvfp4_training", layers=["0"])
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, inp, applied = _step(model, x, plan)
    applied.remove()
    seed = rng.draw_seed(torch.Generator().manual_seed(0))        # apply's first draw (seed=0)
    want = gradstats.quantize(g, "nvfp4_training", seed=seed)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(out, g)
    # what the layer's GEMMs then compute: the weight gradient (Q(R g))^T (R x) = out^T x
    torch.testing.assert_close(model[0].weight.grad, out.t() @ inp.detach(), rtol=1e-5, atol=1e-7)
    rec = applied.to_dataframe().iloc[0]
    assert rec["format"] == "e2m1fn" and rec["rounding"] == "stochastic" and abs(rec["gain"] - 1) < 0.1


@pytest.fixture
def device_path(interpreted, monkeypatch):
    from gradstats.ops.triton import triton_available

    if not triton_available():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")


def test_the_device_path_rounds_as_the_cpu_operator_under_the_same_seed(device_path):
    """On the device path (the Triton engine, interpreted on the CPU) a layer's first call seeds its
    statistics; the second is quantize(g, "nvfp4_training") at the call's seed, bit for bit the CPU
    path's operator (prune_quantize) at that seed."""
    x1, x2 = (torch.randn(40, 16, generator=torch.Generator().manual_seed(s)) for s in (2, 3))
    model = _model()
    plan = Plan.uniform(format="nvfp4_training", layers=["0"])
    seen = {}

    def before(module, inputs, output):    # prepended: its tensor hook runs before apply's
        output.register_hook(lambda g: seen.__setitem__("in", g))

    h = model[0].register_forward_hook(before, prepend=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        applied = gradstats.apply(model, plan, seed=5)
        first, _, _ = _step(model, x1)
        assert torch.equal(first, seen["in"])           # the first call passes unchanged (its statistics seed)
        out, _, _ = _step(model, x2)
        applied.remove()
    h.remove()
    g = seen["in"]
    seed = rng.mix64(rng.mix64(5) + 1) >> 2          # the first enforced call's seed (apply.device)
    assert applied.device_calls == 1
    want = gradstats.quantize(g, "nvfp4_training", seed=seed)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32)) and not torch.equal(out, g)
    cpu, _ = prune_quantize(g, 0.0, "nvfp4_training", seed=seed)      # the CPU path's operator
    assert torch.equal(out.view(torch.int32), cpu.view(torch.int32))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def test_the_te_export_chooses_nvfp4_or_high_precision_per_layer():
    plan = Plan.uniform(format="nvfp4_training").with_entries(PlanEntry("2", format=None))
    with pytest.warns(UserWarning, match="the dgrad GEMM: TE quantises g along the channels"):
        doc = plan.export("te", _mlp())
    secs = {s["layers"]["layer_name_regex_pattern"]: s["transformer_engine"] for s in doc["config"].values()}
    nv = [k for k, f in secs.items() if "LogNvfp4TensorStats" in f]
    hp = [k for k, f in secs.items() if "DisableQuantizationGEMM" in f]
    assert nv == [r"(^|\.)0$"] and hp == [r"(^|\.)2$", r"(^|\.)4$"]     # "2" planned full precision, "4" the output
    assert secs[nv[0]]["LogNvfp4TensorStats"] == {"enabled": True, "tensors": ["gradient"],
                                                  "stats": ["underflows%", "mse"], "freq": 1}
    assert all(secs[k]["DisableQuantizationGEMM"]["gemms"] == ["dgrad", "wgrad"] for k in hp)
    assert doc["recipe"] == {"recipe": "NVFP4BlockScaling", "disable_rht": False,
                             "disable_stochastic_rounding": False}
    text = te_yaml(doc)
    assert "NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False)" in text
    # NVFP4 without the recipe's transform and rounding: TE's recipe is set as the plan says, so only
    # the forward casts are noted; mixed, the recipe follows the recipe's layers and notes the others
    with pytest.warns(UserWarning) as caught:
        plain = Plan.uniform(format="nvfp4", rounding="nearest").export("te", _mlp())
    assert plain["recipe"] == {"recipe": "NVFP4BlockScaling", "disable_rht": True,
                               "disable_stochastic_rounding": True}
    assert plain["dropped"] == {n: ["TE's NVFP4 recipe also quantises the layer's forward input and weight "
                                    "(16x16 weight blocks)"] for n in ("0", "2")} and len(caught) == 1
    mixed = Plan.uniform(format="nvfp4_training").with_entries(PlanEntry("2", format="nvfp4", rounding="nearest"))
    with pytest.warns(UserWarning) as caught:
        m = mixed.export("te", _mlp())
    assert m["recipe"]["disable_rht"] is False and any("2: no Hadamard transform" in str(w.message) for w in caught)
    assert any("2: rounding 'nearest'" in str(w.message) for w in caught) and "0" not in [
        n for n, notes in m["dropped"].items() if any("rounding" in x for x in notes)]
    fp8 = Plan.uniform(format="e4m3fn", scale="amax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "recipe" not in fp8.export("te", _mlp())


def test_the_plain_json_export_carries_the_transform_and_its_signs():
    doc = Plan.uniform(format="nvfp4_training").export("json", _mlp())
    layer = doc["layers"]["0"]
    assert (layer["scheme"], layer["hadamard"], layer["rounding"]) == ("nvfp4_training", 16, "stochastic")
    assert layer["hadamard_signs"] == list(signs(16))
    other = Plan.uniform(format="nvfp4").export("json", _mlp())["layers"]["0"]
    assert other["hadamard"] is None and other["hadamard_signs"] is None


def test_recommend_plans_the_recipe_and_the_command_line_too(tmp_path, capsys):
    """recommend(bits=4, granularity="nvfp4_training"): every planned layer NVFP4 with stochastic
    rounding and the 16-point transform (or left in full precision by the check, with its reason),
    predicted from the replay on whole blocks, passing its own verify; `gradstats recommend` makes the
    same rules."""
    from gradstats.cli import main

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(32 * 8 * 8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradstats.trace(model, tmp_path / "run", sample_every=2) as t:
        for _ in range(6):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(64, 1, 8, 8)), torch.randint(0, 10, (64,))).backward()
            opt.step()
            t.step()
    plan = gradstats.recommend(tmp_path / "run", bits=4, granularity="nvfp4_training", noise_bound=None)
    rules = {n: r for n, r in plan.resolve(model).items() if r.quantizes}
    assert set(rules) == {"0", "3"}                    # the output layer stays in full precision
    for r in rules.values():
        assert (r.hadamard, r.rounding, r.block_size, r.scale_format) == (16, "stochastic", 16, "e4m3")
    assert all(c["predicted_from"] == "blocks" for c in plan.checks if c["layer"] in rules)
    assert plan.verify(tmp_path / "run").ok
    assert main(["recommend", str(tmp_path / "run"), "--bits", "4", "--granularity", "nvfp4_training",
                 "--noise-bound", "none", "-o", str(tmp_path / "plan.json")]) in (0, None)
    cli = gradstats.Plan.load(tmp_path / "plan.json").resolve(model)
    assert {n: r.describe() for n, r in cli.items()} == {n: r.describe() for n, r in plan.resolve(model).items()}
