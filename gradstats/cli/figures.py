"""``gradstats figures RUN -o DIR``: every figure of a run as PNG files
(:func:`gradstats.figures.write_figures`)."""
from __future__ import annotations

import argparse


def _names() -> list[str]:
    from gradstats.figures import FIGURES

    return list(FIGURES)


def register(sub: argparse._SubParsersAction) -> None:
    from gradstats.cli import LazyChoices

    p = sub.add_parser("figures", help="write every figure of a run as PNG files",
                       description="Draw the study's figures from a run (distributions, Q-Q, goodness of "
                                   "fit, statistics over training, pruning, formats) into a directory. "
                                   "What each shows: docs/figures.md.")
    p.add_argument("run", help="run directory")
    p.add_argument("-o", "--output", default="figures", metavar="DIR", help="output directory (default figures)")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=LazyChoices(_names),
                   help="write only these figures (%(choices)s)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn on a terminal only; GRADSTATS_PROGRESS=1 draws it anywhere)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradstats.figures import FIGURES, write_figures

    out = write_figures(args.run, args.output, only=args.only, progress=not args.no_progress)
    for name, path in out.items():
        print(f"{path}  {FIGURES[name][1]}")
    missing = [n for n in (args.only or FIGURES) if n not in out]
    if missing:
        print(f"not drawn for this run (see the warnings): {', '.join(missing)}")
    return 0
