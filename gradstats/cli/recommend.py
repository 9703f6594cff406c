"""``gradstats recommend RUN --bits 8 [--sparsity 0.85] -o plan.json``: a per-layer plan from a run."""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Iterable

from gradstats.formats import PREDICTED_ROUNDINGS
from gradstats.noise import NOISE_BOUND


def _bits(text: str) -> list[int] | list[str]:
    if text.strip().lower() == "auto":
        return ["auto"]
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits takes an int, a comma list of ints or 'auto', got {text!r}") from None


def _step(text: str):
    """'120' -> 120; '100:199' -> range(100, 200) (inclusive); 'last' -> 'latest'."""
    if text in ("last", "latest"):
        return "latest"
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            return range(int(lo), int(hi) + 1)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step takes an int, FIRST:LAST or 'last', got {text!r}") from None


def _ok(v) -> bool:
    return v is not None and v == v and v > 0


def _log2(v) -> float:
    return math.log2(v) if _ok(v) else float("nan")


def granularity_arg(text: str) -> str | int:
    """A granularity name or a block size, read by :func:`gradstats.fpanalysis.granularity.granularity_layout`."""
    from gradstats.fpanalysis.granularity import granularity_layout
    from gradstats.plan.recommend import granularity_recipe

    g = int(text) if text.strip().isdigit() else text.strip()
    try:
        granularity_layout(granularity_recipe(g)[0])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return g


def add_what_if_granularity(p: argparse.ArgumentParser, what: str) -> None:
    """``--granularity NAME|N`` and its shorthand ``--block N`` for the what-if predictions of a command
    (read back by :func:`what_if_granularity`)."""
    p.add_argument("--granularity", type=granularity_arg, default=None, metavar="NAME|N",
                   help=f"where {what} scales live: tensor (default), mx (blocks of 32, E8M0 scales), "
                        "nvfp4 (blocks of 16, E4M3 scales) or a block size N (E8M0 scales)")
    p.add_argument("--block", type=int, default=None, metavar="N", help="the same as --granularity N")


def what_if_granularity(args: argparse.Namespace) -> str | int | None:
    """The granularity :func:`add_what_if_granularity`'s options give (a ``ValueError`` for both)."""
    if args.granularity is not None and args.block is not None:
        raise ValueError("give --granularity or --block (its shorthand for blocks of N), not both")
    return args.granularity if args.block is None else args.block


def _one_of(source: Callable[[], Iterable[str]], what: str) -> Callable[[str], str]:
    """An argument type that accepts the names ``source()`` lists (imported when the option is given,
    so that ``--help`` imports nothing heavy) and refuses any other, naming them."""
    def check(text: str) -> str:
        names = list(source())
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; expected one of {names}")
        return text

    check.__name__ = what
    return check


def _threshold_rules() -> tuple[str, ...]:
    from gradstats.plan import THRESHOLD_RULES

    return THRESHOLD_RULES


def _objectives() -> tuple[str, ...]:
    from gradstats.fpanalysis import OBJECTIVES

    return OBJECTIVES


def _format_rules() -> tuple[str, ...]:
    from gradstats.plan.recommend import FORMAT_RULES

    return FORMAT_RULES


def _candidates(text: str):
    """A preset or convention name ('ocp', 'any', ...) as it is; otherwise a comma list of format or
    scheme names (a scheme, e.g. nvfp4, kept as its name: it sets the granularity)."""
    from gradstats.fpanalysis import CANDIDATE_NAMES
    from gradstats.scheme import Scheme

    if text in CANDIDATE_NAMES:
        return text
    names = [s.strip() for s in text.split(",") if s.strip()]
    try:
        fmts = [Scheme.parse(n) for n in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or one of {', '.join(CANDIDATE_NAMES)}") from None
    if not fmts:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CANDIDATE_NAMES)} or a comma list of "
                                         f"formats, got {text!r}")
    return [str(f) for f in fmts]


def _sparsity(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a sparsity in [0, 1) or 'auto', got {text!r}") from None


def _noise_bound(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive noise ratio or 'none', got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "recommend", help="recommend a per-layer plan (format, scale, pruning) from a run",
        description="Recommend per layer the floating-point format, scale and (with --sparsity) pruning "
                    "threshold rule for the neural gradients of a traced run, print it as a table and "
                    "optionally save it as a plan file (docs/plan-format.md).")
    p.add_argument("run", help="run directory")
    p.add_argument("--bits", type=_bits, default=[8],
                   help="format width, a comma list (then -o needs '{bits}' in its name), or 'auto': per layer the "
                        "fewest bits the noise bound allows (default 8)")
    p.add_argument("--sparsity", type=_sparsity, default=None,
                   help="target gradient sparsity in [0, 1), a ceiling the noise bound lowers per layer where "
                        "needed; 'auto': the most the noise bound allows")
    p.add_argument("--noise-bound", type=_noise_bound, default=NOISE_BOUND, metavar="R|none",
                   help="largest noise ratio the plan (pruning, rounding, and what later layers send back) may add "
                        "to any planned layer's weight gradient, against "
                        f"SGD's own minibatch noise (default {NOISE_BOUND}; docs/noise.md); "
                        "none: not bounded")
    p.add_argument("--granularity", type=granularity_arg, default="tensor", metavar="NAME|N",
                   help="tensor (default), mx (blocks of 32, E8M0 scales), nvfp4 (blocks of 16, E4M3 scales), "
                        "nvfp4_training (nvfp4 with stochastic rounding and a 16-point random Hadamard transform, "
                        "NVIDIA's NVFP4 training recipe) or a block size N (blocks of N, E8M0 scales)")
    p.add_argument("--rounding", default=None, choices=list(PREDICTED_ROUNDINGS),
                   help="force one rounding (default: per layer, what the objective chooses)")
    p.add_argument("--threshold-rule", default=None, metavar="RULE", type=_one_of(_threshold_rules, "threshold rule"),
                   help="pruning threshold rule, one of gradstats.plan.THRESHOLD_RULES (default histogram: "
                        "model-free, the most accurate)")
    p.add_argument("--objective", default="training", metavar="OBJECTIVE", type=_one_of(_objectives, "objective"),
                   help="training (default): least noise within a bound on the magnitude bias; "
                        "mse: least relative mean squared error")
    p.add_argument("--all-layers", action="store_true",
                   help="plan the output layer (the logits) too; by default it stays in full precision")
    p.add_argument("--prune-everywhere", action="store_true",
                   help="with --sparsity, prune every planned layer; by default only the layers whose "
                        "output feeds a BatchNorm (the study's placement) when the model has any")
    p.add_argument("--steps", "--step", dest="steps", type=_step, default=None,
                   help="statistics of step N, of steps FIRST:LAST merged, or 'last' (each layer's latest "
                        "step); default: gradstats.recommend's, up to four steps spread over the run (1/4, "
                        "1/2, 3/4 and the end of the steps holding samples), which the plan is also "
                        "checked on")
    p.add_argument("--layers", default=None,
                   help="comma list of layer names/globs (default: every traced matmul layer: convolutions, "
                        "linear layers, attention, LSTM/GRU/RNN and registered types; --all-layers for the "
                        "output layer)")
    p.add_argument("--format-rule", "--model", dest="format_rule", default="lognormal",
                   metavar="RULE", type=_one_of(_format_rules, "format rule"),
                   help="choose formats from each layer's lognormal fit or from its binade histogram "
                        "(more accurate on real gradients; per-tensor scales only)")
    p.add_argument("--candidates", type=_candidates, default="ocp", metavar="PRESET|LIST",
                   help="formats to choose from: ocp (default: the formats hardware has, FP8 e4m3fn/e5m2, "
                        "FP6 e2m3fn/e3m2fn, FP4 e2m1fn), torchao or te (what torchao's or Transformer "
                        "Engine's recipes use at this granularity: per tensor FP8 only; mx, nvfp4 their "
                        "block formats), any (every exponent/mantissa split: research formats such as "
                        "e2m5fn), hardware, fn, ieee, fnuz (every split in that convention), or a comma "
                        "list of format names (e.g. e4m3fn,e5m2) or of schemes of one block layout "
                        "(e.g. mxfp8_e4m3,mxfp4 or nvfp4: they set the granularity)")
    p.add_argument("-o", "--out", default=None, help="write the plan (JSON) here")
    p.set_defaults(func=run)


def format_table(plan) -> str:
    """The plan's per-layer table as text (sigma and mu in log2 units, labelled)."""
    import pandas as pd

    from gradstats.formats import FPFormat
    from gradstats.plan import amax_scale

    df = plan.to_dataframe()
    rules = [plan.rule_of([e], "") for e in plan.entries]
    fmts = [r.format for r in rules]
    amax = [e.predicted.amax if e.predicted is not None else None for e in plan.entries]
    ln2 = math.log(2.0)
    out = pd.DataFrame({
        "layer": df["layer"],
        "format": df["format"].fillna("-"),
        "rounding": [r.rounding for r in rules],
        "mu_log2": df["mu"] / ln2,
        "sigma_log2": df["sigma"] / ln2,
        "p0": df["p0"],
        "log2_scale": [_log2(s) for s in df["predicted_scale"]],
        "log2_floor": [_log2(amax_scale(f, a)) if isinstance(f, FPFormat) and _ok(a) and _ok(s) else float("nan")
                       for f, a, s in zip(fmts, amax, df["predicted_scale"])],
        "pred_error": df["predicted_error"],
        "pred_bias": [e.predicted.bias if e.predicted is not None and e.predicted.bias is not None
                      else float("nan") for e in plan.entries],
        "snr_db": [-10 * math.log10(e) if e == e and e is not None and e > 0 else float("nan")
                   for e in df["predicted_error"]],
    })
    if plan.defaults.sparsity is not None:
        out["threshold"] = df["predicted_threshold"]
        out["pred_sparsity"] = df["predicted_sparsity"]
    if plan.noise:
        if plan.defaults.sparsity is not None:
            out["sparsity"] = df["sparsity"]
            out["why"] = df["sparsity_reason"]
        out["noise_R"] = df["predicted_noise"]
    with pd.option_context("display.width", 200, "display.max_rows", 1000):
        text = out.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-")
    d = plan.defaults
    head = (f"scale rule {d.scale}"
            + (f" (blocks of {d.block_size}, {d.scale_format} scales)" if d.block_size else "")
            + f", rounding {d.rounding}"
            + (f", sparsity {d.sparsity} ({d.threshold_rule} threshold)" if d.sparsity is not None else ""))
    foot = ("mu_log2, sigma_log2: mean and std of log2|g| (non-zero entries); log2_scale: the scale at "
            "which pred_error = E[(Q(g)-g)^2]/E[g^2] (snr_db = -10 log10 of it) and pred_bias = "
            "E[|Q(g)|-|g|]/E|g| are predicted, pruning and rounding together; log2_floor: the amax scale "
            "(scale rule amax: the plan's scale is log2_scale - log2_floor binades from it at every step)")
    if plan.noise:
        if d.sparsity is not None:
            foot += ("; sparsity: granted (requested " + f"{d.sparsity}" + ")"
                     + (f", within the noise bound {plan.noise_bound}" if plan.noise_bound is not None else ""))
        foot += ("; noise_R: the noise the whole plan is predicted to add to the layer's weight gradient, "
                 "relative to SGD's own minibatch noise (docs/noise.md)")
    out_text = f"{head}\n{text}\n{foot}"
    if plan.checks:
        from gradstats.plan.checks import format_checks

        steps = plan.checks[0].get("calibration_steps", [])
        out_text += (f"\n\nchecked on calibration steps {steps}: predicted from each step's statistics / replayed "
                     "on its stored samples (the exact operator, the plan's seed); means over the steps, the later "
                     "ones weighted more; flushed: share of the non-zero values; gain: <out, g>/<g, g>; bias: "
                     "E[|out|-|g|]/E|g|; below a row, what failed at the step named, or why the layer's first choice "
                     "was replaced (that rule's numbers at that step)\n"
                     + format_checks(plan.checks))
    return out_text


def recommend_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`gradstats.recommend` (other than ``bits``) that the options ask for.
    An option left out is not passed, so the library's own default applies: the command makes the
    plan ``gradstats.recommend(run, **recommend_kwargs(args))`` makes."""
    kw: dict[str, Any] = {
        "sparsity": args.sparsity, "granularity": args.granularity, "rounding": args.rounding,
        "threshold_rule": args.threshold_rule, "format_rule": args.format_rule, "candidates": args.candidates,
        "objective": args.objective, "noise_bound": args.noise_bound,
        "layers": [s for s in args.layers.split(",") if s] if args.layers else None}
    if args.steps is not None:
        kw["steps"] = args.steps
    if args.all_layers:
        kw["output_layer"] = False
    if args.prune_everywhere:
        kw["prune_at"] = False
    return kw


def run(args: argparse.Namespace) -> int:
    from gradstats.plan.recommend import recommend, recommend_each

    if len(args.bits) > 1 and args.out and "{bits}" not in args.out:
        raise ValueError("with several --bits, -o needs '{bits}' in the file name (e.g. plan-{bits}.json)")
    if args.bits == ["auto"]:
        plans = {"auto": recommend(args.run, bits="auto", **recommend_kwargs(args))}
    else:
        plans = recommend_each(args.run, bits=args.bits, **recommend_kwargs(args))
    for b, plan in plans.items():
        print(f"== {b}-bit plan for {args.run}")
        storage = plan.storage()
        if storage is not None:
            print(f"{storage['mean_bits']:.2f} bits per gradient value over the planned layers, "
                  f"{100 * storage['saved_fraction']:.0f}% of their 16-bit gradient bytes saved")
        print(format_table(plan))
        if plan.output_layer:
            print(f"output layer {plan.output_layer} left in full precision and unpruned "
                  "(--all-layers plans it too)")
        if plan.prune_at and plan.defaults.prunes:
            from gradstats.run import open_run

            where = plan.pruned_layers_of(open_run(args.run))
            if where is not None:
                print(f"pruned where the gradient enters a BatchNorm: {', '.join(where)} "
                      "(--prune-everywhere prunes every planned layer)")
        if args.out:
            path = args.out.replace("{bits}", str(b))
            plan.save(path)
            print(f"plan written to {path}")
    return 0
