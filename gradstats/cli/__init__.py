"""The ``gradstats`` command line. Each subcommand lives in its own module of this package
and exposes ``register(subparsers)``; the module names are listed in ``COMMANDS``."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: subcommand modules of gradstats.cli, in the order shown by --help
COMMANDS = ["demo", "trace", "info", "fit", "recommend", "export", "report", "figures", "what_if", "tensorboard"]


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
