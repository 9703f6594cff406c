"""The Triton kernel of quantize, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1),
against the torch path bit for bit. Small inputs: the interpreter is slow."""
from __future__ import annotations

import math

import pytest
import torch

from gradstats.formats import FPFormat, parse

triton = pytest.importorskip("triton")

import gradstats.ops.quantization as Q  # noqa: E402
from gradstats.ops.triton import quantize as kq  # noqa: E402

FORMATS = [parse("e5m2"), parse("e4m3fn"), parse("e4m3fnuz"), parse("e2m1fn"), parse("e3m2fn"),
           FPFormat(3, 3, subnormals=False), FPFormat(4, 0), parse("bf16"), FPFormat(8, 3), parse("fp16"),
           FPFormat(4, 3, bias=12, special="fn")]


@pytest.fixture(autouse=True)
def _interpret(interpreted, monkeypatch):
    monkeypatch.setenv("GRADSTATS_ENGINE", "triton")


def same_bits(a, b):
    a, b = a.float(), b.float()
    an, bn = torch.isnan(a), torch.isnan(b)
    return bool(((an == bn) & (an | (a.view(torch.int32) == b.view(torch.int32)))).all())


def probe(n=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    wide = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 1.1754942e-38,
                            3.4e38, 448.0, 464.0, 57344.0, 61440.0, 6.0, 7.0, 2.0 ** -16, 1.5 * 2.0 ** -16])
    return torch.cat([bits.view(torch.float32), wide, special])


def test_the_triton_path_is_taken_under_the_interpreter():
    from gradstats.ops.triton import use_triton

    assert use_triton("cpu") and kq.supports(parse("e4m3fn")) and not kq.supports(parse("e8m0fnu"))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_kernel_matches_torch_path_bit_for_bit(fmt):
    x = probe()
    R = torch.randint(0, 1 << 23, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    for rounding in ("nearest", "toward_zero", "stochastic"):
        for overflow in ("saturate", "nonfinite"):
            rb = R if rounding == "stochastic" else None
            want = Q._quantize_eager(x, fmt, None, rounding, overflow, None, rbits=rb)
            got = kq.quantize_triton(x, fmt, rounding=rounding, overflow=overflow, rbits=rb)
            assert same_bits(got, want), (str(fmt), rounding, overflow)


@pytest.mark.parametrize("fmt", [parse("e5m2"), parse("e2m1fn"), FPFormat(3, 3, subnormals=False)], ids=str)
def test_stochastic_hash_bits_identical_across_paths(fmt):
    """Same generator state -> the same random bits (counter hash) in the kernel and the torch path."""
    x = probe(2000, seed=3)
    got = Q.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(9))
    want = Q._quantize_eager(x, fmt, None, "stochastic", "saturate", torch.Generator().manual_seed(9))
    assert same_bits(got, want)


def test_dtypes_scales_shapes_and_blocks():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 40, generator=g) * 30
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.to(dtype)
        got = Q.quantize(xh, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(2))
        want = Q._quantize_eager(xh, parse("e4m3fn"), None, "stochastic", "saturate", torch.Generator().manual_seed(2))
        assert got.dtype == dtype and same_bits(got, want)
    fmt = parse("e5m2")
    for scale in (2.0 ** -5, 3.3, torch.exp2(torch.arange(6.0)).view(6, 1), torch.rand(40, generator=g) + 0.5,
                  torch.rand(6, 1, generator=g) * torch.rand(1, 40, generator=g) + 0.1):
        got = Q.quantize(x, fmt, scale=scale, overflow="nonfinite")
        want = Q._quantize_eager(x, fmt, scale, "nearest", "nonfinite", None)
        assert same_bits(got, want), scale
    nc = x.t()[::2]
    assert same_bits(Q.quantize(nc, "e3m2fn"), Q._quantize_eager(nc.contiguous(), parse("e3m2fn"), None, "nearest",
                                                                 "saturate", None))
    assert Q.quantize(torch.empty(0, 3), "e5m2").shape == (0, 3)
    # e8m0fnu is not a kernel format: the torch path serves it under the interpreter too
    assert Q.quantize(torch.tensor([3.0]), "e8m0fnu").item() == 4.0


@pytest.mark.parametrize("scale_format", ["e8m0", "e4m3"])
def test_block_scaling_through_the_kernel(scale_format, monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 72, generator=g) * torch.exp2(torch.randint(-8, 8, (4, 1), generator=g).float())
    got = Q.quantize(x, "e2m1fn", block_size=16, scale_format=scale_format)
    monkeypatch.delenv("GRADSTATS_ENGINE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path for the reference
    want = Q.quantize(x, "e2m1fn", block_size=16, scale_format=scale_format)
    assert same_bits(got, want)


def test_scale_index_patterns():
    shape = torch.Size([3, 4, 5])
    for sshape, expect_mod in [((4, 1), 4), ((5,), 5), ((3, 1, 1), 3), ((1, 4, 5), 20), ((3, 1, 5), 60), ((), 1)]:
        s = torch.rand(sshape) + 0.5
        flat, div, mod = kq._scale_index(s, shape)
        assert mod == expect_mod
        full = s.expand(shape).reshape(-1)
        i = torch.arange(full.numel())
        assert torch.equal(flat[(i // div) % mod], full)


@pytest.mark.gpu
def test_cuda_kernel_matches_torch_path(monkeypatch):
    """GPU twin of test_kernel_matches_torch_path_bit_for_bit (runs where CUDA is available)."""
    monkeypatch.delenv("GRADSTATS_ENGINE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = probe(1 << 16).cuda()
    for fmt in FORMATS:
        for rounding in ("nearest", "toward_zero"):
            got = Q.quantize(x, fmt, rounding=rounding, overflow="nonfinite")
            want = Q._quantize_eager(x, fmt, None, rounding, "nonfinite", None)
            assert same_bits(got.cpu(), want.cpu()), (str(fmt), rounding)
        got = Q.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(1))
        want = Q._quantize_eager(x.cpu(), fmt, None, "stochastic", "saturate", torch.Generator().manual_seed(1))
        assert same_bits(got.cpu(), want), str(fmt)
