"""The fused C kernel of block-scaled prune + quantise (MX's E8M0 scales, NVFP4's E4M3 scales under a tensor
scale) against the composed operators it replaces on the CPU: results bit for bit, counts exactly, sums to
rounding; every scale rounding, every element rounding, the channels of a convolution and of a linear layer,
blocks cut short, zeros, inf and NaN, thresholds below, inside and above the data, and tensors large enough
to be split across threads."""
from __future__ import annotations

import math

import pytest
import torch
from block_cases import close_sums, gradient, same_bits, sums_of

from gradstats.ops import cpu_blocks, fused
from gradstats.ops.fused import prune_quantize
from gradstats.scheme import Scheme

pytestmark = pytest.mark.skipif(fused._native() is None, reason="no C compiler here")

#: MX with each E8M0 rounding, NVFP4, an MX E5M2 element format (no subnormals of its own below 2**-16)
SCHEMES = ["e2m1fn:block=32", "e4m3fn:block=32:scale_rounding=rceil", "e3m2fn:block=32:scale_rounding=even",
           "e2m3fn:block=32:scale_rounding=ceil", "nvfp4", "mxfp8_e5m2"]
#: (shape, block_dim): a convolution's (N, C, H, W) with C not a multiple of the block, a (B, T, C) linear
#: gradient, a matrix, two with more than 2**16 entries (the kernel's threads split them), a feature map
#: of more than 1024 pixels (the kernel's tiles then take the pixels in chunks), and rows longer than the
#: kernel's units of 4096 channels, of a matrix and of a 1-d tensor
SHAPES = [((2, 20, 3, 3), 1), ((3, 7, 24), -1), ((5, 37), -1), ((16, 40, 9, 9), 1), ((4, 300, 60), -1),
          ((2, 18, 37, 41), 1), ((3, 10000), -1), ((70001,), 0)]




def composed(monkeypatch, *args, **kw):
    """The same call on the composed operators (the C block kernel offered neither to prune_quantize nor to
    the quantize it calls)."""
    with monkeypatch.context() as m:
        m.setattr(cpu_blocks, "takes", lambda *a: False)
        return prune_quantize(*args, **kw)








@pytest.mark.parametrize("preset", SCHEMES)
@pytest.mark.parametrize("shape,block_dim", SHAPES)
def test_bit_identical_to_the_composed_operators(monkeypatch, preset, shape, block_dim):
    x = gradient(shape, seed=len(shape) + shape[-1])
    for rounding in ("nearest", "stochastic", "toward_zero"):
        s = Scheme.of(preset, rounding=rounding)
        assert fused._path(x, s, 1.0, block_dim) == "native_blocks"
        for threshold in (0.0, 0.5, 1e9):           # none, inside the data, above all of it
            for tensor_amax in (None, 50.0):
                kw = dict(seed=11, block_dim=block_dim, tensor_amax=tensor_amax)
                y, c = prune_quantize(x, threshold, s, **kw)
                y0, c0 = composed(monkeypatch, x, threshold, s, **kw)
                where = (preset, rounding, threshold, tensor_amax)
                assert same_bits(y, y0), where
                assert c == c0, where
                assert close_sums(sums_of(c), sums_of(c0)), where


def test_the_counts_say_what_happened():
    """A block whose maximum sits far above the rest flushes the rest (underflow), MX's floor scale clips a
    block maximum above the element format's max (saturated), the threshold prunes, inf and NaN are counted."""
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1:] = 768.0, 1e-3             # one block: 768 = 6 * 2**7 next to 31 values far below
    x[1, :] = 7.5                               # the floor scale 2**(2 - emax) = 1 leaves 7.5 above e2m1fn's 6
    x[1, 3], x[1, 4] = math.inf, math.nan
    y, c = prune_quantize(x, 0.0, "e2m1fn:block=32")
    assert c.underflow == 31 and c.nonfinite == 2     # 1e-3 / 2**7 is below e2m1fn's 0.5: flushed
    assert c.saturated == 31                          # 30 entries of 7.5 and the inf
    assert y[0, 0] == 768.0 and y[1, 0] == 6.0 and y[1, 3] == 6.0 and torch.isnan(y[1, 4])
    _, c2 = prune_quantize(x.abs().nan_to_num(0.0, 0.0), 1.0, "e2m1fn:block=32", seed=3)
    assert c2.pruned > 0 and c2.nonfinite == 0


def test_the_result_does_not_depend_on_the_threads(monkeypatch):
    x = gradient((8, 64, 16, 16), seed=2)
    s = Scheme.of("nvfp4", rounding="stochastic")
    y1, c1 = prune_quantize(x, 0.3, s, seed=4, block_dim=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y2, c2 = prune_quantize(x, 0.3, s, seed=4, block_dim=1)
    finally:
        torch.set_num_threads(threads)
    assert same_bits(y1, y2) and c1 == c2 and close_sums(sums_of(c1), sums_of(c2))


def test_out_is_written_and_the_input_kept(monkeypatch):
    x = gradient((3, 40, 5, 5), seed=6)
    keep = x.clone()
    out = torch.empty_like(x)
    y, c = prune_quantize(x, 0.2, "mxfp4", seed=1, block_dim=1, out=out)
    y0, c0 = composed(monkeypatch, x, 0.2, "mxfp4", seed=1, block_dim=1)
    assert y is out and same_bits(out, y0) and c == c0 and same_bits(x, keep)
    y2, _ = prune_quantize(x, 0.2, "mxfp4", seed=1, block_dim=1, out=x)   # in place: through a buffer
    assert same_bits(y2, y0) and same_bits(x, y0)


def test_what_the_kernel_leaves_to_the_composed_operators():
    x = gradient((4, 32), seed=0)
    assert fused._path(x, Scheme.of("nvfp4"), 1.0, -1) == "native_blocks"
    assert fused._path(x, Scheme.of("nvfp4_training"), 1.0, -1) == "composed"          # Hadamard transform
    assert fused._path(x.double(), Scheme.of("nvfp4"), 1.0, -1) == "composed"           # float64
    assert fused._path(x, Scheme.of("e8m0fnu:block=32"), 1.0, -1) == "composed"         # not a fused format
    assert fused._path(x.half(), Scheme.of("nvfp4"), 1.0, -1) == "composed"             # float16


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp4", "mxfp8_e4m3:scale_rounding=rceil", "e5m2fnuz:block=32"])
def test_quantize_takes_the_kernel_and_equals_the_operators(monkeypatch, preset):
    """gradstats.quantize of a block scheme on a float32 CPU tensor runs the kernel (no pruning): bit for bit
    the composed operators, for nearest and stochastic rounding, a seed or a generator (which it draws one seed
    from, as they do), along a convolution's channels and a linear layer's, with and without tensor_amax."""
    from gradstats import quantize

    for shape, block_dim in (((4, 40, 5, 5), 1), ((6, 50), -1)):
        x = gradient(shape, seed=3)
        for rounding in ("nearest", "stochastic"):
            for kw in (dict(seed=5), dict(generator=7), dict(seed=5, tensor_amax=80.0)):
                def call():
                    k = dict(kw)
                    if "generator" in k:
                        k["generator"] = torch.Generator().manual_seed(k["generator"])
                    gen = k.get("generator")
                    y = quantize(x, preset, rounding=rounding, block_dim=block_dim, **k)
                    return y, (None if gen is None else gen.initial_seed(), None if gen is None else
                               torch.randint(0, 2 ** 30, (1,), generator=gen).item())
                with monkeypatch.context() as m:
                    calls = []
                    m.setattr(cpu_blocks, "prune_quantize_blocks_cpu",
                              lambda *a, _f=cpu_blocks.prune_quantize_blocks_cpu, **k: calls.append(1) or _f(*a, **k))
                    y, after = call()
                assert calls, "quantize did not take the kernel"
                with monkeypatch.context() as m:
                    m.setattr(cpu_blocks, "takes", lambda *a: False)
                    y0, after0 = call()
                assert same_bits(y, y0), (preset, shape, rounding, kw)
                assert after == after0          # the generator drew as many values


class _NoMemory(torch.Tensor):
    """A wrapper subclass without memory of its own (``data_ptr() == 0``), as torchao's weight wrappers are:
    every operation runs on the tensor it wraps."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _NoMemory) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_a_tensor_without_memory_of_its_own_takes_the_operators():
    """The C kernels read a tensor by its address: a subclass that has none is left to the operators (it
    crashed the process before), with the same result."""
    from gradstats import quantize
    from gradstats.stats import kernel_applies

    x = gradient((8, 64), seed=1)
    w = _NoMemory(x)
    assert w.data_ptr() == 0 and not kernel_applies(w)
    assert fused._path(w, Scheme.of("nvfp4"), 1.0, -1) == "composed"
    assert fused._path(w, Scheme.of("e4m3fn"), 1.0, -1) == "composed"
    assert same_bits(quantize(w, "nvfp4", seed=2), quantize(x, "nvfp4", seed=2))
    assert same_bits(prune_quantize(w, 0.5, "mxfp4", seed=2)[0], prune_quantize(x, 0.5, "mxfp4", seed=2)[0])
