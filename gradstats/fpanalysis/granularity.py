"""Where a format's scales live, by name: the one place a ``granularity=`` is read.

:func:`gradstats.recommend`, :func:`gradstats.fpanalysis.preset_formats`, :func:`~gradstats.fpanalysis.best_format`
and the ``gradstats recommend`` command take a granularity, and :func:`granularity_layout` reads it as the
block layout of a :class:`~gradstats.scheme.Scheme` (:attr:`~gradstats.scheme.Scheme.block_layout`: block size
and block scale format, on float32 elements):

- ``"tensor"``: one scale per tensor (no blocks);
- ``"mx"``: the OCP MX layout of the ``mxfp*`` presets, blocks of 32 with :data:`~gradstats.scheme.E8M0`
  (power-of-two) scales;
- ``"nvfp4"``: the layout of the ``nvfp4`` preset, blocks of 16 with :data:`~gradstats.scheme.E4M3` scales
  times a float32 tensor scale;
- an int ``N``: blocks of ``N`` with E8M0 scales (so ``32`` is ``"mx"``). Blocks of another size with
  E4M3 scales are a scheme (``"e2m1fn:block=32:scale=e4m3"``), not a granularity.

Example:
    >>> from gradstats.fpanalysis.granularity import granularity_layout, granularity_of
    >>> granularity_layout("nvfp4").block_size, str(granularity_layout("nvfp4").scale_format)
    (16, 'e4m3fn')
    >>> granularity_of(granularity_layout(32)), granularity_of(granularity_layout(64)), granularity_layout("tensor").block_size
    ('mx', None, None)
    >>> str(granularity_layout("mx").replace(element="e2m1fn")), granularity_of("nvfp4_training")
    ('mxfp4', 'nvfp4')
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np

from gradstats.scheme import E8M0, FP32, PRESETS, Scheme

__all__ = ["GRANULARITIES", "granularity_layout", "granularity_of"]

#: the granularity names (besides an int block size): one scale per tensor, MX blocks, NVFP4 blocks
GRANULARITIES = ("tensor", "mx", "nvfp4")

#: the block layouts the names stand for, as the presets have them
_LAYOUTS = {"tensor": Scheme(FP32), "mx": PRESETS["mxfp4"].block_layout, "nvfp4": PRESETS["nvfp4"].block_layout}


def granularity_of(scheme: Union[Scheme, str]) -> Optional[str]:
    """The granularity name (:data:`GRANULARITIES`) of a scheme's block layout (or a scheme name's), or
    None for a layout of no name (blocks of 64, E8M0 blocks of 16).

    Example:
        >>> granularity_of("mxfp8_e5m2"), granularity_of("e4m3fn"), granularity_of("e2m1fn:block=16:scale=e8m0")
        ('mx', 'tensor', None)
    """
    layout = Scheme.parse(scheme).block_layout
    return next((k for k, v in _LAYOUTS.items() if v == layout), None)


def granularity_layout(granularity: Union[str, int, Scheme]) -> Scheme:
    """The block layout a ``granularity`` stands for (see the module doc), a
    :attr:`~gradstats.scheme.Scheme.block_layout`: ``"tensor"``, ``"mx"``, ``"nvfp4"``, an int ``N``
    (blocks of ``N`` with E8M0 scales), or a scheme (its block layout).

    Example:
        >>> granularity_layout(16) == granularity_layout("nvfp4")      # an int has E8M0 scales
        False
        >>> granularity_layout("block")
        Traceback (most recent call last):
        ...
        ValueError: granularity must be one of ['tensor', 'mx', 'nvfp4'] or a block size (an int N: blocks of N with E8M0 scales), got 'block'
    """
    if isinstance(granularity, Scheme):
        return granularity.block_layout
    if isinstance(granularity, str) and granularity in _LAYOUTS:
        return _LAYOUTS[granularity]
    if isinstance(granularity, (int, np.integer)) and not isinstance(granularity, bool) and granularity > 0:
        return Scheme(FP32, block_size=int(granularity), scale_format=E8M0)
    raise ValueError(f"granularity must be one of {list(GRANULARITIES)} or a block size (an int N: "
                     f"blocks of N with E8M0 scales), got {granularity!r}")
