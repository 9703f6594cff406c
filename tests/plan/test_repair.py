"""What the check approves is what the plan carries: a layer recommend repairs resolves to the
choice that passed, every changed field included, so ``plan.verify(run)`` passes on the plan's
calibration steps and apply enforces the repaired rule."""
import math

import pytest
import torch
from torch import nn

import gradstats
from gradstats.plan import Plan, PlanEntry
from gradstats.plan import checks as checks_mod
from gradstats.plan.checks import repair


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """Three Linear layers, every gradient sampled at four steps: MX 4-bit scales rounded down clip
    block maxima here (gain 0.96-0.98), 6-bit nearest rounding shrinks 85% pruning's values."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    path = tmp_path_factory.mktemp("repair")
    with gradstats.trace(m, path, sample_every=1) as t:
        for _ in range(4):
            m(torch.randn(32, 64)).sin().sum().backward()
            t.step()
    return gradstats.open_run(path)


def repaired(plan) -> dict[str, str]:
    """Per repaired layer of ``plan``, what it was repaired to (the label of its note)."""
    return {c["layer"]: c["note"].split(" -> ", 1)[1].split("; ", 1)[0] for c in plan.checks
            if c["note"] and " -> " in c["note"]}


def carries(rule, label: str) -> bool:
    """Whether ``rule`` is what the repair's ``label`` (:func:`gradstats.plan.checks._alternatives`) names."""
    ok = True
    if "rceil" in label:
        ok &= rule.scale_rounding == "rceil"
    if "stochastic rounding" in label:
        ok &= rule.rounding == "stochastic"
    if label.startswith("scale shift 0") or "amax scale" in label:
        ok &= rule.scale_shift == 0
    if " with stochastic rounding" in label:
        ok &= str(rule.format) == label.split(" with ")[0]
    if label.startswith("full precision"):
        ok &= rule.format is None
    if "without pruning" in label:
        ok &= not rule.prunes
    return bool(ok)


#: unbounded, the 4-bit plans keep their formats and carry the check's repairs; bounded, the noise
#: bound widens their formats (mixed plans, which must pass their own verify too)
KWARGS = (dict(bits=4, granularity="mx", noise_bound=None), dict(bits=4, granularity="mx", rounding="nearest", noise_bound=None),
          dict(bits=4, granularity="nvfp4", noise_bound=None),
          dict(bits=4, granularity="nvfp4", rounding="nearest", noise_bound=None),
          dict(bits=4, granularity="mx"), dict(bits="auto"),
          dict(bits=6, sparsity=0.85), dict(bits=6, sparsity=0.85, noise_bound=None))


def test_recommended_plans_pass_their_own_verify(mlp_run):
    for kw in KWARGS:
        plan = gradstats.recommend(mlp_run, output_layer=False, **kw)
        rules = plan.resolve(mlp_run)
        done = repaired(plan)
        if (kw.get("granularity") == "mx" or kw.get("rounding") == "nearest") and "noise_bound" in kw:
            assert done, (kw, plan.checks)          # these plans have repairs to carry
        for layer, label in done.items():
            assert carries(rules[layer], label), (kw, layer, label, rules[layer])
        assert all(c["ok"] for c in plan.checks), kw
        assert not any("no alternative" in (c["note"] or "") for c in plan.checks), kw
        # same steps, same seed: verify replays exactly what the check approved
        v = plan.verify(mlp_run)
        assert v.steps == plan.checks[0]["calibration_steps"]
        assert v.ok, (kw, v.failures)
        per = v.per_layer().set_index("layer")
        assert set(per.index) == {n for n, r in rules.items() if not r.is_identity}
        for c in plan.checks:
            if c["layer"] not in per.index:
                assert rules[c["layer"]].is_identity
                continue
            row = per.loc[c["layer"]]
            assert bool(row["ok"]) and row["rule"] == c["rule"] == rules[c["layer"]].describe(), (kw, c["layer"])
            for q in ("replayed_gain", "replayed_overflow", "replayed_sparsity"):
                if c[q] is not None:
                    assert math.isclose(row[q], c[q], rel_tol=1e-9, abs_tol=1e-12), (kw, c["layer"], q)


def test_mx_repair_to_rounded_up_scales_is_carried_and_applied(mlp_run):
    """The reported case: MX 4-bit scales rounded down fail, rounded up (rceil) pass; the plan carried
    the note but not the rounding, so verify failed on every layer and apply enforced the floor rule."""
    plan = gradstats.recommend(mlp_run, bits=4, granularity="mx", output_layer=False, noise_bound=None)
    rules = plan.resolve(mlp_run)
    rceil = [n for n, label in repaired(plan).items() if "rceil" in label]
    assert rceil and all(rules[n].scale_rounding == "rceil" for n in rceil)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    with gradstats.apply(m, plan) as h:
        assert all(h.rules[n].scale_rounding == "rceil" for n in rceil)


def test_repair_writes_every_changed_field_and_keeps_the_entry(mlp_run):
    """A layer's exact entry is rewritten with the fields the choice changes and keeps what else it set
    (here the threshold rule); an entry after it that selects module types and sets a changed field
    again is overridden by a last exact entry."""
    steps = checks_mod.calibration_steps(mlp_run, ["0", "2"])
    mx = dict(format="e2m1fn", scale="amax", block_size=32, rounding="stochastic")
    plan = Plan([PlanEntry("0", **mx), PlanEntry("0", types=("Linear",), **mx, scale_rounding="floor"),
                 PlanEntry("2", format="e2m3fn", scale="amax", rounding="nearest", sparsity=0.85,
                           threshold_rule="lognormal")])
    before = plan.resolve(mlp_run)
    out = repair(plan, mlp_run, steps, candidates=[], bias_bound=0.01, flush_bound=0.01)
    after = out.resolve(mlp_run)
    notes = {c["layer"]: c["note"] for c in out.checks}
    assert "rceil" in notes["0"] and after["0"].scale_rounding == "rceil"
    assert "stochastic rounding" in notes["2"] and after["2"].rounding == "stochastic"
    assert after["2"].threshold_rule == "lognormal" and after["2"].sparsity == 0.85
    for n in ("0", "2"):
        changed = {k for k in ("format", "scale", "scale_value", "scale_shift", "rounding", "block_size",
                               "scale_format", "scale_rounding", "sparsity", "threshold_rule")
                   if getattr(before[n], k) != getattr(after[n], k)}
        assert changed == ({"scale_rounding"} if n == "0" else {"rounding"}), (n, changed)
    assert out.verify(mlp_run, steps=steps).ok


def test_a_layer_nothing_passes_is_left_in_full_precision(mlp_run, monkeypatch):
    """Never kept as it failed: where pruning alone fails too, the layer is neither rounded nor pruned,
    and the note says why; where not even that passes, the same, said so."""
    steps = checks_mod.calibration_steps(mlp_run, ["0", "2"])
    plan = Plan.uniform(format="e3m2fn", rounding="stochastic", scale="amax", sparsity=0.5, output_layer=False,
                        prune_at=False)
    real = checks_mod.check_layer

    def failing(when):
        def check(run, layer, rule, *a, **kw):
            rows = real(run, layer, rule, *a, **kw)
            if when(rule):
                rows = [{**r, "ok": False, "problems": ["made to fail"]} for r in rows]
            return rows
        return check

    monkeypatch.setattr(checks_mod, "check_layer", failing(lambda rule: rule.prunes))
    out = repair(plan, mlp_run, steps, candidates=[], bias_bound=0.01, flush_bound=0.01)
    rules = out.resolve(mlp_run)
    assert out.checks and all(r.is_identity for r in rules.values())
    for c in out.checks:
        assert c["ok"] and "-> full precision without pruning; full precision failed at step" in c["note"], c["note"]
    assert out.verify(mlp_run, steps=steps).ok
    monkeypatch.setattr(checks_mod, "check_layer", failing(lambda rule: True))
    out = repair(plan, mlp_run, steps, candidates=[], bias_bound=0.01, flush_bound=0.01)
    assert all(r.is_identity for r in out.resolve(mlp_run).values())
    assert all("no alternative passed" in c["note"] and "left in full precision; no pruning" in c["note"]
               for c in out.checks)
