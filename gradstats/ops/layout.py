"""Where a block-scaled GEMM reads a gradient's blocks: the one home of the block layout.

A block scale is shared by values that one GEMM reduces over together. A layer's output gradient
``g`` is read by two GEMMs: the data-gradient GEMM (``dX = g W``) reduces over the layer's output
features (a linear layer's last dim, a convolution's output *channels*), the weight-gradient GEMM
(``dW = g^T X``) over the tokens (every other dim: ``N*H*W`` for a convolution). Both read ``g`` as
the channels-last matrix :func:`gemm_matrix`, ``(M, K)`` with ``K`` the channels, whichever dim
holds them in memory (cuDNN and the FP8 recipes work channels-last). On that matrix an
*orientation* (:data:`ORIENTATIONS`) says where blocks run:

- ``"rows"``: ``B`` consecutive channels of one token (the data-gradient GEMM's operand; what
  :func:`gradstats.quantize` and :func:`gradstats.apply` use by default),
- ``"columns"``: ``B`` consecutive tokens of one channel (the weight-gradient GEMM's operand),
- ``"2d"``: ``B x B`` tiles (one scale per tile, as NVFP4's 16x16 weight blocks).

Never along a convolution's spatial width: cut there, blocks hold 4-14 values and clip several
times more than 16-value blocks. :func:`channel_dim` says which dim of a layer's gradient holds
its channels, from the layer's class names (a run keeps them) and the gradient's rank; every
consumer (``quantize``, ``apply`` on every engine, the tracer's block statistics and samples, the
replay of a plan, ``what_if``) goes through :func:`to_blocks` and :func:`from_blocks`.

Example:
    >>> import torch
    >>> g = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 3, 2, 2)   # (N, C, H, W)
    >>> channel_dim(("Conv2d",), 4), channel_dim(("Linear",), 3)
    (1, -1)
    >>> gemm_matrix(g, 1)[:2].tolist()            # token (n=0, h=0, w=0): its 3 channels
    [[0.0, 4.0, 8.0], [1.0, 5.0, 9.0]]
    >>> xb, ctx = to_blocks(g, 2, "rows", 1)       # 8 tokens x 2 blocks of 2 channels (one padded)
    >>> tuple(xb.shape), torch.equal(from_blocks(xb, ctx), g)
    ((16, 2), True)
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Sequence

import torch

__all__ = ["ORIENTATIONS", "CHANNEL_FIRST_TYPES", "channel_dim", "geometry", "gemm_matrix", "from_gemm_matrix", "to_blocks",
           "from_blocks", "n_blocks", "check_orientation", "BlockContext"]

#: where blocks run on the channels-last matrix ``(M tokens, K channels)`` (see the module doc)
ORIENTATIONS = ("rows", "columns", "2d")
#: class names of layers whose output holds its channels at dim 1 (``(N, C, *spatial)``): convolutions,
#: and the norms and pools that act on their outputs. Every other layer holds them last.
CHANNEL_FIRST_TYPES = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
                       "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "InstanceNorm1d",
                       "InstanceNorm2d", "InstanceNorm3d", "GroupNorm", "MaxPool1d", "MaxPool2d", "MaxPool3d",
                       "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d")


def check_orientation(orientation: str) -> None:
    """Raise a ValueError unless ``orientation`` is one of :data:`ORIENTATIONS`.

    Example:
        >>> check_orientation("rows")
    """
    if orientation not in ORIENTATIONS:
        raise ValueError(f"orientation must be one of {ORIENTATIONS} ('rows': blocks along the channels, the "
                         f"data-gradient GEMM's; 'columns': along the tokens, the weight-gradient GEMM's; '2d': "
                         f"B x B tiles), got {orientation!r}")


def channel_dim(types: Iterable[str] | str | None, ndim: int) -> int:
    """The dim of a layer's output gradient (of rank ``ndim``) that holds its channels: 1 for a
    convolution's ``(N, C, *spatial)`` output (and a norm's or pool's on it, :data:`CHANNEL_FIRST_TYPES`),
    -1 (the last) for every other layer and for gradients of rank below 3.

    ``types``: the layer's class name or its class names (most derived first, as
    :func:`gradstats.layers.module_types` gives them and a run's manifest keeps them).

    Example:
        >>> channel_dim("Conv2d", 4), channel_dim(("MyConv", "Conv2d"), 4), channel_dim("BatchNorm1d", 2)
        (1, 1, -1)
    """
    names = (types,) if isinstance(types, str) else tuple(types or ())
    return 1 if ndim >= 3 and any(t in CHANNEL_FIRST_TYPES for t in names) else -1


def _norm(dim: int, ndim: int) -> int:
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise ValueError(f"channel dim {dim} is out of range for a tensor of {ndim} dims")
    return dim + ndim if dim < 0 else dim


def gemm_matrix(x: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
    """``x`` as the channels-last matrix ``(M, K)`` that both gradient GEMMs read: ``channel_dim``
    moved last, the other dims flattened into tokens in their order (a view where the strides allow,
    else a copy). A 0-d tensor is ``(1, 1)``.

    Example:
        >>> gemm_matrix(torch.zeros(4, 8, 5, 5), 1).shape
        torch.Size([100, 8])
    """
    if x.dim() == 0:
        return x.reshape(1, 1)
    d = _norm(channel_dim, x.dim())
    m = x.movedim(d, -1) if d != x.dim() - 1 else x
    return m.reshape(-1, m.shape[-1])


def from_gemm_matrix(m: torch.Tensor, shape: torch.Size | tuple[int, ...], channel_dim: int = -1) -> torch.Tensor:
    """The inverse of :func:`gemm_matrix`: the ``(M, K)`` matrix back in a tensor of ``shape``.

    Example:
        >>> x = torch.randn(2, 3, 4, 5)
        >>> torch.equal(from_gemm_matrix(gemm_matrix(x, 1), x.shape, 1), x)
        True
    """
    shape = tuple(shape)
    if not shape:
        return m.reshape(())
    d = _norm(channel_dim, len(shape))
    moved = shape[:d] + shape[d + 1:] + (shape[d],)
    t = m.reshape(moved)
    return t.movedim(-1, d) if d != len(shape) - 1 else t


class BlockContext(NamedTuple):
    """What :func:`from_blocks` needs to put blocks back: the tensor's shape, its channel dim, the
    orientation, the block size and the matrix's ``(M, K)``."""

    shape: tuple[int, ...]
    channel_dim: int
    orientation: str
    block_size: int
    M: int
    K: int


def geometry(shape: Sequence[int], channel_dim: int = -1) -> tuple[int, int, int]:
    """``(P, K, Q)``: a contiguous tensor of ``shape`` as the dims before, at and after its channel dim
    ``channel_dim`` (blocks of ``"rows"`` run along ``K``, at each ``(p, q)``): what the fused block
    kernels walk, in place.

    Example:
        >>> geometry((64, 96, 14, 14), 1), geometry((3, 7, 24), -1)
        ((64, 96, 196), (21, 24, 1))
    """
    d = _norm(channel_dim, len(shape))
    return math.prod(shape[:d]), shape[d], math.prod(shape[d + 1:])


def n_blocks(M: int, K: int, block_size: int, orientation: str = "rows") -> int:
    """Blocks of a ``(M, K)`` gradient matrix in an orientation (the last of a row or column partial).

    Example:
        >>> n_blocks(100, 24, 16, "rows"), n_blocks(100, 24, 16, "columns"), n_blocks(100, 24, 16, "2d")
        (200, 168, 14)
    """
    check_orientation(orientation)
    cb = lambda n: -(-n // block_size)  # noqa: E731
    return {"rows": M * cb(K), "columns": cb(M) * K, "2d": cb(M) * cb(K)}[orientation]


def to_blocks(x: torch.Tensor, block_size: int, orientation: str = "rows",
              channel_dim: int = -1) -> tuple[torch.Tensor, BlockContext]:
    """``x``'s blocks as float32 rows ``(n_blocks, block_size)`` (``block_size**2`` per tile for
    ``"2d"``), zero padded, in the order :func:`n_blocks` counts them, and the context to put them back.

    Example:
        >>> xb, ctx = to_blocks(torch.arange(6.0).reshape(2, 3), 2, "columns")
        >>> xb.tolist()
        [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_orientation(orientation)
    m = gemm_matrix(x.float(), channel_dim)
    M, K = m.shape
    ctx = BlockContext(tuple(x.shape), channel_dim, orientation, block_size, M, K)
    B = block_size
    if orientation == "columns":
        m = m.t()
    if orientation in ("rows", "columns"):
        pad = (-m.shape[1]) % B
        if pad:
            m = torch.nn.functional.pad(m, (0, pad))
        return m.reshape(-1, B), ctx
    pm, pk = (-M) % B, (-K) % B
    if pm or pk:
        m = torch.nn.functional.pad(m, (0, pk, 0, pm))
    tiles = m.reshape(m.shape[0] // B, B, m.shape[1] // B, B).permute(0, 2, 1, 3)
    return tiles.reshape(-1, B * B), ctx


def from_blocks(xb: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
    """The inverse of :func:`to_blocks`: blocks (of any dtype) back in a tensor of the original shape
    (padding dropped); contiguous.

    Example:
        >>> x = torch.randn(3, 5, 7)
        >>> all(torch.equal(from_blocks(*to_blocks(x, 4, o, 1)), x) for o in ORIENTATIONS)
        True
    """
    B, M, K = ctx.block_size, ctx.M, ctx.K
    if ctx.orientation == "rows":
        m = xb.reshape(M, -1)[:, :K]
    elif ctx.orientation == "columns":
        m = xb.reshape(K, -1)[:, :M].t()
    else:
        mb, kb = -(-M // B), -(-K // B)
        m = xb.reshape(mb, kb, B, B).permute(0, 2, 1, 3).reshape(mb * B, kb * B)[:M, :K]
    return from_gemm_matrix(m, ctx.shape, ctx.channel_dim).contiguous()
