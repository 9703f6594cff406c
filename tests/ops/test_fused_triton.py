"""The fused prune + quantise Triton kernel, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1),
against the fused C kernel and the composed operators: results bit for bit, counts exactly, sums to
rounding; the counts and sums stay on the device and add up over calls."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradstats.formats import FPFormat, parse

triton = pytest.importorskip("triton")

import gradstats.ops.fused as F  # noqa: E402
from gradstats.ops import random as rng  # noqa: E402
from gradstats.ops.prune import stochastic_prune  # noqa: E402
from gradstats.ops.quantization import quantize  # noqa: E402
from gradstats.ops.triton import fused as kf  # noqa: E402

FORMATS = ["e4m3fn", "e5m2", "e3m2fn", "e2m3fn", "e2m1fn", "e3m2_nosub", "e4m3fnuz", "e4m3"]
ROUNDINGS = ["nearest", "stochastic", "toward_zero"]


@pytest.fixture(autouse=True)
def _interpret(interpreted):
    """The kernel under Triton's interpreter (the shared fixture of tests/conftest.py)."""


def c_path(x, threshold, fmt, scale=1.0, rounding="nearest", seed=0):
    """The fused C kernel on float32 (its CPU path; the Triton engine switched off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        if F._native() is None:
            pytest.skip("no C compiler: the C kernel is the reference here")
        return F.prune_quantize(x.float(), float(threshold), fmt, scale=float(scale), rounding=rounding, seed=seed)


def same_bits(a, b):
    a, b = a.float(), b.float()
    an, bn = torch.isnan(a), torch.isnan(b)
    return bool(((an == bn) & (an | (a.view(torch.int32) == b.view(torch.int32)))).all())


def counts_of(c):
    return [c.zeros, c.pruned, c.underflow, c.saturated, c.nonfinite]


def sums_of(c):
    return [c.dot, c.norm2, c.err2, c.noise2, c.abs_out, c.abs_in]


def close_sums(got, want, rel=1e-9):
    return all(abs(g - w) <= rel * max(abs(w), 1e-300) for g, w in zip(got.tolist(), want))


def lognormal(n, sigma=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * sigma)
    x[:14] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 448, 464, 480, 1e30, -3e-39, 57344,
                           -1.1754942e-38, 2.0 ** -130])
    return x


def test_supports_the_c_kernels_formats_per_tensor_only():
    assert kf.supports(None) and kf.supports(parse("e4m3fn")) and kf.supports("e2m1fn")
    assert kf.supports(FPFormat(3, 2, subnormals=False))
    assert not kf.supports(parse("e2m1fn"), block_size=32)
    assert not kf.supports("bf16")  # steps below float32's subnormal range: the C kernel does not cover it
    assert not kf.supports("e8m0fnu")  # unsigned, no zero


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_bit_exact_against_the_c_kernel(name, rounding):
    x = lognormal(12_000)
    fmt = parse(name)
    for threshold, scale in [(0.0, 1.0), (0.3, 1.0), (0.05, 2.0 ** 6), (2.5, 2.0 ** -7), (0.3, 3.0)]:
        got, counts, sums = kf.prune_quantize_triton(x, threshold, fmt, scale=scale, rounding=rounding, seed=11)
        want, c = c_path(x, threshold, fmt, scale, rounding, 11)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert same_bits(got, want), (name, rounding, threshold, scale)
        assert counts.tolist() == counts_of(c), (name, rounding, threshold, scale)
        assert close_sums(sums, sums_of(c)), (sums.tolist(), sums_of(c))


@pytest.mark.parametrize("name", ["e4m3fn", "e5m2", "e2m1fn", "e3m2_nosub"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_equals_pruning_then_quantising_with_one_seed(name, rounding):
    x = lognormal(4_000, seed=2)
    fmt = parse(name)
    for threshold, scale in [(0.0, 1.0), (0.7, 1.0), (0.01, 2.0 ** 4)]:
        y = stochastic_prune(x, threshold, seed=29) if threshold > 0 else x
        want = quantize(y, fmt, scale=scale, rounding=rounding, seed=29)
        got, _, _ = kf.prune_quantize_triton(x, threshold, fmt, scale=scale, rounding=rounding, seed=29)
        assert same_bits(got, want), (name, rounding, threshold, scale)


def test_pruning_only_equals_stochastic_prune():
    x = lognormal(5_000, seed=4)
    got, counts, _ = kf.prune_quantize_triton(x, 0.2, None, seed=3)
    want = stochastic_prune(x, 0.2, seed=3)
    assert same_bits(got, want) and bool(torch.equal(got.signbit(), want.signbit()))
    assert counts.tolist()[1] == int(((x != 0) & (want == 0)).sum()) > 0
    assert counts.tolist()[2:4] == [0, 0]


def test_a_mantissa_free_format_rounds_ties_to_the_even_exponent_as_the_c_kernel():
    fmt = FPFormat(4, 0)
    x = torch.tensor([1.5, 3.0, 6.0, 12.0, 0.75, 1.25, -1.75, 0.0078125 * 0.5])
    got, _, _ = kf.prune_quantize_triton(x, 0.0, fmt)
    want, _ = c_path(x, 0.0, fmt)
    assert same_bits(got, want) and got.tolist()[:4] == [2.0, 2.0, 8.0, 8.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_read_and_written_in_their_dtype(dtype):
    x = (lognormal(6_000, sigma=1.5, seed=5) * 0.1).to(dtype)
    for name, rounding in [("e4m3fn", "stochastic"), ("e2m1fn", "nearest"), ("e5m2", "toward_zero")]:
        got, counts, sums = kf.prune_quantize_triton(x, 0.0625, name, scale=2.0 ** 3, rounding=rounding, seed=7)
        want, c = c_path(x, 0.0625, parse(name), 2.0 ** 3, rounding, 7)
        assert got.dtype == dtype and same_bits(got, want.to(dtype))
        assert counts.tolist() == counts_of(c) and counts.tolist()[0] == int((got == 0).sum())
        assert close_sums(sums, sums_of(c))
        # and the composed operators on the half tensor itself (0.0625 is exact in both dtypes)
        want2 = quantize(stochastic_prune(x, 0.0625, seed=7), name, scale=2.0 ** 3, rounding=rounding, seed=7)
        assert same_bits(got, want2)


def test_bfloat16_subnormals_are_read_and_written_exactly():
    """bfloat16 values in float32's subnormal range (which Triton's interpreter converts wrongly) and results
    that need rounding to bfloat16 (a threshold of 0.3) give the C kernel's float32 result rounded to bfloat16."""
    x = torch.tensor([2.0 ** -130, -2.0 ** -128, 1e-38, -9e-41, 0.01, -0.2, 1.0, math.nan, -math.inf, 0.0],
                     dtype=torch.bfloat16)
    x = x.repeat(300)
    for fmt, scale in [(None, 1.0), ("e4m3fn", 2.0 ** 127), ("e5m2", 2.0 ** 120)]:
        for threshold in (0.0, 0.3):
            got, counts, _ = kf.prune_quantize_triton(x, threshold, fmt, scale=scale, rounding="stochastic", seed=2)
            want, c = c_path(x, threshold, None if fmt is None else parse(fmt), scale, "stochastic", 2)
            assert same_bits(got, want.to(torch.bfloat16)), (fmt, threshold)
            num = ~got.isnan()
            assert bool(torch.equal(got.signbit()[num], want.to(torch.bfloat16).signbit()[num]))
            assert counts.tolist() == counts_of(c), (fmt, threshold)
    got, _, _ = kf.prune_quantize_triton(x, 0.0, None)
    assert got.view(torch.int16).tolist()[:4] == x.view(torch.int16).tolist()[:4]


@pytest.mark.parametrize("n", [1, 17, 4097, 50_001])
def test_sizes_not_a_multiple_of_the_tile(n):
    x = lognormal(max(n, 14), seed=n)[-n:]
    got, counts, sums = kf.prune_quantize_triton(x, 0.4, "e3m2fn", scale=2.0, rounding="stochastic", seed=n)
    want, c = c_path(x, 0.4, parse("e3m2fn"), 2.0, "stochastic", n)
    assert same_bits(got, want) and counts.tolist() == counts_of(c) and close_sums(sums, sums_of(c))


def test_special_values_zeros_and_subnormals():
    x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -1.1754942e-38,
                      3.4e38, -3.4e38, 448.0, 464.0, 1e-3, -1e-3])
    for fmt in ("e4m3fn", "e4m3fnuz", "e5m2", None):
        for threshold in (0.0, 0.01):
            got, counts, sums = kf.prune_quantize_triton(x, threshold, fmt, rounding="stochastic", seed=1)
            want, c = c_path(x, threshold, None if fmt is None else parse(fmt), 1.0, "stochastic", 1)
            assert same_bits(got, want) and bool(torch.equal(got.signbit(), want.signbit())), (fmt, threshold)
            assert counts.tolist() == counts_of(c) and counts.tolist()[4] == 4
            assert close_sums(sums, sums_of(c))
            assert bool(torch.isfinite(sums).all())  # the non-finite inputs are left out of the sums


def test_tensor_threshold_and_scale_equal_the_float_ones():
    x = lognormal(9_000, seed=8)
    for a, s in [(0.3, 2.0 ** 5), (0.0, 1.0), (1.7, 3.0)]:
        want = kf.prune_quantize_triton(x, a, "e4m3fn", scale=s, rounding="stochastic", seed=4)
        for shape in ((), (1,)):
            got = kf.prune_quantize_triton(x, torch.full(shape, a), "e4m3fn", scale=torch.full(shape, s),
                                           rounding="stochastic", seed=4)
            assert same_bits(got[0], want[0]) and torch.equal(got[1], want[1]), (a, s, shape)
            assert torch.allclose(got[2], want[2], rtol=1e-12, atol=0)
    # a float64 threshold is rounded to float32, as a float is
    got = kf.prune_quantize_triton(x, torch.tensor(0.3, dtype=torch.float64), None, seed=4)[0]
    assert same_bits(got, kf.prune_quantize_triton(x, 0.3, None, seed=4)[0])


def test_counts_and_sums_add_up_over_calls():
    x1, x2 = lognormal(7_000, seed=1), lognormal(3_000, seed=2) * 0.01
    counts = torch.zeros(5, dtype=torch.int64)
    sums = torch.zeros(6, dtype=torch.float64)
    r1, c1, s1 = kf.prune_quantize_triton(x1, 0.2, "e5m2", seed=1, counts=counts, sums=sums)
    r2, c2, s2 = kf.prune_quantize_triton(x2, 0.2, "e5m2", seed=2, counts=counts, sums=sums)
    assert c1 is counts and c2 is counts and s1 is sums and s2 is sums
    _, a = c_path(x1, 0.2, parse("e5m2"), 1.0, "nearest", 1)
    _, b = c_path(x2, 0.2, parse("e5m2"), 1.0, "nearest", 2)
    assert counts.tolist() == [i + j for i, j in zip(counts_of(a), counts_of(b))]
    assert close_sums(sums, [i + j for i, j in zip(sums_of(a), sums_of(b))])


def test_out_shapes_and_non_contiguous_input():
    x = lognormal(1_200, seed=6).reshape(30, 40)
    out = torch.empty_like(x)
    got, _, _ = kf.prune_quantize_triton(x, 0.1, "e2m3fn", out=out, seed=2)
    assert got is out and same_bits(out.reshape(-1), c_path(x.reshape(-1), 0.1, parse("e2m3fn"), seed=2)[0])
    xt = x.t()  # non-contiguous: copied first
    got, _, _ = kf.prune_quantize_triton(xt, 0.1, "e2m3fn", seed=2)
    assert got.shape == xt.shape and same_bits(got, c_path(xt.contiguous(), 0.1, parse("e2m3fn"), seed=2)[0])
    y, c, s = kf.prune_quantize_triton(torch.empty(0, 3), 0.1, "e2m3fn")
    assert y.shape == (0, 3) and c.tolist() == [0] * 5 and s.tolist() == [0.0] * 6


def test_bad_input_names_the_problem():
    x = torch.ones(8)
    cases = [
        (dict(x=x.double()), "float32, bfloat16 or float16"),
        (dict(threshold=-1.0), "threshold"), (dict(threshold=math.nan), "threshold"),
        (dict(threshold=torch.ones(2)), "threshold"), (dict(scale=0.0), "scale"),
        (dict(scale=torch.ones(1, dtype=torch.int64)), "scale"), (dict(fmt="bf16"), "prune_quantize"),
        (dict(fmt="e2m1fn", rounding="up"), "rounding"), (dict(seed=-1), "seed"),
        (dict(out=torch.empty(8, dtype=torch.float16)), "out"), (dict(out=torch.empty(16)[::2]), "out"),
        (dict(counts=torch.zeros(5)), "counts"), (dict(sums=torch.zeros(5, dtype=torch.float64)), "sums"),
    ]
    for kw, word in cases:
        args = dict(x=x, threshold=0.1, fmt="e4m3fn")
        args.update(kw)
        xx, a, f = args.pop("x"), args.pop("threshold"), args.pop("fmt")
        with pytest.raises(ValueError, match=word):
            kf.prune_quantize_triton(xx, a, f, **args)


def test_launch_segments_of_the_counter():
    assert kf._segments(5) == [(0, 5)]
    assert kf._segments(2 ** 33 + 7) == [(0, 2 ** 32), (2 ** 32, 2 ** 32), (2 ** 33, 7)]


class _Ops(TorchDispatchMode):
    """Records the ATen ops of a call with the largest tensor each touches (arguments and results)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            ts = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.ops.append((func, max((t.numel() for t in ts), default=0)))
        return out


def test_one_call_allocates_its_result_and_nothing_else_of_that_size(monkeypatch):
    """The kernel is not an ATen op: the interpreter's own copies are left out by pausing the recorder
    during the launch (on CUDA the launch makes none)."""
    mode = _Ops()
    real = kf._kernel(True)

    class Launcher:
        def __getitem__(self, grid):
            def launch(*a, **k):
                mode.paused = True
                try:
                    return real[grid](*a, **k)
                finally:
                    mode.paused = False
            return launch

    monkeypatch.setattr(kf, "_kernel", lambda interpret: Launcher())
    x = lognormal(10_000, seed=3)
    a, s = torch.tensor(0.2), torch.tensor(4.0)
    counts, sums = torch.zeros(5, dtype=torch.int64), torch.zeros(6, dtype=torch.float64)
    for kw in (dict(threshold=a, scale=s, counts=counts, sums=sums), dict(threshold=0.2, scale=4.0)):
        mode.ops.clear()
        thr = kw.pop("threshold")
        with mode:
            y, _, _ = kf.prune_quantize_triton(x, thr, "e4m3fn", rounding="stochastic", seed=5, **kw)
        big = [f for f, m in mode.ops if m >= x.numel() // 2 and not f.is_view]
        assert len(big) <= 1 and all("empty" in str(f) for f in big), big
        names = {str(f) for f, _ in mode.ops}
        assert not any("_local_scalar_dense" in f or "nonzero" in f for f in names), names
    assert same_bits(y, c_path(x, 0.2, parse("e4m3fn"), 4.0, "stochastic", 5)[0])


@pytest.mark.gpu
def test_cuda_kernel_matches_the_c_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kf._kernel.cache_clear()
    x = lognormal(200_000, seed=9)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for name in ("e4m3fn", "e5m2", "e2m1fn", "e3m2_nosub"):
            for rounding in ROUNDINGS:
                for a, s in [(0.0, 1.0), (0.3, 2.0 ** 5), (0.05, 3.0)]:
                    counts = torch.zeros(5, dtype=torch.int64, device="cuda")
                    got, counts, sums = kf.prune_quantize_triton(
                        xd.cuda(), torch.tensor(a, device="cuda"), name, scale=torch.tensor(s, device="cuda"),
                        rounding=rounding, seed=13, counts=counts)
                    want, c = c_path(xd, a, parse(name), s, rounding, 13)
                    assert same_bits(got.cpu(), want.to(dtype)), (dtype, name, rounding, a, s)
                    assert counts.cpu().tolist() == counts_of(c)
                    assert close_sums(sums.cpu(), sums_of(c))


@pytest.mark.gpu
def test_cuda_kernel_past_two_to_the_31_elements(monkeypatch):
    """int64 offsets: the last entries of a tensor of 2**31 + 4097 halves are pruned with their own draws."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kf._kernel.cache_clear()
    n, m = 2 ** 31 + 4097, 8193
    x = torch.full((n,), 0.25, dtype=torch.float16, device="cuda")
    tail = (torch.rand(m, generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.float16)
    x[-m:] = tail.cuda()
    got, counts, _ = kf.prune_quantize_triton(x, 0.5, None, seed=3)
    u = torch.from_numpy(rng.reference_uniforms(3, n - m, m))
    t = tail.float()
    want = torch.where(u * 0.5 < t.abs(), torch.full_like(t, 0.5), torch.zeros_like(t)).copysign(t)
    assert same_bits(got[-m:].cpu(), want.to(torch.float16))
    assert int(counts[1]) == int((got == 0).sum())


# --- the lag correction inside the kernel: equal to gradstats.apply.device.current_settings, then the kernel ---

def _settings_case(x, rule, threshold, scale, mu_shift, rounding="nearest", seed=21):
    """``current_settings`` followed by the kernel at its (tensor) settings, against one launch with ``stats=``:
    results, counts and sums equal, and ``used`` holds what ``current_settings`` made, exactly."""
    from gradstats.apply.device import current_settings
    from gradstats.apply.refresh import LayerState
    from gradstats.stats import tensor_stats_vector

    v = tensor_stats_vector(x, full=False)
    n_nz = float(v[0] - v[1] - v[2])
    mu_now = float(v[6]) / n_nz if n_nz > 0 else 0.0
    st = LayerState(threshold=threshold, scale=scale, solved_mu=mu_now - mu_shift)
    fmt = rule.format
    thr_t, scale_t = current_settings(v, st, rule, fmt)
    want = kf.prune_quantize_triton(x, thr_t, fmt, scale=scale_t, rounding=rounding, seed=seed)
    used = torch.full((2,), math.nan, dtype=torch.float64)
    got = kf.prune_quantize_triton(x, st.threshold if rule.prunes else 0.0, fmt, scale=st.scale, rounding=rounding,
                                   seed=seed, stats=v, solved_mu=st.solved_mu, correct_threshold=rule.prunes,
                                   correct_scale=rule.scale != "fixed", used=used)
    assert same_bits(got[0], want[0]) and bool(torch.equal(got[0].signbit(), want[0].signbit()))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), (got[1:], want[1:])
    assert used.tolist() == [float(thr_t), float(scale_t)], (used.tolist(), float(thr_t), float(scale_t))
    return used.tolist(), want[1].tolist()


def _rule(fmt, sparsity, scale="lognormal", **kw):
    from gradstats.plan import Rule

    return Rule(format=fmt, sparsity=sparsity, scale=scale, **kw)


@pytest.mark.parametrize("name", ["e4m3fn", "e3m2fn"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_lag_correction_in_the_kernel_equals_current_settings(name, rounding):
    x = lognormal(9_000, sigma=2.0, seed=12) * 1e-3
    fmt = parse(name)
    rule = _rule(name, 0.8)
    # drift up and down: the threshold follows exp(drift), the scale moves by whole binades (1 and 3 here)
    for shift in (0.9, -1.3, 2.2, 0.0):
        (thr, sc), _ = _settings_case(x, rule, 2e-4, 2.0 ** 12, shift, rounding)
        assert thr == pytest.approx(float(torch.tensor(2e-4, dtype=torch.float32)) * math.exp(shift), rel=1e-6)
        if shift:
            assert sc != 2.0 ** 12
    # a threshold above the largest magnitude: the scale is capped by the threshold (pruning rounds up to it)
    x = x[14:]  # without the special values (1e30 among them)
    top = float(x.abs().max())
    (thr, sc), counts = _settings_case(x, rule, 3 * top, 2.0 ** 20, 0.3, rounding)
    assert thr > top and sc == 2.0 ** math.floor(math.log2(fmt.max / thr)) and counts[3] == 0
    # quantise only (no pruning rule), and a pruning rule whose threshold is still 0
    (thr, sc), counts = _settings_case(x, _rule(name, None), 0.5, 2.0 ** 10, -0.7, rounding)
    assert thr == 0.0 and counts[1] == 0 and sc != 2.0 ** 10
    (thr, sc), counts = _settings_case(x, rule, 0.0, 2.0 ** 10, 0.7, rounding)
    assert thr == 0.0 and counts[1] == 0
    # a fixed scale is left as it is; the threshold still moves
    (thr, sc), _ = _settings_case(x, _rule(name, 0.8, "fixed", scale_value=2.0 ** 9), 2e-4, 2.0 ** 9, 1.1, rounding)
    assert sc == 2.0 ** 9 and thr != pytest.approx(2e-4)


@pytest.mark.parametrize("name", ["e4m3fn", "e3m2fn"])
def test_lag_correction_without_non_zero_entries(name):
    """No non-zero finite entry: drift 0 and max_abs NaN (counted as 0), so the scale is only rounded and the
    threshold (if any) caps it."""
    rule = _rule(name, 0.8)
    for x in (torch.zeros(3_000), torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf] * 500)):
        from gradstats.stats import tensor_stats_vector

        assert math.isnan(float(tensor_stats_vector(x, full=False)[9]))
        for threshold in (0.0, 0.25):
            (thr, sc), counts = _settings_case(x, rule, threshold, 2.0 ** 40, 1.5)
            assert thr == threshold
            assert sc == (2.0 ** 40 if threshold == 0 else 2.0 ** math.floor(math.log2(parse(name).max / 0.25)))
            assert counts[4] == int((~x.isfinite()).sum())


def test_lag_correction_pruning_only_and_half_inputs():
    x = lognormal(6_000, sigma=1.5, seed=14) * 0.01
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        (thr, sc), _ = _settings_case(x.to(dtype), _rule(None, 0.7), 3e-3, 1.0, 0.6, "stochastic")
        assert sc == 1.0 and thr != pytest.approx(3e-3)
        _settings_case(x.to(dtype), _rule("e4m3fn", 0.7), 3e-3, 2.0 ** 8, -0.4, "stochastic")


def test_used_records_the_settings_without_the_correction_too():
    x = lognormal(3_000, seed=15)
    used = torch.zeros(2, dtype=torch.float64)
    kf.prune_quantize_triton(x, 0.3, "e4m3fn", scale=2.0 ** 5, used=used)
    assert used.tolist() == [0.3, 32.0]  # the host's float64s
    kf.prune_quantize_triton(x, torch.tensor(0.3), "e4m3fn", scale=torch.tensor(3.0, dtype=torch.float64), used=used)
    assert used.tolist() == [float(torch.tensor(0.3)), 3.0]  # the tensors' values
    v = torch.zeros(16, dtype=torch.float64)
    y = kf.prune_quantize_triton(x, 0.3, "e4m3fn", scale=2.0 ** 5, stats=v, solved_mu=math.nan, used=used)[0]
    assert used.tolist() == [0.3, 32.0]  # NaN solved_mu: nothing to correct (as current_settings)
    assert same_bits(y, kf.prune_quantize_triton(x, 0.3, "e4m3fn", scale=2.0 ** 5)[0])
    used.fill_(7.0)  # an empty tensor launches nothing
    kf.prune_quantize_triton(x[:0], 0.3, "e4m3fn", stats=v, solved_mu=0.0, used=used)
    assert used.tolist() == [7.0, 7.0]


def test_bad_correction_arguments_name_the_problem():
    x = torch.ones(8)
    v = torch.zeros(16, dtype=torch.float64)
    cases = [
        (dict(solved_mu=0.0), "pass stats="),
        (dict(stats=v.float(), solved_mu=0.0), "stats"), (dict(stats=v[:5], solved_mu=0.0), "stats"),
        (dict(stats=v, solved_mu=math.inf), "solved_mu"), (dict(stats=v, solved_mu="0"), "solved_mu"),
        (dict(stats=v, solved_mu=0.0, threshold=torch.tensor(0.1)), "floats"),
        (dict(stats=v, solved_mu=0.0, scale=torch.tensor(2.0)), "floats"),
        (dict(used=torch.zeros(2)), "used"), (dict(used=torch.zeros(3, dtype=torch.float64)), "used"),
    ]
    for kw in cases:
        kw, word = kw
        args = dict(threshold=0.1)
        args.update(kw)
        with pytest.raises(ValueError, match=word):
            kf.prune_quantize_triton(x, args.pop("threshold"), "e4m3fn", **args)


def test_one_corrected_call_makes_no_aten_op_but_the_result(monkeypatch):
    """With the statistics vector, the accumulators and ``used`` given, a corrected call allocates its result
    and makes no other ATen op (views aside): the dozen small ops of ``current_settings`` are in the launch."""
    from gradstats.stats import tensor_stats_vector

    mode = _Ops()
    real = kf._kernel(True)

    class Launcher:
        def __getitem__(self, grid):
            def launch(*a, **k):
                mode.paused = True
                try:
                    return real[grid](*a, **k)
                finally:
                    mode.paused = False
            return launch

    monkeypatch.setattr(kf, "_kernel", lambda interpret: Launcher())
    x = lognormal(10_000, seed=3)
    v = tensor_stats_vector(x, full=False)
    counts, sums = torch.zeros(5, dtype=torch.int64), torch.zeros(6, dtype=torch.float64)
    used = torch.zeros(2, dtype=torch.float64)
    mu = float(v[6] / (v[0] - v[1] - v[2])) - 0.5
    kf.prune_quantize_triton(x[:10], 0.2, "e4m3fn")  # the format's constants are made once, then cached
    with mode:
        y, _, _ = kf.prune_quantize_triton(x, 0.2, "e4m3fn", scale=4.0, rounding="stochastic", seed=5,
                                           counts=counts, sums=sums, stats=v, solved_mu=mu, used=used)
    made = [f for f, _ in mode.ops if not f.is_view]
    assert len(made) == 1 and "empty" in str(made[0]), [str(f) for f, _ in mode.ops]
    assert used[0] != 0.2 and counts.sum() > 0


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_the_corrected_kernel_compiles_for_a_cuda_gpu_without_one(monkeypatch):
    """Triton compiles the kernel for sm_90 on the CPU (its bundled ptxas): the float64 scalar path lowers to
    CUDA (libdevice exp, exp2, log2, floor; IEEE float64 division), not only in the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:  # pragma: no cover - depends on the Triton version
        pytest.skip("this Triton has no ASTSource / GPUTarget")
    kf._kernel.cache_clear()
    fn = kf._kernel(False)
    ptrs = {"X": "*fp32", "Y": "*fp32", "A": "*fp32", "S": "*fp32", "CNT": "*i64", "SUMS": "*fp64", "ST": "*fp64",
            "USED": "*fp64"}
    consts = dict(PRUNE=True, A_PTR=False, QUANT=True, SCALE_MODE=3, S_PTR=False, CORRECT=True, CORR_T=True,
                  WRITE_USED=True, I_N=0, I_ZERO=1, I_NONFIN=2, I_LN=6, I_MAX=9, FMAX_BITS=0x407C000000000000,
                  M=3, MSUB=3, E0F=121, MAXBITS=0x43E00000, C0F=2.0 ** -6, ROUNDING=1, NEG_ZERO=True, BF16=False,
                  BLOCK=kf.BLOCK)
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    sig["n"] = "i64"
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    except RuntimeError as e:  # pragma: no cover - an installation without the CUDA backend's tools
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
    finally:
        kf._kernel.cache_clear()
    ptx = k.asm["ptx"]
    assert "div.rn.f64" in ptx and "st.global.b64" in ptx


@pytest.mark.gpu
def test_cuda_lag_correction_equals_current_settings(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kf._kernel.cache_clear()
    from gradstats.apply.device import current_settings
    from gradstats.apply.refresh import LayerState
    from gradstats.stats import tensor_stats_vector

    x = (lognormal(300_000, sigma=2.0, seed=16) * 1e-3).cuda()
    v = tensor_stats_vector(x, full=False)
    mu = float(v[6] / (v[0] - v[1] - v[2]))
    for name, sparsity, threshold, shift in [("e4m3fn", 0.8, 2e-4, 0.9), ("e3m2fn", 0.8, 2e-4, -1.3),
                                             ("e4m3fn", None, 0.0, 0.4), ("e3m2fn", 0.8, 1e3, 0.2)]:
        rule = _rule(name, sparsity)
        st = LayerState(threshold=threshold, scale=2.0 ** 12, solved_mu=mu - shift)
        thr_t, scale_t = current_settings(v, st, rule, rule.format)
        want = kf.prune_quantize_triton(x, thr_t, rule.format, scale=scale_t, rounding="stochastic", seed=3)
        used = torch.zeros(2, dtype=torch.float64, device="cuda")
        got = kf.prune_quantize_triton(x, st.threshold if rule.prunes else 0.0, rule.format, scale=st.scale,
                                       rounding="stochastic", seed=3, stats=v, solved_mu=st.solved_mu,
                                       correct_threshold=rule.prunes, used=used)
        assert same_bits(got[0].cpu(), want[0].cpu()) and torch.equal(got[1], want[1]), name
        assert used.tolist() == [float(thr_t), float(scale_t)], name
