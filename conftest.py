"""Fixtures for every test, the doctests of the package included."""
from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _close_figures():
    """Close the figures a test (or an example that draws) opened, so that they do not pile up."""
    yield
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")
