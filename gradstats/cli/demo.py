"""``gradstats demo``: the main job on a built-in default (what ``make demo`` runs)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: trace the built-in small CNN on Fashion-MNIST and summarise",
                       description="Train the built-in small CNN on Fashion-MNIST (the full set when the "
                                   "Debian package is installed, else the committed subset) with the tracer "
                                   "attached, then print the run's per-layer summary.")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="demo-out/run", help="run directory (default demo-out/run)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from gradstats.cli import main

    if Path(args.out).exists():
        shutil.rmtree(args.out)
    return main(["trace", "--model", "cnn", "--data", "fashion-mnist", "--steps", str(args.steps),
                 "--every", "1", "--sample-every", "50", "--out", args.out])
