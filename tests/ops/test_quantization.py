"""quantize: bit-exact against ml_dtypes and torch's float8 casts, arbitrary formats against a slow
search over fmt.values(), properties, stochastic rounding statistics, block scaling, dtypes, shapes,
and bad input."""
from __future__ import annotations

import importlib
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstats
import gradstats.ops.quantization as Q
from gradstats.formats import REGISTRY, FPFormat, parse
from gradstats.ops.quantization import block_scales, mx_shared_exponent, quantize

ORACLE = ["float8_e3m4", "float8_e4m3", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz",
          "float8_e5m2", "float8_e5m2fnuz", "float8_e5m3fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
          "bfloat16"]



# many mid-sized tensor ops: run single-threaded (see conftest.one_intraop_thread)
pytestmark = pytest.mark.usefixtures("one_intraop_thread")

# ------------------------------------------------------------------------------------------ helpers
def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: both NaN, or identical float32 bit patterns (so -0 != +0)."""
    a, b = a.float(), b.float()
    an, bn = torch.isnan(a), torch.isnan(b)
    return (an == bn) & (an | (a.view(torch.int32) == b.view(torch.int32)))


def assert_same(a, b, x, what=""):
    ok = same_bits(a, b)
    if not bool(ok.all()):
        i = (~ok).nonzero().flatten()[:5]
        pytest.fail(f"{what}: {int((~ok).sum())} mismatches, e.g. "
                    + ", ".join(f"x={x.flatten()[j].item()!r} got={a.flatten()[j].item()!r} want={b.flatten()[j].item()!r}"
                                for j in i.tolist()))


def ml_type(name: str) -> type:
    """The ml_dtypes type ``name``; the test is skipped when the installed ml_dtypes predates it."""
    t = getattr(ml_dtypes, name, None)
    if t is None:
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name} (added in a later release)")
    return t


def f32(a) -> torch.Tensor:
    with np.errstate(over="ignore"):
        return torch.as_tensor(np.asarray(a, dtype=np.float32))


def probe_points(fmt: FPFormat, n_random: int, seed: int = 0) -> torch.Tensor:
    """Every value, every midpoint between neighbours (ties), one float32 ulp either side of each,
    the overflow midpoint and beyond, specials, tiny values, and random float32 bit patterns."""
    v = fmt.values().numpy().astype(np.float32)
    pos = v[v > 0]
    nxt = np.float32(min(fmt.max + 2.0 ** (fmt.emax - fmt.man_bits), 3.4e38))
    grid = np.concatenate([[0.0] if fmt.has_zero else [], pos, [nxt]]).astype(np.float64)
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    with np.errstate(over="ignore"):
        big = np.float32(nxt) * np.float32(2)
    pts = [pos, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
           np.nextafter(pos, np.float32(np.inf)), np.nextafter(pos, np.float32(0)),
           np.array([nxt, big, 3.0e38, np.inf, np.nan, 0.0, 1e-45, 1.2e-38, pos[0] / 4, pos[0] / 2,
                     np.float32(pos[0]) * np.float32(0.75)], np.float32)]
    with np.errstate(over="ignore"):
        p = np.concatenate(pts).astype(np.float32)
    rng = np.random.default_rng(seed)
    rnd = rng.integers(0, 2 ** 32, n_random, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return torch.from_numpy(np.concatenate([p, -p, rnd]))


def ref_quantize(x: torch.Tensor, fmt: FPFormat, rounding="nearest", overflow="saturate") -> torch.Tensor:
    """Slow reference: search the sorted fmt.values() (float64). Ties go to the neighbour whose
    significand in units of the local spacing is even; results beyond max overflow per convention."""
    vals = fmt.values().numpy()
    pos = vals[vals >= 0] if fmt.has_zero else vals
    pos = np.append(pos, fmt.max + 2.0 ** (fmt.emax - fmt.man_bits))  # next grid point above max
    xd = x.double().numpy()
    fin = np.isfinite(xd)
    ax = np.where(fin, np.abs(xd), 0.0)
    i = np.clip(np.searchsorted(pos, ax, side="right") - 1, 0, len(pos) - 2)
    lo, hi = pos[i], pos[i + 1]
    if rounding == "nearest":
        k = np.round(lo / (hi - lo))
        r = np.where(ax - lo < hi - ax, lo, np.where(hi - ax < ax - lo, hi, np.where(k % 2 == 1, hi, lo)))
    else:
        r = np.where(ax >= hi, hi, lo)
    r = np.where(ax < pos[0], pos[0], r)  # only formats without zero (fnu) get here
    ovf = (r > fmt.max) | np.isinf(xd)
    if overflow == "saturate" or not (fmt.has_inf or fmt.has_nan):
        r = np.where(ovf, fmt.max, r)
    else:
        r = np.where(ovf, np.inf if fmt.has_inf else np.nan, r)
    r = np.where(np.signbit(xd), -r, r)
    if not fmt.has_negative_zero:
        r = r + 0.0
    r = np.where(np.isnan(xd), np.nan, r)
    if not fmt.signed:  # no code for x < 0; +-0 is 0 where the format has a zero, else NaN
        r = np.where((np.signbit(xd) & (xd != 0)) | ((xd == 0) & (not fmt.has_zero)), np.nan, np.abs(r))
    return torch.from_numpy(r.astype(np.float32))


def neighbours(x: torch.Tensor, fmt: FPFormat):
    """(lo, hi): the representable values enclosing finite ``x`` (lo == hi when x is representable)."""
    lo = ref_quantize(x, fmt, "toward_zero", "saturate")
    vals = fmt.values().numpy()
    pos = np.append(vals[vals >= 0], fmt.max)
    a = np.abs(lo.double().numpy())
    j = np.minimum(np.searchsorted(pos, a, side="right"), len(pos) - 1)
    hi = np.where(np.abs(x.double().numpy()) > a, pos[j], a)
    hi = torch.from_numpy(np.copysign(hi, x.double().numpy()).astype(np.float32))
    return lo, hi


# --------------------------------------------------------------------------- oracles: ml_dtypes
@pytest.mark.parametrize("name", ORACLE)
@pytest.mark.parametrize("path", ["default", "generic"])
def test_bit_exact_against_ml_dtypes(name, path):
    """Every code, ties and one ulp either side, subnormals, overflow, +-inf, NaN, +-0, and a
    million random float32 bit patterns (100k for the generic integer path)."""
    fmt = REGISTRY[name]
    t = ml_type(name)
    x = probe_points(fmt, 1_000_000 if path == "default" else 100_000)
    with np.errstate(invalid="ignore", over="ignore"):
        want = f32(x.numpy().astype(t).astype(np.float32))
    if path == "default":
        got = quantize(x, fmt, overflow="nonfinite")
    else:
        got = Q._round_generic(x, Q._consts(fmt), None, "nearest", "nonfinite", None, None)
    nan_in = torch.isnan(x)
    if not fmt.has_nan:
        # documented disagreement: ml_dtypes writes -0 for NaN in formats without a NaN code;
        # quantize propagates NaN
        assert bool(torch.isnan(got[nan_in]).all())
        assert bool((want[nan_in] == 0).all())
        x, got, want = x[~nan_in], got[~nan_in], want[~nan_in]
    assert_same(got, want, x, name)


def test_ml_dtypes_via_half_inputs_and_scale():
    """The same oracle through float16/bfloat16 inputs and power-of-two scales."""
    rng = np.random.default_rng(1)
    x = f32(rng.standard_normal(50_000) * np.exp2(rng.integers(-20, 20, 50_000)))
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.to(dtype)
        for name in ("float8_e5m2", "float8_e4m3fn", "float6_e2m3fn", "float4_e2m1fn"):
            with np.errstate(invalid="ignore", over="ignore"):
                want = f32(xh.float().numpy().astype(getattr(ml_dtypes, name)).astype(np.float32))
            got = quantize(xh, name, overflow="nonfinite")
            assert got.dtype == dtype
            assert_same(got.float(), want, xh, f"{name} {dtype}")
    for k in (-7, 3):
        with np.errstate(invalid="ignore", over="ignore"):
            want = f32((x.numpy() * 2.0 ** k).astype(ml_dtypes.float8_e4m3).astype(np.float32) / 2.0 ** k)
        assert_same(quantize(x, "float8_e4m3", scale=2.0 ** k, overflow="nonfinite"), want, x, f"scale 2**{k}")


def test_e8m0fnu_against_ml_dtypes_and_reference():
    """e8m0fnu equals ml_dtypes except on float32 subnormals in (2**-127, 2**-126), which ml_dtypes
    rounds up to 2**-126 and quantize rounds to nearest (checked against the reference)."""
    fmt = REGISTRY["float8_e8m0fnu"]
    x = probe_points(fmt, 300_000)
    with np.errstate(invalid="ignore", over="ignore"):
        want = f32(x.numpy().astype(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    got = quantize(x, fmt, overflow="nonfinite")
    quirk = (x.abs() > 2.0 ** -127) & (x.abs() < 2.0 ** -126)
    assert_same(got[~quirk], want[~quirk], x[~quirk], "e8m0fnu")
    assert_same(got, ref_quantize(x, fmt, "nearest", "nonfinite"), x, "e8m0fnu reference")
    assert quantize(torch.tensor([1.3 * 2.0 ** -127]), fmt).item() == 2.0 ** -127
    assert quantize(torch.tensor([3.0, 0.75, 1.25]), fmt).tolist() == [4.0, 1.0, 1.0]  # ties up, as ml_dtypes


# ------------------------------------------------------------------------ oracles: torch float8
@pytest.mark.parametrize("dtype,name,overflow", [
    (torch.float8_e5m2, "e5m2", "nonfinite"),
    (torch.float8_e4m3fn, "e4m3fn", "saturate"),  # torch's cast saturates (inf and overflow -> +-448)
    (torch.float8_e5m2fnuz, "e5m2fnuz", "nonfinite"),
    (torch.float8_e4m3fnuz, "e4m3fnuz", "nonfinite"),
])
def test_bit_exact_against_torch_float8(dtype, name, overflow):
    fmt = parse(name)
    x = probe_points(fmt, 1_000_000, seed=2)
    want = x.to(dtype).float()
    assert_same(quantize(x, fmt, overflow=overflow), want, x, str(dtype))


def test_documented_oracle_disagreement_e4m3fn():
    """torch saturates e4m3fn where ml_dtypes gives NaN: overflow='saturate' reproduces torch,
    overflow='nonfinite' reproduces ml_dtypes."""
    x = torch.tensor([464.0, 465.0, 1e4, -1e30, math.inf, -math.inf, 448.0, 463.9])
    t = x.to(torch.float8_e4m3fn).float()
    m = f32(x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert t.tolist() == [448.0, 448.0, 448.0, -448.0, 448.0, -448.0, 448.0, 448.0]
    assert torch.isnan(m[1:6]).all() and m[0] == 448.0  # 464 is the tie 448|480: even 448
    assert_same(quantize(x, "e4m3fn", overflow="saturate"), t, x)
    assert_same(quantize(x, "e4m3fn", overflow="nonfinite"), m, x)
    assert quantize(x, "e4m3fn").tolist() == t.tolist()  # saturate is the default


# ----------------------------------------------------------------- arbitrary formats vs reference
ARBITRARY = [FPFormat(6, 1), FPFormat(3, 3), FPFormat(2, 2), FPFormat(2, 2, special="fn"), FPFormat(3, 1),
             FPFormat(4, 2, special="fn"), FPFormat(3, 1, special="fnuz"), FPFormat(5, 1), FPFormat(3, 3, bias=1),
             FPFormat(4, 3, bias=12, special="fn"), FPFormat(5, 2, bias=10), FPFormat(3, 3, subnormals=False),
             FPFormat(5, 2, special="fnuz", subnormals=False), FPFormat(2, 1, special="fn", subnormals=False),
             FPFormat(4, 0), FPFormat(3, 0, special="fn"), FPFormat(1, 6, special="fn"), FPFormat(7, 0, special="fn"),
             FPFormat(8, 3), FPFormat(5, 10), FPFormat(8, 7), FPFormat(4, 6, special="fnuz"), FPFormat(8, 0, special="fnu"),
             FPFormat(5, 3, special="fnu"), FPFormat(3, 2, special="fnu"), FPFormat(4, 3, bias=3, special="fnu"),
             FPFormat(4, 2, special="fnu", subnormals=False), FPFormat(1, 2, special="fnu"), FPFormat(4, 0, special="fnu")]


@pytest.mark.parametrize("fmt", ARBITRARY, ids=str)
def test_arbitrary_formats_against_slow_reference(fmt):
    x = probe_points(fmt, 20_000, seed=3)
    rng = np.random.default_rng(4)
    lx = f32(rng.choice([-1, 1], 20_000) * np.exp2(rng.uniform(fmt.emin - fmt.man_bits - 3, fmt.emax + 2, 20_000)))
    x = torch.cat([x, lx])
    for rounding in ("nearest", "toward_zero"):
        for overflow in ("saturate", "nonfinite"):
            got = quantize(x, fmt, rounding=rounding, overflow=overflow)
            assert_same(got, ref_quantize(x, fmt, rounding, overflow), x, f"{fmt} {rounding} {overflow}")


def test_wide_formats_fp32_and_23_mantissa_bits():
    x = probe_points(FPFormat(4, 3), 10_000)
    assert_same(quantize(x, "fp32", overflow="nonfinite"), x, x, "fp32 identity")
    assert bool((quantize(x, "fp32").abs() <= torch.finfo(torch.float32).max).all() | torch.isnan(x).any())
    f = FPFormat(4, 23, special="fn")
    y = quantize(x, f, overflow="nonfinite")
    small = x.abs() <= f.max
    # inside the range only the subnormal region below 2**emin rounds
    keep = small & (x.abs() >= f.min_normal)
    assert_same(y[keep], x[keep], x[keep], "e4m3... normals unchanged")
    assert torch.isnan(y[~small & ~torch.isnan(x)]).all()


# --------------------------------------------------------------------------------- properties
@st.composite
def formats(draw):
    special = draw(st.sampled_from(["ieee", "fn", "fnuz"]))
    e = draw(st.integers(2 if special == "ieee" else 1, 6))
    m = draw(st.integers(0, 5))
    base = 2 ** (e - 1) - (0 if special == "fnuz" else 1)
    bias = draw(st.integers(base - 3, base + 3))
    sub = draw(st.booleans())
    try:
        return FPFormat(e, m, bias=bias, special=special, subnormals=sub)
    except ValueError:
        return FPFormat(e, m, special=special, subnormals=sub)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
PROP = settings(max_examples=60, deadline=None)


@PROP
@given(fmt=formats(), xs=st.lists(any32, min_size=1, max_size=40),
       rounding=st.sampled_from(["nearest", "toward_zero", "stochastic"]),
       overflow=st.sampled_from(["saturate", "nonfinite"]))
def test_property_idempotent_and_representable(fmt, xs, rounding, overflow):
    x = torch.tensor(xs, dtype=torch.float32)
    y = quantize(x, fmt, rounding=rounding, overflow=overflow, generator=torch.Generator().manual_seed(1))
    assert_same(quantize(y, fmt, overflow=overflow), y, y, "Q(Q(x)) == Q(x)")
    vals = fmt.values()
    fin = torch.isfinite(y)
    assert bool(torch.isin(y[fin].double(), vals).all())
    nonfin = y[~fin]
    if not fmt.has_inf:
        assert not bool(torch.isinf(nonfin).any())
    if overflow == "saturate":
        assert not bool(torch.isinf(y).any())
    assert bool((torch.isnan(y) == (torch.isnan(x) | (torch.isnan(y) & (overflow == "nonfinite") & fmt.has_nan
                                                       & ((x.abs() > fmt.max) | torch.isinf(x))))).all())


@PROP
@given(fmt=formats(), xs=st.lists(finite32, min_size=2, max_size=40), rounding=st.sampled_from(["nearest", "toward_zero"]))
def test_property_monotone_and_odd(fmt, xs, rounding):
    x = torch.tensor(sorted(xs), dtype=torch.float32)
    y = quantize(x, fmt, rounding=rounding)
    assert bool((y[1:] >= y[:-1]).all())
    yn = quantize(-x, fmt, rounding=rounding)
    assert bool((yn == -y).all())
    if fmt.has_negative_zero:
        assert_same(yn, -y, x, "odd symmetry, bitwise")


@PROP
@given(fmt=formats(), x=finite32)
def test_property_stochastic_two_neighbours_and_mean(fmt, x):
    xt = torch.full((20_000,), x, dtype=torch.float32)
    if abs(x) > fmt.max:
        return
    lo, hi = neighbours(xt[:1], fmt)
    y = quantize(xt, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    assert bool(((y == lo) | (y == hi)).all())
    lo, hi = lo.item(), hi.item()
    if lo != hi:
        p = (x - lo) / (hi - lo)
        sd = abs(hi - lo) * math.sqrt(p * (1 - p) / xt.numel())
        assert abs(y.double().mean().item() - x) <= 6 * sd + 1e-3 * abs(hi - lo)


# ---------------------------------------------------------------------- stochastic rounding
SR_CASES = [
    ("e5m2", [1.1, 3.3e-5, 6.0e-5, 6.2e-5, 6.103515625e-05 * 0.999, 5.0e-6, 55000.0, 57000.0, 1e-7]),
    ("e4m3fn", [0.3, 0.0019, 0.0156, 0.0157, 430.0, 447.0, 1e-4]),
    ("e2m1fn", [0.3, 0.7, 1.2, 5.5, 0.1]),
    ("e3m3", [0.24, 0.26, 14.9, 0.01]),
    ("e3m3_nosub", [0.1, 0.2, 0.26]),
    ("e8m7", [1.0e-39, 3.0e38, 1.234]),
    ("e5m3fnu", [1.1, 3.3e-6, 6.0e-5, 1e-7, 110000.0]),
]


@pytest.mark.parametrize("name,points", SR_CASES)
def test_stochastic_rounding_unbiased(name, points):
    """Mean over 100k draws equals x within 5 standard errors: inside a binade, across the smallest
    normal (subnormal boundary), below the smallest subnormal, and just under max."""
    fmt = parse(name)
    n = 100_000
    g = torch.Generator().manual_seed(11)
    for x in points:
        xt = torch.full((n,), x, dtype=torch.float32)
        x32 = xt[0].item()
        y = quantize(xt, fmt, rounding="stochastic", generator=g)
        lo, hi = neighbours(xt[:1], fmt)
        lo, hi = lo.item(), hi.item()
        assert bool(((y == lo) | (y == hi)).all()), (name, x)
        p = (x32 - lo) / (hi - lo)
        sd = (hi - lo) * math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(y.double().mean().item() - x32) <= 5 * sd, (name, x, y.double().mean().item())


def test_stochastic_subnormal_spacing_uses_fixed_grid():
    """Below 2**emin the rounding unit is fixed (2**(emin-M)): P(up) equals the fraction of it."""
    fmt = parse("e5m2")
    u = fmt.min_subnormal
    x = torch.full((400_000,), 2.25 * u)
    y = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert set(y.unique().tolist()) == {2 * u, 3 * u}
    assert abs((y == 3 * u).double().mean().item() - 0.25) < 5 * math.sqrt(0.25 * 0.75 / x.numel())


def test_stochastic_at_and_above_max():
    fmt = parse("e4m3fn")
    x = torch.tensor([448.0, -448.0] * 1000)
    assert torch.equal(quantize(x, fmt, rounding="stochastic"), x)  # max itself never moves
    big = torch.full((10_000,), 470.0)
    sat = quantize(big, fmt, rounding="stochastic")
    assert bool((sat == 448.0).all())
    nf = quantize(big, fmt, rounding="stochastic", overflow="nonfinite")
    frac = torch.isnan(nf).double().mean().item()  # rounds up to 480 (NaN code) with p = 22/32
    assert abs(frac - 22 / 32) < 5 * math.sqrt(0.2 / big.numel())
    assert bool(((nf == 448.0) | torch.isnan(nf)).all())
    e5 = quantize(torch.full((10_000,), 60_000.0), "e5m2", rounding="stochastic", overflow="nonfinite")
    assert bool(((e5 == 57344.0) | torch.isinf(e5)).all()) and bool(torch.isinf(e5).any())


def test_stochastic_reproducible_and_device_path_independent(monkeypatch):
    x = torch.randn(300_001) * 1e-3
    a = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    b = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    c = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(3)
    d = quantize(x, "e4m3fn", rounding="stochastic")
    torch.manual_seed(3)
    assert torch.equal(d, quantize(x, "e4m3fn", rounding="stochastic"))
    # chunking and threads do not change the bits (counter-based random bits)
    monkeypatch.setattr(Q, "CHUNK", 1000)
    monkeypatch.setattr(Q, "THREADS", 2)
    importlib.import_module("gradstats.ops.random")._iota_cached.cache_clear()
    assert torch.equal(a, quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(5)))
    # the generic integer path draws the same bits
    g = Q._round_generic(x, Q._consts(parse("e4m3fn")), None, "stochastic", "saturate",
                         torch.Generator().manual_seed(5), None)
    assert torch.equal(a, g)
    importlib.import_module("gradstats.ops.random")._iota_cached.cache_clear()


@pytest.mark.parametrize("fmt", [parse("e5m2"), parse("e2m1fn"), FPFormat(3, 3), FPFormat(4, 0), parse("e8m7"),
                                 parse("e4m3fnuz"), parse("e5m3fnu")], ids=str)
def test_stochastic_fast_and_generic_paths_agree_bitwise(fmt):
    x = probe_points(fmt, 20_000, seed=9)
    R = torch.randint(0, 1 << 23, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    for overflow in ("saturate", "nonfinite"):
        a = Q._quantize_eager(x, fmt, None, "stochastic", overflow, None, rbits=R)
        b = Q._round_generic(x, Q._consts(fmt), None, "stochastic", overflow, None, R)
        assert_same(a, b, x, f"{fmt} {overflow}")


def test_random_bits_hash_matches_numpy_and_looks_random():
    from gradstats.ops import random as R

    seed = 0x0123456789ABCDEF
    lo = 2 ** 32 - 3000  # crosses the 2**32 boundary of the counter (a new segment key)
    out = torch.empty(6000, dtype=torch.int32)
    Q._hash_bits(lo, seed, Q._iota(6000, torch.device("cpu")), out, torch.empty_like(out), 23)
    np.testing.assert_array_equal(out.numpy().astype(np.uint32), R.reference_bits(seed, lo, 6000) >> np.uint32(9))
    # statistics of one stream: uniform, no serial correlation, independent pairs
    n = 1 << 20
    r = torch.empty(n, dtype=torch.int32)
    Q._hash_bits(0, 12345, Q._iota(n, torch.device("cpu")), r, torch.empty_like(r), 23)
    u = r.double() / 2 ** 23
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    c = u - u.mean()
    for lag in (1, 2, 3, 4, 5, 8, 16, 1024):
        ac = (c[:-lag] * c[lag:]).mean().item() / c.var().item()
        assert abs(ac) < 5 / math.sqrt(n), lag
    a, b = (u[0::2] * 16).long(), (u[1::2] * 16).long()
    cnt = torch.bincount(a * 16 + b, minlength=256).double()
    chi2 = ((cnt - cnt.mean()) ** 2 / cnt.mean()).sum().item()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)


# -------------------------------------------------------------------------------- block scaling
def test_mx_shared_exponent():
    amax = torch.tensor([1.0, 448.0, 500.0, 0.0, 1e-45, 3e38, 0.75, float("nan"), 2.0 ** -140])
    e = mx_shared_exponent(amax, "e4m3fn")
    assert e.dtype == torch.int32
    want = [0 - 8, 8 - 8, 8 - 8, -127, -127, 127 - 8, -1 - 8, -127, -127]
    assert e.tolist() == want
    rng = np.random.default_rng(0)
    a = f32(np.exp2(rng.uniform(-100, 100, 1000)))
    for name in ("e2m1fn", "e5m2", "e3m2fn"):
        fmt = parse(name)
        got = mx_shared_exponent(a, fmt).tolist()
        ref = [min(max(math.frexp(v)[1] - 1 - fmt.emax, -127), 127) for v in a.tolist()]
        assert got == ref


def _mx_manual(x2d: torch.Tensor, fmt: FPFormat, B: int) -> torch.Tensor:
    out = torch.empty_like(x2d)
    for i in range(x2d.shape[0]):
        for j in range(0, x2d.shape[1], B):
            blk = x2d[i, j:j + B]
            amax = blk[torch.isfinite(blk)].abs().max().item() if torch.isfinite(blk).any() else 0.0
            e = -127 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - fmt.emax, -127), 127)
            out[i, j:j + B] = quantize(blk, fmt, scale=2.0 ** -e)
    return out


@pytest.mark.parametrize("name", ["e2m1fn", "e4m3fn", "e5m2", "e3m2fn"])
def test_mx_block_quantize_equals_manual(name):
    fmt = parse(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 100, generator=g) * torch.exp2(torch.randint(-12, 12, (6, 1), generator=g).float())
    x[0, 5] = 0.0
    x[1, :32] = 0.0  # an all-zero block
    x[2, 40] = float("nan")
    x[3, 70] = float("inf")
    y = quantize(x, fmt, block_size=32)
    assert y.shape == x.shape
    assert_same(y, _mx_manual(x, fmt, 32), x, name)
    assert bool((y[1, :32] == 0).all()) and torch.isnan(y[2, 40])
    # along another dimension, with a partial last block
    y0 = quantize(x, fmt, block_size=4, block_dim=0)
    assert_same(y0, _mx_manual(x.t().contiguous(), fmt, 4).t(), x, name + " dim 0")


def test_block_scales_shapes_and_values():
    x = torch.randn(3, 5, 64)
    s = block_scales(x, "e4m3fn", block_size=32, block_dim=-1)
    assert s.shape == (3, 5, 2)
    amax = x.abs().reshape(3, 5, 2, 32).amax(-1)
    assert torch.equal(s, torch.exp2(mx_shared_exponent(amax, "e4m3fn").float()))
    s1 = block_scales(x, "e4m3fn", block_size=2, block_dim=1)
    assert s1.shape == (3, 3, 64)


def test_nvfp4_style_blocks_equal_manual_with_ml_dtypes_scale():
    fmt = parse("e2m1fn")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (4, 64), generator=g).float())
    x[2, 16:32] = 1e-30  # a block whose e4m3 scale underflows to 0 -> zeros
    y = quantize(x, fmt, block_size=16, scale_format="e4m3")
    t = np.float32(x.abs().max().item() / (6.0 * 448.0))
    out = np.zeros((4, 64), np.float32)
    xn = x.numpy()
    for i in range(4):
        for j in range(0, 64, 16):
            blk = xn[i, j:j + 16]
            sb = np.float32(np.float32(np.abs(blk).max()) / np.float32(np.float32(6.0) * t))
            sbq = np.float32(np.array(sb).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
            X = np.float32(sbq * t)
            if X > 0:
                q = quantize(torch.from_numpy(blk / X), fmt).numpy()
                out[i, j:j + 16] = q * X
    assert_same(y, torch.from_numpy(out), x, "nvfp4")
    assert bool((y[2, 16:32] == 0).all())
    s = block_scales(x, gradstats.Scheme.of(fmt, block_size=16, scale_format="e4m3"))
    assert s.shape == (4, 4) and s[2, 1].item() == 0.0


def test_blocks_relative_error_bound_on_lognormal_data():
    """MX e4m3 keeps every element within half an ulp of its block's format grid."""
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.randn(8, 256, generator=g) * 2.5) * torch.sign(torch.randn(8, 256, generator=g))
    y = quantize(x, "e4m3fn", block_size=32)
    X = block_scales(x, "e4m3fn", block_size=32).repeat_interleave(32, dim=-1)
    z = x / X
    normal = (z.abs() >= 2.0 ** -6) & (z.abs() <= 448)
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max().item() <= 2.0 ** -4 + 1e-7
    sub = z.abs() < 2.0 ** -6
    assert ((y - x).abs() / X)[sub].max().item() <= 2.0 ** -10 + 1e-9


# ------------------------------------------------------------------------- dtypes, shapes, scale
def test_half_precision_inputs_are_exact_when_the_format_fits():
    x = torch.randn(20_000) * 100
    for dtype, name in [(torch.float16, "e5m2"), (torch.float16, "e4m3fn"), (torch.bfloat16, "e4m3fn"),
                        (torch.bfloat16, "e2m1fn"), (torch.bfloat16, "e8m3")]:
        xh = x.to(dtype)
        y = quantize(xh, name, rounding="stochastic", generator=torch.Generator().manual_seed(0))
        yf = quantize(xh.float(), name, rounding="stochastic", generator=torch.Generator().manual_seed(0))
        assert y.dtype == dtype
        assert_same(y.float(), yf, xh, f"{name} in {dtype}")  # no second rounding
    # a format wider than the input dtype: the cast back rounds again (documented)
    xh = torch.tensor([65504.0, 1e-7], dtype=torch.float16)
    y = quantize(xh, "e8m3", overflow="nonfinite")
    assert y.dtype == torch.float16
    assert torch.equal(y, quantize(xh.float(), "e8m3", overflow="nonfinite").to(torch.float16))
    assert torch.isinf(y[0])  # 65504 rounds to 65536 in e8m3, beyond float16


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 4, 5), (2, 0, 3), (0,)])
def test_shapes_and_empty(shape):
    x = torch.randn(shape) * 10
    for rounding in ("nearest", "stochastic"):
        y = quantize(x, "e3m2fn", rounding=rounding)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert_same(quantize(x.flatten(), "e3m2fn", rounding=rounding,
                             generator=torch.Generator().manual_seed(0)).view(shape),
                    quantize(x, "e3m2fn", rounding=rounding, generator=torch.Generator().manual_seed(0)), x)
    assert quantize(x, "e4m3fn", block_size=4).shape == x.shape if x.dim() else True


def test_non_contiguous_inputs_and_input_untouched():
    base = torch.randn(64, 48) * 3
    keep = base.clone()
    for x in (base.t(), base[::3, 1::2], base.unsqueeze(-1).expand(64, 48, 2)):
        assert not x.is_contiguous()
        assert_same(quantize(x, "e4m3"), quantize(x.contiguous(), "e4m3"), x)
        assert_same(quantize(x, "e2m1fn", block_size=8), quantize(x.contiguous(), "e2m1fn", block_size=8), x)
    assert torch.equal(base, keep)
    w = torch.randn(10, requires_grad=True)
    y = quantize(w, "e5m2")
    assert not y.requires_grad and y.shape == w.shape


def test_scale_float_and_per_channel():
    x = torch.randn(16, 40) * 1e-3
    assert_same(quantize(x, "e4m3fn", scale=2.0 ** 10), quantize(x * 2.0 ** 10, "e4m3fn") / 2.0 ** 10, x)
    s = 3.7
    assert_same(quantize(x, "e4m3fn", scale=s), quantize(x * s, "e4m3fn") / s, x)  # x*s, Q, /s as written
    ch = torch.exp2(torch.arange(16).float()).view(16, 1)
    assert_same(quantize(x, "e5m2", scale=ch), quantize(x * ch, "e5m2") / ch, x)
    row = torch.rand(40) + 0.5
    assert_same(quantize(x, "e5m2", scale=row, overflow="nonfinite"),
                quantize(x * row, "e5m2", overflow="nonfinite") / row, x)
    assert_same(quantize(x, "e3m2fn", scale=torch.tensor(8.0)), quantize(x, "e3m2fn", scale=8.0), x)
    # fnuz keeps no negative zero through the division
    y = quantize(torch.tensor([-1e-12, -3.0]), "e4m3fnuz", scale=torch.tensor([2.0, 2.0]))
    assert not torch.signbit(y[0]) and y[1].item() == -3.0


def test_specials_per_convention():
    x = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -1e30])
    def q(name, ov):
        return quantize(x, name, overflow=ov)
    assert_same(q("e5m2", "nonfinite"), f32([np.nan, np.inf, -np.inf, -0.0, 0.0, np.inf, -np.inf]), x)
    assert_same(q("e5m2", "saturate"), f32([np.nan, 57344, -57344, -0.0, 0.0, 57344, -57344]), x)
    assert_same(q("e4m3fn", "nonfinite"), f32([np.nan, np.nan, np.nan, -0.0, 0.0, np.nan, np.nan]), x)
    assert_same(q("e4m3fnuz", "nonfinite"), f32([np.nan, np.nan, np.nan, 0.0, 0.0, np.nan, np.nan]), x)
    assert_same(q("e2m1fn", "nonfinite"), f32([np.nan, 6, -6, -0.0, 0.0, 6, -6]), x)
    assert_same(q("e8m0fnu", "nonfinite"), f32([np.nan, np.nan, np.nan, np.nan, np.nan, 2.0 ** 100, np.nan]), x)
    assert_same(q("e8m0fnu", "saturate"), f32([np.nan, 2.0 ** 127, np.nan, np.nan, np.nan, 2.0 ** 100, np.nan]), x)
    assert_same(q("e5m3fnu", "nonfinite"), f32([np.nan, np.nan, np.nan, 0.0, 0.0, np.nan, np.nan]), x)
    assert_same(q("e5m3fnu", "saturate"), f32([np.nan, 114688, np.nan, 0.0, 0.0, 114688, np.nan]), x)


@pytest.mark.parametrize("path", ["default", "generic", "tensor_scale", "blocks"])
def test_unsigned_format_with_zero_negative_inputs(path):
    """e5m3fnu (unsigned, with a zero): x < 0 has no code and gives NaN, also when it would round to
    0 (as ml_dtypes does); -0 gives +0; non-negative values round as in the signed formats."""
    x = torch.tensor([-1.0, -1e-30, -0.0, 0.0, 1e-30, 3.0, 1.0625, 3e-6, 2e5, -2e5])
    fmt = parse("e5m3fnu")
    # 1.0625 ties to the even 1.0; 3e-6 is below half the smallest subnormal 2**-17; 2e5 saturates
    want = f32([np.nan, np.nan, 0.0, 0.0, 0.0, 3.0, 1.0, 0.0, 114688.0, np.nan])
    if path == "default":
        got = quantize(x, fmt)
    elif path == "generic":
        got = Q._round_generic(x, Q._consts(fmt), None, "nearest", "saturate", None, None)
    elif path == "tensor_scale":  # quantize(2x) / 2: 6e-6 rounds up to 2**-17
        got = quantize(x, fmt, scale=torch.full_like(x, 2.0))
        want = f32([np.nan, np.nan, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0 ** -18, 57344.0, np.nan])
    else:
        got = quantize(x.view(2, 5), fmt, block_size=5).flatten()
        want = None
    if want is not None:
        assert_same(got, want, x, path)
    assert bool(torch.isnan(got[x < 0]).all()) and not bool(torch.isnan(got[x >= 0]).any())
    assert not bool(torch.signbit(got[x >= 0]).any())
    t = getattr(ml_dtypes, "float8_e5m3fnu", None)
    if t is not None:  # what ml_dtypes does with the same inputs
        with np.errstate(invalid="ignore", over="ignore"):
            ml = f32(x.numpy().astype(t).astype(np.float32))
        assert bool(torch.isnan(ml[x < 0]).all()) and not bool(torch.signbit(ml[x >= 0]).any())


def test_public_names():
    assert gradstats.quantize is quantize
    assert Q.ROUNDINGS == ("nearest", "stochastic", "toward_zero")
    assert Q.SCALE_FORMATS == ("e8m0", "e4m3")


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,match", [
    (lambda: quantize([1.0], "e4m3"), "torch.Tensor"),
    (lambda: quantize(torch.ones(3, dtype=torch.int32), "e4m3"), "float32, float16 or bfloat16"),
    (lambda: quantize(torch.ones(3, dtype=torch.float64), "e4m3"), "float32, float16 or bfloat16"),
    (lambda: quantize(torch.ones(3), "e9m9"), "wider than float32|format"),
    (lambda: quantize(torch.ones(3), "fp7"), "unknown format"),
    (lambda: quantize(torch.ones(3), 7), "format"),
    (lambda: quantize(torch.ones(3), "e4m3", rounding="up"), "rounding must be one of"),
    (lambda: quantize(torch.ones(3), "e4m3", overflow="wrap"), "overflow must be one of"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=0.0), "positive and finite"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=-2.0), "positive and finite"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=math.nan), "positive and finite"),
    (lambda: quantize(torch.ones(3), "e4m3", scale="2"), "scale must be None"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=torch.ones(4)), "does not broadcast"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=torch.ones(3, dtype=torch.int64)), "floating point"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=torch.tensor([1.0, 0.0, 1.0])), "positive and finite"),
    (lambda: quantize(torch.ones(3), "e4m3", generator=3), "torch.Generator"),
    (lambda: quantize(torch.ones(3), "e4m3", block_size=0), "block_size must be a positive int"),
    (lambda: quantize(torch.ones(3), "e4m3", block_size=2.0), "block_size must be a positive int"),
    (lambda: quantize(torch.ones(3), "e4m3", block_size=True), "block_size must be a positive int"),
    (lambda: quantize(torch.ones(3), "e4m3", block_size=2, block_dim=1), "block_dim must be in"),
    (lambda: quantize(torch.tensor(1.0), "e4m3", block_size=2), "at least one dimension"),
    (lambda: quantize(torch.ones(3), "e4m3", block_size=2, scale_format="e5m2"), "scale_format must be one of"),
    (lambda: quantize(torch.ones(3), "e4m3", scale=2.0, block_size=2), "not both"),
    (lambda: block_scales(torch.ones(3), "e4m3", block_size=-1), "block_size"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("scale", [1e300, 1e-300, 2.0 ** 128, 2.0 ** -128])
def test_scale_outside_float32_is_an_error_not_nan(scale):
    x = torch.randn(100)
    with pytest.raises(ValueError, match=r"outside \[2\*\*-127, 2\*\*127\]"):
        gradstats.quantize(x, "e4m3fn", scale=scale)
    with pytest.raises(ValueError, match=r"must lie in \[2\*\*-127, 2\*\*127\]"):
        gradstats.quantize(x, "e4m3fn", scale=torch.tensor([scale], dtype=torch.float64))
    # the edges of the allowed range still quantise to finite values
    for ok in (2.0 ** 127, 2.0 ** -127):
        assert torch.isfinite(gradstats.quantize(torch.tensor([1e-30, 1.0]), "e4m3fn", scale=ok)).all()


# -- the default scale: quantize(scale="amax") is what_if's rule; an unscaled call that flushes most of x says so
def test_amax_scale_is_the_power_of_two_of_what_if_and_the_plans():
    from gradstats.formats import amax_scale

    g = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3e-6
    for fmt in ("e4m3fn", "e5m2", "e2m1fn"):
        s = amax_scale(fmt, float(g.abs().max()))
        assert s == 2.0 ** math.floor(math.log2(FPFormat.parse(fmt).max / float(g.abs().max())))
        assert torch.equal(quantize(g, fmt, scale="amax"), quantize(g, fmt, scale=s))
        assert (quantize(g, fmt, scale="amax") == 0).float().mean() < 0.5


def test_an_unscaled_quantize_that_flushes_most_of_a_gradient_warns():
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-6
    with pytest.warns(UserWarning, match=r"flushed about 100% of x's non-zero entries.*scale='amax'"):
        assert bool((quantize(g, "e4m3fn") == 0).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # on purpose (scale=1.0), with a scale, in blocks, or not flushed
        quantize(g, "e4m3fn", scale=1.0)
        quantize(g, "e4m3fn", scale="amax")
        quantize(g, "e4m3fn", block_size=32)
        quantize(g * 1e6, "e4m3fn")


def test_a_bad_scale_names_the_choices():
    with pytest.raises(ValueError, match="scale must be None, 'amax', a float or a tensor, got 'max'"):
        quantize(torch.ones(4), "e4m3fn", scale="max")
    with pytest.raises(ValueError, match="either scale or block_size"):
        quantize(torch.ones(64), "e4m3fn", scale="amax", block_size=32)
