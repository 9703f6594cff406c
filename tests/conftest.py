"""Shared test fixtures."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):  # noqa: D103
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (its CPU twin runs instead)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
