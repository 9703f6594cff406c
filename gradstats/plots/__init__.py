"""Figures. Every function takes a run or result objects and returns a matplotlib Figure.

One consistent style (:func:`gradstats.plots.style.use_style`), log2 axes wherever values
span binades, labelled units. Figures read runs and results, never live models.
"""
from __future__ import annotations

from gradstats.plots.style import savefig, use_style

__all__ = ["use_style", "savefig"]
