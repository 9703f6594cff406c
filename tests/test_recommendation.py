"""Recommendations from runs: statistics used, format/scale/error choices, pruning, speed, CLI."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import nn

import gradstats
from gradstats import fpanalysis, pruning
from gradstats.cli import main
from gradstats.data import load_fashion_mnist
from gradstats.models import build_model
from gradstats.plan import Plan
from gradstats.recommendation import layer_moments, recommend
from gradstats.training import train

STEPS = 5


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    """A real run: the CNN (with BatchNorm) trained on Fashion-MNIST, every gradient of its conv and
    linear layers also captured by our own hooks (step -> layer -> tensor)."""
    torch.manual_seed(0)
    model = build_model("cnn", seed=0)
    path = tmp_path_factory.mktemp("rec") / "cnn"
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    captured: dict[int, dict[str, list[torch.Tensor]]] = {}
    state = {"step": 0}
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]

    def hook(name):
        def fwd(_m, _i, out):
            out.register_hook(lambda g: captured.setdefault(state["step"], {}).setdefault(name, []).append(
                g.detach().clone()))
        return fwd

    handles = [dict(model.named_modules())[n].register_forward_hook(hook(n)) for n in names]
    data = load_fashion_mnist(source="subset", subset=512)
    with gradstats.trace(model, path, optimizer=opt, sample_every=None):
        train(model, data, steps=STEPS, batch_size=64, optimizer=opt, progress=False,
              callback=lambda step, loss: state.update(step=step + 1))
    for h in handles:
        h.remove()
    grads = {s: {n: torch.cat([t.reshape(-1) for t in ts]) for n, ts in d.items()} for s, d in captured.items()}
    return model, gradstats.open_run(path), grads, names


def _moments_of(g: torch.Tensor) -> tuple[float, float, float]:
    g = g.double()
    nz = g[g != 0].abs().log()
    return float(nz.mean()), float(nz.std(unbiased=False)), float((g == 0).double().mean())


# --------------------------------------------------------------------------- statistics used
def test_layer_moments_latest_step_match_the_gradients(cnn_run):
    model, run, grads, names = cnn_run
    df = layer_moments(run)
    assert list(df["layer"]) == names  # conv and linear only; the traced BatchNorms are left out
    assert (df["first_step"] == STEPS - 1).all() and (df["last_step"] == STEPS - 1).all()
    for _, row in df.iterrows():
        mu, sigma, p0 = _moments_of(grads[STEPS - 1][row["layer"]])
        assert row["mu"] == pytest.approx(mu, rel=1e-5)
        assert row["sigma"] == pytest.approx(sigma, rel=1e-4)
        assert row["p0"] == pytest.approx(p0, abs=1e-12)
        assert row["amax"] == pytest.approx(float(grads[STEPS - 1][row["layer"]].abs().max()), rel=1e-7)


def test_layer_moments_of_a_step_and_of_merged_steps(cnn_run):
    model, run, grads, names = cnn_run
    one = layer_moments(run, step=1, layers=["conv*"])
    assert list(one["layer"]) == ["conv1", "conv2"]
    assert one["mu"][0] == pytest.approx(_moments_of(grads[1]["conv1"])[0], rel=1e-5)
    merged = layer_moments(run, step=(1, 3), layers="fc1")
    g = torch.cat([grads[s]["fc1"] for s in (1, 2, 3)])
    mu, sigma, p0 = _moments_of(g)
    assert merged["mu"][0] == pytest.approx(mu, rel=1e-5) and merged["sigma"][0] == pytest.approx(sigma, rel=1e-4)
    assert merged["p0"][0] == pytest.approx(p0, abs=1e-12)
    assert (int(merged["first_step"][0]), int(merged["last_step"][0]), int(merged["n"][0])) == (1, 3, g.numel())
    assert layer_moments(run, step=range(1, 4), layers="fc1")["mu"][0] == merged["mu"][0]


@pytest.mark.parametrize("kw, msg", [
    ({"step": 99}, "no 'grad' statistics at step 99 for layers"),
    ({"step": (3, 1)}, "step must be None"),
    ({"step": "last"}, "step must be None"),
    ({"layers": ["nope*"]}, r"'nope\*' matches no traced layer"),
])
def test_layer_moments_errors(cnn_run, kw, msg):
    with pytest.raises(ValueError, match=msg):
        layer_moments(cnn_run[1], **kw)


# --------------------------------------------------------------------------- recommendations
def test_recommend_picks_the_best_format_and_scale_per_layer(cnn_run):
    model, run, grads, names = cnn_run
    plan = recommend(run, bits=8)
    assert isinstance(plan, Plan) and [e.layer for e in plan.entries] == names
    assert plan.provenance.source == str(run.path) and plan.provenance.steps == (STEPS - 1, STEPS - 1)
    assert "bits=8" in plan.provenance.generator
    rules = plan.resolve(model)
    assert list(rules) == names
    df = layer_moments(run)
    for (_, row), (name, rule) in zip(df.iterrows(), rules.items()):
        p = rule.predicted
        assert rule.format.bits == 8 and rule.scale == "lognormal" and rule.sparsity is None
        assert (p.mu, p.sigma, p.p0) == (row["mu"], row["sigma"], row["p0"])
        # per-tensor choices are conditioned on the tensor's observed maximum and size
        cond = {"amax": row["amax"], "numel": row["numel"], "p0": p.p0}
        ranked = fpanalysis.best_format(8, mu=p.mu, sigma=p.sigma, **cond).choices()
        best = ranked[0]
        assert rule.format == best.format
        assert p.scale == pytest.approx(float(best.scale)) and p.error == pytest.approx(float(best.error))
        # the prediction is the analytic error of that format at that scale
        e = fpanalysis.expected_error(rule.format, mu=p.mu, sigma=p.sigma, scale=p.scale, **cond)
        assert p.error == pytest.approx(float(e.total), rel=1e-9)
        # and no other 8-bit candidate does better at its own best scale
        for c in ranked[1:]:
            assert float(c.error) >= p.error


def test_recommend_from_the_histograms(cnn_run):
    """model="histogram": each layer's format and scale come from its own binade histogram and
    maximum (the run's statistics), and the predicted error matches the measured one of that format
    at that scale on the very gradient the statistics describe."""
    model, run, grads, names = cnn_run
    plan = recommend(run, bits=6, model="histogram")
    assert "model='histogram'" in plan.provenance.generator
    st = run.stats(kinds=["grad"])
    last = st[st["step"] == STEPS - 1]
    for name, rule in plan.resolve(model).items():
        row = gradstats.stats.merge_stats(last[last["layer"] == name].to_dict("records"))
        pick = fpanalysis.best_format_from_stats(6, row)
        assert rule.format == pick.format and rule.predicted.scale == pick.scale
        g = grads[STEPS - 1][name]
        measured = _measured(g, rule, rule.predicted.scale)
        assert rule.predicted.error == pytest.approx(measured, rel=0.25), name
    with pytest.raises(ValueError, match="block-scaled"):
        recommend(run, bits=4, granularity="mx", model="histogram")
    with pytest.raises(ValueError, match="model must be"):
        recommend(run, bits=4, model="empirical")


def _measured(g: torch.Tensor, rule, scale: float) -> float:
    q = gradstats.quantize(g, scale=scale, **rule.quantize_kwargs())
    return float(((q.double() - g.double()) ** 2).sum() / (g.double() ** 2).sum())


def test_the_amax_floor_of_the_lognormal_scale_on_real_gradients(cnn_run):
    """On the captured gradients, the lognormal scale floored at the observed amax (what
    Rule.scale_for gives with amax=) is never worse than the bare lognormal optimum, and it rescues
    the layers whose fitted upper tail reaches far beyond their largest value."""
    model, run, grads, names = cnn_run
    gains = []
    for b in (6, 8):
        plan = recommend(run, bits=b)
        for name, rule in plan.resolve(model).items():
            g = grads[STEPS - 1][name]
            p = rule.predicted
            assert p.amax == pytest.approx(float(g.abs().max()), rel=1e-6)
            floored = rule.scale_for(mu=p.mu, sigma=p.sigma, amax=p.amax)
            unconditioned = float(fpanalysis.optimal_scale(rule.format, mu=p.mu, sigma=p.sigma).scale)
            assert floored >= unconditioned and float(g.abs().max()) * floored <= rule.format.max
            bare, best = _measured(g, rule, unconditioned), _measured(g, rule, floored)
            assert best <= bare * (1 + 1e-12), (b, name)
            gains.append(bare / best)
    assert max(gains) > 2.0


def test_recommend_with_sparsity(cnn_run):
    model, run, grads, names = cnn_run
    plan = recommend(run, bits=6, sparsity=0.85, rounding="stochastic")
    assert (plan.defaults.sparsity, plan.defaults.threshold_rule, plan.defaults.rounding) == \
        (0.85, "lognormal", "stochastic")
    for name, rule in plan.resolve(model).items():
        p = rule.predicted
        a = pruning.threshold(0.85, mu=p.mu, sigma=p.sigma, p0=p.p0)
        assert p.threshold == pytest.approx(a, rel=1e-12)
        assert p.sparsity == pytest.approx(max(0.85, p.p0), abs=1e-9)  # the lognormal rule hits its target
        # the prediction is conditioned on the tensor's observed maximum and size
        row = layer_moments(run).set_index("layer").loc[name]
        e = fpanalysis.expected_error(rule.format, mu=p.mu, sigma=p.sigma, scale=p.scale, rounding="stochastic",
                                      amax=p.amax, numel=row["numel"], p0=p.p0)
        assert p.error == pytest.approx(float(e.total), rel=1e-9)
    naive = recommend(run, bits=6, sparsity=0.85, threshold_rule="naive_lognormal").resolve(model)
    for name, rule in naive.items():
        if rule.predicted.p0 < 0.85:  # ignoring the values rounded up undershoots the target
            assert rule.predicted.sparsity < 0.85 - 0.01
    exact = recommend(run, bits=6, sparsity=0.85, threshold_rule="exact").resolve(model)
    assert all(r.predicted.threshold is None and r.predicted.sparsity >= 0.85 for r in exact.values())
    # the analytic threshold prunes the real gradient to about the predicted sparsity
    g = grads[STEPS - 1]["conv2"]
    rule = plan.resolve(model)["conv2"]
    pruned = pruning.stochastic_prune(g, rule.predicted.threshold, generator=torch.Generator().manual_seed(0))
    assert abs(float((pruned == 0).double().mean()) - rule.predicted.sparsity) < 0.05


def test_recommend_several_widths_and_block_granularities(cnn_run):
    model, run, grads, names = cnn_run
    plans = recommend(run, bits=[4, 6, 8])
    assert list(plans) == [4, 6, 8]
    for b, plan in plans.items():
        assert all(e.format.bits == b for e in plan.entries)
    errs = [np.mean([e.predicted.error for e in plans[b].entries]) for b in (4, 6, 8)]
    assert errs[0] > errs[1] > errs[2]  # more bits, less error
    mx = recommend(run, bits=4, granularity="mx")
    d = mx.defaults
    assert (d.block_size, d.scale_format, d.scale) == (32, "e8m0", "amax")
    assert all(e.predicted.scale is None and e.predicted.error > 0 for e in mx.entries)
    nv = recommend(run, bits=4, granularity="nvfp4")
    assert (nv.defaults.block_size, nv.defaults.scale_format) == (16, "e4m3")
    assert recommend(run, bits=8, granularity=64).defaults.block_size == 64


def test_recommended_plan_round_trips_and_exports(cnn_run, tmp_path):
    model, run, grads, names = cnn_run
    plan = recommend(run, bits=8, sparsity=0.5)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    doc = plan.export("json", model)
    assert list(doc["layers"]) == names
    for k, v in doc["layers"].items():
        p = plan.resolve(model)[k].predicted
        assert v["scale"] == p.scale            # the recommended scale, conditioned on the tensor's amax


@pytest.mark.parametrize("kw, msg", [
    ({"rounding": "toward_zero"}, "rounding must be one of"),
    ({"bits": 2}, "bits"),
    ({"bits": [8, 8]}, "bits lists a width twice"),
    ({"bits": "8"}, "bits must be an int"),
    ({"sparsity": 1.0}, "sparsity must be a number in"),
    ({"granularity": "channel"}, "granularity must be one of"),
    ({"threshold_rule": "topk"}, "unknown threshold_rule 'topk'"),
])
def test_recommend_errors(cnn_run, kw, msg):
    with pytest.raises(ValueError, match=msg):
        recommend(cnn_run[1], **kw)


def test_recommend_needs_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run directory"):
        recommend(tmp_path / "nothing")
    with pytest.raises(ValueError, match="run must be a gradstats Run"):
        recommend(42)


# --------------------------------------------------------------------------- speed
def _deep_run(path, n_layers=100):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_layers):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    with gradstats.trace(model, path, sample_every=None) as t:
        for _ in range(2):
            model(torch.randn(32, 16)).square().mean().backward()
            t.step()
    return gradstats.open_run(path)


def test_100_layers_and_5_widths_under_a_second(tmp_path):
    run = _deep_run(tmp_path / "deep")
    run.stats()  # read the files once (I/O is not the recommendation)
    recommend(run, bits=8)  # warm caches of the format analysis
    times = []
    for _ in range(3):
        t0 = time.process_time()
        plans = recommend(run, bits=[4, 5, 6, 7, 8], sparsity=0.85)
        times.append(time.process_time() - t0)
    assert [len(p.entries) for p in plans.values()] == [100] * 5
    assert sorted(times)[1] < 1.0, times


# --------------------------------------------------------------------------- command line
def test_cli_recommend(cnn_run, tmp_path, capsys):
    model, run, grads, names = cnn_run
    out = tmp_path / "plan.json"
    assert main(["recommend", str(run.path), "--bits", "8", "--sparsity", "0.85", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sigma_log2" in text and "pred_sparsity" in text and "fc2" in text and str(out) in text
    plan = Plan.load(out)
    assert plan.defaults.sparsity == 0.85 and [e.layer for e in plan.entries] == names
    assert main(["recommend", str(run.path), "--bits", "6,8", "--granularity", "mx", "--step", "1:3",
                 "-o", str(tmp_path / "p{bits}.json")]) == 0
    assert Plan.load(tmp_path / "p6.json").entries[0].format.bits == 6
    assert Plan.load(tmp_path / "p8.json").provenance.steps == (1, 3)
    assert main(["recommend", str(run.path), "--bits", "6,8", "-o", str(out)]) == 2
    assert "'{bits}'" in capsys.readouterr().err
