"""``gradstats tensorboard RUN --logdir DIR``: a run's statistics as TensorBoard scalars and
histograms (:func:`gradstats.integrations.tensorboard.export_run`)."""
from __future__ import annotations

import argparse

from gradstats.cli.recommend import granularity_arg
from gradstats.formats import PREDICTED_ROUNDINGS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensorboard", help="write a run's statistics to a TensorBoard log directory")
    p.add_argument("run", help="run directory")
    p.add_argument("--logdir", required=True, help="TensorBoard log directory (created)")
    p.add_argument("--formats", default=None, help="comma-separated formats whose what-if underflow and "
                                                  "overflow are logged too (e.g. e4m3fn,e5m2,e2m1fn)")
    p.add_argument("--granularity", type=granularity_arg, default=None, metavar="NAME|N",
                   help="where those what-if predictions' scales live: mx, nvfp4, or blocks of N (default: per tensor)")
    p.add_argument("--block", type=int, default=None, metavar="N", help="the same as --granularity N")
    p.add_argument("--rounding", default="nearest", choices=list(PREDICTED_ROUNDINGS))
    p.add_argument("--kinds", nargs="*", default=["grad"], help="kinds of tensors (default grad)")
    p.add_argument("--layers", nargs="*", default=None, help="names or globs (default every layer)")
    p.add_argument("--no-histograms", action="store_true", help="scalars only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradstats.integrations.tensorboard import export_run

    if args.granularity is not None and args.block is not None:
        raise ValueError("give --granularity or --block (its shorthand for blocks of N), not both")
    granularity = args.granularity if args.block is None else args.block
    n = export_run(args.run, args.logdir, formats=args.formats, granularity=granularity, rounding=args.rounding,
                   kinds=args.kinds, layers=args.layers, histograms=not args.no_histograms)
    print(f"{n} scalars written to {args.logdir}; view with: tensorboard --logdir {args.logdir}")
    return 0
