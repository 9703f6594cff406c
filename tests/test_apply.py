"""gradstats.apply: plans enforced on neural gradients in the backward pass."""
from __future__ import annotations

import copy
import importlib
import re

import numpy as np
import pytest
import torch
from torch import nn

import gradstats
from gradstats.formats import FPFormat
from gradstats.plan import Plan, PlanEntry

APPLY = importlib.import_module("gradstats.apply")  # the module (gradstats.apply is the verb)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def uniform(**kw):
    """``Plan.uniform`` as these tests were written: every convolution and linear layer, the
    output layer included, pruned wherever a sparsity is given (not only at BatchNorm inputs),
    nearest rounding and lognormal scales and thresholds unless given."""
    for k, v in (("rounding", "nearest"), ("scale", "lognormal"), ("threshold_rule", "lognormal")):
        kw.setdefault(k, v)
    return Plan.uniform(output_layer=False, prune_at=False, **kw)


def batches(n=6, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 1, 8, 8, generator=g), torch.randint(0, 10, (bs,), generator=g)) for _ in range(n)]


def train(model, data, plan=None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    handle = gradstats.apply(model, plan, **kw) if plan is not None else None
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if handle is not None:
        handle.remove()
    return model, handle


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_pass_through_plan_is_bit_identical():
    torch.manual_seed(0)
    base = Net()
    plain, _ = train(copy.deepcopy(base), batches())
    passed, h = train(copy.deepcopy(base), batches(), uniform(format=None, sparsity=None))
    assert same_weights(plain, passed) and h.history == []


def outgoing_gradients(model, names):
    """Register (after apply) tensor hooks that see the gradient the plan lets through."""
    seen = {}
    mods = dict(model.named_modules())

    def fwd(name):
        def hook(m, i, o):
            o.register_hook(lambda g: seen.setdefault(name, []).append(g.clone()))
        return hook
    return seen, [mods[n].register_forward_hook(fwd(n)) for n in names]


@pytest.mark.parametrize("fmt, scale, rounding", [("e3m2fn", "amax", "nearest"), ("e4m3fn", "fixed", "stochastic"),
                                                   ("e2m1fn", "amax", "stochastic")])
def test_outgoing_gradients_are_representable(fmt, scale, rounding):
    model = Net()
    kw = {"scale_value": 2.0 ** 14} if scale == "fixed" else {}
    plan = uniform(format=fmt, sparsity=0.8, scale=scale, rounding=rounding, **kw) if not kw else \
        Plan([PlanEntry("*", types=["Conv2d", "Linear"], format=fmt, scale="fixed", scale_value=2.0 ** 14,
                        rounding=rounding, sparsity=0.8)])
    handle = gradstats.apply(model, plan)
    seen, hooks = outgoing_gradients(model, ["conv", "fc1", "fc2"])
    for x, y in batches(2):
        nn.functional.cross_entropy(model(x), y).backward()
    values = set(FPFormat.parse(fmt).values().tolist())
    df = handle.to_dataframe()
    for name, grads in seen.items():
        rows = df[df.layer == name]
        for g, s in zip(grads, rows["scale"]):
            scaled = (g * s).reshape(-1).tolist()
            assert set(scaled) <= values, name
    assert set(df["layer"]) == {"conv", "fc1", "fc2"}          # Plan.uniform: conv and linear only


def test_weight_gradient_from_compressed_neural_gradient():
    torch.manual_seed(1)
    model = Net()
    plan = uniform(format="e3m2fn", sparsity=0.7, scale="amax")
    gradstats.apply(model, plan)
    seen, _ = outgoing_gradients(model, ["fc1"])
    inputs = {}
    model.fc1.register_forward_hook(lambda m, i, o: inputs.update(x=i[0].detach()))
    x, y = batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    gc = seen["fc1"][0]
    torch.testing.assert_close(model.fc1.weight.grad, gc.t() @ inputs["x"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(model.fc1.bias.grad, gc.sum(0), rtol=1e-6, atol=1e-9)


def test_achieved_sparsity_on_real_training():
    from gradstats.zoo.data import load_fashion_mnist
    from gradstats.zoo.models import build_model

    data = load_fashion_mnist(split="train", source="subset", subset=640)
    model = build_model("cnn", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    handle = gradstats.apply(model, uniform(sparsity=0.85))
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        idx = torch.randint(0, len(data), (64,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(data.images[idx]), data.labels[idx]).backward()
        opt.step()
    s = handle.summary()
    assert len(s) == 4
    assert abs(s["achieved_sparsity"].mean() - 0.85) <= 0.01, s
    assert (abs(s["achieved_sparsity"] - 0.85) <= 0.02).all(), s


def test_remove_restores_identical_behaviour():
    torch.manual_seed(2)
    base = Net()
    a = copy.deepcopy(base)
    h = gradstats.apply(a, uniform(format="e2m1fn", sparsity=0.9, scale="amax"))
    h.remove()
    a, _ = train(a, batches())
    b, _ = train(copy.deepcopy(base), batches())
    assert same_weights(a, b)


def test_saved_plan_applies_identically(tmp_path):
    torch.manual_seed(3)
    base = Net()
    plan = uniform(format="e4m3fn", sparsity=0.8, scale="amax", rounding="stochastic")
    plan.save(tmp_path / "plan.json")
    a, _ = train(copy.deepcopy(base), batches(), plan, seed=7)
    b, _ = train(copy.deepcopy(base), batches(), tmp_path / "plan.json", seed=7)
    c, _ = train(copy.deepcopy(base), batches(), plan, seed=8)
    assert same_weights(a, b) and not same_weights(a, c)


def test_eval_no_grad_accumulation_reuse_and_autocast():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    model = Reuse()
    h = gradstats.apply(model, uniform(format="e3m2fn", scale="amax"))
    with torch.no_grad():
        model(torch.randn(3, 6))
    model.eval()
    model(torch.randn(3, 6)).sum().backward()
    model.train()
    assert h.history == []                                   # eval and no_grad: untouched
    for _ in range(3):                                       # accumulation, reused module
        model(torch.randn(3, 6)).sum().backward()
    assert list(h.to_dataframe()["seq"]) == list(range(6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(3, 6))
    out.float().sum().backward()
    assert h.to_dataframe()["n"].iloc[-1] == 18


def test_log_to_a_tracer(tmp_path):
    model = Net()
    with gradstats.trace(model, tmp_path, every=1) as tr:
        gradstats.apply(model, uniform(format="e4m3fn", sparsity=0.5, scale="amax"), log_to=tr)
        for x, y in batches(3):
            nn.functional.cross_entropy(model(x), y).backward()
            tr.step()
    t = gradstats.open_run(tmp_path).table("applied")
    assert len(t) == 9 and sorted(t["step"].unique()) == [0, 1, 2]
    assert np.all(t["achieved_sparsity"] >= 0.4)


def test_refresh_every_and_ema():
    model = Net()
    h = gradstats.apply(model, uniform(sparsity=0.8), refresh_every=3, ema=0.5)
    for x, y in batches(4):
        nn.functional.cross_entropy(model(x), y).backward()
    df = h.to_dataframe()
    fc1 = df[df.layer == "fc1"]["threshold"].tolist()
    assert fc1[0] == fc1[1] == fc1[2] and fc1[3] != fc1[2]


@pytest.mark.parametrize("tracer_first", [True, False])
def test_tracer_records_what_comes_before_it(tmp_path, tracer_first):
    """Gradient hooks run in the order they were registered: a tracer attached before apply
    records the raw gradient, one attached after records what the plan lets through."""
    model, plan = Net(), uniform(sparsity=0.5)
    tr = gradstats.Tracer(model, tmp_path, every=1, sample_every=None)
    if tracer_first:
        tr.attach()
    applied = gradstats.apply(model, plan)
    if not tracer_first:
        tr.attach()
    for x, y in batches(2):
        nn.functional.cross_entropy(model(x), y).backward()
        tr.step()
    tr.detach()
    applied.remove()
    logits = gradstats.open_run(tmp_path).stats().query("layer == 'fc2'")
    assert len(logits) == 2                                 # one row per step: .all() below is not vacuous
    zero_fraction = logits["n_zero"] / logits["n"]
    if tracer_first:
        assert (zero_fraction == 0).all()                   # softmax minus one-hot: no zeros
    else:
        assert (zero_fraction >= 0.4).all()


@pytest.mark.parametrize("kwargs, match", [({"refresh_every": 0}, "refresh_every"), ({"ema": 1.0}, "ema"),
                                           ({"log_to": "run"}, "log_to")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradstats.apply(Net(), uniform(sparsity=0.5), **kwargs)
    with pytest.raises(ValueError, match="Plan"):
        gradstats.apply(Net(), {"format": "e4m3"})
    with pytest.raises(ValueError, match="match"):
        gradstats.apply(Net(), Plan([PlanEntry("nothing*", sparsity=0.5)]))


DDP_SCRIPT = """
import json, os, sys, torch
import torch.distributed as dist
from torch import nn
import gradstats
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 4))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
plan = gradstats.Plan.uniform(format="e3m2fn", sparsity=0.8, scale="amax")
h = gradstats.apply(ddp, plan, sync_stats=sys.argv[2] == "sync", seed=rank)
g = torch.Generator().manual_seed(rank)
for _ in range(3):
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(torch.randn(8, 10, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
    opt.step()
df = h.to_dataframe()
json.dump({"threshold": df["threshold"].tolist(), "scale": df["scale"].tolist(),
           "w": model[0].weight.sum().item()}, open(f"{sys.argv[1]}/r{rank}.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["sync", "local"])
def test_ddp_same_plan_on_every_rank(tmp_path, mode):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(28500 + os.getpid() % 1000 + (mode == "sync")),
               WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", DDP_SCRIPT, str(tmp_path), mode], env=dict(env, RANK=str(r)))
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    r0, r1 = (json.load(open(tmp_path / f"r{r}.json")) for r in range(2))
    assert r0["w"] == r1["w"]                                  # DDP keeps the replicas equal
    if mode == "sync":
        assert r0["threshold"] == r1["threshold"] and r0["scale"] == r1["scale"]
    else:
        assert r0["threshold"] != r1["threshold"]              # each rank's own statistics


@pytest.mark.slow
def test_torch_compile_runs_the_plan():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    h = gradstats.apply(model, uniform(format="e4m3fn", sparsity=0.5, scale="amax"))
    compiled = torch.compile(model)
    for _ in range(3):
        compiled(torch.randn(32, 8)).sum().backward()
    df = h.to_dataframe()
    assert len(df) == 6 and set(df["layer"]) == {"0", "2"}


def test_histogram_threshold_rule_hits_the_target():
    """threshold_rule="histogram": model-free thresholds from the refresh pass's binade histogram;
    the predicted sparsity is the target and the achieved one is close to it on every call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4))
    with gradstats.apply(model, uniform(sparsity=0.8, threshold_rule="histogram")) as ap:
        for _ in range(3):
            model(torch.randn(512, 16)).exp().mean().backward()
    df = ap.to_dataframe()
    assert len(df) == 6 and (df["threshold"] > 0).all()
    assert ((df["predicted_sparsity"] - 0.8).abs() < 1e-6).all()
    assert (df["achieved_sparsity"] - 0.8).abs().max() < 0.03


# --------------------------------------------------------------------------- checkpoints

def train_steps(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def checkpointed(tmp_path, plan, data, split=4, check=None, **kw):
    """Train on ``data`` under ``plan`` with a checkpoint (model, optimizer, applied) after
    ``split`` steps. Returns the model, its handle and ``resume(load_applied)``: a fresh model,
    optimizer and apply() from the checkpoint (``check(handle)`` after loading the applied state)
    trained on the rest of the data."""
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    applied = gradstats.apply(model, plan, seed=11, **kw)
    train_steps(model, opt, data[:split])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "applied": applied.state_dict()},
               tmp_path / "ckpt.pt")
    train_steps(model, opt, data[split:])
    applied.remove()

    def resume(load_applied):
        ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        torch.manual_seed(99)                               # another initialisation, another seed
        fresh = Net()
        fresh.load_state_dict(ckpt["model"])
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
        fopt.load_state_dict(ckpt["opt"])
        h = gradstats.apply(fresh, plan, seed=12, **kw)
        if load_applied:
            h.load_state_dict(ckpt["applied"])
            if check is not None:
                check(h)
        train_steps(fresh, fopt, data[split:])
        h.remove()
        return fresh, h
    return model, applied, resume


def test_state_dict_resumes_training_exactly(tmp_path):
    """N steps, checkpoint (model, optimizer, applied), M more steps; a fresh model, optimizer
    and apply() loaded from the checkpoint repeat the M steps bit for bit. Stochastic pruning
    and rounding, a refresh cycle cut in the middle and EMA statistics: all of the state."""
    plan = uniform(format="e3m2fn", sparsity=0.8, rounding="stochastic")
    model, applied, resume = checkpointed(tmp_path, plan, batches(9, seed=4), refresh_every=3, ema=0.5)
    resumed, h = resume(True)
    assert same_weights(model, resumed)
    df, ref = h.to_dataframe(), applied.to_dataframe()
    assert df["seq"].min() == 4                              # the call counters continue
    pd_cols = ["layer", "seq", "threshold", "scale", "achieved_sparsity"]
    assert df[pd_cols].reset_index(drop=True).equals(ref[ref.seq >= 4][pd_cols].reset_index(drop=True))
    assert not same_weights(model, resume(False)[0])        # without the applied state: another run


def test_state_dict_is_plain_data_and_checks_layers(tmp_path, caplog):
    model = Net()
    a = gradstats.apply(model, uniform(format="e4m3fn", sparsity=0.5))
    for x, y in batches(2):
        nn.functional.cross_entropy(model(x), y).backward()
    sd = a.state_dict()
    assert set(sd["layers"]) == {"conv", "fc1", "fc2"} and sd["layers"]["fc1"]["seq"] == 2
    torch.save(sd, tmp_path / "a.pt")
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    b = gradstats.apply(Net(), uniform(format="e4m3fn", sparsity=0.5))
    b.load_state_dict(loaded)
    assert b.state_dict()["layers"] == sd["layers"]
    assert torch.equal(b.generator.get_state(), a.generator.get_state())
    only_fc = gradstats.apply(Net(), Plan([PlanEntry("fc*", sparsity=0.5)]))
    with pytest.raises(ValueError, match=r"missing from it: \[\]; .*\['conv'\]"):
        only_fc.load_state_dict(sd)
    with pytest.raises(ValueError, match="state_dict"):
        b.load_state_dict({"conv": 1})
    other = gradstats.apply(Net(), uniform(format="e4m3fn", sparsity=0.5), refresh_every=2)
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        other.load_state_dict(sd)
    assert "refresh_every=1" in caplog.text


# --------------------------------------------------------------------------- alerts

def alerts_logged(caplog):
    """(layer, kind) of every alert record of the gradstats.apply logger."""
    out = []
    for r in caplog.records:
        if r.name == "gradstats.apply" and r.levelname == "WARNING":
            msg = r.getMessage()
            kind = ("gain" if "magnitude gain" in msg else "overflow" if "clipped at" in msg
                    else "nonfinite" if "NaN or inf" in msg
                    else "underflow" if "flushed to zero" in msg else "sparsity" if "achieved sparsity" in msg
                    else "zero_gradient" if "all zeros" in msg else "other")
            out.append((r.args[0], kind))
    return out


def run_steps(model, plan, n=6, **kw):
    h = gradstats.apply(model, plan, **kw)
    for x, y in batches(n):
        nn.functional.cross_entropy(model(x), y).backward()
    return h


def test_alerts_fire_once_per_layer_on_a_flushing_format(caplog):
    """e3m2fn at a scale far too small for fc2's gradient (as BERT's attention outputs at 2^13):
    everything the pruning keeps is flushed. Underflow and sparsity fire at the first call, the
    all-zero gradient at the third; each once over six calls, and in summary()."""
    plan = Plan([PlanEntry("fc2", format="e3m2fn", scale="fixed", scale_value=2.0 ** -2, sparsity=0.5)])
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        h = run_steps(Net(), plan)
    logged = alerts_logged(caplog)
    assert sorted(logged) == [("fc2", "gain"), ("fc2", "sparsity"), ("fc2", "underflow"), ("fc2", "zero_gradient")]
    assert "2^-2" in h.alerts["fc2"]["underflow"] and "3 calls in a row" in h.alerts["fc2"]["zero_gradient"]
    s = h.summary()
    assert s.set_index("layer").loc["fc2", "alerts"] == "gain, underflow, sparsity, zero_gradient"
    assert s["achieved_sparsity"].iloc[0] == 1.0


def test_each_alert_on_its_own(caplog):
    # the sparsity check alone (the underflow one off): the format's flushing still shows as excess
    plan = Plan([PlanEntry("fc1", format="e3m2fn", scale="fixed", scale_value=2.0 ** 2, sparsity=0.3)])
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        h = run_steps(Net(), plan, underflow_bound=None, zero_calls=None, bias_bound=None)
    assert alerts_logged(caplog) == [("fc1", "sparsity")] and "format flushed" in h.alerts["fc1"]["sparsity"]
    # a looser margin keeps it quiet
    caplog.clear()
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        run_steps(Net(), plan, sparsity_margin=0.99, underflow_bound=None, zero_calls=None, bias_bound=None)
    assert alerts_logged(caplog) == []

    # a layer whose incoming gradient is zero: only the all-zero alert, at the ZERO_CALLS-th call
    class Dead(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.b(self.a(x) * 0.0 + x)

    model = Dead()
    caplog.clear()
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        h = gradstats.apply(model, uniform(format="e4m3fn", scale="amax"))
        for i in range(5):
            model(torch.randn(4, 6)).sum().backward()
            assert ("a" in h.alerts) == (i + 1 >= APPLY.ZERO_CALLS)
    assert alerts_logged(caplog) == [("a", "zero_gradient")]
    assert h.summary().set_index("layer")["alerts"].to_dict() == {"a": "zero_gradient", "b": ""}


@pytest.mark.parametrize("plan", [uniform(format="e4m3fn", scale="amax"), uniform(format="e4m3fn"),
                                  uniform(sparsity=0.85), uniform(format="e3m2fn", sparsity=0.85)],
                         ids=["e4m3fn-amax", "e4m3fn-lognormal", "prune-0.85", "e3m2fn-0.85"])
def test_no_alert_on_a_healthy_plan(caplog, plan):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        h = run_steps(Net(), plan)
        h2 = gradstats.apply(mlp, plan)
        for _ in range(6):
            nn.functional.cross_entropy(mlp(torch.randn(64, 16)), torch.randint(0, 10, (64,))).backward()
    assert alerts_logged(caplog) == [] and h.alerts == {} and h2.alerts == {}
    assert (h.summary()["alerts"] == "").all()


@pytest.mark.parametrize("kwargs, match", [({"sparsity_margin": -0.1}, "sparsity_margin"),
                                           ({"underflow_bound": 1.5}, "underflow_bound"),
                                           ({"zero_calls": 0}, "zero_calls")])
def test_bad_alert_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradstats.apply(Net(), uniform(sparsity=0.5), **kwargs)


# --------------------------------------------------------------------------- wrappers

def test_wrapped_model_hooks_the_users_modules():
    """DataParallel (on the CPU it calls the module directly) is looked through: the layer names
    are the user's and the wrapped forward runs the plan."""
    torch.manual_seed(0)
    base = Net()
    dp = nn.DataParallel(copy.deepcopy(base))
    h = gradstats.apply(dp, uniform(format="e4m3fn", sparsity=0.5, scale="amax"), seed=3)
    assert list(h.rules) == ["conv", "fc1", "fc2"]
    for x, y in batches(2):
        nn.functional.cross_entropy(dp(x), y).backward()
    assert sorted(set(h.to_dataframe()["layer"])) == ["conv", "fc1", "fc2"] and len(h.history) == 6
    plain = copy.deepcopy(base)
    gradstats.apply(plain, uniform(format="e4m3fn", sparsity=0.5, scale="amax"), seed=3)
    for x, y in batches(2):
        nn.functional.cross_entropy(plain(x), y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(dp.module.parameters(), plain.parameters()))


def test_apply_on_a_compiled_model():
    """apply(torch.compile(model)): the plan resolves to the user's names ('0', not '_orig_mod.0')
    and the compiled forward still calls the hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled = torch.compile(model)
    plan = uniform(format="e4m3fn", sparsity=0.5, scale="amax")
    assert list(plan.resolve(compiled)) == ["0", "2"]
    h = gradstats.apply(compiled, plan)
    assert list(h.rules) == ["0", "2"]
    for _ in range(2):
        compiled(torch.randn(32, 8)).sum().backward()
    df = h.to_dataframe()
    assert len(df) == 4 and set(df["layer"]) == {"0", "2"}
    assert (df["achieved_sparsity"] > 0.3).all()


# --------------------------------------------------------------------------- fast refresh

@pytest.mark.parametrize("rule", ["lognormal", "naive_lognormal", "normal", "laplace", "histogram"])
def test_refresh_sets_the_thresholds_and_scales_recommend_computes(monkeypatch, rule):
    """The refresh takes each threshold from the rule of pruning.rules.THRESHOLD_RULES (the one
    pruning.threshold solves one layer with) and each scale from Rule.scale_for: checked against
    the vectorised reference solvers at every refresh of a training."""
    import importlib

    from gradstats import fpanalysis, pruning
    from gradstats.formats import amax_scale
    from gradstats.pruning.rules import THRESHOLD_RULES
    from gradstats.stats import vector_to_stats

    enforce = importlib.import_module("gradstats.apply.refresh")
    seen = {"threshold": 0, "scale": 0}

    class Checked:
        def __init__(self, inner):
            self.inner = inner

        def threshold(self, target, stats, **kw):
            a = self.inner.threshold(target, stats, **kw)
            if rule == "histogram":
                ref = float(pruning.threshold(target, vector_to_stats(vectors[-1]), threshold_rule="histogram"))
            else:
                kw_ = {"mu": np.array([stats.mu]), "sigma": np.array([stats.sigma])} if "lognormal" in rule else {
                    "scale": np.array([stats.scale_normal if rule == "normal" else stats.scale_laplace])}
                if stats.amax is not None:
                    kw_.update(amax=np.array([stats.amax]), mean_abs=np.array([stats.mean_abs]))
                ref = float(pruning.threshold(np.array([target]), threshold_rule=rule, p0=np.array([stats.p0]),
                                              **kw_)[0])
            assert a == pytest.approx(ref, rel=1e-11, abs=0)
            seen["threshold"] += 1
            return a

        def __getattr__(self, name):
            return getattr(self.inner, name)

    vectors = []
    histogram = enforce.histogram_of

    def recorded(v, **kw):
        vectors.append(v)
        return histogram(v, **kw)

    monkeypatch.setattr(enforce, "histogram_of", recorded)
    monkeypatch.setattr(enforce, "THRESHOLD_RULES", {**THRESHOLD_RULES, rule: Checked(THRESHOLD_RULES[rule])})
    plan = uniform(format="e3m2fn", sparsity=0.85, threshold_rule=rule)
    torch.manual_seed(0)
    _, h = train(Net(), batches(4), plan, seed=1)
    df = h.to_dataframe()
    assert len(df) == 12 and seen["threshold"] == 12 and len(vectors) == (12 if rule == "histogram" else 0)
    for _, r in df.iterrows():            # the scale: the vectorised search at the running statistics
        amax = max(r["amax"], r["threshold"])
        ref = fpanalysis.optimal_scale("e3m2fn", mu=[r["mu"]], sigma=[max(r["sigma"], 1e-6)]).scale[0]
        assert r["scale"] == max(ref, amax_scale(FPFormat.parse("e3m2fn"), amax))


def test_apply_is_a_function_and_a_package():
    """gradstats.apply is the verb (a function) after its package's modules are imported; the
    module's public names stay where they were."""
    import gradstats.apply.alerts  # noqa: F401
    import gradstats.apply.refresh  # noqa: F401
    from gradstats.apply import Applied, Fallback, apply, widen

    assert callable(gradstats.apply) and not isinstance(gradstats.apply, type(importlib))
    assert gradstats.apply is apply is APPLY.apply and gradstats.Applied is Applied is APPLY.Applied
    assert Fallback is APPLY.Fallback and widen(FPFormat.parse("e3m2fn")) == FPFormat.parse("e4m3fn")


def test_records_set_predicted_against_achieved():
    """Every record carries the lognormal model's underflow, saturation and error beside the
    achieved counts; on a healthy plan they agree in size."""
    torch.manual_seed(0)
    plan = uniform(format="e4m3fn", sparsity=0.5, rounding="stochastic")
    _, h = train(Net(), batches(4), plan, fallback=APPLY.Fallback(error=4.0))
    df = h.to_dataframe()
    for col in ("predicted_underflow", "predicted_overflow", "predicted_error", "error", "fallback", "rounding"):
        assert col in df
    live = df[df["achieved_sparsity"] < 1]
    assert live["error"].notna().all() and (live["predicted_error"] > 0).all()
    ratio = live["error"] / live["predicted_error"]
    assert ratio.between(0.2, 4.0).all(), ratio
    s = h.summary()
    assert {"predicted_underflow", "predicted_error", "plan_sparsity", "plan_error", "fallbacks"} <= set(s.columns)
    assert (s["fallbacks"] == "").all()


def test_summary_shows_the_plans_own_prediction():
    from gradstats.plan import Prediction

    plan = Plan([PlanEntry("fc1", format="e4m3fn", sparsity=0.5,
                           predicted=Prediction(error=7e-4, sparsity=0.5))])
    h = run_steps(Net(), plan, n=2)
    row = h.summary().set_index("layer").loc["fc1"]
    assert row["plan_error"] == 7e-4 and row["plan_sparsity"] == 0.5


# --------------------------------------------------------------------------- fallback

FLUSHING = Plan([PlanEntry("fc2", format="e3m2fn", scale="fixed", scale_value=2.0 ** -8, sparsity=0.5),
                 PlanEntry("fc1", format="e4m3fn", scale="amax", rounding="stochastic", sparsity=0.5)])


def fallbacks_logged(caplog):
    return [(r.args[0], r.args[1]) for r in caplog.records
            if r.name == "gradstats.apply" and r.levelname == "WARNING" and "fallback" in r.msg]


def test_fallback_changes_the_drifting_layers_rule(tmp_path, caplog):
    """e3m2fn at a scale far too small for fc2's gradient flushes everything: after two drifting
    calls (patience) fc2 turns to stochastic rounding, then to e4m3fn, then to full precision;
    fc1 (healthy) keeps its rule. Each change is logged, recorded and in the run, and the
    gradients that follow are those of the new rule."""
    torch.manual_seed(0)
    model = Net()
    raw, _ = outgoing_gradients(model, ["fc2"])              # before apply: the raw gradient
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        with gradstats.trace(model, tmp_path / "run", every=1, sample_every=None) as tr:
            h = gradstats.apply(model, FLUSHING, fallback="widen", log_to=tr)
            seen, _ = outgoing_gradients(model, ["fc2"])     # after apply: what the plan lets through
            for x, y in batches(8):
                nn.functional.cross_entropy(model(x), y).backward()
                tr.step()
    assert [(r["layer"], r["seq"], r["action"]) for r in h.fallbacks] == [
        ("fc2", 1, "stochastic"), ("fc2", 3, "widen"), ("fc2", 5, "full")]
    assert fallbacks_logged(caplog) == [("fc2", "stochastic"), ("fc2", "widen"), ("fc2", "full")]
    assert "flushed to zero" in h.fallbacks[0]["reason"] and h.fallbacks[1]["to_format"] == "e4m3fn"
    # achieved and predicted are shares of the same values (those reaching the rounding): the
    # model, too, predicts that nearly all of them flush at this scale
    shares = re.match(r"([\d.]+)% of the non-zero values reaching the rounding flushed to zero, predicted ([\d.]+)%",
                      h.fallbacks[0]["reason"])
    assert shares and float(shares[1]) == 100.0 and 90.0 <= float(shares[2]) <= 100.0
    assert h.rules["fc2"].format is None and h.rules["fc1"] == h.plan_rules["fc1"]
    df = h.to_dataframe()
    fc2 = df[df.layer == "fc2"].set_index("seq")
    assert fc2["fallback"].tolist() == ["", "stochastic", "", "widen", "", "full", "", ""]
    assert fc2["format"].tolist()[:6] == ["e3m2fn"] * 4 + ["e4m3fn"] * 2 and fc2["format"].iloc[6:].isna().all()
    assert fc2["rounding"].tolist() == ["nearest"] * 2 + ["stochastic"] * 6
    assert (df[df.layer == "fc1"]["fallback"] == "").all()
    # the gradients that follow each change are the new rule's
    scale = 2.0 ** 8
    for seq in (2, 3):
        assert set((seen["fc2"][seq] * scale).reshape(-1).tolist()) <= set(FPFormat.parse("e3m2fn").values().tolist())
    for seq in (4, 5):
        assert set((seen["fc2"][seq] * scale).reshape(-1).tolist()) <= set(FPFormat.parse("e4m3fn").values().tolist())
    for seq in (6, 7):                                       # full precision: pruning alone
        g, out, a = raw["fc2"][seq], seen["fc2"][seq], fc2.loc[seq, "threshold"]
        kept = g.abs() >= a
        assert torch.equal(out[kept], g[kept])
        assert torch.isin(out[~kept].abs(), torch.tensor([0.0, float(np.float32(a))])).all()
    assert fc2.loc[6:, "achieved_sparsity"].max() < 0.8       # the gradient flows again
    # in the run
    run = gradstats.open_run(tmp_path / "run")
    t = run.table("applied_fallbacks")
    assert t["action"].tolist() == ["stochastic", "widen", "full"] and set(t["layer"]) == {"fc2"}
    assert sorted(t["step"]) == [1, 3, 5]
    assert run.table("applied").query("layer == 'fc2'")["fallback"].tolist()[5] == "full"
    s = h.summary().set_index("layer")
    assert s.loc["fc2", "fallbacks"] == "stochastic, widen, full" and s.loc["fc1", "fallbacks"] == ""


def test_fallback_action_list_and_patience():
    torch.manual_seed(0)
    fb = APPLY.Fallback(patience=1, actions=("widen",))
    h = run_steps(Net(), FLUSHING, n=4, fallback=fb)
    assert [(r["seq"], r["action"], r["to_format"], r["to_rounding"]) for r in h.fallbacks] == [
        (0, "widen", "e4m3fn", "nearest")]                    # widened at once; no further action listed
    assert str(h.rules["fc2"].format) == "e4m3fn"
    h = run_steps(Net(), FLUSHING, n=3, fallback="full")
    assert [r["action"] for r in h.fallbacks] == ["full"] and h.rules["fc2"].format is None
    assert [r["seq"] for r in h.fallbacks] == [1]


@pytest.mark.parametrize("plan", [uniform(format="e4m3fn", scale="amax"), uniform(format="e4m3fn"),
                                  uniform(sparsity=0.85), uniform(format="e3m2fn", sparsity=0.85),
                                  uniform(format="e3m2fn", sparsity=0.85, rounding="stochastic",
                                          threshold_rule="histogram"),
                                  Plan.uniform(format="e3m2fn", sparsity=0.85)],
                         ids=["e4m3fn-amax", "e4m3fn-lognormal", "prune-0.85", "e3m2fn-0.85", "e3m2fn-sr-histogram",
                              "uniform-defaults"])
def test_a_healthy_plan_never_falls_back(caplog, plan):
    torch.manual_seed(0)
    fb = APPLY.Fallback(patience=1, error=4.0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        _, h = train(Net(), batches(8), plan, fallback=fb)
        h2 = gradstats.apply(mlp, plan, fallback=fb)
        for _ in range(8):
            nn.functional.cross_entropy(mlp(torch.randn(64, 16)), torch.randint(0, 10, (64,))).backward()
    assert h.fallbacks == [] and h2.fallbacks == [] and fallbacks_logged(caplog) == []
    assert h.rules == h.plan_rules and (h.to_dataframe()["fallback"] == "").all()


def test_state_dict_keeps_the_changed_rules(tmp_path):
    """Checkpoint between two fallbacks of a layer; the resumed training continues with the
    changed rule (and its fallback state: the next change comes at the same call) and repeats the
    uninterrupted one bit for bit."""
    def changed(h):
        assert str(h.rules["fc2"].format) == "e4m3fn" and h.rules["fc2"].rounding == "stochastic"
        assert h.rules["fc1"] == h.plan_rules["fc1"]

    model, applied, resume = checkpointed(tmp_path, FLUSHING, batches(8, seed=4), check=changed, fallback="widen")
    assert [r["action"] for r in applied.fallbacks if r["seq"] < 4] == ["stochastic", "widen"]   # before it
    resumed, h = resume(True)
    assert same_weights(model, resumed)
    assert [(r["seq"], r["action"]) for r in h.fallbacks] == [(1, "stochastic"), (3, "widen"), (5, "full")]
    assert h.fallbacks == applied.fallbacks
    cols = ["layer", "seq", "format", "rounding", "threshold", "scale", "achieved_sparsity", "fallback"]
    df, ref = h.to_dataframe(), applied.to_dataframe()
    assert df[cols].reset_index(drop=True).equals(ref[ref.seq >= 4][cols].reset_index(drop=True))
    plain, h0 = resume(False)                                  # the plan's rules, from the start again
    assert not same_weights(model, plain) and [r["action"] for r in h0.fallbacks][0] == "stochastic"


def test_state_dict_of_version_1_still_loads():
    model = Net()
    a = run_steps(model, uniform(format="e4m3fn", sparsity=0.5), n=2)
    sd = a.state_dict()
    old = {"version": 1, "generator": sd["generator"], "refresh_every": 1, "ema": None,
           "layers": {n: {k: v for k, v in d.items() if k in APPLY._STATE_FIELDS + ("alerts",)}
                      for n, d in sd["layers"].items()}}
    b = gradstats.apply(Net(), uniform(format="e4m3fn", sparsity=0.5))
    b.load_state_dict(old)
    assert b.state["fc1"].seq == 2 and b.state["fc1"].fallback_done == []


@pytest.mark.parametrize("kwargs, match", [({"underflow": 1.5}, "underflow"), ({"error": 0.5}, "error"),
                                           ({"patience": 0}, "patience"), ({"actions": ()}, "actions"),
                                           ({"actions": ("bf16",)}, "actions")])
def test_bad_fallback_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        APPLY.Fallback(**kwargs)
    with pytest.raises(ValueError, match="fallback"):
        gradstats.apply(Net(), uniform(sparsity=0.5), fallback="bf16")


def test_widen_ladder():
    from gradstats.apply import widen

    names = {f: None if widen(FPFormat.parse(f)) is None else str(widen(FPFormat.parse(f)))
             for f in ("e2m1fn", "e3m2fn", "e2m3fn", "e4m3fn", "e5m2", "e3m2")}
    assert names == {"e2m1fn": "e3m2fn", "e3m2fn": "e4m3fn", "e2m3fn": "e4m3fn", "e4m3fn": None, "e5m2": None,
                     "e3m2": "e4m3"}


# --------------------------------------------------------------------------- warm-up and schedule
WARM = Plan([PlanEntry("fc1", format="e3m2fn", scale="amax", rounding="stochastic", sparsity=0.8)])


def warm_run(warmup, refresh_every=1, ema=0.5, n=6):
    """The same gradients every call (no optimizer step): fc1's incoming gradient does not
    depend on the plan, so handles with different warm-ups see the same sequence."""
    torch.manual_seed(0)
    model = Net()
    raw, _ = outgoing_gradients(model, ["fc1"])
    h = gradstats.apply(model, WARM, warmup=warmup, refresh_every=refresh_every, ema=ema)
    seen, _ = outgoing_gradients(model, ["fc1"])
    for x, y in batches(n):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    h.remove()
    return h, raw["fc1"], seen["fc1"]


def test_warmup_leaves_the_first_gradients_unchanged_and_starts_warm():
    cold, _, _ = warm_run(0)
    h, raw, seen = warm_run(3)
    for i in range(3):                                   # warm-up: bit for bit the raw gradient
        assert torch.equal(seen[i], raw[i])
    for i in range(3, 6):                                # then the plan: pruned and representable
        assert (seen[i] == 0).float().mean() > 0.6 and not torch.equal(seen[i], raw[i])
    assert [r["seq"] for r in h.history] == [3, 4, 5]    # warm-up calls are counted, not recorded
    # the statistics followed the warm-up: the first enforced call's threshold is the one the
    # cold handle reached after the same four gradients
    assert h.history[0]["threshold"] == pytest.approx(cold.history[3]["threshold"], rel=1e-12)
    assert h.history[0]["mu"] == pytest.approx(cold.history[3]["mu"], rel=1e-12)
    assert h.state_dict()["warmup"] == 3 and h.to_dict()["warmup"] == 3


def test_refresh_schedule_is_a_function_of_the_call_index():
    calls = []

    def schedule(k):
        calls.append(k)
        return k == 3

    h, _, _ = warm_run(1, refresh_every=schedule, ema=None)
    th = [r["threshold"] for r in h.history]
    assert calls == [1, 2, 3, 4]                          # k = 0 always refreshes, unasked
    # the threshold changes at the refreshes (k = 0 and k = 3) and holds between them
    assert th[0] == th[1] == th[2] != th[3] == th[4]
    assert h.state_dict()["refresh_every"].startswith("schedule:")


@pytest.mark.parametrize("kw, match", [({"warmup": -1}, "warmup must be an int >= 0"),
                                       ({"warmup": 1.5}, "warmup must be an int >= 0"),
                                       ({"refresh_every": 0}, "refresh_every must be a positive int")])
def test_warm_up_and_schedule_arguments_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        gradstats.apply(Net(), WARM, **kw)


def test_sparsity_alert_of_the_histogram_rule_points_at_the_refresh(caplog):
    """With the histogram rule a stale threshold, not the rule, is what overshoots: the alert
    says to refresh more often instead of suggesting the rule in force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256))
    plan = Plan([PlanEntry("0", sparsity=0.5, threshold_rule="histogram")])
    x = torch.randn(64, 16)
    with caplog.at_level("WARNING", logger="gradstats.apply"):
        h = gradstats.apply(model, plan, refresh_every=100)
        for c in (1.0, 0.01):                 # the second gradient is 100x smaller: stale threshold
            model.zero_grad()
            (model(x) * torch.randn(64, 256) * c).sum().backward()
    msg = h.alerts["0"]["sparsity"]
    assert "refresh more often" in msg and "try threshold_rule='histogram'" not in msg


def test_apply_config_is_the_keywords_as_one_value(tmp_path):
    """ApplyConfig's defaults are apply's keywords; apply takes a config, the keywords, or both when
    they agree; a contradiction is a ValueError naming both; the trainer session builds one at once."""
    import dataclasses
    import inspect

    from gradstats.apply import ApplyConfig
    from gradstats.integrations._session import APPLY_OPTIONS, TrainingSession

    sig = inspect.signature(gradstats.apply).parameters
    for f in dataclasses.fields(ApplyConfig):
        assert sig[f.name].default == f.default, f.name
    assert set(sig) - {f.name for f in dataclasses.fields(ApplyConfig)} == {"model", "plan", "config", "log_to"}
    assert set(APPLY_OPTIONS) == {f.name for f in dataclasses.fields(ApplyConfig)} - {"seed"}
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    plan = Plan.uniform(format="e4m3fn", scale="amax", layers=["0"])
    cfg = ApplyConfig(warmup=1, fallback="widen", seed=3)
    h = gradstats.apply(m, plan, config=cfg, warmup=1)              # an agreeing keyword is fine
    for _ in range(3):
        m(torch.randn(5, 4)).sum().backward()
    h.remove()
    assert h.config is cfg and h.config.fallback.actions == ("stochastic", "widen", "full")
    assert [r["seq"] for r in h.history] == [1, 2]                   # the warm-up call is not recorded
    with pytest.raises(ValueError, match=r"warmup=2\) contradicts the config's warmup=1"):
        gradstats.apply(m, plan, config=cfg, warmup=2)
    with pytest.raises(ValueError, match="config must be a gradstats.apply.ApplyConfig"):
        gradstats.apply(m, plan, config={"warmup": 1})
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        ApplyConfig(warmup=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.warmup = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="zero_calls must be None"):
        TrainingSession(None, plan=plan, zero_calls=0)                # checked when the callback is made
    assert TrainingSession(None, plan=plan, apply_seed=4).apply_config.seed == 4


@pytest.mark.parametrize("rule", ["normal", "laplace"])
def test_refresh_reads_the_family_scales_recommend_reads_from_a_gradient_with_zeros(rule):
    """With exact zeros (ReLU), apply's normal and Laplace thresholds use the scale of the non-zero
    magnitudes, as pruning.threshold does from the same statistics row: the same threshold."""
    from gradstats import pruning
    from gradstats.apply.refresh import LayerState, layer_stats, stats_update
    from gradstats.pruning.rules import THRESHOLD_RULES
    from gradstats.stats import tensor_stats, tensor_stats_vector

    g = torch.randn(4096, generator=torch.Generator().manual_seed(0)).clamp_min(0) * 1e-3   # half zeros
    st = LayerState()
    stats_update(st, tensor_stats_vector(g), None)
    mine = THRESHOLD_RULES[rule].threshold(0.8, layer_stats(st))
    ref = float(pruning.threshold(0.8, tensor_stats(g), threshold_rule=rule))
    assert mine == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("alerts", [True, False])
def test_a_block_rule_alerts_when_it_flushes_past_its_replayed_prediction(alerts):
    """A block rule is predicted by replaying it on whole blocks (exact on its calibration steps): it
    alerts ("drift") at its first call when it flushes more than the prediction plus max(0.5 x, 0.01),
    and not when its prediction is what it flushes; the per-tensor band (twice the prediction plus
    0.01) would have stayed silent at a prediction of f / 1.8."""
    from gradstats.plan import Prediction

    torch.manual_seed(0)
    lin = nn.Linear(16, 64)
    g = torch.randn(256, 64)
    measured = float(((gradstats.quantize(g, "nvfp4") == 0) & (g != 0)).float().mean())
    pred = measured / 1.8 if alerts else measured
    assert (pred + max(0.5 * pred, 0.01) < measured) == alerts and 2 * pred + 0.01 > measured
    plan = Plan([PlanEntry("(root)", format="nvfp4", rounding="nearest",
                           predicted=Prediction(flushed=pred, overflow=0.5))])
    applied = gradstats.apply(lin, plan)
    lin(torch.randn(256, 16)).backward(g)
    applied.remove()
    assert ("drift" in applied.alerts.get("(root)", {})) == alerts


@pytest.mark.parametrize("sparsity", [None, 0.8])
def test_a_block_rules_clipping_alert_says_why_block_scales_clip(sparsity):
    """NVFP4's E4M3 block scales rounded down put the values nearest a block's maximum above e2m1's range by
    design (3.3% of a lognormal-like gradient's values here): a uniform NVFP4 plan, with no prediction to hold
    it to, that clips more than the bound is told why and to let recommend predict the share, not to change a
    per-tensor scale it does not have; a per-tensor format's alert keeps the scale advice."""
    from gradstats.apply.alerts import clip_reason

    torch.manual_seed(0)
    lin = nn.Linear(16, 64)
    rule = {} if sparsity is None else {"sparsity": sparsity}
    applied = gradstats.apply(lin, Plan([PlanEntry("(root)", format="nvfp4", rounding="nearest", **rule)]))
    lin(torch.randn(256, 16)).backward(torch.randn(256, 64) * torch.exp(torch.randn(256, 64)))
    applied.remove()
    assert applied.to_dataframe()["overflow_fraction"].iloc[0] > 0.012
    msg = applied.alerts["(root)"]["overflow"]
    assert "by design" in msg and "gradstats.recommend" in msg and "scale='amax'" not in msg
    assert ("pruning puts each small value" in msg) == (sparsity is not None)
    assert msg.endswith(clip_reason(applied.rules["(root)"]))
    assert "scale='amax'" in clip_reason(Plan([PlanEntry("(root)", format="e4m3fn")]).resolve(lin)["(root)"])


def _same_records(a, b):
    assert len(a) == len(b) and a
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            va, vb = ra[k], rb[k]
            assert va == vb or (isinstance(va, float) and np.isnan(va) and np.isnan(vb)), (k, va, vb)


@pytest.mark.parametrize("refresh_every", [1, 3])
def test_predictions_computed_when_read_are_those_of_each_solve(monkeypatch, refresh_every):
    """The CPU path leaves each solve's predictions pending until a record or the state is read: the
    records (read late or step by step), the state dict and the gradients are those the eager solve gives."""
    refresh = importlib.import_module("gradstats.apply.refresh")
    plan = uniform(format="e3m2fn", sparsity=0.7, scale="amax", rounding="stochastic")
    data = batches(5)

    def run(eager, read_each_step=False):
        torch.manual_seed(0)
        model = Net()
        with monkeypatch.context() as m:
            if eager:
                m.setattr(refresh, "defer_predict", refresh.predict)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            h = gradstats.apply(model, plan, refresh_every=refresh_every)
            seen = []
            for x, y in data:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if read_each_step:
                    seen = [dict(r) for r in h.history]
            sd = h.state_dict()
            h.remove()
        return model, h, sd, seen

    lazy_model, lazy, lazy_sd, _ = run(False)
    eager_model, eager, eager_sd, _ = run(True)
    stepwise_model, stepwise, _, seen = run(False, read_each_step=True)
    assert same_weights(lazy_model, eager_model) and same_weights(lazy_model, stepwise_model)
    _same_records(lazy.history, eager.history)
    _same_records(stepwise.history, eager.history)
    _same_records(seen, eager.history)
    assert np.isfinite([r["predicted_error"] for r in eager.history]).all()
    for n, st in eager_sd["layers"].items():
        for k in refresh.PREDICTED:
            assert lazy_sd["layers"][n][k] == st[k], (n, k)


def test_a_pending_prediction_is_computed_once_and_then_kept():
    refresh = importlib.import_module("gradstats.apply.refresh")
    from gradstats.plan import Rule

    rule = Rule(format="e4m3fn", sparsity=0.5, scale="amax")
    st = refresh.LayerState(mu=-9.0, m2=81.0 + 4.0, p0=0.1, amax=1e-2, threshold=1e-4, scale=2.0 ** 12)
    refresh.defer_predict(rule, st, 1000)
    pending = st.pending
    st.mu = -5.0                                             # the state moves on: the pending inputs do not
    got = (st.predicted_underflow, st.predicted_overflow, st.predicted_error)
    assert st.pending is None and pending.value == got
    st.mu = -9.0
    refresh.predict(rule, st, 1000)
    assert (st.predicted_underflow, st.predicted_overflow, st.predicted_error) == got


@pytest.mark.parametrize("plan", [
    uniform(format="e4m3fn", sparsity=0.6, rounding="stochastic", scale="amax", threshold_rule="histogram"),
    uniform(format="e3m2fn", rounding="nearest"),
    uniform(sparsity=0.5, threshold_rule="histogram"),
])
def test_the_prepared_native_call_trains_as_the_operator(monkeypatch, plan):
    """On the CPU's native engine a hook runs the C kernels directly (the statistics into the layer's own
    array, prune + quantise through a prepared :class:`~gradstats.ops.fused.NativeCall`, seeds drawn from the
    handle's generator as prune_quantize draws them): the same weights and records, bit for bit, as the
    hook through stats_vector and prune_quantize."""
    from gradstats.ops import fused

    data = batches()
    fast, h_fast = train(_seeded_net(), data, plan)
    calls = []
    call = fused.NativeCall.__call__
    monkeypatch.setattr(fused.NativeCall, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    again, _ = train(_seeded_net(), data, plan)
    assert calls and same_weights(fast, again)                   # the prepared call ran, and deterministically
    monkeypatch.setattr(fused.NativeCall, "covers", lambda self, scale=1.0: False)
    monkeypatch.setattr(APPLY.Applied, "_compress_on", _through_the_operators(APPLY.Applied._compress_on))
    slow, h_slow = train(_seeded_net(), data, plan)
    assert same_weights(fast, slow)
    keys = ("layer", "seq", "threshold", "scale", "achieved_sparsity", "underflow_fraction", "gain", "mu", "sigma")
    assert [[r[k] for k in keys] for r in h_fast.history] == [[r[k] for k in keys] for r in h_slow.history]


def _through_the_operators(compress_on):
    """_compress_on with the statistics through stats_vector (as where the caller's ``flat`` check says no)."""
    def run(self, name, g):
        keep = self.refresher.refresh
        self.refresher.refresh = lambda n, g_, r, flat=False: keep(n, g_, r, flat=False)
        try:
            return compress_on(self, name, g)
        finally:
            self.refresher.refresh = keep
    return run


def _seeded_net():
    torch.manual_seed(0)
    return Net()
