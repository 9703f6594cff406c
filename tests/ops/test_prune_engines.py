"""The two CPU paths of gradstats.pruning.stochastic_prune for float32: the C kernel shared with
the fused prune/quantise and the numpy engine it falls back to (also float64 and explicit
uniforms). Both draw the one stream of gradstats.ops.random: bit for bit the torch reference
given those uniforms, whatever the thread count (tests/ops/test_random.py checks every engine)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gradstats.ops import cpu as _cpu
from gradstats.ops import random as _rng
from gradstats.ops.fused import prune_quantize
from gradstats.ops.triton.prune import stochastic_prune_torch
from gradstats.pruning import prune, stochastic_prune, threshold


@pytest.fixture(params=["native", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(_cpu, "native_kernel", lambda: None)
    elif _cpu.native_kernel() is None:
        pytest.skip("no C compiler here: the numpy engine is tested instead")
    return request.param


@pytest.fixture
def native():
    if _cpu.native_kernel() is None:
        pytest.skip("no C compiler here: the numpy engine is tested instead")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def lognormal(n: int, mu: float, sigma: float, seed: int, *, signed: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).mul_(sigma).add_(mu).exp_()
    if signed:
        x.mul_(torch.randint(0, 2, (n,), generator=g, dtype=torch.float64).mul_(2).sub_(1))
    return x.float()


SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e30, -3e-39]


def _seed_of(seed: int) -> int:
    """The seed the operator draws from a generator seeded with ``seed``."""
    return int(torch.randint(0, 2 ** 62, (1,), generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("n", [1, 7, 4095, 4097, 65_536, 300_001])
@pytest.mark.parametrize("a", [1.5, 1e-3, 3e-33])
def test_native_equals_the_reference_with_its_hash_uniforms(native, n, a):
    x = lognormal(n, math.log(a), 2.0, seed=n)
    x[: min(n, len(SPECIAL))] = torch.tensor(SPECIAL[: min(n, len(SPECIAL))])
    y = stochastic_prune(x, a, generator=torch.Generator().manual_seed(5))
    u = _rng.uniforms(_seed_of(5), n)
    a32 = float(torch.tensor(a))
    ref = stochastic_prune_torch(x, a32, uniforms=u)
    nan = x.isnan()
    assert torch.equal(y.isnan(), nan) and torch.equal(y[~nan], ref[~nan])
    # pruned entries are zeros carrying x's sign; kept entries keep their bits
    zero = (y == 0) & ~nan
    assert torch.equal(torch.signbit(y[zero]), torch.signbit(x[zero]))
    big = (x.abs() >= a32) & ~nan
    assert torch.equal(y[big].view(torch.int32), x[big].view(torch.int32))


def test_native_uniforms_are_uniform():
    u = _rng.reference_uniforms(2 ** 40 + 12345, 0, 1_000_000).astype(np.float64)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)
    counts = np.bincount((u * 64).astype(int), minlength=64)
    chi2 = float(((counts - u.size / 64) ** 2 / (u.size / 64)).sum())
    assert chi2 < 120  # 63 degrees of freedom: p < 1e-5 beyond this
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(u.size)


def test_native_words_beyond_2_32_entries(native):
    """The kernel's own words (its test entry point, made of the functions of its loop) are the
    reference's on both sides of 2^31, 2^32 and 2^33, and entries 2^32 apart draw different ones."""
    from gradstats.ops.native import random_bits

    draw = random_bits()
    seed = _rng.stream(_seed_of(3), _rng.PRUNE)
    for start in (0, 2 ** 31 - 8, 2 ** 32 - 8, 2 ** 33 - 4093, 5 * 2 ** 31 + 4093):
        got = np.empty(4096, np.uint32)
        draw(seed, start, got.size, got.ctypes.data)
        np.testing.assert_array_equal(got, _rng.reference_bits(seed, start, got.size))
    low = _rng.reference_bits(seed, 0, 4096)
    for k in (1, 2, 3):
        far = _rng.reference_bits(seed, k * 2 ** 32, 4096)
        assert np.mean(far == low) < 0.01, k      # not the stream of entries 0..4095 again


def test_native_result_does_not_depend_on_the_thread_count(native, threads):
    x = lognormal(1_000_003, -3.0, 2.5, seed=1)
    a = float(threshold(0.85, mu=-3.0, sigma=2.5))
    ys = []
    for t in (1, 2, 3):
        torch.set_num_threads(t)
        ys.append(stochastic_prune(x, a, generator=torch.Generator().manual_seed(9)))
        ys.append(prune(x, 0.85, generator=torch.Generator().manual_seed(9)))
    for y in ys[2::2]:
        assert torch.equal(y, ys[0])
    for y in ys[3::2]:
        assert torch.equal(y, ys[1])


def test_reproducible_and_one_kernel_with_prune_quantize(path):
    x = lognormal(200_000, -5.0, 2.0, seed=4)
    a = float(threshold(0.8, mu=-5.0, sigma=2.0))
    g = torch.Generator().manual_seed(1)
    y1, y2 = stochastic_prune(x, a, generator=g), stochastic_prune(x, a, generator=g)
    assert not torch.equal(y1, y2)  # the generator advanced
    assert torch.equal(y1, stochastic_prune(x, a, generator=torch.Generator().manual_seed(1)))
    torch.manual_seed(11)
    d1 = stochastic_prune(x, a)
    torch.manual_seed(11)
    assert torch.equal(d1, stochastic_prune(x, a))  # the default generator governs
    # in place, into out, non-contiguous: the same values
    xc = x.clone()
    assert stochastic_prune(xc, a, generator=torch.Generator().manual_seed(1), out=xc) is xc
    assert torch.equal(xc, y1)
    ot = torch.empty(500, 400).t()
    stochastic_prune(x.reshape(400, 500), a, generator=torch.Generator().manual_seed(1), out=ot)
    assert torch.equal(ot.reshape(-1), y1)
    if path == "native":
        # pruning alone through the fused operator is the same kernel with the same seed
        z, c = prune_quantize(x, a, None, generator=torch.Generator().manual_seed(1))
        assert torch.equal(z.view(torch.int32), y1.view(torch.int32))
        assert c.zeros == int((y1 == 0).sum())


def test_fallback_and_float64_draw_the_one_stream(monkeypatch):
    n = 100_003
    x = lognormal(n, 0.0, 2.0, seed=3)
    seed = _seed_of(2)
    # float64 takes the numpy engine whether or not the kernel is compiled (53-bit uniforms)
    x64 = x.double()
    y64 = stochastic_prune(x64, 1.5, generator=torch.Generator().manual_seed(2))
    u64 = _rng.uniforms(seed, n, torch.float64)
    assert torch.equal(y64, stochastic_prune_torch(x64, 1.5, uniforms=u64))
    native = stochastic_prune(x, 1.5, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(_cpu, "native_kernel", lambda: None)
    y = stochastic_prune(x, 1.5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(y, stochastic_prune_torch(x, 1.5, uniforms=_rng.uniforms(seed, n)))
    assert torch.equal(y.view(torch.int32), native.view(torch.int32))  # the same as the C kernel


def test_gradstats_native_0_falls_back_to_the_numpy_engine():
    code = textwrap.dedent("""
        import numpy as np, torch
        from gradstats.ops.triton.prune import stochastic_prune_torch
        from gradstats.ops import cpu as _cpu, random as _rng
        from gradstats.pruning import stochastic_prune
        assert _cpu.native_kernel() is None
        x = torch.randn(70_000, generator=torch.Generator().manual_seed(0)).mul(2).exp()
        y = stochastic_prune(x, 2.0, generator=torch.Generator().manual_seed(2))
        seed = _rng.draw_seed(torch.Generator().manual_seed(2))
        u = _rng.uniforms(seed, x.numel())
        assert torch.equal(y, stochastic_prune_torch(x, 2.0, uniforms=u))
        print("ok")
    """)
    env = {**os.environ, "GRADSTATS_NATIVE": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def _check_operator(x: torch.Tensor, a: float, y: torch.Tensor) -> tuple[float, float]:
    """(z of the zero count against its exact expectation given x, z of sum(T(x) - x))."""
    xd, yd = x.double(), y.double()
    ax = xd.abs()
    small = ax < a
    p = torch.where(small, 1 - ax / a, (ax == 0).double())  # P(zero) of each entry
    zeros = float((y == 0).sum())
    z_zero = (zeros - float(p.sum())) / math.sqrt(float((p * (1 - p)).sum()))
    var = float(torch.where(small, a * ax - ax * ax, torch.zeros_like(ax)).sum())
    z_mean = float((yd - xd).sum()) / math.sqrt(var)
    return z_zero, z_mean


@pytest.mark.parametrize("sigma, targets", [(0.5, (0.5, 0.95)), (2.0, (0.7, 0.99)), (4.0, (0.85, 0.97))])
def test_native_and_fallback_agree_in_distribution(sigma, targets, monkeypatch):
    n = 2_000_000
    x = lognormal(n, -6.0, sigma, seed=int(sigma * 10), signed=False)
    paths = ["native", "numpy"] if _cpu.native_kernel() is not None else ["numpy"]
    for S in targets:
        a = float(torch.tensor(float(threshold(S, mu=-6.0, sigma=sigma))))
        achieved = {}
        for p in paths:
            with monkeypatch.context() as m:
                if p == "numpy":
                    m.setattr(_cpu, "native_kernel", lambda: None)
                y = stochastic_prune(x, a, generator=torch.Generator().manual_seed(7))
            z_zero, z_mean = _check_operator(x, a, y)
            assert abs(z_zero) < 4.5 and abs(z_mean) < 4.5, (p, sigma, S, z_zero, z_mean)
            achieved[p] = float((y == 0).double().mean())
            assert abs(achieved[p] - S) <= 0.002, (p, sigma, S, achieved[p])
        if len(achieved) == 2:  # two independent draws of the same operator
            se = math.sqrt(2 * S * (1 - S) / n)
            assert abs(achieved["native"] - achieved["numpy"]) < 5 * se, (sigma, S, achieved)


def test_prune_hits_targets_on_both_paths(path):
    x = lognormal(1_000_000, -11.0, 2.2, seed=5)
    x[torch.rand(x.numel(), generator=torch.Generator().manual_seed(6)) < 0.25] = 0.0
    g = torch.Generator().manual_seed(0)
    for S in (0.5, 0.85, 0.95):
        y, a = prune(x, S, generator=g, return_threshold=True)
        assert float((y == 0).double().mean()) == pytest.approx(S, abs=0.002)
        z_zero, z_mean = _check_operator(x, float(torch.tensor(a)), y)
        assert abs(z_zero) < 4.5 and abs(z_mean) < 4.5


def test_bad_input_gives_clear_errors_on_both_paths(path):
    x = torch.ones(100_000)
    cases = [
        (lambda: stochastic_prune([1.0, 2.0], 0.1), "torch.Tensor"),
        (lambda: stochastic_prune(torch.ones(3, dtype=torch.int32), 0.1), "floating"),
        (lambda: stochastic_prune(torch.zeros(0), 0.1), "empty"),
        (lambda: stochastic_prune(x, -0.1), "threshold"),
        (lambda: stochastic_prune(x, math.nan), "threshold"),
        (lambda: stochastic_prune(x, math.inf), "threshold"),
        (lambda: stochastic_prune(x, "big"), "threshold"),
        (lambda: stochastic_prune(x, 0.1, out=torch.empty(4)), "out"),
        (lambda: stochastic_prune(x, 0.1, out=torch.empty(100_000, dtype=torch.float64)), "out"),
        (lambda: stochastic_prune(x, 0.1, uniforms=torch.rand(3)), "uniforms"),
        (lambda: stochastic_prune(x, 0.1, generator=7), "generator"),
        (lambda: prune(x, 0.5, generator="seed"), "generator"),
        (lambda: prune(x, 1.0), "target"),
        (lambda: prune(x, 0.5, threshold_rule="topk"), "threshold_rule"),
    ]
    for fn, word in cases:
        with pytest.raises(ValueError, match=word):
            fn()


def test_new_and_given_outputs_agree():
    x = lognormal(3_000_001, 0.0, 2.0, seed=8)
    g = torch.Generator().manual_seed(3)
    y = stochastic_prune(x, 1.0, generator=g)
    assert torch.equal(y, stochastic_prune(x, 1.0, generator=torch.Generator().manual_seed(3),
                                           out=torch.empty_like(x)))

@pytest.mark.parametrize("threads_n", [1, 2])
def test_native_log2_histogram_equals_the_numpy_sweep(native, threads, threads_n):
    """The C counting kernel of the histogram rule: the same counts as the numpy sweep, specials
    (zeros, subnormals, inf, NaN) included, whatever the thread count; prune(threshold_rule="histogram")
    hits its targets with it."""
    from gradstats.pruning import operator

    torch.set_num_threads(threads_n)
    x = lognormal(300_001, -9.0, 2.5, seed=11)
    x[::13] = 0.0
    x[: len(SPECIAL)] = torch.tensor(SPECIAL)
    fn = operator._native_log2_hist()
    for mbits in (0, 2, 5):
        counts = np.zeros(256 << mbits, dtype=np.int64)
        assert fn(x.data_ptr(), x.numel(), mbits, counts.ctypes.data, threads_n) == 0
        np.testing.assert_array_equal(counts, _cpu.log2_histogram(x.numpy(), mbits))
    assert fn(x.data_ptr(), x.numel(), 7, counts.ctypes.data, 1) != 0       # out of range: refused
    y = prune(x[len(SPECIAL):], 0.85, threshold_rule="histogram", generator=torch.Generator().manual_seed(1))
    assert float((y == 0).double().mean()) == pytest.approx(0.85, abs=0.002)
