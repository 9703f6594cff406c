"""``gradstats report RUN -o DIR [--layers PATTERN ...]``: fit every layer, thresholds,
recommended formats, plans, figures and ``report.md`` for any run
(:func:`gradstats.report.report`); layers without statistics and groups that cannot be fitted
are noted in the output, never fatal."""
from __future__ import annotations

import argparse


def _floats(text: str) -> list[float]:
    try:
        return [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="analyse a run: fits, thresholds, formats, plans, figures, report.md",
                       description="Fit every traced layer of a run, derive the pruning thresholds for the "
                                   "target sparsities and the recommended formats per bit width, write the "
                                   "plans (plan.json and plans/), the tables, the figures and report.md "
                                   "into the output directory, and print the per-layer summary.")
    p.add_argument("run", help="run directory written by gradstats trace (or gradstats.trace)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="output directory")
    p.add_argument("--sparsity", type=_floats, default=[0.85, 0.9],
                   help="target sparsities, comma list (default 0.85,0.9; the first goes into plan.json)")
    p.add_argument("--bits", type=_ints, default=[8, 6, 4],
                   help="format widths, comma list (default 8,6,4; the first goes into plan.json)")
    p.add_argument("--layers", nargs="+", metavar="PATTERN",
                   help="traced layers to analyse: names, globs or 're:REGEX' (the tracer's layers= patterns; "
                        "default: all)")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are drawn on a terminal only; GRADSTATS_PROGRESS=1 draws them anywhere)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradstats.report import report

    rep = report(args.run, args.output, sparsities=args.sparsity, bits=args.bits, figures=not args.no_figures,
                 progress=not args.no_progress, layers=args.layers)
    print(rep)
    return 0
