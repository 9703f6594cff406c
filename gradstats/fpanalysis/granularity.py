"""Where a format's scales live, by name: the one place a ``granularity=`` is read.

:func:`gradstats.recommend`, :func:`gradstats.fpanalysis.preset_formats`, :func:`~gradstats.fpanalysis.best_format`
and the ``gradstats recommend`` command take a granularity, and :func:`granularity_layout` reads it as the
block layout of a :class:`~gradstats.scheme.Scheme` (a :class:`Layout`: block size and block scale format):

- ``"tensor"``: one scale per tensor (no blocks);
- ``"mx"``: the OCP MX layout of the ``mxfp*`` presets, blocks of 32 with :data:`~gradstats.scheme.E8M0`
  (power-of-two) scales;
- ``"nvfp4"``: the layout of the ``nvfp4`` preset, blocks of 16 with :data:`~gradstats.scheme.E4M3` scales
  times a float32 tensor scale;
- an int ``N``: blocks of ``N`` with E8M0 scales (so ``32`` is ``"mx"``). Blocks of another size with
  E4M3 scales are a scheme (``"e2m1fn:block=32:scale=e4m3"``), not a granularity.

Example:
    >>> from gradstats.fpanalysis.granularity import granularity_layout
    >>> granularity_layout("nvfp4").block_size, str(granularity_layout("nvfp4").scale_format)
    (16, 'e4m3fn')
    >>> granularity_layout(32).name, granularity_layout(64).name, granularity_layout("tensor").block_size
    ('mx', None, None)
    >>> str(granularity_layout("mx").scheme("e2m1fn"))
    'mxfp4'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from gradstats.formats import FPFormat
from gradstats.scheme import E8M0, PRESETS, SCALE_FORMATS, Scheme, scale_format_of

__all__ = ["GRANULARITIES", "Layout", "granularity_layout"]

#: the granularity names (besides an int block size): one scale per tensor, MX blocks, NVFP4 blocks
GRANULARITIES = ("tensor", "mx", "nvfp4")


@dataclass(frozen=True)
class Layout:
    """The block layout of a scheme: ``block_size`` (None: one scale per tensor) and the block scale
    format ``scale_format`` (:data:`~gradstats.scheme.E8M0`, the default with blocks, or
    :data:`~gradstats.scheme.E4M3`; a name of :data:`~gradstats.scheme.SCALE_FORMATS` is accepted).

    Example:
        >>> Layout(16, "e4m3").name, Layout(32).scale_format_name, Layout.of(Scheme.parse("mxfp4")).name
        ('nvfp4', 'e8m0', 'mx')
    """

    block_size: Optional[int] = None
    scale_format: Optional[FPFormat] = None

    def __post_init__(self) -> None:
        b = self.block_size
        if b is None:
            if self.scale_format is not None:
                raise ValueError("a block scale format needs blocks: give a block size (MX uses 32, NVFP4 16), "
                                 "or no scale format")
            return
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"a block size must be a positive int (MX uses 32, NVFP4 16), got {b!r}")
        object.__setattr__(self, "scale_format", E8M0 if self.scale_format is None
                           else scale_format_of(self.scale_format))

    @classmethod
    def of(cls, scheme: Union[Scheme, str]) -> "Layout":
        """The layout of a scheme (or a scheme's name)."""
        s = Scheme.parse(scheme)
        return cls(s.block_size, s.scale_format)

    @property
    def name(self) -> Optional[str]:
        """The granularity name of this layout (:data:`GRANULARITIES`), or None for another one."""
        return next((k for k, v in _LAYOUTS.items() if v == self), None)

    @property
    def scale_format_name(self) -> Optional[str]:
        """The short name of the block scale format (``"e8m0"``, ``"e4m3"``), None without blocks."""
        if self.scale_format is None:
            return None
        return next(n for n in SCALE_FORMATS if scale_format_of(n) == self.scale_format)

    def scheme(self, element: Union[FPFormat, str], **fields: Any) -> Scheme:
        """The scheme of ``element`` in this layout (``fields``: its other fields, e.g. ``rounding``)."""
        return Scheme(element, block_size=self.block_size, scale_format=self.scale_format, **fields)


#: the layouts the names stand for, as the presets have them
_LAYOUTS = {"tensor": Layout(), "mx": Layout.of(PRESETS["mxfp4"]), "nvfp4": Layout.of(PRESETS["nvfp4"])}


def granularity_layout(granularity: Union[str, int, Layout]) -> Layout:
    """The block layout a ``granularity`` stands for (see the module doc): ``"tensor"``, ``"mx"``,
    ``"nvfp4"``, an int ``N`` (blocks of ``N`` with E8M0 scales), or a :class:`Layout` (returned as is).

    Example:
        >>> granularity_layout(16) == granularity_layout("nvfp4")      # an int has E8M0 scales
        False
        >>> granularity_layout("block")
        Traceback (most recent call last):
        ...
        ValueError: granularity must be one of ['tensor', 'mx', 'nvfp4'] or a block size (an int N: blocks of N with E8M0 scales), got 'block'
    """
    if isinstance(granularity, Layout):
        return granularity
    if isinstance(granularity, str) and granularity in _LAYOUTS:
        return _LAYOUTS[granularity]
    if isinstance(granularity, (int, np.integer)) and not isinstance(granularity, bool) and granularity > 0:
        return Layout(int(granularity), E8M0)
    raise ValueError(f"granularity must be one of {list(GRANULARITIES)} or a block size (an int N: "
                     f"blocks of N with E8M0 scales), got {granularity!r}")
