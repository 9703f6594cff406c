"""The one random stream of the stochastic operators (pruning and rounding) on every engine.

The generator is counter based: 32 uniform bits are a function of a 64-bit seed and an element's
64-bit index, nothing else, so a result depends on ``(seed, x)`` alone, never on the engine, the
device, the block size or the number of threads. :func:`reference_bits` below (numpy) is the
reference; the torch CPU/CUDA path (:func:`hash_bits`, :func:`bits`), the C kernel
(``gradstats/ops/native/prune_quant.c``) and both Triton kernels (:mod:`gradstats.ops.triton`)
implement the very same words, and ``tests/ops/test_random.py`` checks them bit for bit.

The algorithm, word by word (all arithmetic wraps; ``>>`` is a logical shift):

1. Segment key (64-bit words, computed once per ``2**32`` indices, on the host):
   ``mix64(z) = (z ^ z >> 30) * 0xBF58476D1CE4E5B9; z = (z ^ z >> 27) * 0x94D049BB133111EB;
   z ^ z >> 31`` (the SplitMix64 finaliser, a bijection of 64-bit words), and for the index's
   high word ``hi = index >> 32``: ``K = mix64(mix64(seed) + hi * 0x9E3779B97F4A7C15)``, split
   into ``k1 = K & 0xFFFFFFFF`` and ``k2 = K >> 32``.
2. Element word (32-bit words, ``c = index & 0xFFFFFFFF``):
   ``h = (c + k1) * 0x7FEB352D; h ^= h >> 16; h = h * 0x846CA68B + k2; h ^= h >> 15;
   h *= 0x9E3779B1`` -- a keyed multiply-xorshift hash. Every step is invertible, so for a
   fixed key the map ``c -> h`` is a bijection of the low index word: distinct elements of a
   segment get distinct words, and over seeds each element's word is uniform. Indices
   ``>= 2**32`` use another segment key, so they never repeat the bits of ``index - 2**32``.

How the operators use the 32 bits ``b`` (:data:`PRUNE`, :data:`ROUND`, :data:`PRUNE_LOW` are
the domains; :func:`stream` derives one 64-bit stream seed per domain from the user's seed as
``mix64(seed + (domain + 1) * 0x9E3779B97F4A7C15)``, so pruning and rounding of one seed are
independent streams, and the fused prune+quantise equals pruning then quantising bit for bit):

- pruning keeps an entry ``|x| < a`` (as ``sign(x) * a``) when ``u * a < |x|``, ``u * a``
  rounded to the compute dtype, with ``u = (b >> 8) * 2**-24`` (float32; also float16/bfloat16,
  computed in float32) from the :data:`PRUNE` stream. float64 tensors take a 53-bit uniform
  ``u = (b >> 8) * 2**-24 + (b' >> 3) * 2**-53`` with ``b'`` the :data:`PRUNE_LOW` stream's
  word of the same index (its top 24 bits are float32's uniform);
- stochastic rounding to a format with ``M`` mantissa bits adds the top ``23 - M`` bits of the
  :data:`ROUND` stream's word (``(b >> 9) >> M``) below the kept mantissa bits and truncates;
- the random signs of a Hadamard transform (:mod:`gradstats.ops.hadamard`) are the top bits of the
  :data:`HADAMARD` stream's words at indices ``0 .. n - 1`` (set: -1).

Seeds: ``seed=`` (an int in ``[0, 2**64)``) or one draw ``torch.randint(0, 2**62)`` from
``generator=`` (torch's default generator when neither is given), see :func:`resolve_seed`.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["reference_bits", "reference_uniforms", "bits", "uniforms", "stream", "segment_key", "mix64",
           "resolve_seed", "draw_seed", "rounding_stream", "hash_bits", "iota", "PRUNE", "ROUND", "PRUNE_LOW",
           "HADAMARD"]

#: domains of the operators' streams (see :func:`stream`)
PRUNE, ROUND, PRUNE_LOW, HADAMARD = 0, 1, 2, 3

#: elements per chunk whose ``arange(n) * K1`` is cached
CHUNK_IOTA = 1 << 15

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
K1, K2, K3 = 0x7FEB352D, 0x846CA68B, 0x9E3779B1
_K2S = K2 - (1 << 32)  # as int32
_K3S = K3 - (1 << 32)


def _s32(v: int) -> int:
    v &= M32
    return v - (1 << 32) if v >= 1 << 31 else v


def mix64(z: int) -> int:
    """The SplitMix64 finaliser of a 64-bit word (Python ints)."""
    z &= M64
    z = ((z ^ (z >> 30)) * _MIX1) & M64
    z = ((z ^ (z >> 27)) * _MIX2) & M64
    return z ^ (z >> 31)


def stream(seed: int, domain: int) -> int:
    """The 64-bit stream seed of ``domain`` (:data:`PRUNE`, :data:`ROUND`, :data:`PRUNE_LOW`,
    :data:`HADAMARD`) for a user seed."""
    return mix64(int(seed) + (domain + 1) * GOLDEN)


@functools.lru_cache(maxsize=256)
def _premix(seed: int) -> int:
    return mix64(seed)


@functools.lru_cache(maxsize=1024)
def segment_key(seed: int, hi: int) -> tuple[int, int]:
    """``(k1, k2)``, the 32-bit keys of the indices ``hi * 2**32 .. hi * 2**32 + 2**32 - 1``."""
    k = mix64(_premix(int(seed) & M64) + int(hi) * GOLDEN)
    return k & M32, k >> 32


def resolve_seed(seed, generator: Optional[torch.Generator], what: str = "seed") -> int:
    """The 64-bit seed of one call: ``seed`` itself (an int in ``[0, 2**64)``), or one draw from
    ``generator`` (torch's default generator when it is None). ValueError when both are given or
    the seed is not such an int."""
    if seed is None:
        return draw_seed(generator)
    if generator is not None:
        raise ValueError(f"{what}: give either seed or generator, not both")
    if isinstance(seed, (bool, np.bool_)):
        raise ValueError(f"{what}: seed must be an int in [0, 2**64), got {seed!r}")
    try:
        s = operator.index(seed)
    except TypeError:
        raise ValueError(f"{what}: seed must be an int in [0, 2**64), got {type(seed).__name__}") from None
    if not 0 <= s < 1 << 64:
        raise ValueError(f"{what}: seed must be an int in [0, 2**64), got {s}")
    return s


def draw_seed(generator: Optional[torch.Generator]) -> int:
    """One seed drawn from ``generator`` (or torch's default CPU generator): ``randint(0, 2**62)``."""
    dev = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=dev).item())


# --------------------------------------------------------------------------- the reference (numpy)
def rounding_stream(rng: Any) -> int:
    """The stream seed of stochastic rounding from ``rng``: a user seed (int), or a generator (or
    None, torch's default generator) from which one seed is drawn."""
    return stream(rng if isinstance(rng, int) else draw_seed(rng), ROUND)


def reference_bits(seed: int, start: int = 0, n: int | None = None, *, index=None) -> np.ndarray:
    """The reference: the 32 bits (``uint32``) of ``seed`` at indices ``start .. start + n - 1``
    (or at the int64/uint64 array ``index``), as the module docstring defines them.

    Example:
        >>> b = reference_bits(7, 0, 4)
        >>> b.dtype, len(set(b.tolist()))
        (dtype('uint32'), 4)
        >>> bool((reference_bits(7, 2 ** 32, 4) != b).all())  # no wrap at 2**32
        True
    """
    if index is None:
        idx = np.arange(n, dtype=np.uint64) + np.uint64(start)
    else:
        idx = np.asarray(index).astype(np.uint64)
    hi = idx >> np.uint64(32)
    c = (idx & np.uint64(M32)).astype(np.uint32)
    k1 = np.empty(idx.shape, np.uint32)
    k2 = np.empty(idx.shape, np.uint32)
    for h in np.unique(hi):
        sel = hi == h
        k1[sel], k2[sel] = segment_key(seed, int(h))
    u32 = np.uint32
    with np.errstate(over="ignore"):
        h = (c + k1) * u32(K1)
        h ^= h >> u32(16)
        h = h * u32(K2) + k2
        h ^= h >> u32(15)
        h *= u32(K3)
    return h


def reference_uniforms(seed: int, start: int, n: int, dtype=np.float32) -> np.ndarray:
    """The pruning uniforms of user seed ``seed`` at indices ``start .. start + n - 1`` (float32:
    24 bits; float64: 53 bits, see the module docstring)."""
    b = reference_bits(stream(seed, PRUNE), start, n)
    if np.dtype(dtype) == np.float64:
        b2 = reference_bits(stream(seed, PRUNE_LOW), start, n)
        return ((b >> np.uint32(8)).astype(np.float64) * 2.0 ** -24
                + (b2 >> np.uint32(3)).astype(np.float64) * 2.0 ** -53)
    return (b >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


# --------------------------------------------------------------------------- torch
@functools.lru_cache(maxsize=8)
def _iota_cached(n: int, device: str) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32, device=device).mul_(K1)


def iota(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n) * K1`` (int32, wrapping): the first multiplication of the hash, done once."""
    if n <= CHUNK_IOTA:
        return _iota_cached(n, str(device))
    return torch.arange(n, dtype=torch.int32, device=device).mul_(K1)


def hash_bits(start: int, seed: int, iota: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor,
              nbits: int = 32) -> torch.Tensor:
    """The top ``nbits`` bits of the words of stream seed ``seed`` at indices ``start + i`` for the
    ``i`` of ``iota`` (given as ``i * K1``, int32), into the int32 ``out`` (``tmp``: scratch of its
    size). A range that crosses a multiple of ``2**32`` is split at it (the wrapping of
    ``(c + k1) * K1`` lets ``iota`` run on unchanged)."""
    m = out.numel()
    pos = 0
    while pos < m:
        g = start + pos
        hi, lo = g >> 32, g & M32
        e = min(m, pos + (1 << 32) - lo)
        k1, k2 = segment_key(seed, hi)
        o, t = out[pos:e], tmp[pos:e]
        # (lo + j + k1) * K1 = j * K1 + (lo + k1 - pos) * K1, with iota[pos + j'] = (pos + j') * K1
        torch.add(iota[pos:e], _s32((lo - pos + k1) * K1), out=o)
        torch.bitwise_right_shift(o, 16, out=t).bitwise_and_(0xFFFF)
        o.bitwise_xor_(t).mul_(_K2S).add_(_s32(k2))
        torch.bitwise_right_shift(o, 15, out=t).bitwise_and_(0x1FFFF)
        o.bitwise_xor_(t).mul_(_K3S)
        if nbits < 32:
            o.bitwise_right_shift_(32 - nbits).bitwise_and_((1 << nbits) - 1)
        pos = e
    return out


def bits(seed: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32 bits of stream seed ``seed`` at indices ``start .. start + n - 1`` as an int32
    tensor on ``device`` (the same words as :func:`reference_bits`, viewed as signed)."""
    device = torch.device(device)
    out = torch.empty(n, dtype=torch.int32, device=device)
    return hash_bits(start, seed, iota(n, device), out, torch.empty_like(out), 32)


def uniforms(seed: int, n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             start: int = 0) -> torch.Tensor:
    """The pruning uniforms of user seed ``seed`` (as :func:`reference_uniforms`) as a torch
    tensor: float64 for ``dtype=torch.float64``, else float32 (the compute dtype of float16/bfloat16).

    Example:
        >>> u = uniforms(7, 5)
        >>> u.dtype, bool(((u >= 0) & (u < 1)).all())
        (torch.float32, True)
    """
    device = torch.device(device)
    wide = dtype == torch.float64
    u = torch.empty(n, dtype=torch.float64 if wide else torch.float32, device=device)
    # chunks of CHUNK_IOTA (each op on cache-resident buffers) on the CPU; one chunk on devices
    chunk = CHUNK_IOTA if device.type == "cpu" else max(n, 1)
    m0 = min(chunk, n)
    it = iota(m0, device)
    o, t = torch.empty(m0, dtype=torch.int32, device=device), torch.empty(m0, dtype=torch.int32, device=device)
    sp, sl = stream(seed, PRUNE), stream(seed, PRUNE_LOW)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        uc = u[lo:lo + m]
        uc.copy_(hash_bits(start + lo, sp, it[:m], o[:m], t[:m], 24))            # (b >> 8), 24 bits
        if wide:  # exact: (b >> 8) * 2**29 + (b' >> 3) < 2**53
            uc.mul_(2.0 ** 29).add_(hash_bits(start + lo, sl, it[:m], o[:m], t[:m], 29))  # (b' >> 3)
    return u.mul_(2.0 ** -53 if wide else 2.0 ** -24)


# --------------------------------------------------------------------------- numpy, in place
@functools.lru_cache(maxsize=4)
def _np_iota(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.arange(n, dtype=np.uint32) * np.uint32(K1)


def np_bits_into(seed: int, start: int, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """:func:`reference_bits` of stream seed ``seed`` at ``start ..`` into the uint32 ``out``
    (``tmp``: uint32 scratch of its size), with in-place ufuncs; the range must not cross a
    multiple of ``2**32`` (the numpy engine's blocks divide it)."""
    m = out.shape[0]
    if (start & M32) + m > 1 << 32:
        raise ValueError("np_bits_into: the range crosses a multiple of 2**32")
    k1, k2 = segment_key(seed, start >> 32)
    u32 = np.uint32
    np.add(_np_iota(max(m, 1 << 16))[:m], u32(((start & M32) + k1) * K1 & M32), out=out)
    np.right_shift(out, u32(16), out=tmp)
    np.bitwise_xor(out, tmp, out=out)
    np.multiply(out, u32(K2), out=out)
    np.add(out, u32(k2), out=out)
    np.right_shift(out, u32(15), out=tmp)
    np.bitwise_xor(out, tmp, out=out)
    np.multiply(out, u32(K3), out=out)
    return out
