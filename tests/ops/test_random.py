"""The one random stream of the stochastic operators (gradstats.ops.random): the numpy reference
against the torch, C and Triton (interpreter) implementations bit for bit, far indices included;
its statistical quality; and every stochastic operator on every engine against the reference for
the same seed (torch.equal outputs, special values included)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradstats.formats import FPFormat, parse
from gradstats.ops import cpu as _cpu
from gradstats.ops import fused as _fused
from gradstats.ops import quantization as Q
from gradstats.ops import random as R
from gradstats.ops.fused import prune_quantize
from gradstats.ops.prune import stochastic_prune
from gradstats.ops.quantization import quantize
from gradstats.ops.triton import prune as kp
from gradstats.ops.triton import triton_available

FAR = [0, 12345, 2 ** 32 - 1500, 2 ** 33 - 700, 2 ** 40 + 3]
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 3e-39, -1e-40, 1e30, -2.0, 1e-8]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

def _native_bits():
    from gradstats.ops.native import random_bits

    fn = random_bits()
    if fn is None:
        pytest.skip("no C compiler here")
    return fn


@pytest.fixture
def interpret(monkeypatch):
    if not triton_available():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")


def sample(n: int, a: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Magnitudes around ``a`` (both signs), with NaN, inf, zeros and subnormals at the front."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).mul_(1.5).add_(math.log(a)).exp_()
    x.mul_(torch.randint(0, 2, (n,), generator=g, dtype=torch.float64).mul_(2).sub_(1))
    x[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    return x.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN included (as NaN), signed zeros distinguished."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    na, nb = a.isnan(), b.isnan()
    if not torch.equal(na, nb):
        return False
    ib = {torch.float32: torch.int32, torch.float64: torch.int64}.get(a.dtype, torch.int16)
    return torch.equal(a[~na].view(ib), b[~nb].view(ib))


def ref_prune(x: torch.Tensor, a: float, seed: int, start: int = 0) -> torch.Tensor:
    """Pruning with the reference's uniforms (numpy), by the torch formula."""
    cd = np.float64 if x.dtype == torch.float64 else np.float32
    u = torch.from_numpy(R.reference_uniforms(seed, start, x.numel(), cd)).reshape(x.shape)
    return kp.stochastic_prune_torch(x, a, uniforms=u)


def ref_rbits(seed: int, n: int, start: int = 0) -> torch.Tensor:
    """The 23 rounding bits of the reference for user seed ``seed`` (int32)."""
    b = R.reference_bits(R.stream(seed, R.ROUND), start, n) >> np.uint32(9)
    return torch.from_numpy(b.astype(np.int32))


# ----------------------------------------------------------------------------- the generator
@pytest.mark.parametrize("start", FAR)
def test_torch_numpy_and_c_words_equal_the_reference(start):
    seed = 0xDEADBEEF12345678
    n = 5000  # the ranges below 2**32 and 2**33 cross the multiple
    ref = R.reference_bits(seed, start, n)
    assert np.array_equal(R.bits(seed, start, n).numpy().view(np.uint32), ref)
    fn = _native_bits()
    got = np.empty(n, np.uint32)
    fn(seed, start, n, got.ctypes.data)
    assert np.array_equal(got, ref)
    # the numpy engine's in-place form, on pieces that stay inside a segment
    out, tmp = np.empty(n, np.uint32), np.empty(n, np.uint32)
    cut = min(n, (1 << 32) - (start & R.M32))
    R.np_bits_into(seed, start, out[:cut], tmp[:cut])
    if cut < n:
        R.np_bits_into(seed, start + cut, out[cut:], tmp[cut:])
    assert np.array_equal(out, ref)
    # and hash_bits on a range that is split mid-way (the chunked CPU path's form)
    o = torch.empty(n, dtype=torch.int32)
    R.hash_bits(start, seed, R.iota(n, torch.device("cpu")), o, torch.empty_like(o), 23)
    assert np.array_equal(o.numpy().astype(np.uint32), ref >> np.uint32(9))


def test_reference_by_index_array_and_no_wrap():
    idx = np.array([5, 2 ** 32 + 5, 2 ** 33 + 5, 2 ** 63 + 5], dtype=np.uint64)
    b = R.reference_bits(11, index=idx)
    assert len(set(b.tolist())) == 4  # indices >= 2**32 do not repeat index - 2**32
    for i, v in zip(idx.tolist(), b.tolist()):
        assert R.reference_bits(11, i, 1)[0] == v
    lo, hi = R.reference_bits(11, 0, 4096), R.reference_bits(11, 2 ** 32, 4096)
    assert (lo != hi).mean() > 0.99


def test_the_map_of_the_low_word_is_a_bijection():
    # distinct indices of a segment give distinct words: no collision among 2**22 consecutive ones
    b = R.reference_bits(3, 2 ** 32 - 2 ** 21, 2 ** 22)  # two segments, each a bijection
    assert np.unique(b[: 2 ** 21]).size == 2 ** 21 and np.unique(b[2 ** 21:]).size == 2 ** 21
    # the steps are invertible: invert them on a sample
    k1, k2 = R.segment_key(3, 0)
    h = R.reference_bits(3, 0, 1000).astype(np.uint64)
    inv = lambda k: pow(k, -1, 1 << 32)  # noqa: E731
    m = np.uint64(R.M32)
    h = (h * np.uint64(inv(R.K3))) & m
    h ^= h >> np.uint64(15)
    h ^= h >> np.uint64(30)
    h = ((h - np.uint64(k2)) * np.uint64(inv(R.K2))) & m
    h ^= h >> np.uint64(16)
    h = ((h * np.uint64(inv(R.K1))) - np.uint64(k1)) & m
    assert np.array_equal(h, np.arange(1000, dtype=np.uint64))


def _chi2_bytes(b: np.ndarray) -> list[float]:
    out = []
    for k in range(4):
        c = np.bincount(((b >> np.uint32(8 * k)) & np.uint32(255)).astype(np.int64), minlength=256)
        e = b.size / 256
        out.append(float(((c - e) ** 2 / e).sum()))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2 ** 63 + 17])
def test_generator_quality(seed):
    n = 1 << 21
    b = R.reference_bits(R.stream(seed, R.PRUNE), 2 ** 32 - n // 2, n)  # across a segment boundary
    # every byte uniform: chi-square with 255 degrees of freedom (sd ~22.6), 6 sd bound
    for c in _chi2_bytes(b):
        assert c < 255 + 6 * math.sqrt(2 * 255)
    # bit balance: each of the 32 bits set half the time (5 sd)
    ones = np.array([((b >> np.uint32(i)) & np.uint32(1)).mean() for i in range(32)])
    assert np.abs(ones - 0.5).max() < 5 * 0.5 / math.sqrt(n)
    # adjacent indices: correlation of the words, and of the 24-bit uniforms at lags 1..4
    u = b.astype(np.float64)
    for lag in (1, 2, 3, 4, 7, 2 ** 10):
        r = np.corrcoef(u[:-lag], u[lag:])[0, 1]
        assert abs(r) < 5 / math.sqrt(n), lag
    # pairs of adjacent words: joint chi-square of their top 4 bits (255 dof)
    a, c = (b[:-1] >> np.uint32(28)).astype(np.int64), (b[1:] >> np.uint32(28)).astype(np.int64)
    cnt = np.bincount(a * 16 + c, minlength=256)
    assert float(((cnt - cnt.mean()) ** 2 / cnt.mean()).sum()) < 255 + 6 * math.sqrt(2 * 255)


def test_adjacent_seeds_and_domains_are_uncorrelated():
    n = 1 << 20
    for s0, s1 in ((7, 8), (R.stream(5, R.PRUNE), R.stream(5, R.ROUND)), (R.stream(5, R.PRUNE), R.stream(6, R.PRUNE))):
        u, v = R.reference_bits(s0, 0, n).astype(np.float64), R.reference_bits(s1, 0, n).astype(np.float64)
        assert abs(np.corrcoef(u, v)[0, 1]) < 5 / math.sqrt(n)
        assert (u != v).mean() > 0.999
    # the first word of consecutive seeds
    w = np.array([R.reference_bits(s, 0, 1)[0] for s in range(20_000)], dtype=np.float64)
    assert abs(np.corrcoef(w[:-1], w[1:])[0, 1]) < 5 / math.sqrt(w.size)
    for c in _chi2_bytes(w.astype(np.uint32)):
        assert c < 255 + 6 * math.sqrt(2 * 255)


def test_uniforms_torch_equal_reference_both_widths():
    for dt, ndt in ((torch.float32, np.float32), (torch.float64, np.float64)):
        for start in (0, 2 ** 32 - 100):
            got = R.uniforms(99, 3000, dt, start=start)
            want = R.reference_uniforms(99, start, 3000, ndt)
            assert torch.equal(got, torch.from_numpy(want))
            assert ((got >= 0) & (got < 1)).all()
    u64 = R.reference_uniforms(5, 0, 1000, np.float64)
    u32 = R.reference_uniforms(5, 0, 1000, np.float32)
    assert np.array_equal(np.floor(u64 * 2 ** 24), u32.astype(np.float64) * 2 ** 24)  # same top 24 bits
    assert (u64 * 2 ** 53 % 2 ** 29 != 0).mean() > 0.99  # and 29 more


# ----------------------------------------------------------------------------- seeds
def test_seed_keyword_validation():
    x = torch.randn(100)
    g = torch.Generator().manual_seed(0)
    calls = [lambda **k: quantize(x, "e4m3fn", rounding="stochastic", **k),
             lambda **k: stochastic_prune(x, 0.5, **k),
             lambda **k: prune_quantize(x, 0.5, "e4m3fn", rounding="stochastic", **k)]
    for f in calls:
        with pytest.raises(ValueError, match="not both"):
            f(seed=1, generator=g)
        for bad in (-1, 2 ** 64, 1.5, "3", True):
            with pytest.raises(ValueError, match="seed"):
                f(seed=bad)
        # a generator gives the result of the seed drawn from it; numpy ints are accepted
        s = R.draw_seed(torch.Generator().manual_seed(4))
        a, b = f(generator=torch.Generator().manual_seed(4)), f(seed=np.uint64(s))
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- pruning
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("engine", ["default", "numpy"])
def test_cpu_prune_engines_equal_the_reference(engine, dtype, monkeypatch):
    if engine == "numpy":
        monkeypatch.setattr(_cpu, "native_kernel", lambda: None)
    a = float(torch.tensor(1e-3, dtype=dtype))
    for n in (1, 4097, 200_001):
        x = sample(n, a, seed=n, dtype=dtype) if n > 1 else torch.tensor([5e-4], dtype=dtype)
        for seed in (0, 2 ** 64 - 1):
            y = stochastic_prune(x, a, seed=seed)
            assert same(y, ref_prune(x, a, seed)), (n, seed)
    # the result does not depend on the number of threads
    before = torch.get_num_threads()
    try:
        x = sample(300_000, a, 3, dtype)
        torch.set_num_threads(1)
        y1 = stochastic_prune(x, a, seed=9)
        torch.set_num_threads(2)
        assert same(y1, stochastic_prune(x, a, seed=9))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_torch_prune_path_equals_the_reference(device, dtype):
    a = float(torch.tensor(1e-3, dtype=dtype))
    x = sample(30_001, a, 5, dtype)
    y = kp.stochastic_prune_torch(x.to(device), a, seed=77).cpu()
    assert same(y, ref_prune(x, a, 77))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_triton_prune_equals_the_reference(interpret, dtype):
    a = float(torch.tensor(1e-3, dtype=dtype))
    x = sample(5000, a, 6, dtype)
    assert same(kp.stochastic_prune(x, a, seed=77), ref_prune(x, a, 77))
    # the public operator routes to the kernel under the interpreter: the same result
    assert same(stochastic_prune(x, a, seed=77), ref_prune(x, a, 77))


@pytest.mark.parametrize("start", [2 ** 32 - 1500, 2 ** 33 - 700])
def test_triton_prune_at_far_counters(interpret, start):
    for dtype in (torch.float32, torch.float64):
        x = sample(3000, 1e-3, 7, dtype)
        a = float(torch.tensor(1e-3, dtype=dtype))
        y = kp.stochastic_prune(x, a, seed=5, index_start=start)
        assert same(y, ref_prune(x, a, 5, start))
        assert not same(y, ref_prune(x, a, 5, start ^ (1 << 32)))  # another 2**32 segment


@pytest.mark.gpu
def test_triton_prune_on_cuda_equals_the_reference():  # CPU twin: test_triton_prune_equals_the_reference
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        a = float(torch.tensor(1e-3, dtype=dtype))
        x = sample(300_001, a, 6, dtype)
        assert same(stochastic_prune(x.cuda(), a, seed=77).cpu(), ref_prune(x, a, 77))
        assert same(stochastic_prune(x.cuda(), a, seed=77).cpu(), stochastic_prune(x, a, seed=77))


# ----------------------------------------------------------------------------- rounding
ROUND_FORMATS = [parse("e5m2"), parse("e4m3fn"), parse("e2m1fn"), parse("e3m2fn"), FPFormat(3, 3, subnormals=False),
                 FPFormat(4, 0), parse("e4m3fnuz"), parse("e8m0fnu"), parse("e5m3fnu")]


def _qsample(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).mul_(4).exp_() * 1e-2
    x.mul_(torch.randint(0, 2, (n,), generator=g, dtype=torch.float64).mul_(2).sub_(1))
    x[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ROUND_FORMATS, ids=str)
def test_stochastic_rounding_cpu_paths_equal_the_reference(fmt, monkeypatch):
    monkeypatch.setattr(Q, "CHUNK", 4096)  # several chunks and worker threads
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = _qsample(20_011, 3, dtype)
        for overflow in ("saturate", "nonfinite"):
            want = Q._quantize_eager(x, fmt, None, "stochastic", overflow, None, rbits=ref_rbits(12, x.numel()))
            got = quantize(x, fmt, rounding="stochastic", overflow=overflow, seed=12)
            assert same(got, want), (str(fmt), dtype, overflow)
    # the generic integer path draws the same bits
    x = _qsample(5000, 4)
    g = Q._round_generic(x, Q._consts(fmt), None, "stochastic", "saturate", 12, None)
    assert same(g, Q._quantize_eager(x, fmt, None, "stochastic", "saturate", None, rbits=ref_rbits(12, 5000)))


@pytest.mark.parametrize("fmt", [f for f in ROUND_FORMATS if f.special != "fnu"], ids=str)
def test_triton_stochastic_rounding_equals_the_reference(interpret, fmt):
    from gradstats.ops.triton import quantize as kq

    for dtype in (torch.float32, torch.bfloat16):
        x = _qsample(3001, 5, dtype)
        want = Q._quantize_eager(x, fmt, None, "stochastic", "saturate", None, rbits=ref_rbits(12, x.numel()))
        assert same(kq.quantize_triton(x, fmt, rounding="stochastic", generator=12), want)
        assert same(quantize(x, fmt, rounding="stochastic", seed=12), want)  # routed to the kernel
    # block scales: the counter is the index in the blocked layout, alike on both paths
    x = _qsample(64 * 8, 6).reshape(8, 64)
    got = quantize(x, fmt, rounding="stochastic", seed=3, block_size=32)
    with pytest.MonkeyPatch.context() as m:
        m.delenv("GRADSTATS_ENGINE", raising=False)
        m.setenv("TRITON_INTERPRET", "0")  # the torch path
        assert same(got, quantize(x, fmt, rounding="stochastic", seed=3, block_size=32))


@pytest.mark.parametrize("start", [2 ** 32 - 1500, 2 ** 33 - 700])
def test_triton_rounding_at_far_counters(interpret, start):
    from gradstats.ops.triton import quantize as kq

    fmt = parse("e4m3fn")
    x = _qsample(3000, 8)
    y = kq.quantize_triton(x, fmt, rounding="stochastic", generator=21, index_start=start)
    want = Q._quantize_eager(x, fmt, None, "stochastic", "saturate", None, rbits=ref_rbits(21, 3000, start))
    assert same(y, want)


@pytest.mark.gpu
def test_triton_rounding_on_cuda_equals_the_cpu():  # CPU twin: test_triton_stochastic_rounding_equals_the_reference
    for fmt in ("e5m2", "e4m3fn", "e2m1fn"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = _qsample(1_000_003, 9, dtype)
            assert same(quantize(x.cuda(), fmt, rounding="stochastic", seed=5).cpu(),
                        quantize(x, fmt, rounding="stochastic", seed=5))


# ----------------------------------------------------------------------------- fused
FUSED_FORMATS = [None, parse("e5m2"), parse("e4m3fn"), parse("e2m1fn"), FPFormat(3, 3, subnormals=False),
                 FPFormat(4, 0), parse("e8m7")]


@pytest.mark.parametrize("fmt", FUSED_FORMATS, ids=str)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest", "toward_zero"])
def test_fused_kernel_equals_the_composed_operators(fmt, rounding, monkeypatch):
    if _fused._native() is None:
        pytest.skip("no C compiler here")
    x = sample(70_001, 1e-3, 11)
    for a, scale in ((1e-3, 1.0), (0.0, 1.0), (1e-3, 2.0 ** 12), (3e-33, 2.0 ** -3)):
        a32 = float(torch.tensor(a))
        y, c = prune_quantize(x, a32, fmt, scale=scale, rounding=rounding, seed=2 ** 63 + 5)
        p = stochastic_prune(x, a32, seed=2 ** 63 + 5) if a32 > 0 else x
        want = p if fmt is None else quantize(p, fmt, scale=scale, rounding=rounding, seed=2 ** 63 + 5)
        assert same(y, want), (str(fmt), rounding, a, scale)
        with monkeypatch.context() as m:  # the composed path (no C kernel) gives the same, counts too
            m.setattr(_fused, "_native", lambda: None)
            y2, c2 = prune_quantize(x, a32, fmt, scale=scale, rounding=rounding, seed=2 ** 63 + 5)
        assert same(y2, y) and c2 == c


@pytest.mark.parametrize("fmt", [parse("e4m3fn"), FPFormat(3, 3, subnormals=False)], ids=str)
def test_fused_on_triton_equals_the_cpu_kernel(interpret, fmt):
    x = sample(6000, 1e-3, 12)
    y, c = prune_quantize(x, 1e-3, fmt, rounding="stochastic", seed=8)  # CPU: C kernel (float32)
    from gradstats.ops.prune import stochastic_prune as sp

    want = quantize(sp(x, float(torch.tensor(1e-3)), seed=8), fmt, rounding="stochastic", seed=8)
    assert same(y, want)


@pytest.mark.gpu
def test_fused_on_cuda_equals_the_cpu_kernel():  # CPU twin: test_fused_on_triton_equals_the_cpu_kernel
    x = sample(1_000_001, 1e-3, 12)
    for fmt in ("e4m3fn", "e2m1fn"):
        y, c = prune_quantize(x, 1e-3, fmt, rounding="stochastic", seed=8)
        yc, cc = prune_quantize(x.cuda(), 1e-3, fmt, rounding="stochastic", seed=8)
        assert same(yc.cpu(), y) and cc == c
