"""trace and apply on a torch.compile'd model: no graph break, no recompile per module or step, the
same statistics and the same plan as eager (gradstats.tracer.taps)."""
from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo
from torch import nn

import gradstats


class Shapes(nn.Module):
    """Layers of several shapes and ``groups`` (the kind that made dynamo recompile per module):
    a stem, a pointwise expansion, a depthwise conv, BatchNorms, a residual and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, 2, 1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.expand = nn.Conv2d(8, 24, 1, bias=False)
        self.dw = nn.Conv2d(24, 24, 3, 1, 1, groups=24, bias=False)
        self.bn1 = nn.BatchNorm2d(24)
        self.project = nn.Conv2d(24, 8, 1, bias=False)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn0(self.stem(x)))
        h = h + self.project(torch.relu(self.bn1(self.dw(self.expand(h)))))
        return self.head(h.mean((2, 3)))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 1, 12, 12, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def _train(model: nn.Module, run_model: nn.Module, batches, after=None, weights=None) -> None:
    """SGD steps on ``batches``. ``weights``: a list that each step's starting weights (and BatchNorm
    buffers) are appended to, or, where it already holds them, are loaded from before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i, (x, y) in enumerate(batches):
        if weights is not None:
            if len(weights) > i:
                model.load_state_dict(weights[i])
            else:
                weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        opt.zero_grad()
        nn.functional.cross_entropy(run_model(x), y).backward()
        opt.step()
        if after is not None:
            after()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_trace_of_a_compiled_model_equals_eager(tmp_path, fresh_dynamo):
    """Statistics of every layer and step equal eager tracing's (same weights, same batches),
    sampled steps and block statistics included; one graph, no break, no recompile. Each compiled step
    starts from the eager step's weights: the two graphs round differently, and from the same start the
    weights would drift apart step by step (the stem's output gradient, below a BatchNorm, then differed
    by 1.4e-4 in sum ln^2|g| at the fourth step on one CPU thread)."""
    batches = _batches(4)
    stats = {}
    weights: list = []
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = Shapes()
        run_model = torch.compile(model, backend="inductor") if mode == "compiled" else model
        tracer = gradstats.trace(run_model, tmp_path / mode, sample_every=2).attach()
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            _train(model, run_model, batches, tracer.step, weights)
        tracer.detach()
        run = gradstats.open_run(tmp_path / mode)
        stats[mode] = run.stats().sort_values(["step", "layer"]).reset_index(drop=True)
        manifest = json.loads((tmp_path / mode / "manifest.json").read_text())
        assert ("compiled" in manifest) == (mode == "compiled")
        if mode == "compiled":
            assert len(run.sample_index()) == len(gradstats.open_run(tmp_path / "eager").sample_index()) > 0
            assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    eager, compiled = stats["eager"], stats["compiled"]
    assert len(eager) == len(compiled) == 4 * 7
    assert (eager[["step", "layer", "kind", "n", "n_zero"]] == compiled[["step", "layer", "kind", "n", "n_zero"]]).all().all()
    # (not min_abs: the smallest magnitude of a gradient is its most rounding-sensitive value)
    for col in ("sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq", "max_abs"):
        torch.testing.assert_close(torch.tensor(compiled[col].to_numpy()), torch.tensor(eager[col].to_numpy()),
                                   rtol=1e-4, atol=0)
    hist_e, hist_c = torch.tensor(list(eager["hist"])), torch.tensor(list(compiled["hist"]))
    assert (hist_c - hist_e).abs().sum(1).max() <= 2       # a value on a binade's edge may round across it


def test_apply_on_a_compiled_model_matches_eager(fresh_dynamo):
    """A plan applied to the compiled model makes the same calls, at the same thresholds and scales
    within rounding, as on the eager model; the weight gradients agree; no recompile."""
    batches = _batches(3)
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.6, output_layer=False)
    out = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = Shapes()
        run_model = torch.compile(model, backend="aot_eager") if mode == "compiled" else model
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            with gradstats.apply(run_model, plan) as applied:
                _train(model, run_model, batches)
        out[mode] = (applied.to_dataframe(), model.stem.weight.detach().clone())
        planned = len(applied.rules)
    (de, we), (dc, wc) = out["eager"], out["compiled"]
    assert planned >= 4 and list(dc["layer"]) == list(de["layer"]) and len(de) == 3 * planned
    torch.testing.assert_close(torch.tensor(dc["threshold"].to_numpy()), torch.tensor(de["threshold"].to_numpy()),
                               rtol=1e-4, atol=0, equal_nan=True)
    assert (dc["achieved_sparsity"] - de["achieved_sparsity"]).abs().max() < 0.02
    torch.testing.assert_close(wc, we, rtol=1e-3, atol=1e-5)
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
