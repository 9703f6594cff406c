"""The tracer: exact capture of dL/d(output), passivity, messy models, bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import gradstats
from gradstats.layers import module_types
from gradstats.ops.layout import channel_dim, gemm_matrix
from gradstats.stats import tensor_stats

# ----------------------------------------------------------------------------- models

class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ResCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = ResBlock(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = self.block(self.stem(x))
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))


class TransformerBlock(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]   # tuple output
        return x + self.mlp(self.ln2(x))


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, _ = self.lstm(x)          # (output, (h, c))
        return self.head(out[:, -1])


class Reuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


CASES = {
    "rescnn": (ResCNN, lambda: torch.randn(4, 1, 8, 8)),
    "transformer": (TransformerBlock, lambda: torch.randn(3, 5, 16)),
    "lstm": (LSTMModel, lambda: torch.randn(4, 7, 6)),
    "reuse": (Reuse, lambda: torch.randn(5, 8)),
}


def retained_grads(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[tuple[str, int], torch.Tensor]:
    """dL/d(output) of each call of each named module, via torch.autograd.grad."""
    outs: list[tuple[str, int, torch.Tensor]] = []
    calls: dict[str, int] = {}
    handles = []
    mods = dict(model.named_modules())
    for n in names:
        def hook(m, i, o, n=n):
            t = o[0] if isinstance(o, tuple) else o
            outs.append((n, calls.get(n, 0), t))
            calls[n] = calls.get(n, 0) + 1
        handles.append(mods[n].register_forward_hook(hook))
    loss = model(x).square().mean()
    grads = torch.autograd.grad(loss, [t for _, _, t in outs])
    for h in handles:
        h.remove()
    return {(n, c): g for (n, c, _), g in zip(outs, grads)}


@pytest.mark.parametrize("case", list(CASES))
def test_capture_equals_autograd_exactly(case, tmp_path):
    build, make_x = CASES[case]
    torch.manual_seed(1)
    model = build()
    x = make_x()
    with gradstats.trace(model, tmp_path, samples=None, sample_every=1) as tr:
        model(x).square().mean().backward()
        tr.step()
    names = list(tr.modules)
    ref = retained_grads(model, x, names)
    run = gradstats.open_run(tmp_path)
    stats = run.stats()
    mods = dict(model.named_modules())
    for (name, call), g in ref.items():
        # a gradient's sample is its channels-last GEMM matrix (here whole: samples=None)
        got = run.sample_matrix(name, 0, call=call)
        cd = channel_dim(module_types(mods[name] if name in mods else model), g.dim())
        assert torch.equal(got, gemm_matrix(g, cd).float()), (name, call)
        assert torch.equal(run.samples(name, 0, call=call), got.reshape(-1))
        row = stats[(stats.layer == name) & (stats.call == call)].iloc[0]
        exp = tensor_stats(g)
        assert row["n"] == exp["n"] and row["n_zero"] == exp["n_zero"]
        assert row["sum_ln_abs"] == pytest.approx(exp["sum_ln_abs"], rel=1e-6)
        np.testing.assert_array_equal(row["hist"], exp["hist"])
    if case == "reuse":
        assert sorted(stats[stats.layer == "shared"]["call"]) == [0, 1]


def test_compiled_model_is_traced(tmp_path):
    """A model run through torch.compile is traced like the eager one: the hooks registered in
    the compiled forward fire in the backward and record the same gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(32, 8)
    ref = retained_grads(model, x, ["0", "2"])
    compiled = torch.compile(model)
    with gradstats.trace(model, tmp_path, samples=None, sample_every=1) as tr:
        for _ in range(2):
            compiled(x).square().mean().backward()
            tr.step()
    run = gradstats.open_run(tmp_path)
    stats = run.stats()
    assert run.steps == [0, 1] and len(stats) == 4
    for (name, call), g in ref.items():
        for step in (0, 1):
            torch.testing.assert_close(run.samples(name, step, call=call), g.reshape(-1))
            row = stats[(stats.layer == name) & (stats.step == step)].iloc[0]
            exp = tensor_stats(g)
            assert row["n"] == exp["n"] and row["n_zero"] == exp["n_zero"]
            assert row["sum_abs"] == pytest.approx(exp["sum_abs"], rel=1e-5)


def test_default_selection_is_modules_with_parameters(tmp_path):
    model = ResCNN()
    tr = gradstats.Tracer(model, tmp_path)
    assert set(tr.modules) == {"stem", "block.conv1", "block.bn1", "block.conv2", "block.bn2", "fc"}
    assert set(gradstats.Tracer(model, tmp_path, layers="block.conv*").modules) == {"block.conv1", "block.conv2"}
    assert set(gradstats.Tracer(model, tmp_path, layers="re:.*bn\\d").modules) == {"block.bn1", "block.bn2"}
    pick = gradstats.Tracer(model, tmp_path, layers=lambda n, m: isinstance(m, nn.Linear))
    assert list(pick.modules) == ["fc"]


def train(model: nn.Module, steps: int, tracer_path=None, **kw) -> nn.Module:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tr = gradstats.trace(model, tracer_path, optimizer=opt, **kw).attach() if tracer_path else None
    for _ in range(steps):
        x = torch.randn(8, 1, 8, 8)
        y = torch.randint(0, 10, (8,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if tr:
        tr.detach()
    return model


def test_passive_bit_identical_training(tmp_path):
    torch.manual_seed(3)
    base = ResCNN()
    a = train(copy.deepcopy(base), 6)
    b = train(copy.deepcopy(base), 6, tmp_path, sample_every=2, samples=100,
              kinds=("grad", "act", "weight", "wgrad"))
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    run = gradstats.open_run(tmp_path)
    assert run.steps == list(range(6))
    assert set(run.stats()["kind"]) == {"grad", "act", "weight", "wgrad"}


def test_schedules_and_sampling(tmp_path):
    model = ResCNN()
    train(model, 7, tmp_path, every=3, sample_every=[1, 4], samples=50)
    run = gradstats.open_run(tmp_path)
    stats = run.stats()
    assert sorted(stats["step"].unique()) == [0, 3, 6]
    idx = run.sample_index()
    assert sorted(idx["step"].unique()) == [1, 4]
    s = run.samples("stem", 4)          # whole groups of tokens (8 channels each) hold the 50 asked for
    assert s.shape == (16 * 8,) and int(idx[(idx.layer == "stem") & (idx.step == 4)]["n_total"].iloc[0]) == 8 * 8 * 8 * 8
    with pytest.raises(ValueError, match="exist at steps \\[1, 4\\]"):
        run.samples("stem", 3)
    with pytest.raises(ValueError, match="not in this run"):
        run.samples("nope", 1)


def test_sample_is_uniform_subset_of_token_groups(tmp_path):
    """A gradient's sample: whole aligned groups of 32 tokens with all their channels (the blocks a
    GEMM reads stay whole), drawn uniformly without replacement, at least as many values as asked."""
    lin = nn.Sequential(nn.Linear(1, 4, bias=False))
    with gradstats.trace(lin, tmp_path, samples=5000, sample_every=1) as tr:
        x = torch.ones(20000, 1, requires_grad=True)
        w = torch.arange(20000, dtype=torch.float32)[:, None].expand(20000, 4)
        (lin(x) * w).sum().backward()          # dL/dy[t, j] = t
        tr.step()
    m = gradstats.open_run(tmp_path).sample_matrix("0", 0)
    assert m.shape == (40 * 32, 4)                              # ceil(5000 / (32 * 4)) groups
    assert bool((m == m[:, :1]).all())                          # every token with all its channels
    tok = m[:, 0].reshape(40, 32)
    assert bool((tok[:, 0] % 32 == 0).all()) and bool((tok.diff(dim=1) == 1).all())   # aligned, consecutive
    assert len(set(tok[:, 0].tolist())) == 40                   # without replacement
    assert abs(tok.mean().item() - 9999.5) < 4 * 5774 / np.sqrt(40)   # uniform over the groups


def test_sample_indices_uniform_without_replacement():
    """The cheap sampler for k << n: distinct indices, every index equally likely, and positions
    in the sample carry no order (the law of randperm(n)[:k])."""
    from scipy import stats as sps

    from gradstats.tracer import sample_indices

    n, k, reps = 100_000, 2_000, 200
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(20)
    first = torch.zeros(20)
    for _ in range(reps):
        idx = sample_indices(n, k, g, torch.device("cpu"))
        assert idx.numel() == k and idx.unique().numel() == k
        assert 0 <= int(idx.min()) and int(idx.max()) < n
        counts += torch.bincount(idx * 20 // n, minlength=20)
        first += torch.bincount(idx[:50] * 20 // n, minlength=20)
    assert sps.chisquare(counts.numpy()).pvalue > 1e-3      # uniform over the index range
    assert sps.chisquare(first.numpy()).pvalue > 1e-3       # and in random order


def test_messy_inputs(tmp_path):
    """dict outputs, no-grad eval passes, in-place ops after the module, non-contiguous
    outputs, outputs that do not require grad, and autocast."""
    class Messy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 6)
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.b = nn.Linear(6, 6)

        def forward(self, x):
            x = self.frozen(x)                 # output requires no grad: skipped
            h = self.a(x)
            h = torch.relu_(h)                 # in-place after the module
            y = self.b(h).t()                  # non-contiguous downstream
            return {"y": y}

    model = Messy()
    ref = Messy(); ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    with gradstats.trace(model, tmp_path, samples=None, sample_every=1) as tr:
        with torch.no_grad():
            model(x)                            # eval pass: not recorded
        model(x)["y"].square().sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)["y"].float().square().sum().backward()
        tr.step()
    run = gradstats.open_run(tmp_path)
    stats = run.stats()
    assert "frozen" not in set(stats.layer)
    assert sorted(stats[stats.layer == "a"]["call"]) == [0, 1]
    # dL/d(a's output) before the in-place relu: relu mask times upstream grad
    h = ref.a(ref.frozen(x)).detach().requires_grad_(True)
    (ref.b(torch.relu(h)).t().square().sum()).backward()
    assert torch.equal(run.samples("a", 0, call=0), h.grad.reshape(-1))
    bf = run.samples("b", 0, call=1)
    assert bf.dtype == torch.float32 and torch.equal(bf, bf.bfloat16().float())


def test_accumulation_records_each_micro_batch(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3))
    with gradstats.trace(model, tmp_path) as tr:
        for _ in range(2):
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
            tr.step()
    st = gradstats.open_run(tmp_path).stats()
    assert sorted(zip(st.step, st.call)) == [(s, c) for s in (0, 1) for c in range(3)]


@pytest.mark.parametrize("lagging_writer", [False, True])
def test_max_bytes_stops_sampling_with_warning(tmp_path, monkeypatch, lagging_writer):
    """Sampling stops at the byte budget while statistics go on, also when the writer thread lags
    behind the training (a slow disk, a busy machine): queued sample bytes count."""
    import time

    from gradstats.run import RunWriter

    if lagging_writer:
        write = RunWriter._write
        monkeypatch.setattr(RunWriter, "_write", lambda self, fl: (time.sleep(0.05), write(self, fl))[1])
    model = nn.Sequential(nn.Linear(100, 1000))
    with pytest.warns(UserWarning, match="byte budget"):
        with gradstats.trace(model, tmp_path, samples=None, sample_every=1, max_bytes=40_000) as tr:
            for _ in range(10):
                model(torch.randn(4, 100)).sum().backward()
                tr.step()
    run = gradstats.open_run(tmp_path)
    assert run.steps == list(range(10))                       # statistics go on
    assert 1 <= len(run.sample_index()) <= 2                   # 16 kB each: two fit in 40 kB


def test_run_readable_while_in_progress(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3))
    tr = gradstats.trace(model, tmp_path).attach()
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
        tr.step()
    tr.flush()
    assert gradstats.open_run(tmp_path).steps == [0, 1, 2]
    tr.detach()
    assert gradstats.open_run(tmp_path).manifest["layers"][0]["output_shape"] == [2, 3]


def test_closed_steps_are_committed_in_batches(tmp_path):
    """flush_secs: closed steps wait for the next commit (by time, a sampled step, flush() or
    detach); 0 commits every step."""
    def steps_on_disk(path):
        return gradstats.open_run(path).steps

    model = nn.Sequential(nn.Linear(3, 3))
    tr = gradstats.trace(model, tmp_path / "a", sample_every=None, flush_secs=3600).attach()
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
        tr.step()
    tr._writer.wait()
    assert steps_on_disk(tmp_path / "a") == []                 # within the hour: nothing yet
    tr.flush()
    assert steps_on_disk(tmp_path / "a") == [0, 1, 2]
    tr.detach()
    tr = gradstats.trace(model, tmp_path / "b", sample_every=None, flush_secs=0).attach()
    for i in range(3):
        model(torch.randn(2, 3)).sum().backward()
        tr.step()
        tr._writer.wait()
        assert steps_on_disk(tmp_path / "b") == list(range(i + 1))
    tr.detach()
    assert len(list((tmp_path / "b" / "stats").glob("*.parquet"))) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"flush_secs": -1}, "flush_secs must be"),
    ({"every": 0}, "every must be a positive"),
    ({"sample_every": -2}, "sample_every must be a positive"),
    ({"layers": "nothing*"}, "matches no module"),
    ({"kinds": ("grads",)}, "kinds must be"),
    ({"samples": 0}, "samples must be a positive"),
    ({"layers": 3}, "layers= must be"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradstats.trace(nn.Sequential(nn.Linear(2, 2)), tmp_path, **kwargs)


def test_not_a_module_and_unwritable_path(tmp_path):
    with pytest.raises(ValueError, match="torch.nn.Module"):
        gradstats.trace(lambda x: x, tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot write a run"):
        gradstats.trace(nn.Sequential(nn.Linear(2, 2)), blocker / "run").attach()


def test_a_path_that_is_not_a_path_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"path of a run directory \(a str or pathlib.Path\).*got int"):
        gradstats.trace(nn.Sequential(nn.Linear(2, 2)), 123)


def test_optimizer_and_manual_step_conflict(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstats.trace(model, tmp_path, optimizer=opt) as tr:
        with pytest.raises(ValueError, match="advances on optimizer.step"):
            tr.step()


# ----------------------------------------------------------------------------- names and selection

class FunctionalAttention(nn.Module):
    """nn.MultiheadAttention calls its out_proj functionally: the module is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_modules_never_called_are_left_out_once(tmp_path, caplog):
    model = FunctionalAttention()
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        with gradstats.trace(model, tmp_path, sample_every=1, kinds=("grad", "wgrad")) as tr:
            for _ in range(3):
                model(torch.randn(8, 6, 8)).square().mean().backward()
                tr.step()
    run = gradstats.open_run(tmp_path)
    assert "attn.out_proj" in tr.modules and run.layers == ["attn", "head"]
    assert set(run.stats()["layer"]) == {"attn", "head"}
    said = [r for r in caplog.records if "attn.out_proj" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"
    # asked for by name, the same is a warning
    caplog.clear()
    with caplog.at_level("INFO", logger="gradstats.tracer"):
        with gradstats.trace(model, tmp_path / "named", layers="attn*") as tr:
            model(torch.randn(2, 4, 8)).sum().backward()
            tr.step()
    assert [r.levelname for r in caplog.records if "attn.out_proj" in r.getMessage()] == ["WARNING"]
    from gradstats.report import report  # the report of such a run works
    report(run, tmp_path / "report")


class OwnWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x @ self.w)


def test_root_module_with_parameters_is_named(tmp_path):
    model = OwnWeight()
    with gradstats.trace(model, tmp_path) as tr:
        model(torch.randn(3, 4)).sum().backward()
        tr.step()
    run = gradstats.open_run(tmp_path)
    assert run.layers == ["(root)", "fc"] and "" not in set(run.stats()["layer"])
    plan = gradstats.Plan.uniform(sparsity=0.5, layers="*")
    assert list(plan.resolve(model)) == ["(root)", "fc"]
    with gradstats.apply(model, plan) as applied:                 # apply hooks the root too
        model(torch.randn(64, 4)).square().mean().backward()
    assert set(applied.to_dataframe()["layer"]) == {"(root)", "fc"}


def test_wrapped_models_keep_the_users_names(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for i, wrapped in enumerate([torch.compile(model, backend="eager"), nn.DataParallel(model),
                                 torch.compile(nn.DataParallel(model), backend="eager")]):
        with gradstats.trace(wrapped, tmp_path / str(i)) as tr:
            wrapped(torch.randn(4, 8)).sum().backward()
            tr.step()
        assert gradstats.open_run(tmp_path / str(i)).layers == ["0", "2"]
        # a plan made from the eager run resolves on the wrapped model, and the other way round
        plan = gradstats.Plan.uniform(sparsity=0.5, output_layer=False)
        assert list(plan.resolve(wrapped)) == list(plan.resolve(model)) == ["0", "2"]
        assert list(plan.resolve(gradstats.open_run(tmp_path / str(i)))) == ["0", "2"]
        # the output layer found through the wrapper too
        assert list(gradstats.Plan.uniform(sparsity=0.5).resolve(wrapped)) == ["0"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_records_each_gradient_once(tmp_path, reentrant):
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

        def forward(self, x, ckpt):
            inner = lambda t: torch.tanh(self.b(torch.tanh(self.a(t))))        # noqa: E731
            return self.c(checkpoint(inner, x, use_reentrant=reentrant) if ckpt else inner(x))

    x = torch.randn(5, 4, requires_grad=True)
    stats, grads = {}, {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        net = Net()
        plan = gradstats.Plan.uniform(format="e2m1fn", rounding="nearest", scale="fixed", scale_value=4.0,
                                      layers=["a", "b"])
        with gradstats.trace(net, tmp_path / f"run{ckpt}") as t, gradstats.apply(net, plan):
            net(x, ckpt).square().sum().backward()
            t.step()
        stats[ckpt] = gradstats.open_run(tmp_path / f"run{ckpt}").stats()
        grads[ckpt] = net.a.weight.grad.clone()
    assert (stats[True]["call"] == 0).all() and len(stats[True]) == len(stats[False]) == 3
    np.testing.assert_allclose(stats[True]["sum_abs"], stats[False]["sum_abs"], rtol=1e-6)
    torch.testing.assert_close(grads[True], grads[False])      # the plan is enforced once, as without


def test_trace_config_is_the_keywords_as_one_value(tmp_path):
    """TraceConfig's defaults are trace's keywords; trace takes a config, the keywords, or both when
    they agree; a keyword that contradicts the config is a ValueError naming both."""
    import dataclasses
    import inspect

    from gradstats.tracer import TraceConfig

    sig = inspect.signature(gradstats.trace).parameters
    for f in dataclasses.fields(TraceConfig):
        assert sig[f.name].default == f.default, f.name
    assert set(sig) - {f.name for f in dataclasses.fields(TraceConfig)} == {"model", "path", "config", "optimizer"}
    m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    cfg = TraceConfig(every=2, sample_every=None, kinds=["grad", "act"], flush_secs=0)
    with gradstats.trace(m, tmp_path / "a", config=cfg, every=2) as t:   # an agreeing keyword is fine
        for _ in range(4):
            m(torch.randn(5, 4)).sum().backward(); t.step()
    assert t.config is cfg and t.kinds == ("grad", "act")
    run = gradstats.open_run(tmp_path / "a")
    assert run.steps == [0, 2] and sorted(run.stats()["kind"].unique()) == ["act", "grad"]
    assert run.manifest["capture"]["every"] == 2 and run.manifest["capture"]["kinds"] == ["grad", "act"]
    with pytest.raises(ValueError, match=r"every=3\) contradicts the config's every=2"):
        gradstats.trace(m, tmp_path / "b", config=cfg, every=3)
    with pytest.raises(ValueError, match="config must be a gradstats.tracer.TraceConfig"):
        gradstats.trace(m, tmp_path / "b", config={"every": 2})
    with pytest.raises(ValueError, match="kinds must be a non-empty subset"):
        TraceConfig(kinds=("grads",))
    with pytest.raises(ValueError, match="alarms must be True"):
        TraceConfig(alarms="yes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.every = 5  # type: ignore[misc]
