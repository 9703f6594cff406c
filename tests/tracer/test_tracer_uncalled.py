"""Traced modules whose weights get gradients although the module is never called (weights used
functionally): named once in a warning, in the run's manifest and in a plan's explain."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradstats


class SideWeights(nn.Module):
    """``side``'s weight is used functionally: the module itself is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)           # neither called nor used: no gradient, not named
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = h + F.linear(h, self.side.weight)
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(h)


class Mixer(nn.Module):
    """Like transformers' Mamba mixer: owns parameters, is called, and uses a child's weight itself."""

    def __init__(self) -> None:
        super().__init__()
        self.D = nn.Parameter(torch.ones(8))
        self.dt_proj = nn.Linear(8, 8)
        self.out_proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.linear(x, self.dt_proj.weight) * self.D)


def _steps(model: nn.Module, path, steps: int = 3, **kw) -> "gradstats.Run":
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradstats.trace(model, path, optimizer=opt, **kw):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 5, 8)).square().mean().backward()
            opt.step()
    return gradstats.open_run(path)


def _warnings(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "never called" in r.getMessage() and name in r.getMessage()]


def test_a_module_used_functionally_is_named_once(tmp_path, caplog):
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        run = _steps(SideWeights(), tmp_path, sample_every=1)
    said = _warnings(caplog, "side")
    assert len(said) == 1 and "side (Linear)" in said[0] and "cannot be traced or planned" in said[0]
    assert not _warnings(caplog, "unused") and not _warnings(caplog, "out_proj")
    assert run.manifest["uncalled"] == {"side": "Linear"}
    why = gradstats.Plan.uniform(sparsity=0.5).explain(run).set_index("layer")
    assert why.loc["side", "type"] == "Linear" and not why.loc["side", "planned"]
    assert why.loc["side", "why"].startswith("never called as a module: its weights are used functionally")
    assert "side" in gradstats.Plan.uniform(sparsity=0.5).unplanned(run)
    # the run's path, as recommend and every stage that reads a run take it, explains the same
    plan = gradstats.recommend(run.path, bits="auto")
    assert plan.explain(run.path).equals(plan.explain(run)) and "side" in set(plan.explain(str(run.path))["layer"])
    with pytest.raises(ValueError, match="which holds no run"):
        plan.explain(str(tmp_path / "nowhere"))


def test_multihead_attentions_out_proj_is_not_named(tmp_path, caplog):
    """The attention module is called and applies its out_proj's weights itself: it stands for it."""
    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2, batch_first=True))
    model.forward = lambda x: model[1](*(3 * (model[0](x),)), need_weights=False)[0]
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        run = _steps(model, tmp_path, sample_every=1)
    assert not _warnings(caplog, "out_proj") and "uncalled" not in run.manifest
    assert model[1].out_proj.weight.grad is not None          # it did get a gradient
    assert "1.out_proj" not in set(gradstats.Plan.uniform(sparsity=0.5).explain(run)["layer"])


def test_an_attention_left_untraced_does_not_stand_for_its_out_proj(tmp_path, caplog):
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        run = _steps(SideWeights(), tmp_path, layers=["a", "attn.out_proj", "head"])
    assert len(_warnings(caplog, "attn.out_proj")) == 1
    assert run.manifest["uncalled"] == {"attn.out_proj": "NonDynamicallyQuantizableLinear"}


def test_a_called_ancestor_that_is_not_a_matmul_layer_does_not_cover(tmp_path, caplog):
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        run = _steps(Mixer(), tmp_path)
    assert run.layers == ["(root)", "out_proj"]
    assert run.manifest["uncalled"] == {"dt_proj": "Linear"} and len(_warnings(caplog, "dt_proj")) == 1


def test_found_without_noise_records_and_kept_by_a_resumed_run(tmp_path, caplog):
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        _steps(SideWeights(), tmp_path, steps=1, noise=False)      # the optimizer's step still closes it
    assert len(_warnings(caplog, "side")) == 1
    model = SideWeights()
    model.forward = lambda x: model.head(model.a(x))                 # side no longer used at all
    run = _steps(model, tmp_path, steps=1, resume=True)
    assert run.manifest["uncalled"] == {"side": "Linear"}


def test_a_run_written_before_has_no_uncalled_layers(tmp_path):
    run = _steps(SideWeights(), tmp_path, steps=1)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["uncalled"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    why = gradstats.Plan.uniform(sparsity=0.5).explain(gradstats.open_run(tmp_path))
    assert "side" not in set(why["layer"]) and "side" in set(gradstats.Plan.uniform(sparsity=0.5).explain(run)["layer"])
