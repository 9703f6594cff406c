"""``gradstats what-if RUN --formats e4m3fn,e5m2,e2m1fn [--block 32]``: what each format would do to
every traced tensor, from the run's statistics alone (:func:`gradstats.what_if`)."""
from __future__ import annotations

import argparse

from gradstats.cli.recommend import add_what_if_granularity, what_if_granularity
from gradstats.formats import PREDICTED_ROUNDINGS
from gradstats.scheme import E4M3, PRESETS, scale_format_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("what-if", help="what formats would do to a run's gradients (underflow, overflow, "
                                       "error, bias), from its statistics")
    p.add_argument("run", help="run directory")
    p.add_argument("--formats", default="e4m3fn,e5m2,e2m1fn",
                   help=f"comma-separated format names or schemes (presets {', '.join(PRESETS)} bring their own "
                        "blocks; default e4m3fn,e5m2,e2m1fn)")
    add_what_if_granularity(p, "the plain formats'")
    p.add_argument("--rounding", default="nearest", choices=list(PREDICTED_ROUNDINGS))
    p.add_argument("--layers", nargs="*", default=None, help="names or globs (default every layer)")
    p.add_argument("--steps", type=int, nargs="*", default=None, help="steps (default every step)")
    p.add_argument("-o", "--out", default=None, help="write the full table here (.csv or .parquet)")
    p.add_argument("--figure", default=None, help="write per-format heat maps of the underflow here (.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    import gradstats

    df = gradstats.what_if(args.run, args.formats, granularity=what_if_granularity(args), rounding=args.rounding,
                           steps=args.steps, layers=args.layers)
    per_layer = (df.groupby(["layer", "format"], sort=False)[["underflow", "overflow", "rel_mse", "bias"]]
                 .median().reset_index())
    with pd.option_context("display.width", 160, "display.max_rows", 500):
        print(per_layer.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    layouts = df.drop_duplicates("format")
    scales = "; ".join(f"{r.format}: " + (f"{'NVFP4' if scale_format_of(r.scale_format) == E4M3 else 'MX'} blocks of {int(r.block_size)}"
                                          if pd.notna(r.block_size) else "per-tensor amax scale")
                       for r in layouts.itertuples())
    print(f"medians over {df['step'].nunique()} steps; fractions of the non-zero entries; {scales}; "
          f"{args.rounding} rounding")
    if args.out:
        (df.to_parquet if str(args.out).endswith(".parquet") else lambda p: df.to_csv(p, index=False))(args.out)
        print(f"table: {args.out}")
    if args.figure:
        from gradstats.plots.fpanalysis import plot_what_if

        plot_what_if(df, path=args.figure)
        print(f"figure: {args.figure}")
    return 0
