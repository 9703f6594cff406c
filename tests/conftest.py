"""Shared test fixtures."""
from __future__ import annotations

import logging
import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # each xdist worker gets one core: two workers with two OpenMP threads each on a 2-core
    # machine stall on each other
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _gradstats_log_level():
    """Each test starts with the package's loggers as the process had them: an experiment's main()
    run in-process quiets ``gradstats`` below ERROR for its own output, which would hide the warnings
    later tests of the same worker assert on."""
    lg = logging.getLogger("gradstats")
    level = lg.level
    yield
    lg.setLevel(level)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):  # noqa: D103
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (its CPU twin runs instead)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def one_intraop_thread():
    """For modules of many mid-sized tensor ops: on a shared, busy machine OpenMP threads that are
    not scheduled stall each op, so the module runs single-threaded (the quantiser's CPU path is
    single-threaded per op anyway) and the setting is restored afterwards. Use with
    ``pytestmark = pytest.mark.usefixtures("one_intraop_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter on (``TRITON_INTERPRET=1``), one torch thread, and numpy's warnings on
    the NaN lanes it computes silenced: what the tests of the Triton kernels run under."""
    import warnings

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
    torch.set_num_threads(n)

