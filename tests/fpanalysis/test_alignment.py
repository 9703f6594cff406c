"""fpanalysis.weight_gradient_alignment: the exact weight gradient of a layer feeding a BatchNorm
is orthogonal to its weights per channel; a biased gradient format breaks that, an unbiased one
keeps it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from nets import Branchy
from torch import nn

import gradstats
from gradstats.fpanalysis import AlignmentResult, batchnorm_inputs, weight_gradient_alignment
from gradstats.zoo.training import prepare


def test_batchnorm_inputs_are_the_layers_whose_output_a_batchnorm_reads():
    net = Branchy()
    assert batchnorm_inputs(net, torch.randn(5, 1, 8, 8)) == ["a", "fc"]
    assert all(p.grad is None for p in net.parameters())        # no gradients, no state left behind
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


def test_exact_gradients_are_orthogonal_with_a_bias_too():
    """Conv and linear with a bias behind BatchNorm: <w_c, dW_c> = 0 up to BatchNorm's eps (the
    invariance is exact for eps -> 0: with eps = 1e-300 to rounding); not for the layers behind it."""
    torch.manual_seed(0)
    net = Branchy().double()
    nn.functional.cross_entropy(net(torch.randn(16, 1, 8, 8, dtype=torch.double)),
                                torch.randint(0, 3, (16,))).backward()
    a = weight_gradient_alignment(net)
    assert a.layers == ["a", "b", "fc", "head"]
    assert a.max_abs_cos["a"] < 1e-3 and a.max_abs_cos["fc"] < 1e-3
    assert a.mean_abs_cos["b"] > 1e-3 and a.mean_abs_cos["head"] > 1e-3
    df = a.to_dataframe()
    assert df.set_index("layer").loc["a", "channels"] == 4 and set(df.columns) >= {"mean_abs_cos", "max_abs_cos"}
    d = a.to_dict()
    assert len(d["cos"]["fc"]) == 6 and d["mean_abs_cos"]["a"] == a.mean_abs_cos["a"]
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eps = 1e-300
    net.zero_grad()
    nn.functional.cross_entropy(net(torch.randn(16, 1, 8, 8, dtype=torch.double)),
                                torch.randint(0, 3, (16,))).backward()
    a = weight_gradient_alignment(net)
    assert a.max_abs_cos["a"] < 1e-10 and a.max_abs_cos["fc"] < 1e-10 and a.mean_abs_cos["b"] > 1e-3


def test_a_zero_channel_is_nan_not_a_division_error():
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight[1] = 0
    lin(torch.ones(4, 3)).sum().backward()
    c = weight_gradient_alignment(lin, ["(root)"]).cos["(root)"]
    assert math.isnan(c[1]) and np.isfinite(c[0])


@pytest.mark.parametrize("call, match", [
    (lambda: weight_gradient_alignment(nn.Linear(2, 2)), "run a backward pass first"),
    (lambda: weight_gradient_alignment(nn.Sequential(nn.Linear(2, 2)), ["nope"]), "not a module of the model"),
    (lambda: weight_gradient_alignment("model"), "needs a torch.nn.Module"),
    (lambda: batchnorm_inputs(3), "needs a torch.nn.Module")])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.fixture(scope="module")
def trained_cnn():
    task = prepare("cnn", seed=0, source="subset", subset=1024, test_subset=100)
    task.run(30, progress=False)
    return task.model, task.train_data.images[:128], task.train_data.labels[:128]


def alignment_under(model, x, y, plan):
    model.zero_grad()
    handle = gradstats.apply(model, plan, underflow_bound=None) if plan is not None else None
    nn.functional.cross_entropy(model(x), y).backward()
    if handle is not None:
        handle.remove()
    return weight_gradient_alignment(model, ["conv1", "conv2"])


def test_the_diagnostic_separates_a_biased_format_from_an_unbiased_one(trained_cnn):
    """The CNN after 30 steps: exact ~0; e3m2fn round-to-nearest at the MSE-optimal scale (which
    flushes most values) tilts conv1's gradient by |cos| ~ 0.3; the same format with stochastic
    rounding at the amax scale stays several times lower."""
    model, x, y = trained_cnn
    assert batchnorm_inputs(model, x) == ["conv1", "conv2"]
    layers = ["conv1", "conv2", "fc1"]
    exact = alignment_under(model, x, y, None)
    nearest = alignment_under(model, x, y, gradstats.Plan.uniform(format="e3m2fn", rounding="nearest",
                                                                   scale="lognormal", layers=layers))
    sr = alignment_under(model, x, y, gradstats.Plan.uniform(format="e3m2fn", rounding="stochastic",
                                                              scale="amax", layers=layers))
    assert max(exact.max_abs_cos.values()) < 1e-3
    assert nearest.mean_abs_cos["conv1"] > 0.15
    assert nearest.mean_abs_cos["conv1"] > 4 * sr.mean_abs_cos["conv1"]
    assert nearest.mean_abs_cos["conv2"] > 4 * sr.mean_abs_cos["conv2"]


def test_plot_shows_each_label(trained_cnn, tmp_path):
    model, x, y = trained_cnn
    exact = alignment_under(model, x, y, None)
    from gradstats.plots.fpanalysis import plot_weight_alignment

    fig = plot_weight_alignment({"exact": exact, "again": exact},
                                path=tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["exact", "again"]
    assert isinstance(exact, AlignmentResult) and exact.plot().axes[0].get_ylim() == (0.0, 1.0)
