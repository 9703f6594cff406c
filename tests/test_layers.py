"""gradstats.layers: the output layer and the layers feeding a BatchNorm, from a model's
structure, a traced run or a table of types; exact from one forward pass."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradstats
from gradstats.layers import batchnorm_inputs, layer_records, output_layer
from gradstats.models import build_model
from nets import Branchy


@pytest.mark.parametrize("name, shape", [("cnn", (4, 1, 28, 28)), ("resnet20", (2, 1, 28, 28))])
def test_structure_agrees_with_the_forward_pass_on_the_built_in_models(name, shape):
    model = build_model(name)
    exact = batchnorm_inputs(model, torch.randn(*shape))
    assert exact and batchnorm_inputs(model) == exact
    assert all(isinstance(dict(model.named_modules())[n], nn.Conv2d) for n in exact)


def test_models_without_batchnorm_have_no_batchnorm_inputs():
    for name in ("mlp", "transformer"):
        assert batchnorm_inputs(build_model(name)) == []


def test_a_run_gives_the_same_layers_in_call_order(tmp_path):
    model = build_model("cnn")
    with gradstats.trace(model, tmp_path / "run", sample_every=None) as t:
        nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
        t.step()
    run = gradstats.open_run(tmp_path / "run")
    assert batchnorm_inputs(run) == batchnorm_inputs(run.layer_info()) == ["conv1", "conv2"]
    assert output_layer(run) == "fc2" == output_layer(model)
    assert [r.name for r in layer_records(run)][:2] == ["conv1", "bn1"]


def test_widths_must_match_and_functional_ops_are_invisible_to_the_structure():
    net = Branchy()
    # the forward pass sees the ReLU between b and bn_b; the structure cannot
    assert batchnorm_inputs(net, torch.randn(5, 1, 8, 8)) == ["a", "fc"]
    assert batchnorm_inputs(net) == ["a", "b", "fc"]
    # a BatchNorm of another width is not the layer's own
    odd = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(4))
    assert batchnorm_inputs(odd) == []
    assert batchnorm_inputs({"conv": "Conv2d", "bn": "BatchNorm2d", "fc": "Linear"}) == ["conv"]


@pytest.mark.parametrize("call, match", [
    (lambda: batchnorm_inputs({"a": "Linear"}, torch.ones(1)), "needs a torch.nn.Module"),
    (lambda: batchnorm_inputs(3), "needs a torch.nn.Module, a Run or a layer table"),
    (lambda: output_layer(3.0), "come from a Run"),
    (lambda: layer_records({"a": 3}), "maps to a int")])
def test_bad_sources_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_old_import_path_still_works():
    from gradstats.pruning.allocation import output_layer as old

    assert old is output_layer
