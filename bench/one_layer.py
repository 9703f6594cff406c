"""One layer's floats through the formulas apply's refresh runs on every step: microseconds per call.

    python bench/one_layer.py [--repeats 21] [--against DIR] [--only SUBSTRING ...]

Rows: the threshold rules on one layer's floats (``THRESHOLD_RULES[...].threshold``, what the refresh
solves), ``gradstats.pruning.threshold`` and ``expected_sparsity`` for one layer (their array path),
``fpanalysis.optimal_scale`` on one layer's floats, and ``fpanalysis.composed.predict_one`` on one
layer's floats (the refresh's predictions). Each row: the median over ``--repeats`` rounds of the mean
time of a batch of calls sized to about 20 ms.

``--against DIR``: a second checkout of the package (e.g. ``git worktree add /tmp/before <commit>``)
loaded into the same process; every round times both, one after the other, so that load on the
machine falls on both alike. Its column comes first, with the ratio this tree / that one.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any, Callable

HERE = str(Path(__file__).resolve().parents[1])


def load(root: str) -> dict[str, Any]:
    """The package at ``root``, imported afresh: its modules (``sys.modules`` entries)."""
    for k in [k for k in sys.modules if k == "gradstats" or k.startswith("gradstats.")]:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        import gradstats  # noqa: F401
        import gradstats.fpanalysis.composed  # noqa: F401
        import gradstats.pruning.rules  # noqa: F401
    finally:
        sys.path.remove(root)
    if not gradstats.__file__.startswith(root):
        raise SystemExit(f"{root}: imported gradstats from {gradstats.__file__}")
    logging.getLogger("gradstats").setLevel(logging.ERROR)
    return {k: v for k, v in sys.modules.items() if k == "gradstats" or k.startswith("gradstats.")}


def cases(mods: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The timed calls, on the package ``mods``."""
    pruning, rules = mods["gradstats.pruning"], mods["gradstats.pruning.rules"]
    fa, composed = mods["gradstats.fpanalysis"], mods["gradstats.fpanalysis.composed"]
    FP = mods["gradstats.formats"].FPFormat
    R, LS = rules.THRESHOLD_RULES, rules.LayerStats
    e4, e2 = FP.parse("e4m3fn"), FP.parse("e2m1fn")
    ln, lna = LS(mu=-10.0, sigma=2.0), LS(mu=-10.0, sigma=2.0, p0=0.1, amax=1e-2, mean_abs=1e-5)
    sn, sl = LS(scale_normal=1e-4), LS(scale_laplace=1e-4)
    po = composed.predict_one
    return {
        "rule lognormal threshold, floats": lambda: R["lognormal"].threshold(0.9, ln),
        "rule lognormal threshold, floats, amax": lambda: R["lognormal"].threshold(0.9, lna),
        "rule normal threshold, floats": lambda: R["normal"].threshold(0.9, sn),
        "rule laplace threshold, floats": lambda: R["laplace"].threshold(0.9, sl),
        "rule lognormal expected_sparsity, floats": lambda: R["lognormal"].expected_sparsity(1e-4, lna),
        "pruning.threshold, one layer": lambda: pruning.threshold(0.9, mu=-10.0, sigma=2.0),
        "pruning.threshold, one layer, laplace": lambda: pruning.threshold(0.9, scale=1e-4, threshold_rule="laplace"),
        "pruning.expected_sparsity, one layer": lambda: pruning.expected_sparsity(1e-4, mu=-10.0, sigma=2.0),
        "optimal_scale e4m3fn, floats": lambda: fa.optimal_scale("e4m3fn", mu=-9.0, sigma=1.5),
        "optimal_scale e2m1fn, floats": lambda: fa.optimal_scale("e2m1fn", mu=-9.0, sigma=1.0),
        "predict_one e4m3fn, no pruning": lambda: po(e4, "nearest", -9.0, 1.5, 0.0, 0.0, 2.0 ** 7),
        "predict_one e4m3fn, pruned, amax, numel": lambda: po(e4, "nearest", -9.0, 1.5, 0.1, 1e-5, 2.0 ** 7, 0.05, 4096.0),
        "predict_one e2m1fn stochastic, pruned": lambda: po(e2, "stochastic", -9.0, 1.5, 0.0, 1e-5, 2.0 ** 9),
        "predict_one no format, pruned": lambda: po(None, "nearest", -9.0, 1.5, 0.0, 1e-5, 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--against", metavar="DIR", help="another checkout, timed in the same rounds")
    ap.add_argument("--only", nargs="+", default=None, help="rows whose name contains one of these")
    args = ap.parse_args(argv)
    trees = ([("against", str(Path(args.against).resolve()))] if args.against else []) + [("this", HERE)]
    mods = {name: load(root) for name, root in trees}
    calls = {name: cases(m) for name, m in mods.items()}
    rows = [r for r in calls["this"] if not args.only or any(o in r for o in args.only)]
    head = " | ".join(f"{name} (us)" for name, _ in trees) + (" | this / against" if args.against else "")
    print(f"| call | {head} |")
    print("|---" * (len(trees) + 1 + bool(args.against)) + "|")
    for row in rows:
        timed = {}
        for name, _ in trees:
            sys.modules.update(mods[name])
            f = calls[name][row]
            f()
            n = 1
            while timeit.timeit(f, number=n) < 0.02:
                n *= 2
            timed[name] = (f, n, [])
        for _ in range(args.repeats):
            for name, _ in trees:
                f, n, xs = timed[name]
                sys.modules.update(mods[name])         # lazy imports inside the calls find their own tree
                xs.append(timeit.timeit(f, number=n) / n * 1e6)
        med = {name: statistics.median(timed[name][2]) for name, _ in trees}
        cells = " | ".join(f"{med[name]:.2f}" for name, _ in trees)
        ratio = f" | {med['this'] / med['against']:.2f}" if args.against else ""
        print(f"| {row} | {cells}{ratio} |", flush=True)
    print(f"\nmedians of {args.repeats} rounds" + (", the two trees interleaved in each" if args.against else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
