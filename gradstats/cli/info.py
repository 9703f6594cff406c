"""``gradstats info RUN``: layers, steps, sizes and a per-layer summary of a run."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="print a run's layers, steps, sizes and per-layer summary")
    p.add_argument("run", help="run directory")
    p.add_argument("--kind", default="grad", help="grad, act, weight or wgrad (default grad)")
    p.set_defaults(func=run)


def _size(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def print_info(r, kind: str = "grad") -> None:
    """Print the summary of an opened run; damage found on the way is printed once, at the end."""
    import warnings

    from gradstats.run import RunDamageWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDamageWarning)     # listed below, once each
        _print_info(r, kind)
    for p in r.problems:
        print(f"warning: {p}")


def _print_info(r, kind: str) -> None:
    import pandas as pd

    m = r.manifest
    steps = r.steps
    span = f"{steps[0]}..{steps[-1]} ({len(steps)} captured)" if steps else "none yet"
    idx = r.sample_index()
    print(f"run {r.path}: {m['model_class']} ({m['model_params']:,} parameters), gradstats "
          f"{m['gradstats_version']}, torch {m['torch_version']}, world size {m['world_size']}")
    print(f"steps {span}; sampled steps {sorted(idx['step'].unique().tolist())[:10]}"
          f"{' ...' if idx['step'].nunique() > 10 else ''}; {_size(r.path) / 1e6:.2f} MB on disk")
    held = sorted(r.stats()["kind"].unique().tolist()) if r.steps else []
    if held and kind not in held:
        raise ValueError(f"the run holds no {kind!r} statistics: it has {', '.join(map(repr, held))} "
                         f"(gradstats trace --kinds chooses what is captured); pass --kind {held[0]}")
    s = r.summary(kind=kind)
    s["output_shape"] = s["output_shape"].map(lambda v: "x".join(map(str, v)) if v else "-")
    with pd.option_context("display.width", 160, "display.max_rows", 500, "display.float_format", "{:.3f}".format):
        print(s.drop(columns=["last_mean_log2", "last_std_log2"]).to_string(index=False))
    print("zero_fraction, mean_log2, std_log2: medians over steps of the zero fraction and of the mean "
          f"and std of log2|{kind}| over non-zero entries")


def run(args: argparse.Namespace) -> int:
    import gradstats

    print_info(gradstats.open_run(args.run), kind=args.kind)
    return 0
