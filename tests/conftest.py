"""Shared test fixtures."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # each xdist worker gets one core: two workers with two OpenMP threads each on a 2-core
    # machine stall on each other
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):  # noqa: D103
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (its CPU twin runs instead)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
