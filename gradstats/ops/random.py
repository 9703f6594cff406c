"""Random bits of the stochastic operators (rounding and pruning), keyed by a seed and each element's index."""
from __future__ import annotations

import functools
from typing import Optional

import torch

#: elements per chunk whose ``arange(n) * K1`` is cached
CHUNK_IOTA = 1 << 15

_K1 = 0x7FEB352D
_K2 = 0x846CA68B - (1 << 32)  # as int32
_K3 = 0x9E3779B1 - (1 << 32)


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def random_key(generator: Optional[torch.Generator], device: torch.device):
    """Two int32 keys of the random-bit hash, drawn from ``generator`` (default: torch's global CPU
    generator). Python ints for a CPU generator; a 2-element int32 tensor on the generator's device
    otherwise (no host-device synchronisation)."""
    gdev = generator.device if generator is not None else torch.device("cpu")
    k = torch.randint(-(1 << 31), 1 << 31, (2,), generator=generator, dtype=torch.int64, device=gdev)
    if gdev.type == "cpu":
        return int(k[0]), int(k[1])
    return k.to(device=device, dtype=torch.int32)


@functools.lru_cache(maxsize=8)
def _iota_cached(n: int, device: str) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32, device=device).mul_(_K1)


def iota(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n) * K1`` (int32, wrapping): the first multiplication of the hash, done once."""
    if n <= CHUNK_IOTA:
        return _iota_cached(n, str(device))
    return torch.arange(n, dtype=torch.int32, device=device).mul_(_K1)


def hash_bits(lo: int, key, iota: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor, nbits: int) -> torch.Tensor:
    """The top ``nbits`` bits of ``h(lo + i)`` for the ``i`` of ``iota`` (given as ``i * K1``), into ``out``.

    On 32-bit words, ``h = (c + k1) * K1; h ^= h >> 16; h = h * K2 + k2; h ^= h >> 15; h *= K3``
    (logical shifts): a keyed multiply-xorshift hash, a bijection of the counter ``c`` for every key,
    so each element's bits are exactly uniform over keys. ``c`` is the element's index in the
    flattened tensor: every path and device draws the same bits for the same key.
    """
    k1, k2 = key
    if isinstance(k1, int):
        torch.add(iota, _s32((lo + k1) * _K1), out=out)
    else:
        torch.add(iota, (k1 + _s32(lo)) * _K1, out=out)
    torch.bitwise_right_shift(out, 16, out=tmp).bitwise_and_(0xFFFF)
    out.bitwise_xor_(tmp).mul_(_K2).add_(k2)
    torch.bitwise_right_shift(out, 15, out=tmp).bitwise_and_(0x1FFFF)
    out.bitwise_xor_(tmp).mul_(_K3)
    return out.bitwise_right_shift_(32 - nbits).bitwise_and_((1 << nbits) - 1)
