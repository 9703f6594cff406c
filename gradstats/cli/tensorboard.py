"""``gradstats tensorboard RUN --logdir DIR``: a run's statistics as TensorBoard scalars and
histograms (:func:`gradstats.integrations.tensorboard.export_run`)."""
from __future__ import annotations

import argparse

from gradstats.cli.recommend import add_what_if_granularity, what_if_granularity
from gradstats.formats import PREDICTED_ROUNDINGS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensorboard", help="write a run's statistics to a TensorBoard log directory")
    p.add_argument("run", help="run directory")
    p.add_argument("--logdir", required=True, help="TensorBoard log directory (created)")
    p.add_argument("--formats", default=None, help="comma-separated formats whose what-if underflow and "
                                                  "overflow are logged too (e.g. e4m3fn,e5m2,e2m1fn)")
    add_what_if_granularity(p, "those what-if predictions'")
    p.add_argument("--rounding", default="nearest", choices=list(PREDICTED_ROUNDINGS))
    p.add_argument("--kinds", nargs="*", default=["grad"], help="kinds of tensors (default grad)")
    p.add_argument("--layers", nargs="*", default=None, help="names or globs (default every layer)")
    p.add_argument("--no-histograms", action="store_true", help="scalars only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradstats.integrations.tensorboard import export_run

    n = export_run(args.run, args.logdir, formats=args.formats, granularity=what_if_granularity(args), rounding=args.rounding,
                   kinds=args.kinds, layers=args.layers, histograms=not args.no_histograms)
    print(f"{n} scalars written to {args.logdir}; view with: tensorboard --logdir {args.logdir}")
    return 0
