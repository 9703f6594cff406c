"""The engine switch: GRADSTATS_ENGINE and gradstats.ops.active_engine."""
from __future__ import annotations

import pytest
import torch

from gradstats.ops.engine import ENV, active_engine, interpreting, requested_engine, use_native, use_triton
from gradstats.ops.triton import triton_available


def test_defaults_per_device(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")      # the interpreter alone does not change the CPU's engine
    assert active_engine("cpu") == "native" and use_native("cpu") and not use_triton("cpu")
    assert active_engine("cuda") == ("triton" if triton_available() else "torch")
    assert active_engine("mps") == "torch" and not use_native("cuda")


def test_native_asks_nothing_of_cuda_tensors(monkeypatch):
    monkeypatch.setenv(ENV, "native")                 # the C kernels are the CPU's: CUDA keeps its default
    assert active_engine("cuda") == ("triton" if triton_available() else "torch")
    assert not use_native("cuda") and use_native("cpu")


def test_the_request_is_read_at_each_call(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert requested_engine() is None
    for value, asked in (("", None), ("  ", None), (" Torch ", "torch"), ("TRITON", "triton"), ("native", "native")):
        monkeypatch.setenv(ENV, value)
        assert requested_engine() == asked, value


def test_interpreting_is_triton_interpret_set_to_1(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interpreting() is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpreting() is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreting() is True


def test_torch_engine_everywhere(monkeypatch):
    monkeypatch.setenv(ENV, "torch")
    assert active_engine("cpu") == active_engine("cuda") == "torch"
    from gradstats.stats import kernel_applies, tensor_stats_vector

    x = torch.tensor([0.0, 1.5, -2.0, float("inf")])
    assert not kernel_applies(x)                      # the C kernel is the native engine's
    v = tensor_stats_vector(x)
    monkeypatch.setenv(ENV, "native")
    w = tensor_stats_vector(x)
    assert torch.allclose(v, w, rtol=1e-6, equal_nan=True)     # one behaviour (sums to float32 rounding)
    assert torch.equal(v[:3], w[:3]) and torch.equal(v[10:287], w[10:287])


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv(ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        active_engine("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert active_engine("cpu") == "triton" and use_triton("cpu") and not use_native("cpu")


def test_a_wrong_name_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match="GRADSTATS_ENGINE='cuda' names no engine: expected one of native, torch, triton"):
        active_engine("cpu")
    monkeypatch.setenv(ENV, " Native ")
    assert active_engine("cpu") == "native"


# ----------------------------------------------------------------------------- the engine as an option
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _weight_grads(handle_of, env=None, monkeypatch=None):
    """The weight gradients of one step of the model under ``handle_of(model)``, and the engine each
    prune-quantise call of the step ran under."""
    from gradstats.ops import fused

    model = _model()
    seen = []
    path, native_call = fused._path, fused.NativeCall.__call__      # prune_quantize's paths, and apply's prepared call
    monkeypatch.setattr(fused, "_path", lambda *a: seen.append(active_engine("cpu")) or path(*a))
    monkeypatch.setattr(fused.NativeCall, "__call__",
                        lambda self, *a, **k: seen.append(active_engine("cpu")) or native_call(self, *a, **k))
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with handle_of(model):
        model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()], seen


def test_apply_runs_on_the_engine_of_its_config(monkeypatch):
    """apply(..., engine="torch") runs every call of the handle on the torch engine while GRADSTATS_ENGINE
    is unset, with the gradients GRADSTATS_ENGINE=torch gives; a bad name is refused where it is given."""
    import gradstats

    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5, scale="amax", layers=["0", "2"])
    by_option, seen = _weight_grads(lambda m: gradstats.apply(m, plan, engine="torch"), monkeypatch=monkeypatch)
    assert seen and set(seen) == {"torch"}
    by_env, seen_env = _weight_grads(lambda m: gradstats.apply(m, plan), env="torch", monkeypatch=monkeypatch)
    assert set(seen_env) == {"torch"}
    assert all(torch.equal(a, b) for a, b in zip(by_option, by_env))
    _, seen_default = _weight_grads(lambda m: gradstats.apply(m, plan), monkeypatch=monkeypatch)
    assert set(seen_default) == {"native"}
    assert active_engine("cpu") == "native"                 # the option ends with the handle's calls
    with pytest.raises(ValueError, match="engine must be one of"):
        gradstats.ApplyConfig(engine="cuda")


def test_trace_records_on_the_engine_of_its_config(monkeypatch, tmp_path):
    """trace(..., engine="torch") computes its statistics on the torch engine: the rows GRADSTATS_ENGINE=torch
    gives, bit for bit."""
    import gradstats
    from gradstats.tracer import capture

    seen = []
    record = capture.Capture._record_on
    monkeypatch.setattr(capture.Capture, "_record_on",
                        lambda self, *a: seen.append(active_engine("cpu")) or record(self, *a))
    runs = {}
    for label, env, engine in (("option", None, "torch"), ("env", "torch", None)):
        if env is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, env)
        model, seen[:] = _model(), []
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        with gradstats.trace(model, tmp_path / label, engine=engine, noise=False) as t:
            model(x).square().sum().backward()
            t.step()
        assert seen and set(seen) == {"torch"}, label
        runs[label] = gradstats.open_run(tmp_path / label).stats().drop(columns=["time"], errors="ignore")
    import pandas as pd

    pd.testing.assert_frame_equal(runs["option"], runs["env"])
    with pytest.raises(ValueError, match="engine must be one of"):
        gradstats.TraceConfig(engine="gpu")
