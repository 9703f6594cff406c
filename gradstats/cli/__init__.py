"""The ``gradstats`` command line. Each subcommand lives in its own module of this package
and exposes ``register(subparsers)``; the module names are listed in ``COMMANDS``.

Building the parser imports no heavy module (torch, numpy, pandas, scipy, matplotlib): ``register``
only declares arguments, each command imports what it needs when it runs, and choices that live
in a heavy module are :class:`LazyChoices`. So ``gradstats --help`` and ``gradstats info RUN``
start in a fraction of ``import torch`` (``bench/cli_startup.py``)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, Iterable, Iterator

#: subcommand modules of gradstats.cli, in the order shown by --help
COMMANDS = ["demo", "trace", "info", "fit", "recommend", "export", "report", "figures", "what_if", "tensorboard"]


class LazyChoices:
    """The ``choices`` of an argument, listed by ``source()`` on first use (a bad value, or the
    command's own ``--help``), so that declaring the argument imports nothing. Give the argument a
    ``metavar``: argparse lists the choices of one without it while the parser is built.

    Example:
        >>> calls = []
        >>> c = LazyChoices(lambda: calls.append(1) or ["a", "b"])
        >>> calls
        []
        >>> "b" in c, list(c), ", ".join(c), calls
        (True, ['a', 'b'], 'a, b', [1])
    """

    def __init__(self, source: Callable[[], Iterable[str]]) -> None:
        self._source = source
        self._names: list[str] | None = None

    def _list(self) -> list[str]:
        if self._names is None:
            self._names = list(self._source())
        return self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __contains__(self, name: object) -> bool:
        return name in self._list()

    def __len__(self) -> int:
        return len(self._list())


def build_parser() -> argparse.ArgumentParser:
    from gradstats import __version__

    parser = argparse.ArgumentParser(
        prog="gradstats",
        description="Statistics of neural gradients: trace, fit, analyse, plan, apply.")
    parser.add_argument("--version", action="version", version=f"gradstats {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"gradstats.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradstats`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():      # a warning logged under a progress bar gets its own line
            return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"gradstats {args.command}: error: {exc}", file=sys.stderr)
        return 2
