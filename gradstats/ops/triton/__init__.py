"""GPU kernels (Triton). Each kernel module has a torch reference path that is used when
Triton or a CUDA device is absent; the kernels themselves are tested on the CPU through
Triton's interpreter (``GRADSTATS_ENGINE=triton TRITON_INTERPRET=1``)."""
from __future__ import annotations

from gradstats.ops.engine import interpreting, triton_available, use_triton  # noqa: F401 - their home is the engine

__all__ = ["interpreting", "triton_available", "use_triton"]
