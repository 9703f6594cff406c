"""The random Hadamard transform (RHT) of NVFP4 training: the one home of the rotation.

NVIDIA's NVFP4 pretraining recipe ("Pretraining Large Language Models with NVFP4", 2025; Transformer
Engine's ``NVFP4BlockScaling``, torchao's ``NVFP4TrainingConfig``) rotates both operands of the
weight-gradient GEMM ``dW = g^T x`` along the dim it reduces over, the tokens, in groups of 16:
``dW = (R g)^T (R x)`` with ``R`` block-diagonal of ``R16 = H16 S / 4`` (``H16`` the 16x16 Sylvester
Hadamard matrix, ``S`` a diagonal of random signs), orthogonal, so the product is unchanged; the
rotated operands spread a token's outlier over its 16-token group and quantise in NVFP4 blocks along
the tokens with less error.

:func:`rotate` applies ``R`` along the tokens of the channels-last GEMM matrix
(:func:`gradstats.ops.layout.gemm_matrix`; the tokens padded with zeros to a multiple of ``n``),
:func:`unrotate` applies ``R^T = R^-1`` and puts the tensor back. Both are fast Walsh-Hadamard
butterflies (``log2 n`` stages of float32 sums and differences, then a multiplication by the signs
and by ``1/sqrt(n)``): elementwise IEEE operations, so the result is the same bit for bit on every
device and engine, and no host synchronisation happens. For ``n`` a power of 4 (the recipe's 16)
``1/sqrt(n)`` is a power of two and the normalisation is exact.

The signs are the top bits of the :data:`~gradstats.ops.random.HADAMARD` stream of
:mod:`gradstats.ops.random` for :data:`SIGN_SEED` (the recipe uses one fixed sign vector for the whole
training); :func:`signs` gives them, as torchao's ``rht_sign_vector`` takes them (its RHT matrix
``diag(s) @ H16 / 4`` multiplies the token vectors from the right, which is ``R16`` from the left).

Example:
    >>> import torch
    >>> x = torch.randn(40, 8)                          # 40 tokens, 8 channels
    >>> m, ctx = rotate(x, 16)
    >>> tuple(m.shape), torch.allclose(unrotate(m, ctx), x, atol=1e-6)
    ((48, 8), True)
    >>> R = rht_matrix(16)
    >>> torch.equal(R.t() @ R, torch.eye(16))
    True
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from gradstats.ops import random as _rng
from gradstats.ops.layout import check_orientation, from_gemm_matrix, gemm_matrix
from gradstats.scheme import HADAMARD_SIZES, check_hadamard

__all__ = ["HADAMARD_SIZES", "SIGN_SEED", "check_hadamard", "resolve_orientation", "sylvester", "signs",
           "rht_matrix", "rotate", "unrotate", "RotatedContext"]

#: the seed of the random signs (one fixed sign vector, as in the recipe)
SIGN_SEED = 0


def resolve_orientation(orientation: Optional[str], hadamard: Optional[int]) -> str:
    """The block orientation of a call: ``"rows"`` by default, ``"columns"`` (along the tokens, the
    rotated dim) with a Hadamard transform, which takes no other.

    Example:
        >>> resolve_orientation(None, None), resolve_orientation(None, 16), resolve_orientation("2d", None)
        ('rows', 'columns', '2d')
    """
    if hadamard is None:
        o = "rows" if orientation is None else orientation
        check_orientation(o)
        return o
    if orientation not in (None, "columns"):
        raise ValueError(f"orientation {orientation!r}: a Hadamard transform rotates the tokens (the weight-gradient "
                         "GEMM's reduction dim), whose blocks run along them: use orientation 'columns' (or leave it "
                         "unset), or remove hadamard")
    return "columns"


@functools.lru_cache(maxsize=16)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sylvester(n: int = 16) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries +-1, float32; ``H[i, j] = (-1)**popcount(i & j)``).

    Example:
        >>> sylvester(4).tolist()
        [[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [1.0, -1.0, -1.0, 1.0]]
    """
    check_hadamard(n, 1, "sylvester")
    return _sylvester(n).clone()


@functools.lru_cache(maxsize=64)
def _signs(n: int, seed: int) -> tuple[int, ...]:
    words = _rng.reference_bits(_rng.stream(seed, _rng.HADAMARD), 0, n)
    return tuple(-1 if int(w) >> 31 else 1 for w in words)


def signs(n: int = 16, seed: int = SIGN_SEED) -> tuple[int, ...]:
    """The ``n`` random signs (+-1) of the transform for ``seed``: the top bits of the
    :data:`~gradstats.ops.random.HADAMARD` stream's words at indices ``0 .. n - 1``.

    Example:
        >>> s = signs(16)
        >>> len(s), set(s) <= {-1, 1}, s == signs(16, SIGN_SEED)
        (16, True, True)
    """
    check_hadamard(n, 1, "signs")
    return _signs(n, int(_rng.resolve_seed(seed, None, "signs")))


def rht_matrix(n: int = 16, seed: int = SIGN_SEED) -> torch.Tensor:
    """The rotation ``R = H S / sqrt(n)`` (float32) that :func:`rotate` applies to each group of ``n``
    tokens, as an explicit matrix (``H``: :func:`sylvester`, ``S``: the diagonal of :func:`signs`).

    Example:
        >>> R = rht_matrix(16)
        >>> torch.equal(R, sylvester(16) * torch.tensor(signs(16), dtype=torch.float32) / 4)
        True
    """
    s = torch.tensor(signs(n, seed), dtype=torch.float32)
    return sylvester(n) * s * float(n) ** -0.5


class RotatedContext(NamedTuple):
    """What :func:`unrotate` needs: the tensor's shape, its channel dim, the transform's size and
    seed, and the number of tokens before padding."""

    shape: tuple[int, ...]
    channel_dim: int
    size: int
    seed: int
    M: int


def _butterflies(m: torch.Tensor, n: int) -> torch.Tensor:
    """``H_n`` (Sylvester, unnormalised) applied to each group of ``n`` consecutive rows of ``m``."""
    K = m.shape[1]
    y = m.reshape(-1, n, K)
    h = 1
    while h < n:
        v = y.reshape(y.shape[0], n // (2 * h), 2, h, K)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n, K)
        h *= 2
    return y.reshape(-1, K)


@functools.lru_cache(maxsize=32)
def _diag_on(n: int, seed: int, device: str) -> torch.Tensor:
    return torch.tensor(signs(n, seed), dtype=torch.float32, device=device).reshape(1, n, 1)


def _diag(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """The signs as a ``(1, n, 1)`` tensor on ``device``, copied there once (cached)."""
    return _diag_on(n, seed, str(device))


def rotate(x: torch.Tensor, n: int = 16, channel_dim: int = -1, seed: int = SIGN_SEED
           ) -> tuple[torch.Tensor, RotatedContext]:
    """``R g`` of ``x``: its channels-last GEMM matrix ``(M, K)`` (``channel_dim``: the dim that holds
    the channels, :func:`gradstats.ops.layout.channel_dim`), the tokens zero-padded to a multiple of
    ``n`` and each group of ``n`` tokens of each channel multiplied by ``R = H S / sqrt(n)``
    (:func:`rht_matrix`). Returns the float32 matrix ``(M_pad, K)`` and the context of :func:`unrotate`.

    Example:
        >>> x = torch.zeros(16, 1); x[3] = 8.0             # one outlier among 16 tokens
        >>> sorted(set(rotate(x)[0].abs().flatten().tolist()))  # spread over all of them
        [2.0]
    """
    check_hadamard(n, 1, "rotate")
    m = gemm_matrix(x.float(), channel_dim)
    M, K = m.shape
    pad = (-M) % n
    if pad:
        m = torch.nn.functional.pad(m, (0, 0, 0, pad))
    s = _diag(n, seed, m.device)
    y = _butterflies((m.reshape(-1, n, K) * s).reshape(-1, K), n) * float(n) ** -0.5
    return y, RotatedContext(tuple(x.shape), channel_dim, n, seed, M)


def unrotate(m: torch.Tensor, ctx: RotatedContext) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``R^T = S H / sqrt(n)`` on each group of ``n`` rows of the
    ``(M_pad, K)`` matrix ``m``, the padding tokens dropped, back in a float32 tensor of the original
    shape (contiguous).

    Example:
        >>> x = torch.randn(2, 3, 5, 5)
        >>> torch.allclose(unrotate(*rotate(x, 16, 1)), x, atol=1e-6)
        True
    """
    n, K = ctx.size, m.shape[1]
    y = _butterflies(m.float(), n) * float(n) ** -0.5
    y = (y.reshape(-1, n, K) * _diag(n, ctx.seed, y.device)).reshape(-1, K)[:ctx.M]
    return from_gemm_matrix(y, ctx.shape, ctx.channel_dim).contiguous()
