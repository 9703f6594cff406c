"""GPU kernels (Triton). Each kernel module has a torch reference path that is used when
Triton or a CUDA device is absent; the kernels themselves are tested on the CPU through
Triton's interpreter (``TRITON_INTERPRET=1``)."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports (it may still lack a GPU; see :func:`use_triton`)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device_type: str) -> bool:
    """Whether a tensor on ``device_type`` goes through a Triton kernel: what
    :func:`gradstats.ops.engine.active_engine` says (CUDA with Triton installed; the CPU under
    ``GRADSTATS_ENGINE=triton`` and ``TRITON_INTERPRET=1``)."""
    from gradstats.ops.engine import use_triton as engine_says

    return engine_says(device_type)
