"""The block-scaled prune + quantise Triton kernels (MX, NVFP4, NVFP4 with its Hadamard transform), run on
the CPU by Triton's interpreter, against the CPU path (``prune_quantize`` on the C/torch engines): results
bit for bit, counts exactly, sums to rounding; nothing read back; small tensors (the interpreter is slow)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from block_cases import close_sums, counts_of, gradient, same_bits, sums_of  # noqa: E402

from gradstats.ops.fused import prune_quantize, prune_quantize_into  # noqa: E402
from gradstats.ops.triton import blocks as kb  # noqa: E402
from gradstats.scheme import Scheme  # noqa: E402

#: (name, format, keywords): MX floor and rceil, NVFP4, NVFP4 with the Hadamard transform
SCHEMES = [
    ("mx-floor", "e2m1fn", dict(block_size=32, scale_format="e8m0", scale_rounding="floor")),
    ("mx-rceil", "e4m3fn", dict(block_size=32, scale_format="e8m0", scale_rounding="rceil")),
    ("mx-even", "e3m2fn", dict(block_size=32, scale_format="e8m0", scale_rounding="even")),
    ("nvfp4", "e2m1fn", dict(block_size=16, scale_format="e4m3")),
    ("nvfp4-rht", "e2m1fn", dict(block_size=16, scale_format="e4m3", hadamard=16)),
]
#: (name, shape, block_dim): a convolution's (N, C, H, W) with C not a multiple of the block, a (B, T, C)
#: linear gradient, a matrix
SHAPES = [("conv", (2, 20, 3, 3), 1), ("linear", (3, 7, 24), -1), ("matrix", (5, 37), -1)]


@pytest.fixture(autouse=True)
def _interpret(interpreted):
    """The kernels under Triton's interpreter (the shared fixture of tests/conftest.py)."""




_SCHEME_KEYS = ("rounding", "block_size", "scale_format", "scale_rounding", "hadamard")


def cpu_path(x, threshold, fmt, **kw):
    """The CPU path's result and counts (the Triton engine not asked for), on the scheme the format and
    keywords resolve to."""
    kw = dict(kw)
    s = Scheme.of(fmt, **{k: kw.pop(k) for k in _SCHEME_KEYS if k in kw})
    return prune_quantize(x, threshold, s, **kw)


def kernel(x, threshold, fmt, **kw):
    """The block kernel on the scheme a call's format and keywords resolve to (as the operators' door does)."""
    s = Scheme.of(fmt, **{k: kw.pop(k) for k in _SCHEME_KEYS if k in kw})
    return kb.prune_quantize_blocks_triton(x, threshold, s, **kw)










def check(x, threshold, fmt, kw, **extra):
    want_y, want = cpu_path(x, threshold, fmt, **kw)
    y, counts, sums = kernel(x, threshold, fmt, **kw, **extra)
    assert same_bits(y, want_y)
    assert counts.tolist() == counts_of(want)
    assert close_sums(sums.tolist(), sums_of(want))
    return y, counts


def cases(scheme, shape):
    """The calls of one scheme on one shape: nearest and stochastic rounding, without and with pruning."""
    _, fmt, kw = scheme
    _, dims, block_dim = shape
    for rounding, threshold in (("nearest", 0.0), ("stochastic", 0.0), ("nearest", 0.5), ("stochastic", 0.5)):
        x = gradient(dims, seed=len(dims) + int(threshold * 10))
        yield x, threshold, fmt, dict(kw, rounding=rounding, seed=11, block_dim=block_dim)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s[0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_bit_identical_to_the_cpu_path(scheme, shape):
    """The CPU twin of test_cuda_block_kernel_matches_the_cpu_path."""
    for x, threshold, fmt, kw in cases(scheme, shape):
        check(x, threshold, fmt, kw)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s[0])
def test_zeros_inf_nan_and_a_threshold_above_the_maximum(scheme):
    _, fmt, kw = scheme
    kw = dict(kw, rounding="stochastic", seed=2, block_dim=-1)
    check(torch.zeros(4, 16), 0.0, fmt, kw)
    check(torch.full((2, 16), math.inf), 0.0, fmt, kw)
    x = torch.tensor([[math.nan, -math.inf, 1.0, -0.0] * 4] * 2)
    check(x, 0.0, fmt, kw)
    check(gradient((3, 16), seed=5, specials=False) * 1e-3, 1e3, fmt, kw)     # every value pruned or at a


@pytest.mark.parametrize("scheme", SCHEMES[2:], ids=lambda s: s[0])
def test_tensor_amax_from_the_host_or_the_statistics_vector(scheme):
    """NVFP4's tensor scale: a host float as given; the statistics vector's maximum (one launch) gives the
    pruned tensor's, as the CPU path takes it."""
    from gradstats.stats import tensor_stats_vector

    _, fmt, kw = scheme
    x = gradient((4, 6, 32), seed=8)
    kw = dict(kw, rounding="stochastic", seed=4, block_dim=-1)
    check(x, 0.0, fmt, dict(kw, tensor_amax=1e4))  # the CPU path with the same host amax
    want_y, want = cpu_path(x, 0.5, fmt, **kw)
    v = tensor_stats_vector(x, full=False)
    y, counts, _ = kernel(x, torch.tensor(0.5), fmt, stats=v, **kw)
    assert same_bits(y, want_y) and counts.tolist() == counts_of(want)
    small = gradient((2, 32), seed=9, specials=False) * 1e-2          # the threshold above the maximum
    want_y, want = cpu_path(small, 1.0, fmt, **kw)
    y, counts, _ = kernel(small, 1.0, fmt, stats=tensor_stats_vector(small, full=False), **kw)
    assert same_bits(y, want_y) and counts.tolist() == counts_of(want)


def test_tensor_amax_host_float_matches_quantize_with_it():
    from gradstats.ops.quantization import quantize

    x = gradient((3, 48), seed=3, specials=False)
    got, _ = prune_quantize(x, 0.0, "nvfp4", tensor_amax=77.0)
    y, _, _ = kernel(x, 0.0, "e2m1fn", block_size=16, scale_format="e4m3", tensor_amax=77.0)
    assert same_bits(y, got) and same_bits(y, quantize(x, "nvfp4", tensor_amax=77.0))


def test_the_engine_dispatches_block_formats_to_the_kernel(monkeypatch):
    """prune_quantize and prune_quantize_into on the Triton engine take the kernel: the same result, counts
    on the device, one launch (no whole-gradient ATen operation but the result's allocation)."""
    from gradstats.ops.audit import Audit

    x = gradient((2, 20, 3, 3), seed=1)
    want_y, want = cpu_path(x, 0.3, "nvfp4", seed=7, block_dim=1)
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")
    got_y, got = prune_quantize(x, 0.3, "nvfp4", seed=7, block_dim=1)
    assert same_bits(got_y, want_y) and counts_of(got) == counts_of(want)
    with Audit(big=x.numel() // 2) as a:
        y, counts, sums = prune_quantize_into(x, 0.3, "nvfp4", seed=7, block_dim=1)
    assert same_bits(y, want_y) and counts.tolist() == counts_of(want)
    assert a.launches["forward"] == 2 and a.syncs["forward"] == 0          # the amax pass, then the kernel
    assert sum(a.big_ops.values()) <= 1, dict(a.big_names)


def test_counts_and_sums_add_up_over_calls():
    x = gradient((4, 32), seed=6)
    kw = dict(block_size=32, scale_format="e8m0", rounding="stochastic", seed=1)
    _, c1, s1 = kernel(x, 0.2, "e4m3fn", **kw)
    _, c2, s2 = kernel(x, 0.2, "e4m3fn", counts=c1.clone(), sums=s1.clone(), **kw)
    assert c2.tolist() == (2 * c1).tolist()
    assert torch.allclose(s2, 2 * s1, rtol=1e-12, equal_nan=True)


def test_rejects_what_it_does_not_take():
    x = torch.ones(4, 16)
    assert not kb.covers(Scheme.of("e2m1fn", block_size=16, scale_format="e4m3", hadamard=8))
    assert not kb.covers(Scheme.of("e2m1fn", block_size=16, scale_format="e4m3"), x=x.double())
    with pytest.raises(ValueError, match="block_size"):
        kernel(x, 0.0, "e2m1fn", block_size=16, hadamard=8)
    with pytest.raises(ValueError, match="scale_rounding"):
        kernel(x, 0.0, "e2m1fn", block_size=16, scale_rounding="up")


def test_rceil_is_exact_above_a_power_of_two():
    """rceil on the quotient's bits: just above a power of two it rounds up (a float log2 rounds down)."""
    from gradstats.ops.block_scales import mx_shared_exponent

    a = torch.tensor([2.0 ** 100 * (1 + 2 ** -23) * 448, 448.0 * 2.0 ** -130, 448.0 * 2.0 ** -126.5])
    assert mx_shared_exponent(a, "e4m3fn", "rceil").tolist() == [101, -127, -126]
    x = torch.zeros(3, 32)
    x[:, 0] = a
    check(x, 0.0, "e4m3fn", dict(block_size=32, scale_rounding="rceil"))


@pytest.mark.gpu
def test_cuda_block_kernel_matches_the_cpu_path(monkeypatch):
    """GPU twin of test_bit_identical_to_the_cpu_path: its pruning calls (the same tensors, seeds and settings)
    through the compiled kernel on CUDA, against the same CPU path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (its CPU twin runs instead)")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kb._kernels.cache_clear()
    for scheme in SCHEMES:
        for shape in SHAPES:
            for x, threshold, fmt, kw in cases(scheme, shape):
                if threshold == 0:              # fewer compilations: the pruning calls cover the kernel's paths
                    continue
                want_y, want = cpu_path(x, threshold, fmt, **kw)
                y, counts, sums = kernel(x.cuda(), threshold, fmt, **kw)
                assert same_bits(y.cpu(), want_y), (scheme[0], shape[0], kw)
                assert counts.cpu().tolist() == counts_of(want)
                assert close_sums(sums.cpu().tolist(), sums_of(want))


def test_lag_correction_in_the_kernel_as_the_per_tensor_kernel():
    """With the statistics vector and the solved mean ln|g|, the block kernel corrects the threshold as the
    per-tensor kernel does (the same recorded threshold) and prunes at it: the CPU path at the recorded
    threshold, bit for bit."""
    from gradstats.ops.triton import fused as kf
    from gradstats.stats import tensor_stats_vector

    x = gradient((4, 40), seed=12, specials=False)
    v = tensor_stats_vector(x, full=False)
    mu = float(v[6] / (v[0] - v[1])) - 0.4
    used, used_pt = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    y, counts, _ = kernel(x, 0.3, "e2m1fn", block_size=16, scale_format="e4m3",
                                                   rounding="stochastic", seed=6, stats=v, solved_mu=mu, used=used,
                                                   scale=0.5)
    kf.prune_quantize_triton(x, 0.3, "e2m1fn", scale=0.5, seed=6, stats=v, solved_mu=mu, used=used_pt,
                             correct_scale=False)
    assert used.tolist() == used_pt.tolist() and used[0] > 0.3
    want_y, want = cpu_path(x, float(used[0]), "nvfp4", rounding="stochastic", seed=6)
    assert same_bits(y, want_y) and counts.tolist() == counts_of(want)
