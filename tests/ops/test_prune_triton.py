"""The Triton stochastic-prune kernel, run on the CPU by Triton's interpreter
(``TRITON_INTERPRET=1``), against the torch reference path; its GPU twin runs on CUDA."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from gradstats.ops import random as _rng  # noqa: E402
from gradstats.ops.triton import prune as kp  # noqa: E402
from gradstats.pruning import added_variance, expected_sparsity, stochastic_prune, threshold  # noqa: E402

MU, SIGMA = -7.0, 2.0


def _sample(n: int, seed: int, device: str = "cpu", p0: float = 0.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).mul_(SIGMA).add_(MU).exp_()
    x.mul_(torch.randint(0, 2, (n,), generator=g, dtype=torch.float64).mul_(2).sub_(1))
    x[torch.rand(n, generator=g, dtype=torch.float64) < p0] = 0.0
    x[:4] = torch.tensor([float("inf"), float("nan"), -0.0, -float("inf")], dtype=torch.float64)
    return x.float().to(device)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")
    yield


def _check_bit_exact(device: str) -> None:
    n = 50_001  # not a multiple of the block: the masked tail is exercised
    x = _sample(n, 1, device)
    g = torch.Generator().manual_seed(2)
    u = torch.rand(n, generator=g).to(device)
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        xd = x.to(dt)
        a = float(torch.tensor(float(threshold(0.8, mu=MU, sigma=SIGMA)), dtype=dt))
        y = kp.stochastic_prune(xd, a, uniforms=u)
        ref = kp.stochastic_prune_torch(xd, a, uniforms=u)
        assert y.dtype == dt
        assert torch.equal(y.isnan(), ref.isnan())
        fin = ~y.isnan()
        assert torch.equal(y[fin], ref[fin]), dt
    # out= and in place
    a = float(torch.tensor(float(threshold(0.9, mu=MU, sigma=SIGMA))))
    ref = kp.stochastic_prune_torch(x, a, uniforms=u)
    out = torch.empty_like(x)
    assert kp.stochastic_prune(x, a, uniforms=u, out=out) is out
    xc = x.clone()
    kp.stochastic_prune(xc, a, uniforms=u, out=xc)
    for r in (out, xc):
        assert torch.equal(r.nan_to_num(7.0), ref.nan_to_num(7.0))


def _check_seeded_statistics(device: str) -> None:
    n = 200_000
    x = _sample(n, 3, device, p0=0.0)[4:].abs()  # positive, finite: a non-trivial mean
    n = x.numel()
    for S, seed in ((0.6, 1234), (0.9, 2 ** 62 - 5)):
        a = float(torch.tensor(float(threshold(S, mu=MU, sigma=SIGMA))))
        y = kp.stochastic_prune(x, a, seed=seed)
        assert torch.equal(y, kp.stochastic_prune(x, a, seed=seed))
        assert not torch.equal(y, kp.stochastic_prune(x, a, seed=seed + 1))
        # the seeded draws are the one stream of gradstats.ops.random: reproduced bit for bit on the CPU
        u = _rng.uniforms(seed, n).to(device)
        assert torch.equal(y, kp.stochastic_prune_torch(x, a, uniforms=u))
        achieved = float((y == 0).double().mean())
        # sparsity expected for this very sample, and its Monte Carlo standard error
        xd = x.double()
        p_zero = torch.where(xd < a, 1 - xd / a, torch.zeros_like(xd))
        expect = float(p_zero.mean())
        se = math.sqrt(float((p_zero * (1 - p_zero)).sum())) / n
        assert abs(achieved - expect) < 5 * se
        assert abs(achieved - S) < 0.01
        assert expected_sparsity(a, mu=MU, sigma=SIGMA) == pytest.approx(S, abs=1e-6)
        # unbiased: z-test of the mean of T(x) - x, variance a|x| - x^2 below the threshold
        d = y.double() - xd
        var = float(torch.where(xd < a, a * xd - xd * xd, torch.zeros_like(xd)).sum()) / n
        z = float(d.mean()) / math.sqrt(var / n)
        assert abs(z) < 4.5
        assert added_variance(a, mu=MU, sigma=SIGMA) > 0


def test_kernel_matches_reference_bit_for_bit(interpret):
    _check_bit_exact("cpu")


def test_kernel_seeded_draws_statistics(interpret):
    _check_seeded_statistics("cpu")


def test_public_prune_routes_to_the_kernel_under_the_interpreter(interpret):
    from gradstats.ops.triton import use_triton

    assert use_triton("cpu")
    x = _sample(20_000, 5)
    a = 1e-3
    y1 = stochastic_prune(x, a, generator=torch.Generator().manual_seed(9))
    y2 = stochastic_prune(x, a, generator=torch.Generator().manual_seed(9))
    assert torch.equal(y1.nan_to_num(7.0), y2.nan_to_num(7.0))
    u = torch.rand(x.shape)
    y3 = stochastic_prune(x, a, uniforms=u)
    ref = kp.stochastic_prune_torch(x, float(torch.tensor(a)), uniforms=u)
    assert torch.equal(y3.nan_to_num(7.0), ref.nan_to_num(7.0))


def test_stream_uniforms_are_uniform():
    for dt in (torch.float32, torch.float64):
        u = _rng.uniforms(99, 1_000_000, dt).double()
        assert ((u >= 0) & (u < 1)).all()
        assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / 1e6)
        counts = torch.histc(u, bins=64, min=0, max=1)
        chi2 = float(((counts - 1e6 / 64) ** 2 / (1e6 / 64)).sum())
        assert chi2 < 120  # 63 degrees of freedom: p ~ 5e-5
        lag = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
        assert abs(lag) < 5e-3


def test_kernel_needs_exactly_one_source_of_randomness(interpret):
    with pytest.raises(ValueError, match="exactly one"):
        kp.stochastic_prune(torch.ones(4), 0.5)


@pytest.mark.gpu
def test_kernel_on_cuda():
    _check_bit_exact("cuda")
    _check_seeded_statistics("cuda")
    x = _sample(1_000_000, 7, "cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    y = stochastic_prune(x, 1e-3, generator=g)
    g = torch.Generator(device="cuda").manual_seed(3)
    assert torch.equal(y.nan_to_num(7.0), stochastic_prune(x, 1e-3, generator=g).nan_to_num(7.0))
