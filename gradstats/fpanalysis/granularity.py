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

from gradstats.scheme import E8M0, FP32, PRESETS, Scheme, names_scheme

__all__ = ["GRANULARITIES", "granularity_layout", "granularity_of", "analysed_scheme", "BlockViews"]

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


def analysed_scheme(fmt: Union[str, Scheme, object], granularity: Union[str, int, Scheme, None] = None, *,
                    what: str = "the analysis", exact_scales: bool = False) -> Scheme:
    """The scheme an analysis function predicts for ``fmt``: the one door of the ``granularity=`` of
    :func:`~gradstats.fpanalysis.expected_error`, :func:`~gradstats.fpanalysis.best_format`,
    :func:`~gradstats.fpanalysis.what_if` and the other predictions.

    A scheme, or a scheme's name (``"nvfp4"``, ``"e2m1fn:block=16:scale=e4m3"``), brings its own block
    layout; a plain format (a name or an :class:`~gradstats.formats.FPFormat`) takes ``granularity``'s
    (:func:`granularity_layout`; None: one scale per tensor). A scheme with a ``granularity`` of another
    layout is a ``ValueError`` (say it once). The estimators model E8M0 scales rounded by the OCP rule:
    another ``scale_rounding`` is refused with the fix, unless the caller computes the block scales
    exactly (``exact_scales``: :func:`~gradstats.fpanalysis.composed.composed_blocks`).

    Example:
        >>> str(analysed_scheme("e2m1fn", "nvfp4")), str(analysed_scheme("nvfp4")), str(analysed_scheme("e4m3fn", 32))
        ('nvfp4', 'nvfp4', 'mxfp8_e4m3')
        >>> analysed_scheme("mxfp4", "nvfp4")
        Traceback (most recent call last):
        ...
        ValueError: the analysis: 'mxfp4' brings its own blocks; granularity='nvfp4' names another layout: pass the format alone ('mxfp4'), or a plain element format with granularity='nvfp4'
    """
    if names_scheme(fmt):
        s = Scheme.parse(fmt)  # type: ignore[arg-type]
        if granularity is not None and granularity_layout(granularity) != s.block_layout:
            raise ValueError(f"{what}: {str(s)!r} brings its own blocks; granularity={granularity!r} names another "
                             f"layout: pass the format alone ({str(s)!r}), or a plain element format with "
                             f"granularity={granularity!r}")
    else:
        from gradstats.formats import parse

        layout = granularity_layout("tensor" if granularity is None else granularity)
        s = layout.replace(element=parse(fmt))  # type: ignore[arg-type]
    if s.scale_rounding not in (None, "floor") and not exact_scales:
        raise ValueError(f"{what}: scheme {str(s)!r}: the predictions model E8M0 scales rounded by the OCP rule "
                         f"('floor'); drop ':scale_rounding={s.scale_rounding}' (quantize and apply honour it)")
    return s


class BlockViews:
    """The views of a result's block scheme ``blocks`` (None: one scale per tensor): what
    :class:`~gradstats.fpanalysis.ErrorResult` and :class:`~gradstats.fpanalysis.BestFormat` show of it.

    Example:
        >>> from gradstats.fpanalysis import expected_error
        >>> r = expected_error("nvfp4", mu=0.0, sigma=1.0)
        >>> r.block_size, r.scale_format, expected_error("e4m3fn", mu=0.0, sigma=1.0).block_size
        (16, 'e4m3', None)
    """

    blocks: Optional[Scheme]

    @property
    def block_size(self) -> Optional[int]:
        """Entries per block scale, None for one scale per tensor."""
        return None if self.blocks is None else self.blocks.block_size

    @property
    def scale_format(self) -> Optional[str]:
        """The block scale's format (``"e8m0"``, ``"e4m3"``), None for one scale per tensor."""
        return None if self.blocks is None else self.blocks.scale_format_name
