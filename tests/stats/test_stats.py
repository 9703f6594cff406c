"""Streaming statistics of a tensor against a float64 numpy reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradstats.stats as stats_mod
import gradstats.stats.kernel as kernel_mod
from gradstats.stats import (
    HIST_BINS,
    HIST_MIN_EXP,
    TOP_K,
    lognormal_moments,
    merge_stats,
    tensor_stats,
    tensor_stats_vector,
    vector_to_stats,
)


@pytest.fixture(params=["native", "native-portable", "torch"], autouse=True)
def kernel_path(request, monkeypatch):
    """Every test runs on the fused C kernel (as built for this CPU: its AVX-512 loop, or its portable
    loop with the AVX2 binade counts; and its portable loop in plain C) and on the pure-torch path."""
    if request.param == "torch":
        monkeypatch.setattr(kernel_mod, "_native_kernel", lambda: None)
    elif kernel_mod._native_kernel() is None:
        pytest.skip("no C compiler here: the torch path is tested instead")
    elif request.param == "native-portable":
        portable = kernel_mod._native_kernel(portable=True)
        monkeypatch.setattr(kernel_mod, "_native_kernel", lambda: portable)
    return request.param


def reference(x: np.ndarray) -> dict:
    x = x.astype(np.float32).astype(np.float64).ravel()
    fin = np.isfinite(x)
    a = np.abs(x[fin])
    nz = a[a > 0]
    hist = np.zeros(HIST_BINS, np.int64)
    if nz.size:
        _, e = np.frexp(nz.astype(np.float32))
        np.add.at(hist, e - 1 - HIST_MIN_EXP, 1)
    return {"n": x.size, "n_zero": int((x == 0).sum()), "n_nonfinite": int((~fin).sum()),
            "sum": x[fin].sum(), "sum_abs": a.sum(), "sum_sq": (a ** 2).sum(),
            "sum_ln_abs": np.log(nz).sum(), "sum_ln_abs_sq": (np.log(nz) ** 2).sum(),
            "min_abs": nz.min() if nz.size else math.nan, "max_abs": nz.max() if nz.size else math.nan,
            "hist": hist, "top_abs": _top(nz), "scale_sum": a.sum(), "scale_sum_abs": a.sum(),
            "scale_sum_sq": (a ** 2).sum(), "scale_sum_ln_abs": np.abs(np.log(nz)).sum(),
            "scale_sum_ln_abs_sq": (np.log(nz) ** 2).sum()}


def _top(nz: np.ndarray) -> np.ndarray:
    out = np.full(TOP_K, np.nan, np.float32)
    v = np.sort(nz)[::-1][:TOP_K]
    out[: v.size] = v
    return out


def check(got: dict, ref: dict) -> None:
    check_exact(got, ref)
    # float32 sums: error relative to the sum of the magnitudes of the terms
    for k in ("sum", "sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq"):
        tol = 1e-5 * ref["scale_" + k] + 1e-30
        assert abs(got[k] - ref[k]) <= tol, (k, got[k], ref[k])


def check_exact(got: dict, ref: dict) -> None:
    """The counts, extremes, binade counts and top magnitudes: exact."""
    for k in ("n", "n_zero", "n_nonfinite"):
        assert got[k] == ref[k], k
    for k in ("min_abs", "max_abs"):
        if math.isnan(ref[k]):
            assert math.isnan(got[k])
        else:
            assert got[k] == pytest.approx(ref[k], rel=0, abs=0), k
    np.testing.assert_array_equal(got["hist"], ref["hist"])
    np.testing.assert_array_equal(got["top_abs"], ref["top_abs"])       # exact, NaN-padded


def lognormal(n: int, sigma: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).sign() * torch.exp(torch.randn(n, generator=g) * sigma - 8)


@pytest.mark.parametrize("case", ["clean", "zeros", "nonfinite", "subnormal", "all_zero", "empty", "runs"])
def test_against_reference(case):
    x = lognormal(50_000)
    if case == "runs":              # long runs of one binade (what a counter per bin must survive)
        x = torch.full((50_000,), 0.75); x[::7] = -3.0; x[20_000:30_000] = 1e-3
    elif case == "zeros":
        x = torch.relu(x)
    elif case == "nonfinite":
        x[::97] = float("inf"); x[5::101] = float("-inf"); x[7::103] = float("nan"); x[::11] = 0
        # a NaN with a payload; a run with no non-finite entry (the kernel tells inf and NaN
        # apart from the rest per block)
        x[9] = torch.tensor(0x7fc00123, dtype=torch.int32).view(torch.float32)
        x[40_000:45_000] = lognormal(5_000, seed=9)
    elif case == "subnormal":
        x[::13] = torch.tensor(3e-42); x[1::17] = -1.4e-45; x[::19] = 0.0
    elif case == "all_zero":
        x = torch.zeros(100)
    elif case == "empty":
        x = torch.zeros(0)
    check(tensor_stats(x), reference(x.numpy()))


def test_largest_finite_beside_inf_and_nan():
    """The largest finite magnitude is finite and non-zero (binade 127, the maximum, the top 64),
    inf and NaN beside it are counted apart, in blocks with and without them."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, float("inf"), float("nan"), 1.0, 0.0]).repeat(3000)
    x[9000:] = torch.tensor([big, -big, 1.0, 0.0, 0.5, 0.25]).repeat(1500)
    s = tensor_stats(x)
    n_big = int((x.abs() == big).sum())
    assert (s["n"], s["n_nonfinite"], s["n_zero"]) == (18_000, 3000, int((x == 0).sum()))
    assert s["max_abs"] == big and s["hist"][127 - HIST_MIN_EXP] == n_big
    assert s["hist"].sum() == 18_000 - 3000 - s["n_zero"]
    np.testing.assert_array_equal(s["top_abs"], np.full(TOP_K, big, np.float32))


@pytest.mark.parametrize("seed", range(6))
def test_binade_counts_exact_across_scales_and_tails(seed):
    """Segments whose scales jump by up to 2^80 (so that a block's largest |x| moves any window of
    binades placed from the blocks before it), magnitudes at both ends of float32 (subnormals,
    2^127), lengths that are not multiples of any vector or block size, every thread count. (The
    float32 sums of squares overflow at such magnitudes, as specified: the exact fields here.)"""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(rng.integers(1, 12)):
        m = int(rng.integers(1, 9000))
        scale = float(2.0 ** rng.integers(-140, 120))
        v = np.exp(rng.normal(0, rng.uniform(0.1, 6), m)) * scale * rng.choice([-1, 1], m)
        v[rng.random(m) < rng.uniform(0, 0.5)] = 0.0
        parts.append(v)
    x = np.concatenate(parts).astype(np.float32)             # overflows to inf, underflows to 0
    if seed % 2:
        x[rng.integers(0, x.size, 5)] = np.float32(3.4e38)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            check_exact(tensor_stats(torch.from_numpy(x)), reference(x))
        finally:
            torch.set_num_threads(2)


def test_ln_within_two_ulps():
    """ln|x| of single entries against float64, in float32 ulps of the result: across the whole
    range, near |x| = 1 (where a table-based logarithm could lose its relative accuracy), at the
    edges of the mantissa pieces and for subnormals."""
    rng = np.random.default_rng(1)
    one = np.float32(1)
    xs = np.concatenate([np.exp(rng.uniform(-85, 85, 800)), rng.uniform(0.97, 1.04, 400),
                         rng.uniform(0.7, 1.42, 400), [3e-39, 1e-45, 3.4e38, 0.70710677, 1.4142135],
                         [np.nextafter(one, 2 * one), np.nextafter(one, 0 * one)]]).astype(np.float32)
    for x in xs:
        got = tensor_stats(torch.tensor([x]))["sum_ln_abs"]
        want = math.log(float(x))
        assert abs(got - want) <= 2 * float(np.spacing(np.float32(abs(want)))), (float(x), got, want)
    assert tensor_stats(torch.tensor([1.0, -1.0]))["sum_ln_abs"] == 0.0


def test_large_tensor_counts_are_exact():
    x = torch.relu(lognormal(1 << 25, seed=3))  # past the float32 integer range
    s = tensor_stats(x)
    assert s["n_zero"] == int((x == 0).sum())
    assert int(s["hist"].sum()) == x.numel() - s["n_zero"]
    # every bin exact: counts of millions in one bin and window (the kernel's counts carry
    # through several levels of bit-sliced counters)
    a = x.numpy()
    _, e = np.frexp(a[a != 0])
    np.testing.assert_array_equal(s["hist"], np.bincount(e - 1 - HIST_MIN_EXP, minlength=HIST_BINS))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_computed_in_float32(dtype):
    x = lognormal(10_000, sigma=1.0).mul(1e4).to(dtype)
    check(tensor_stats(x), reference(x.float().numpy()))


def test_non_contiguous():
    x = lognormal(40_000).reshape(200, 200).t()[::2]
    check(tensor_stats(x), reference(x.contiguous().numpy()))


def test_merge_equals_whole():
    x = torch.relu(lognormal(30_000)); x[3] = float("nan")
    parts = [tensor_stats(p) for p in x.split(7_000)]
    m, whole = merge_stats(parts), tensor_stats(x)
    for k in ("n", "n_zero", "n_nonfinite", "min_abs", "max_abs"):
        assert m[k] == whole[k]
    for k in ("sum", "sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq"):
        assert m[k] == pytest.approx(whole[k], rel=1e-5)
    np.testing.assert_array_equal(m["hist"], whole["hist"])
    np.testing.assert_array_equal(m["top_abs"], whole["top_abs"])
    assert "top_abs" not in merge_stats([{k: v for k, v in p.items() if k != "top_abs"} for p in parts])


@pytest.mark.parametrize("threads", [1, 2])
def test_top_magnitudes_ties_order_and_threads(threads, monkeypatch):
    """The 64 largest non-zero finite |g|, whatever their positions (ascending data puts every block
    ahead of the heap), with ties and across threads; a tensor with fewer is NaN-padded."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for x in [torch.arange(1, 300_001, dtype=torch.float32), torch.arange(300_000, 0, -1).float(),
              torch.ones(200_000).index_fill_(0, torch.tensor([5, 150_000]), 2.0),
              lognormal(500_000, sigma=4.0),
              # ties across the 64th place among thousands of candidates (the selection's pivots)
              torch.randint(1, 4, (250_000,), generator=torch.Generator().manual_seed(3)).float()
              * torch.where(torch.rand(250_000, generator=torch.Generator().manual_seed(4)) < 0.5, -1.0, 1.0),
              torch.zeros(100_000).index_fill_(0, torch.randperm(100_000, generator=torch.Generator()
                                                                 .manual_seed(5))[:1000], 4.0)
              .index_fill_(0, torch.arange(60) * 997, -5.0)]:
        got = tensor_stats(x)["top_abs"]
        want = torch.topk(x.abs(), TOP_K).values.numpy()
        np.testing.assert_array_equal(got, want)
        assert got[0] == tensor_stats(x)["max_abs"]


def test_scalar_statistics_alone_equal_the_full_ones():
    """full=False (the refresh of apply): the same scalar statistics, bit for bit; the histogram and
    top parts NaN."""
    x = torch.relu(lognormal(300_001, seed=5)); x[7] = float("inf")
    k = len(stats_mod.SCALAR_FIELDS)
    a, b = tensor_stats_vector(x), tensor_stats_vector(x, full=False)
    assert torch.equal(a[:k], b[:k]) and b[k:].isnan().all()


def test_lognormal_moments_mle():
    x = lognormal(200_000, sigma=1.5)
    mu, sigma = lognormal_moments(tensor_stats(x))
    ln = np.log(np.abs(x.double().numpy()))
    assert mu == pytest.approx(ln.mean(), rel=1e-5)
    assert sigma == pytest.approx(ln.std(), rel=1e-4)
    assert all(math.isnan(v) for v in lognormal_moments(tensor_stats(torch.zeros(4))))


def test_vector_roundtrip_and_errors():
    v = tensor_stats_vector(torch.tensor([1.0, -3.0]))
    assert vector_to_stats(v)["max_abs"] == 3.0
    with pytest.raises(ValueError, match="floating-point"):
        tensor_stats(torch.arange(3))
    with pytest.raises(ValueError, match="torch.Tensor"):
        tensor_stats([1.0, 2.0])


def test_rows_written_in_place_equal_vectors():
    """write_stats into VectorRows (several pages) gives the vectors of tensor_stats_vector;
    tensors the kernel cannot take as they are are refused with a clear error."""
    xs = [lognormal(1000 + 37 * i, seed=i) for i in range(150)]
    odd = [torch.randn(8, 8).t(), torch.randn(10).half(), torch.zeros(0)]
    if not stats_mod.has_native_kernel():
        assert not any(stats_mod.kernel_applies(x) for x in xs + odd)
        with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
            stats_mod.write_stats(xs[0], 0)
        return
    rows = stats_mod.VectorRows()
    for x in xs:
        assert stats_mod.kernel_applies(x)
        stats_mod.write_stats(x, rows.claim())
    assert len(rows) == 150
    got = rows.take()
    assert got.shape == (150, stats_mod.VECTOR_LEN) and len(rows) == 0
    want = torch.stack([tensor_stats_vector(x) for x in xs]).numpy()
    np.testing.assert_array_equal(got, want)
    for x in odd:
        assert not stats_mod.kernel_applies(x)
        with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
            stats_mod.write_stats(x, rows.claim())


def test_the_flushed_fraction_is_what_ifs_underflow():
    """stats.law.flushed_fraction (the tracer's alarms) and what_if's underflow are one law: equal to
    rounding error, per tensor, for every rounding and several formats and spreads; and the flush is
    what quantize measures on the tensor to within the law's error."""
    import gradstats
    from gradstats.fpanalysis.what_if import predict_from_stats
    from gradstats.stats.law import flushed_fraction

    g = torch.Generator().manual_seed(0)
    for sigma in (1.0, 2.5, 4.0):
        x = torch.exp(-12 + sigma * torch.randn(50_000, generator=g)) * torch.randn(50_000, generator=g).sign()
        x[::7] = 0.0
        row = tensor_stats(x)
        nz = x != 0
        for fmt in ("e4m3fn", "e5m2", "e2m1fn", "e3m2fn"):
            for rounding in ("nearest", "stochastic"):
                u = flushed_fraction(row, fmt, rounding=rounding)
                assert u == pytest.approx(predict_from_stats(row, fmt, rounding=rounding)["underflow"], abs=1e-12)
            q = gradstats.quantize(x, fmt, scale=gradstats.formats.amax_scale(gradstats.FPFormat.parse(fmt),
                                                                             float(x.abs().max())))
            measured = float(((q == 0) & nz).sum() / nz.sum())
            assert flushed_fraction(row, fmt) == pytest.approx(measured, abs=0.02), (sigma, fmt)
    with pytest.raises(ValueError, match="rounding"):
        flushed_fraction(row, "e4m3fn", rounding="toward_zero")
