"""The public names resolve, and importing gradstats stays light."""
from __future__ import annotations

import subprocess
import sys

import gradstats


def test_every_public_name_resolves():
    for name in gradstats.__all__:
        assert getattr(gradstats, name) is not None, name


def test_stable_names_from_the_brief():
    for name in ("FPFormat", "quantize", "trace", "open_run", "fit", "pruning", "fpanalysis",
                 "recommend", "Plan", "apply"):
        assert name in gradstats.__all__
    assert callable(gradstats.quantize) and callable(gradstats.apply) and callable(gradstats.recommend)


def test_import_is_lazy():
    code = "import sys, gradstats; print('torch' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gradstats.nope  # noqa: B018
