"""Progress bars that a person watching sees, and logs that a person reading finds clean.

Every progress bar of the package comes from :func:`progress_bar`. The bar is drawn when its
stream is a terminal, or inside a Jupyter kernel (where it redraws in place); anywhere else
(``gradstats demo > log.txt``, CI, a pipe) it is hidden, so the output holds no bar redraws, and
the stage says once, through ``logging`` at INFO, what it is doing. The environment variable
``GRADSTATS_PROGRESS`` overrides the choice: ``1`` draws bars on any stream, ``0`` hides them
everywhere; a call's own ``progress=False`` always hides its bar.

Example:
    >>> import io
    >>> bar = progress_bar(total=3, desc="count", progress=True, file=io.StringIO())  # not a terminal
    >>> bar.shown
    False
    >>> for _ in range(3):
    ...     bar.update()
    >>> bar.close()
"""
from __future__ import annotations

import logging
import os
import sys
from types import TracebackType
from typing import IO, Any, Iterable, Iterator, Optional

log = logging.getLogger("gradstats")

#: the environment variable that overrides where bars are drawn: 1 (always), 0 (never), auto
ENV = "GRADSTATS_PROGRESS"

_ON = ("1", "true", "yes", "on", "always")
_OFF = ("0", "false", "no", "off", "never")


def show_progress(progress: bool = True, stream: Optional[IO[str]] = None) -> bool:
    """Whether a progress bar on ``stream`` (default ``sys.stderr``, where tqdm draws) is drawn:
    never when ``progress`` is False; else as ``GRADSTATS_PROGRESS`` says when it is set to ``1``
    or ``0``; else when the stream is a terminal or the code runs in a Jupyter kernel.

    Example:
        >>> import io
        >>> class Terminal(io.StringIO):
        ...     def isatty(self):
        ...         return True
        >>> show_progress(False, Terminal())     # progress=False: hidden whatever the stream or GRADSTATS_PROGRESS
        False
        >>> show_progress(True, io.StringIO())   # not a terminal (GRADSTATS_PROGRESS unset): hidden
        False
    """
    if not progress:
        return False
    env = os.environ.get(ENV, "").strip().lower()
    if env in _ON:
        return True
    if env in _OFF:
        return False
    if env not in ("", "auto"):
        log.warning("%s=%r is not one of 1, 0 or auto: progress bars are drawn on a terminal only",
                    ENV, os.environ[ENV])
    if _in_jupyter_kernel():
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):      # no isatty, or a closed stream
        return False


def _in_jupyter_kernel() -> bool:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class Progress:
    """A progress bar, drawn or hidden (:attr:`shown`); made by :func:`progress_bar`.

    The methods are those of a tqdm bar that the package uses, plus :meth:`stage`, which names
    the part of the work now running: the bar's postfix when drawn, one INFO line when hidden.
    """

    def __init__(self, bar: Any, shown: bool, desc: str, logger: logging.Logger) -> None:
        self.bar = bar
        self.shown = shown
        self.desc = desc
        self.logger = logger

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n``."""
        self.bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        """Show ``key=value`` pairs after the bar (nothing when hidden)."""
        if self.shown:
            self.bar.set_postfix(**values)

    def stage(self, text: str) -> None:
        """Say which part of the work runs now: after the bar when drawn, else logged at INFO.

        Example:
            >>> import io, logging
            >>> lines = io.StringIO()
            >>> logger = logging.Logger("doc")             # a logger of its own, not registered
            >>> logger.addHandler(logging.StreamHandler(lines))
            >>> bar = progress_bar(total=2, desc="analyse", unit="stage", file=io.StringIO(), logger=logger)
            >>> bar.stage("fit")         # a hidden bar: one INFO line
            >>> bar.close()
            >>> lines.getvalue().splitlines()
            ['analyse: 2 stages', 'analyse: fit']
        """
        if self.shown:
            self.bar.set_postfix_str(text)
        else:
            self.logger.info("%s: %s", self.desc, text)

    def close(self) -> None:
        """Remove the bar (as tqdm's ``leave`` says)."""
        self.bar.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.bar)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()


def progress_bar(iterable: Optional[Iterable[Any]] = None, *, total: Optional[int] = None, desc: str,
                 unit: str = "it", progress: bool = True, note: Optional[str] = None, leave: bool = False,
                 logger: Optional[logging.Logger] = None, file: Optional[IO[str]] = None) -> Progress:
    """A tqdm bar (``tqdm.auto``) over ``iterable`` or ``total`` units, drawn when
    :func:`show_progress` says so. When hidden, it logs ``note`` (default: ``desc`` and the
    count) once at INFO on ``logger`` (default the ``gradstats`` logger), so that a log still
    says what the long stage is doing.

    Args:
        iterable: what to iterate over (``for x in progress_bar(xs, ...)``), or None with ``total``.
        total: the number of units (default ``len(iterable)`` where it has one).
        desc: the bar's label, e.g. ``"train SmallCNN"``.
        unit: the name of one unit (``"step"``, ``"group"``).
        progress: False hides the bar whatever the stream (a ``--no-progress`` option).
        note: what a hidden bar logs instead, e.g. ``"training SmallCNN for 300 steps"``.
        leave: keep the finished bar on screen.
        logger: where a hidden bar's note and stages go.
        file: the bar's stream (default ``sys.stderr``).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> [x for x in progress_bar(range(3), desc="squares", file=out)], out.getvalue()
        ([0, 1, 2], '')
    """
    from tqdm.auto import tqdm

    shown = show_progress(progress, file)
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    logger = log if logger is None else logger
    bar = tqdm(iterable, total=total, desc=desc, unit=unit, disable=not shown, leave=leave, file=file)
    if not shown:
        if note is None:
            note = desc if total is None else f"{desc}: {total:,} {unit}{'' if total == 1 else 's'}"
        logger.info("%s", note)
    return Progress(bar, shown, desc, logger)
