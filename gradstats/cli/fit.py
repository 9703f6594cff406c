"""``gradstats fit RUN``: fit every layer and step of a run; print which family wins per layer
and by how much, the median KS per family and the groups that could not be fitted (and why);
write all rows to Parquet."""
from __future__ import annotations

import argparse
import math
from typing import Sequence


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="fit lognormal/normal/Laplace per layer and step of a run",
                       description="Fit the non-zero gradient magnitudes of every selected layer and step "
                                   "(raw samples where the run has them, streamed statistics otherwise) "
                                   "and compare lognormal, half-normal (normal) and exponential (Laplace).")
    p.add_argument("run", help="run directory written by gradstats trace")
    p.add_argument("--layers", nargs="+", metavar="PATTERN",
                   help="layer names, globs or 're:REGEX' (the tracer's layers= patterns; default: all)")
    p.add_argument("--steps", nargs="+", metavar="STEP",
                   help="steps: integers and ranges START:STOP[:STEP] (STOP excluded; default: all)")
    p.add_argument("--kinds", nargs="+", default=["grad"], help="captured kinds to fit (default: grad)")
    p.add_argument("--stats-only", action="store_true", help="fit from streamed statistics even where samples exist")
    p.add_argument("--max-samples", type=int, default=None,
                   help="KS on a random subsample of this many values per group (default: exact KS on all)")
    p.add_argument("-o", "--output", metavar="PARQUET", help="write one row per layer, step, kind and family")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn on a terminal only; GRADSTATS_PROGRESS=1 draws it anywhere)")
    p.set_defaults(func=run)


def parse_steps(tokens: Sequence[str] | None, all_steps: Sequence[int]) -> list[int] | None:
    """Expand ``["0", "10:100:10", "7,8"]`` against the run's steps (None: all steps)."""
    if not tokens:
        return None
    have = sorted(int(s) for s in all_steps)
    want: set[int] = set()
    for tok in (t for tok in tokens for t in tok.split(",") if t):
        try:
            if ":" in tok:
                parts = [int(v) if v else None for v in tok.split(":")]
                if len(parts) > 3 or (len(parts) == 3 and parts[2] is not None and parts[2] <= 0):
                    raise ValueError
                sl = slice(*parts)
                lo = -math.inf if sl.start is None else sl.start
                hi = math.inf if sl.stop is None else sl.stop
                st, base = sl.step or 1, sl.start or 0
                want.update(s for s in have if lo <= s < hi and (s - base) % st == 0)
            else:
                want.add(int(tok))
        except ValueError:
            raise ValueError(f"bad --steps item {tok!r}: use integers or START:STOP[:STEP]") from None
    return sorted(want)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from gradstats import open_run
    from gradstats.fitting import failed_groups, failure_lines, fit_run, layer_verdicts

    r = open_run(args.run)
    steps = parse_steps(args.steps, r.steps)
    df = fit_run(r, layers=args.layers, steps=steps, kinds=args.kinds, use_samples=not args.stats_only,
                 max_samples=args.max_samples, progress=not args.no_progress)
    if args.output:
        df.to_parquet(args.output, index=False)
    failed = failed_groups(df)
    n_failed = int(failed["n_steps"].sum()) if len(failed) else 0
    v = layer_verdicts(df)
    v = v[v["groups"] > 0]
    if v.empty:
        print("no group could be fitted" + (f" (all rows are in {args.output}, see the status column)"
                                            if args.output else "") + ":")
        print("\n".join(failure_lines(failed)))
        return 1
    ks_cols = [c for c in ("ks_lognormal", "ks_normal", "ks_laplace") if c in v]
    with pd.option_context("display.width", 200, "display.max_rows", 1000, "display.float_format", "{:.4g}".format):
        print(v[["layer", "kind", "groups", "winner", "wins_lognormal", "wins_normal", "wins_laplace",
                 "margin_loglik", "vuong_effect", *ks_cols, "ks_from", "sigma"]].to_string(index=False))
    n_layers = len(v)
    n_ln = int((v["winner"] == "lognormal").sum())
    ok = df[df.status == "ok"]
    src = ok.drop_duplicates(["layer", "step", "kind"])["source"].value_counts().to_dict()
    parts = []
    for label, sel in (("exact KS (samples)", ok["ks_method"].isin(["exact", "subsample"])),
                       ("KS bound midpoints (statistics)", ok["ks_method"] == "hist")):
        if sel.any():
            meds = ", ".join(f"{c[3:]} {ok[sel & (ok.family == c[3:])]['ks'].median():.4g}" for c in ks_cols)
            parts.append(f"{label}: {meds}")
    print(f"lognormal wins {n_ln} of {n_layers} fitted layer(s) (majority over steps); median KS per family, "
          + "; ".join(parts))
    print(f"groups fitted from samples: {src.get('samples', 0)}, from statistics: {src.get('stats', 0)}; "
          "margin_loglik = median (best - runner-up) mean log-likelihood per value; vuong_effect = median z/sqrt(n) "
          "(samples only); KS from statistics is the midpoint of its proven bounds")
    if n_failed:
        print(f"{n_failed} group(s) could not be fitted (their rows have NaN numbers and this status):")
        print("\n".join(failure_lines(failed)))
    if args.output:
        print(f"wrote {len(df)} rows to {args.output}")
    return 0
