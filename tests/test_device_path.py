"""The device path, run on the CPU: GRADSTATS_ENGINE=triton with TRITON_INTERPRET=1 sends CPU
tensors through exactly the code CUDA tensors take (the Triton statistics and fused kernels, apply's
deferred settling, the tracer's outbox). Checked on a model no other test uses: statistics equal to
the C kernel's, no host synchronisation in the backward pass, at most one per step, at most 2
whole-gradient ATen operations per layer-call beyond the model's own backward."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

import gradstats
from gradstats.ops.audit import Audit
from gradstats.ops.triton import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")


class Tagger(nn.Module):
    """A depthwise-separable 1-d convolution, a GRU and a Linear head tagging each step."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv1d(12, 12, 5, padding=2, groups=12)
        self.pw = nn.Conv1d(12, 48, 1)
        self.gru = nn.GRU(48, 48, batch_first=True)
        self.mid = nn.Linear(48, 96)
        self.head = nn.Linear(96, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.pw(self.dw(x.transpose(1, 2)))).transpose(1, 2)
        h, _ = self.gru(h)
        return self.head(torch.tanh(self.mid(h))).flatten(0, 1)


def workload(seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Tagger()
    batches = [(torch.randn(16, 20, 12, generator=g) * 3, torch.randint(0, 7, (16 * 20,), generator=g))
               for _ in range(4)]
    return model, torch.optim.SGD(model.parameters(), lr=0.05), batches


def train(model, opt, batches, *, after=None):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if after is not None:
            after()


@pytest.fixture
def device_path(interpreted, monkeypatch):
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")


def traced_stats(tmp_path, name: str):
    model, opt, batches = workload()
    with gradstats.trace(model, tmp_path / name, sample_every=None, noise=False) as t:
        train(model, opt, batches, after=t.step)
    return gradstats.open_run(tmp_path / name).stats().sort_values(["step", "layer", "call"]).reset_index(drop=True)


def test_trace_statistics_equal_the_c_kernels(tmp_path, device_path, monkeypatch):
    dev = traced_stats(tmp_path, "device")
    monkeypatch.delenv("GRADSTATS_ENGINE")
    cpu = traced_stats(tmp_path, "cpu")
    assert len(dev) == len(cpu) == 4 * 5 and list(dev["layer"]) == list(cpu["layer"])
    for col in ("n", "n_zero", "n_nonfinite", "min_abs", "max_abs"):
        assert (dev[col].to_numpy() == cpu[col].to_numpy()).all(), col
    for col in ("sum_abs", "sum_sq", "sum_ln_abs_sq"):
        np.testing.assert_allclose(dev[col], cpu[col], rtol=2e-5, err_msg=col)
    # signed sums to float32 rounding of the sums of their magnitudes (the head's sums cancel to ~0)
    assert (abs(dev["sum"] - cpu["sum"]) <= 2e-5 * cpu["sum_abs"]).all()
    assert (abs(dev["sum_ln_abs"] - cpu["sum_ln_abs"]) <= 2e-5 * np.sqrt(cpu["sum_ln_abs_sq"] * cpu["n"])).all()
    assert all((a == b).all() for a, b in zip(dev["hist"], cpu["hist"]))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(dev["top_abs"], cpu["top_abs"]))


def audited(config: str):
    model, opt, batches = workload(1)
    handles = []
    tracer = applied = None
    if "trace" in config:
        import tempfile

        tracer = gradstats.trace(model, tempfile.mkdtemp(), sample_every=None, noise=False).attach()
        handles.append(tracer)
    if "apply" in config:
        applied = gradstats.apply(model, gradstats.Plan.uniform(format="e4m3fn", sparsity=0.8))
        handles.append(applied)
    train(model, opt, batches[:2], after=tracer.step if tracer else None)
    x, y = batches[2]
    smallest = 16 * 20 * 7                       # the head's output, the smallest gradient
    with Audit(big=smallest // 2) as a:
        train(model, opt, [(x, y)], after=tracer.step if tracer else None)
    for h in handles:
        h.__exit__(None, None, None)
    return a, (len(applied.rules) if applied else 0) + (5 if tracer else 0)


def test_no_host_synchronisation_in_the_backward_pass(device_path):
    plain, _ = audited("plain")
    for config in ("trace", "apply"):
        a, calls = audited(config)
        assert a.syncs["backward"] == 0, (config, dict(a.sync_names))
        assert a.syncs["backward"] + a.syncs["forward"] - plain.syncs["forward"] <= 1, (config, dict(a.sync_names))
        extra = a.big_ops["backward"] - plain.big_ops["backward"]
        assert extra <= 2 * calls, (config, extra, calls, dict(a.big_names))
        assert a.launches["backward"] >= calls        # the kernels did run


def test_apply_on_the_device_path_prunes_and_records_with_one_step_of_lag(device_path):
    model, opt, batches = workload(2)
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.8, rounding="stochastic")
    with gradstats.apply(model, plan) as applied:
        train(model, opt, batches)
    df = applied.to_dataframe()
    layers = list(applied.rules)
    assert set(df["layer"]) == set(layers)
    # each layer's first call seeds its statistics and passes unchanged: 3 of 4 calls recorded
    assert df.groupby("layer").size().to_dict() == {n: 3 for n in layers}
    assert df["seq"].min() == 1
    assert (df["achieved_sparsity"] > 0.6).all() and (df["achieved_sparsity"] < 0.95).all()
    assert np.isfinite(df["threshold"]).all() and (df["threshold"] > 0).all()
    assert (abs(df["gain"] - 1) < 0.1).all()       # unbiased pruning and rounding
    assert applied.device_calls == len(df)


def test_device_path_checkpoint_resumes_exactly(device_path):
    plan = gradstats.Plan.uniform(format="e3m2fn", sparsity=0.7, rounding="stochastic")
    model, opt, batches = workload(3)
    full = gradstats.apply(model, plan)
    train(model, opt, batches)
    want = [p.detach().clone() for p in model.parameters()]
    full.remove()

    model, opt, batches = workload(3)
    first = gradstats.apply(model, plan)
    train(model, opt, batches[:2])
    state = (first.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    first.remove()
    model2, opt2, _ = workload(3)
    model2.load_state_dict(state[1])
    opt2.load_state_dict(state[2])
    second = gradstats.apply(model2, plan)
    second.load_state_dict(state[0])
    train(model2, opt2, batches[2:])
    second.remove()
    assert all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))


@pytest.mark.gpu
def test_cuda_device_path_equals_the_interpreted_one(device_path, monkeypatch):
    """GPU twin of the tests above: the same training on CUDA and through the interpreter on the
    CPU makes the same records (the same kernels, seeds and settling)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (its CPU twins run instead)")
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.8, rounding="stochastic")
    model, opt, batches = workload(4)
    with gradstats.apply(model, plan) as a:
        train(model, opt, batches)
    cpu = a.to_dataframe()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, opt, batches = workload(4)
    model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradstats.apply(model, plan) as a:
        train(model, opt, [(x.cuda(), y.cuda()) for x, y in batches])
    gpu = a.to_dataframe()
    assert list(cpu["layer"]) == list(gpu["layer"])
    np.testing.assert_allclose(cpu["achieved_sparsity"], gpu["achieved_sparsity"], atol=0.02)


@functools.lru_cache(maxsize=1)
def _plain_backward_big_ops() -> int:
    """Whole-gradient ATen operations of the plain model's backward pass (its third step)."""
    model, opt, batches = workload(5)
    train(model, opt, batches[:2])
    with Audit(big=16 * 20 * 7 // 2) as a:
        train(model, opt, batches[2:3])
    return a.big_ops["backward"]


@pytest.mark.parametrize("scheme,kernels", [("nvfp4", 1), ("mxfp4", 1), ("nvfp4_training", 2)])
def test_block_scaled_plans_take_one_pass_and_read_nothing_back(device_path, scheme, kernels):
    """MX and NVFP4 blocks take the fused block kernel on the device path (NVFP4's tensor scale from the
    statistics vector's maximum): at most 2 whole-gradient ATen operations per layer-call, no host
    synchronisation in the backward pass, the statistics' two launches and the kernel's one per call (two
    with the Hadamard transform, whose rotated maximum takes a pass of its own), and the counts recorded."""
    plain = _plain_backward_big_ops()
    model, opt, batches = workload(5)
    plan = gradstats.Plan.uniform(format=scheme, sparsity=0.7)
    applied = gradstats.apply(model, plan)
    train(model, opt, batches[:2])
    with Audit(big=16 * 20 * 7 // 2) as a:
        train(model, opt, batches[2:3])
    df = applied.to_dataframe()
    applied.remove()
    calls = len(applied.rules)
    assert a.syncs["backward"] == 0, dict(a.sync_names)
    assert a.big_ops["backward"] - plain <= 2 * calls, dict(a.big_names)
    assert a.launches["backward"] == (2 + kernels) * calls
    assert len(df) == 2 * calls and (df["pruned_fraction"] > 0.3).all()


def test_block_kernel_on_the_device_path_equals_the_cpu_operator(device_path, monkeypatch):
    """The device path's block call equals prune_quantize on the CPU engine with the settings it used (the
    record's threshold) and the call's seed: result bit for bit, counts equal."""
    from gradstats.ops.fused import prune_quantize, prune_quantize_into
    from gradstats.stats import tensor_stats_vector

    g = torch.randn(6, 10, 48, generator=torch.Generator().manual_seed(2)) * 1e-3
    thr = torch.tensor(4e-4, dtype=torch.float32)
    got, counts, _ = prune_quantize_into(g, thr, "nvfp4:rounding=stochastic", seed=9, block_dim=-1,
                                         stats=tensor_stats_vector(g, full=False))
    monkeypatch.setenv("GRADSTATS_ENGINE", "native")
    want, c = prune_quantize(g, float(thr), "nvfp4", rounding="stochastic", seed=9, block_dim=-1)
    assert torch.equal(got, want)
    assert counts.tolist() == [c.zeros, c.pruned, c.underflow, c.saturated, c.nonfinite]
