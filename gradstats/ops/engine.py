"""Which engine runs the tensor passes (statistics, pruning, quantisation, the fused operator) for
tensors of a device: the one switch, ``GRADSTATS_ENGINE``.

============  ==================================================================================
``native``    the CPU engines for CPU tensors (the default there): the C kernels of
              :mod:`gradstats.ops.native`, numpy (:mod:`gradstats.ops.cpu`) without a C compiler;
              CUDA tensors keep their default, Triton
``torch``     the torch reference path on every device (a sequence of torch operations)
``triton``    the Triton kernels (the default for CUDA tensors when Triton is installed); CPU
              tensors take them too under Triton's interpreter (``TRITON_INTERPRET=1``): exactly
              the code path of CUDA tensors, statistics, pruning, quantisation, apply's refresh
              and counts and the tracer's copies, which is how the tests check the device path
              on a machine without a GPU
============  ==================================================================================

Unset, each device gets its default: ``native`` on the CPU, ``triton`` on CUDA (``torch`` without Triton). The variable is read at each call (tests and
notebooks may change it between calls). :func:`gradstats.apply` and :func:`gradstats.trace` take the engine as an
option too (``ApplyConfig.engine``, ``TraceConfig.engine``; None: the variable's): their hooks run under
:func:`using`, which this module's one choice, :func:`active_engine`, reads before the variable.

Example:
    >>> active_engine("cpu") == (requested_engine() or "native")   # the CPU's: the one asked for, else native
    True
    >>> active_engine("mps")          # a device without kernels of its own: the torch reference path
    'torch'
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import Iterator

#: the engines, by name
ENGINES = ("native", "torch", "triton")
#: the environment variable that picks one
ENV = "GRADSTATS_ENGINE"
#: the engine a caller asked for in code (:func:`using`), which comes before the variable
_ASKED: contextvars.ContextVar[str | None] = contextvars.ContextVar("gradstats_engine", default=None)


def check_engine(engine: str | None, what: str = "engine") -> str | None:
    """``engine`` if it names one of :data:`ENGINES` (or is None: the variable's, else each device's default),
    else a ValueError naming them.

    Example:
        >>> check_engine("torch"), check_engine(None)
        ('torch', None)
    """
    if engine is None or engine in ENGINES:
        return engine
    raise ValueError(f"{what} must be one of {ENGINES} or None (GRADSTATS_ENGINE's, else each device's default), "
                     f"got {engine!r}")


def using(engine: str | None) -> contextlib.AbstractContextManager[None]:
    """Run the passes inside under ``engine`` (None: as :envvar:`GRADSTATS_ENGINE` says, a context that does
    nothing): how ``apply(..., engine=)`` and ``trace(..., engine=)`` hold their hooks to the engine of their
    config.

    Example:
        >>> with using("torch"):
        ...     active_engine("cpu")
        'torch'
    """
    return contextlib.nullcontext() if engine is None else _held(check_engine(engine))


@contextlib.contextmanager
def _held(engine: str | None) -> Iterator[None]:
    token = _ASKED.set(engine)
    try:
        yield
    finally:
        _ASKED.reset(token)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports (it may still lack a GPU; see :func:`use_triton`).

    Example:
        >>> import importlib.util
        >>> triton_available() == (importlib.util.find_spec("triton") is not None)   # installed, so importable
        True
    """
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``).

    Example:
        >>> import os
        >>> interpreting() == (os.environ.get("TRITON_INTERPRET") == "1")   # "1" only: unset or "0" is False
        True
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_engine() -> str | None:
    """The engine asked for: :func:`using`'s, else ``GRADSTATS_ENGINE``'s (None: unset or empty, every device's default).

    Example:
        >>> import os
        >>> requested_engine() == (os.environ.get(ENV, "").strip().lower() or None)   # " Torch " asks for "torch"
        True
    """
    asked = _ASKED.get()
    if asked is not None:
        return asked
    name = os.environ.get(ENV, "").strip().lower()
    if not name:
        return None
    if name not in ENGINES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} names no engine: expected one of {', '.join(ENGINES)} "
                         f"(or leave it unset for each device's default)")
    return name


def active_engine(device_type: str) -> str:
    """The engine that runs the passes over a tensor on ``device_type`` (``"cpu"``, ``"cuda"``, ...):
    ``"native"``, ``"torch"`` or ``"triton"`` (see the module's docstring).

    ``GRADSTATS_ENGINE=triton`` on the CPU needs Triton's interpreter (``TRITON_INTERPRET=1``) and
    Triton installed: a clear error says so otherwise, rather than a silent fall-back to another
    path than the one asked for.

    Example:
        >>> active_engine("mps")
        'torch'
        >>> active_engine("cuda") == ("triton" if triton_available() and requested_engine() != "torch" else "torch")
        True
    """
    if device_type == "cpu" and not os.environ.get(ENV) and _ASKED.get() is None:
        return "native"                        # the common case, first: two lookups per call
    asked = requested_engine()
    if device_type == "cuda":
        if asked == "torch" or not triton_available():
            return "torch"
        return "triton"
    if device_type != "cpu":
        return "torch"                         # mps, xpu...: the reference path
    if asked == "triton":
        if not triton_available():
            raise ValueError(f"the triton engine ({ENV}=triton or engine='triton') needs the triton package (pip install triton), which is not "
                             "importable here; unset it for the C kernels")
        if not interpreting():
            raise ValueError(f"the triton engine ({ENV}=triton or engine='triton') on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
                             "too (before the first kernel is built), or unset it for the C kernels")
        return "triton"
    if asked == "torch":
        return "torch"
    return "native"


def use_triton(device_type: str) -> bool:
    """Whether a tensor on ``device_type`` goes through the Triton kernels.

    Example:
        >>> use_triton("mps")
        False
        >>> use_triton("cpu") == (requested_engine() == "triton")   # CPU tensors only when it is asked for
        True
    """
    return active_engine(device_type) == "triton"


def use_native(device_type: str) -> bool:
    """Whether a tensor on ``device_type`` goes through the C kernels (CPU tensors only).

    Example:
        >>> use_native("cuda")
        False
        >>> use_native("cpu") == (requested_engine() in (None, "native"))   # the CPU's default
        True
    """
    return device_type == "cpu" and active_engine("cpu") == "native"


__all__ = ["ENGINES", "ENV", "using", "check_engine", "active_engine", "requested_engine", "use_triton", "use_native", "triton_available",
           "interpreting"]
