"""gradstats.layers: the output layer and the layers feeding a BatchNorm, from a model's
structure, a traced run or a table of types; exact from one forward pass."""
from __future__ import annotations

import pytest
import torch
from nets import Branchy
from torch import nn

import gradstats
from gradstats.layers import (
    batchnorm_inputs,
    layer_records,
    matmul_layers,
    matmul_types,
    output_layer,
    register_matmul_type,
)
from gradstats.zoo.models import build_model


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


# --------------------------------------------------------------------------- matmul layers
class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(20, 16), nn.LSTM(16, 24, batch_first=True), nn.Linear(24, 20)

    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.head = nn.Linear(16, 20)

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


def test_matmul_layers_by_type_and_base_class():
    recs = {"wte": "Embedding", "h.attn.c_attn": "Conv1D", "ln": "LayerNorm", "proj": "NonDynamicallyQuantizableLinear",
            "mha": "MultiheadAttention", "rnn": "GRU", "head": "Linear"}
    assert matmul_layers(recs) == ["h.attn.c_attn", "proj", "mha", "rnn", "head"]
    assert matmul_layers(Encoder()) == ["block.self_attn", "block.self_attn.out_proj", "block.linear1",
                                        "block.linear2", "head"]


def test_a_run_records_base_classes_so_subclasses_are_selected(tmp_path):
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with gradstats.trace(model, tmp_path / "run", sample_every=None) as t:
        model(torch.randn(3, 4)).sum().backward()
        t.step()
    run = gradstats.open_run(tmp_path / "run")
    assert run.layer_info()["bases"][0][:1] == ["Linear"]
    assert matmul_layers(run) == ["0", "2"]
    assert sorted(gradstats.Plan.uniform(format="e4m3fn").resolve(run)) == ["0"]


def test_register_matmul_type(monkeypatch):
    monkeypatch.setattr("gradstats.layers._registered", [])

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            return x @ self.w

    model = nn.Sequential(Fused(), nn.Linear(4, 2))
    assert gradstats.Plan.uniform(format="e5m2").unplanned(model)["0"].startswith("not a matmul layer type: Fused")
    register_matmul_type(Fused)
    assert "Fused" in matmul_types()
    assert list(gradstats.Plan.uniform(format="e5m2").resolve(model)) == ["0"]
    with pytest.raises(ValueError, match="module class or a class name"):
        register_matmul_type(3)


def test_explain_says_what_is_planned_and_why_not(caplog):
    model = Encoder()
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5)
    ex = plan.explain(model).set_index("layer")
    assert ex.loc["block.self_attn", "planned"] and ex.loc["block.linear1", "planned"]
    assert "never called as a module" in ex.loc["block.self_attn.out_proj", "why"]
    assert ex.loc["emb", "why"].startswith("an embedding") and not ex.loc["emb", "planned"]
    assert ex.loc["block.norm1", "why"].startswith("a normalisation")
    assert ex.loc["head", "why"].startswith("the output layer")
    assert ex.loc["block.linear1", "rule"] == "e4m3fn nearest lognormal; sparsity 0.5 (histogram)"
    # one log line when the plan is applied
    with caplog.at_level("INFO", logger="gradstats.apply"):
        gradstats.apply(model, plan).remove()
    lines = [r.getMessage() for r in caplog.records if "not planned" in r.getMessage()]
    assert len(lines) == 1 and "emb" in lines[0] and "Plan.explain" in lines[0]
    # an LSTM language model: the LSTM is planned, the decoder is the output layer
    ex = gradstats.Plan.uniform(format="e5m2").explain(LSTMLM()).set_index("layer")
    assert ex["planned"].to_dict() == {"emb": False, "lstm": True, "head": False}


def test_apply_on_an_lstm_and_an_attention_block_changes_their_gradients():
    torch.manual_seed(0)
    for model in (LSTMLM(), Encoder()):
        x = torch.randint(0, 20, (4, 7))
        handle = gradstats.apply(model, gradstats.Plan.uniform(format="e2m1fn"))
        model(x).square().mean().backward()
        handle.remove()
        assert len(handle.summary()) >= 1 and (handle.summary()["format"] == "e2m1fn").all()
