"""The README's Python examples run as shown and do what their text says: each block is run, then
checked by the check of :data:`CHECKS` whose marker it contains (a block without one fails)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import gradstats

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _the_tour(ns, out):
    """trace, fit, threshold, best format, recommend, save, apply: 20 steps traced, a threshold
    that prunes 85% by its model, 6-bit formats, and the plan saved and enforced."""
    run = ns["run"]
    assert run.steps == list(range(20)) and "conv2" in run.layers
    assert ns["g"].numel() > 0
    mu, sigma, fit = ns["mu"], ns["sigma"], ns["fit"]
    assert sigma > 0 and set(fit.params) == {"lognormal", "normal", "laplace"} and fit.best in fit.params
    expected = gradstats.pruning.expected_sparsity(ns["a"], mu=mu, sigma=sigma, p0=fit.zero_fraction)
    assert ns["a"] > 0 and float(expected) == pytest.approx(0.85, abs=1e-6)
    assert ns["best"].format.bits == 6
    plan = ns["plan"]
    assert gradstats.Plan.load(f"{ns['path']}/plan.json").to_dict() == plan.to_dict()
    table = plan.to_dataframe().set_index("layer")
    summary = ns["applied"].summary().set_index("layer")
    assert list(summary.index) == list(table.index) and (summary["format"] == table["format"]).all()
    pruned = table["sparsity"].notna()
    assert pruned.any() and (table.loc[pruned, "sparsity"] <= 0.85 + 1e-9).all()
    assert (summary.loc[pruned, "achieved_sparsity"] > 0.5).all()
    assert "conv2" in out and str(ns["best"].format) in out


def _resume(ns, out):
    """A run resumed from a checkpoint goes on numbering its steps: [0, 1, 2, 3, 4], as printed."""
    assert gradstats.open_run(ns["path"]).steps == [0, 1, 2, 3, 4]
    assert out.strip() == "[0, 1, 2, 3, 4]"


def _formats(ns, out):
    """The printed constants of E4M3, values on its grid, and FP4 blocks of 32 with one scale each."""
    fmt, x, q, s = ns["fmt"], ns["x"], ns["q"], ns["s"]
    assert (fmt.max, fmt.min_subnormal, fmt.epsilon) == (448.0, 2.0 ** -9, 0.125)
    assert out.split() == ["448.0", "0.001953125", "0.125"]
    assert q.shape == x.shape and not torch.equal(q, x)                 # it rounds
    assert torch.equal(gradstats.quantize(q, fmt, scale=2.0 ** 12), q)  # onto the grid: rounding it again keeps it
    # E2M1 has 8 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6): at most 8 per block under one shared scale
    assert s.shape == x.shape and max(len(set(b.abs().tolist())) for b in s.split(32)) <= 8


def _apply_logged(ns, out):
    """apply(..., log_to=tracer): the plan's records are in the traced run, every step, format e5m2."""
    run = gradstats.open_run(ns["tracer"].path)
    applied = run.table("applied")
    assert run.steps == [0, 1, 2] and len(applied) > 0
    assert set(applied["step"]) == {0, 1, 2} and set(applied["format"].astype(str)) == {"e5m2"}


def _callback(ns, out):
    """A Trainer with the callback: its run holds each of the three steps."""
    trainer = ns["trainer"]
    callbacks = getattr(trainer, "callback_handler", trainer).callbacks      # transformers / lightning
    (cb,) = [c for c in callbacks if isinstance(c, ns["GradstatsCallback"])]
    run = gradstats.open_run(cb.session.run_dir)
    assert run.steps == [0, 1, 2] and len(run.layers) > 0
    return run


def _huggingface(ns, out):
    run = _callback(ns, out)
    assert ns["trainer"].state.global_step == 3 and "transformer.h.0.mlp.c_fc" in run.layers


def _lightning(ns, out):
    run = _callback(ns, out)
    assert ns["trainer"].global_step == 3 and run.layers == ["net.0", "net.2"]


#: (a text only that block contains, its check)
CHECKS = [("gradstats.recommend(run", _the_tour), ("resume=True", _resume), ('FPFormat.parse("e4m3fn")', _formats),
          ("log_to=tracer", _apply_logged), ("GPT2LMHeadModel", _huggingface), ("lightning.Trainer", _lightning)]


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, capsys):
    checks = [check for marker, check in CHECKS if marker in BLOCKS[i]]
    assert len(checks) == 1, f"README python block {i} matches {len(checks)} checks: give it one in CHECKS"
    capsys.readouterr()
    ns = {"__name__": "__readme__"}
    exec(compile(BLOCKS[i], f"README.md[python block {i}]", "exec"), ns)
    checks[0](ns, capsys.readouterr().out)
