"""Threshold rules on real neural gradients: achieved vs target sparsity per rule and layer type.

Traces a short real training of four built-in models -- the CNN with BatchNorm, ResNet-20 and
the MLP on Fashion-MNIST, the character-level transformer on Shakespeare -- keeping whole
gradient tensors (``samples=None``) of every layer at three steps: 0 (initialisation), the
middle and the last step. Every tensor is filed under its layer type (the module's class:
``conv`` for Conv2d, ``attention`` for the q/k/v/output projections of the attention blocks,
``linear`` for the other Linear layers; ``--all-layers`` adds ``norm`` for BatchNorm/LayerNorm
and ``embedding``) and phase (``init`` at step 0, ``training`` after). For every tensor and
target sparsity each threshold rule sets a threshold from that tensor:

  histogram        the default of threshold(S, row): model-free rule from the tensor's
                   statistics row (binade histogram, 64 largest |g| exactly, extremes): what a
                   traced run stores
  histogram4       the default of prune(g, S): the same rule at four bins per binade, counted
                   from the tensor in one sweep
  histogram_plain  the binade counts alone (no top values, bins at whole powers of two): the
                   histogram rule before it read the top values and extremes
  histogram_law    the same row read as the format analysis's law (fpanalysis HistogramLaw:
                   log-linear density within binades, the top values as atoms)
  lognormal        analytic rule from (mu, sigma, p0) of the tensor, conditioned on its maximum
                   and mean |g| (the study's closed form; exact above the maximum)
  lognormal_free   the same from (mu, sigma, p0) alone
  lognormal_skew   a near-lognormal correction: ln|g| as a Gram-Charlier series with the
                   tensor's own skewness and excess kurtosis of ln|g| (computed from the tensor;
                   a statistics row does not store them)
  naive_lognormal  lognormal quantile exp(mu + sigma Phi^-1(S)), ignores the rounding up
  normal           half-normal model, s^2 = E g^2 of the non-zero entries
  laplace          exponential model, b = E|g| of the non-zero entries
  exact            exact quantile (as exact_threshold), hard threshold (deterministic, biased)
  exact_stochastic the same exact quantile fed to the stochastic operator

and the stochastic operator (or the hard one, for ``exact``) is applied. The *achieved*
sparsity is the operator's expected fraction of exact zeros on that very tensor,
``(1/n) sum_{|g|<a} (1 - |g|/a)`` at the threshold rounded to the tensor's dtype (hard:
``(1/n) #{|g| < a}``), so small layers carry no Monte Carlo noise; the zero fraction of the
actual draw that ``prune(g, S)`` returns is also recorded (``achieved_draw``, rule
``histogram4``). Cases where the exact zeros alone reach the target (threshold 0) are left
out of the summaries.

    python experiments/pruning_real.py [--out DIR] [--results FILE] [--quick] [--fresh] [--all-layers]

Resumable: each model's rows are kept in ``DIR/pruning_real_<model>_<key>.csv`` (the key a hash
of the settings they were made with, which sit beside them) and reused by a later run with the
same settings; ``--fresh`` recomputes. About 8 minutes on 2 shared cores. Prints the table of
mean / max |achieved - target| per rule and layer type (the one in ``docs/pruning.md``), writes
``pruning_real.csv`` and the figure ``pruning_achieved_vs_target.png`` to ``DIR`` and the
summary to ``--results`` (``experiments/results/pruning_real.json``; with ``--quick``
``DIR/pruning_real_quick.json``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import layer_tensors, log_shape  # noqa: E402

from gradstats.pruning import prune, stochastic_prune, threshold
from gradstats.pruning.histogram import LogHistogram
from gradstats.stats import HIST_MIN_EXP, lognormal_moments, tensor_stats

#: (training steps, keyword arguments for prepare / run); whole tensors at 0, steps // 2, steps - 1
CONFIGS = {
    "cnn": dict(steps=120, prepare={}, run={}),
    "resnet20": dict(steps=24, prepare={}, run={"batch_size": 64}),
    "transformer": dict(steps=40, prepare={"d_model": 128, "n_layers": 4}, run={"batch_size": 16}),
    "mlp": dict(steps=200, prepare={}, run={}),
}
TARGETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
RULES = ("histogram", "histogram4", "histogram_plain", "histogram_law", "lognormal", "lognormal_free",
         "lognormal_skew", "naive_lognormal", "normal", "laplace", "exact", "exact_stochastic")
#: the rules of the table in docs/pruning.md
TABLE_RULES = ("histogram", "histogram4", "histogram_plain", "histogram_law", "lognormal", "lognormal_skew",
               "naive_lognormal", "normal", "laplace")
#: the layer types of the table (the layers evaluated by default), and the phases
TYPES = ("conv", "linear", "attention")
PHASES = ("init", "training")
#: one actual draw of the operator is recorded for these rules (prune's own output)
DRAW_RULES = ("histogram4",)
#: prepare() arguments that choose the data, not the model
_DATA_KW = ("data", "root", "source", "subset", "test_subset", "seed", "device")
#: the statistics the results are reported by
_STATS = ("mean_abs_error", "max_abs_error", "mean_error")


class SortedMagnitudes:
    """``|g|`` sorted (float64) with prefix sums: the operators' expected zero fraction at any
    threshold in O(log n)."""

    def __init__(self, g: torch.Tensor) -> None:
        self.v = g.detach().reshape(-1).abs().double().sort().values
        self.c = torch.cumsum(self.v, 0)
        self.n = self.v.numel()
        self.n_zero = self.n - int(torch.count_nonzero(self.v))

    def expected_zeros(self, a: float, stochastic: bool) -> float:
        """``(1/n) #{|g| < a}`` (hard) or ``(1/n) sum_{|g|<a} (1 - |g|/a)``; exact zeros when
        ``a = 0``."""
        if a == 0:
            return self.n_zero / self.n
        k = int(torch.searchsorted(self.v, torch.tensor([a], dtype=torch.float64))[0])
        if not stochastic:
            return k / self.n
        s = float(self.c[k - 1]) if k > 0 else 0.0
        return (k - s / a) / self.n


def layer_types(name: str, prepare_kw: dict | None = None) -> dict[str, str]:
    """Layer name -> type (``conv``, ``linear``, ``attention``, ``norm``, ``embedding``,
    ``other``) of a built-in model, from the class of each module (and of its parent, for the
    attention projections)."""
    from torch import nn

    from gradstats.zoo.models import build_model

    model = build_model(name, **{k: v for k, v in (prepare_kw or {}).items() if k not in _DATA_KW})
    out: dict[str, str] = {}
    for parent_name, parent in model.named_modules():
        for child_name, m in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(m, nn.Conv2d):
                out[full] = "conv"
            elif isinstance(m, nn.Linear):
                out[full] = "attention" if "Attention" in type(parent).__name__ else "linear"
            elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm)):
                out[full] = "norm"
            elif isinstance(m, nn.Embedding):
                out[full] = "embedding"
            else:
                out[full] = "other"
    return out


def plain_histogram(st: dict) -> LogHistogram:
    """The binade counts of a statistics row alone, bins at whole powers of two."""
    h = np.asarray(st["hist"], dtype=np.float64)
    e = np.arange(h.size) + HIST_MIN_EXP
    keep = np.flatnonzero(h > 0)
    h, e = h[keep[0]:keep[-1] + 1], e[keep[0]:keep[-1] + 1]
    return LogHistogram(h, np.exp2(e.astype(np.float64)), np.exp2(e + 1.0), int(st["n"]), int(st["n_zero"]))


class SkewLognormal:
    """``ln|g|`` of the non-zero entries as a Gram-Charlier series about the fitted normal, with
    the tensor's skewness and excess kurtosis (density clipped at 0 and renormalised), on a grid."""

    def __init__(self, st: dict, skew: float, kurt: float) -> None:
        mu, sigma = lognormal_moments(st)
        p0 = st["n_zero"] / st["n"]
        sk, ku = skew, kurt
        z = np.linspace(-12.0, 12.0, 12_001)
        f = np.exp(-z * z / 2) * (1 + sk / 6 * (z ** 3 - 3 * z) + ku / 24 * (z ** 4 - 6 * z * z + 3))
        f = np.maximum(f, 0.0)
        x = np.exp(mu + sigma * z)
        dz = z[1] - z[0]
        H = np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) / 2 * dz)])
        U = np.concatenate([[0.0], np.cumsum((f[1:] * x[1:] + f[:-1] * x[:-1]) / 2 * dz)])
        H, U = H / H[-1], U / H[-1]
        self.ln_a = mu + sigma * z
        self.s = p0 + (1 - p0) * (H - U / x)

    def threshold(self, target: float) -> float:
        k = int(np.clip(np.searchsorted(self.s, target), 1, self.s.size - 1))
        w = (target - self.s[k - 1]) / max(self.s[k] - self.s[k - 1], 1e-300)
        return math.exp(self.ln_a[k - 1] + w * (self.ln_a[k] - self.ln_a[k - 1]))


def zero_fraction(y: torch.Tensor) -> float:
    """Fraction of exact zeros of ``y``."""
    return (y.numel() - int(torch.count_nonzero(y))) / y.numel()


class LawThreshold:
    """Thresholds of the stochastic operator under :class:`gradstats.fpanalysis.histogram.HistogramLaw`
    of a statistics row (partial moments in closed form), on a log grid refined around the target."""

    def __init__(self, st: dict) -> None:
        from gradstats.fpanalysis.histogram import HistogramLaw

        self.law = HistogramLaw.from_stats(st)
        self.p0 = st["n_zero"] / st["n"]
        self.lo, self.hi = math.log(float(st["min_abs"])) - 1.0, math.log(float(st["max_abs"])) + 1.0

    def sparsity(self, la: np.ndarray) -> np.ndarray:
        a = np.exp(la)
        H = self.law.partial_moments(a, 0, np.zeros(1))[0]
        U = self.law.partial_moments(a, 1, np.zeros(1))[0]
        return self.p0 + (1 - self.p0) * (H - U / a)

    def threshold(self, target: float) -> float:
        if target <= self.p0:
            return 0.0
        lo, hi = self.lo, self.hi
        for _ in range(3):       # each pass narrows the bracket to one of 256 grid cells
            la = np.linspace(lo, hi, 257)
            s = self.sparsity(la)
            k = int(np.clip(np.searchsorted(s, target), 1, la.size - 1))
            lo, hi = la[k - 1], la[k]
        s0, s1 = self.sparsity(np.array([lo, hi]))
        w = (target - s0) / (s1 - s0) if s1 > s0 else 1.0
        return math.exp(lo + min(max(w, 0.0), 1.0) * (hi - lo))


def evaluate_tensor(g: torch.Tensor, targets=TARGETS, *, generator: torch.Generator,
                    shape: dict | None = None) -> list[dict]:
    """Rows (rule, target, threshold, achieved, achieved_draw) for one gradient tensor; ``shape``:
    its :func:`log_shape` (computed when not given)."""
    shape = shape or log_shape(g)
    st = tensor_stats(g)
    mu, sigma = lognormal_moments(st)
    p0 = st["n_zero"] / st["n"]
    sm = SortedMagnitudes(g)
    plain = plain_histogram(st)
    law = LawThreshold(st)
    skew = SkewLognormal(st, shape["skew"], shape["kurt"])
    rows = []
    for S in targets:
        # exact_threshold's quantile, read off the sorted magnitudes (no second selection)
        a_exact = float(sm.v[min(int(round(S * sm.n)), sm.n - 1)])
        for rule in RULES:
            y = None
            if rule in ("exact", "exact_stochastic"):
                a = a_exact
            elif rule == "histogram":
                a = float(threshold(S, st))                 # the default rule of a statistics row
            elif rule == "histogram4":
                y, a = prune(g, S, generator=generator, return_threshold=True)   # prune's default
            elif rule == "histogram_plain":
                a = plain.threshold(S)
            elif rule == "histogram_law":
                a = law.threshold(S)
            elif rule == "lognormal_skew":
                a = skew.threshold(S) if S > p0 else 0.0
            elif rule == "lognormal_free":
                a = float(threshold(S, threshold_rule="lognormal", mu=mu, sigma=sigma, p0=p0))
            else:
                a = float(threshold(S, st, threshold_rule=rule))
            sto = rule != "exact"
            # the operator rounds the threshold to the tensor's dtype first
            a32 = float(torch.tensor(min(a, float(torch.finfo(g.dtype).max)), dtype=g.dtype))
            draw = math.nan
            if rule in DRAW_RULES:
                if y is None:
                    y = stochastic_prune(g, a32, generator=generator)
                draw = zero_fraction(y)
            rows.append({"rule": rule, "target": S, "threshold": a,
                         "achieved": sm.expected_zeros(a32, sto), "achieved_draw": draw})
    return rows


def _settings(name: str, cfg: dict, targets, seed: int, types) -> dict:
    """What a model's rows depend on (the key of the kept rows)."""
    return {"model": name, "config": cfg, "targets": list(targets), "seed": seed, "rules": list(RULES),
            "types": None if types is None else list(types)}


def _cache_files(cache: Path, name: str, settings: dict) -> tuple[Path, Path]:
    """The kept rows of a model and their settings: one pair of files per model and settings."""
    import hashlib

    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return cache / f"pruning_real_{name}_{key}.csv", cache / f"pruning_real_{name}_{key}.json"


def _cached(cache: Path | None, name: str, settings: dict) -> tuple[pd.DataFrame, float] | None:
    """The kept rows of a model and the seconds they took, if made with ``settings``."""
    if cache is None:
        return None
    csv, meta = _cache_files(cache, name, settings)
    if csv.exists() and meta.exists():
        try:
            m = json.loads(meta.read_text())
            if m.get("settings") == json.loads(json.dumps(settings)):
                return pd.read_csv(csv), float(m.get("seconds", math.nan))
        except (OSError, ValueError):
            pass
    return None


def run_experiment(configs: dict = CONFIGS, *, workdir: str | Path | None = None, targets=TARGETS,
                   seed: int = 0, verbose: bool = True, cache: str | Path | None = None,
                   types=TYPES) -> pd.DataFrame:
    """Trace each configured model and evaluate every rule on every layer tensor of the given
    ``types`` (``None``: every layer, the norm and embedding layers too). ``cache``: a directory
    where each model's rows are kept and reused when made with the same settings."""
    cache = Path(cache) if cache is not None else None
    frames = []
    seconds = {}
    for name, cfg in configs.items():
        settings = _settings(name, cfg, targets, seed, types)
        got = _cached(cache, name, settings)
        if got is not None:
            if verbose:
                print(f"# {name}: reusing {_cache_files(cache, name, settings)[0]}", flush=True)
            frames.append(got[0])
            seconds[name] = got[1]
            continue
        t0 = time.perf_counter()
        steps = cfg["steps"]
        cfg = {**cfg, "sample_steps": cfg.get("sample_steps") or sorted({0, steps // 2, steps - 1})}
        kinds = layer_types(name, cfg.get("prepare"))
        gen = torch.Generator().manual_seed(seed)
        rows = []
        for model, layer, step, g in layer_tensors({name: cfg}, workdir, prefix="pruning_real_", min_nonzero=2,
                                                   seed=seed, verbose=verbose):
            kind = kinds.get(layer, "other")
            if types is not None and kind not in types:
                continue
            info = log_shape(g)
            rows += [{"model": model, "layer": layer, "type": kind, "step": step,
                      "phase": "init" if step == 0 else "training", **info, **r}
                     for r in evaluate_tensor(g, targets, generator=gen, shape=info)]
        df = pd.DataFrame(rows)
        seconds[name] = time.perf_counter() - t0
        if cache is not None:
            cache.mkdir(parents=True, exist_ok=True)
            csv, meta = _cache_files(cache, name, settings)
            df.to_csv(csv, index=False)
            meta.write_text(json.dumps({"settings": settings, "seconds": round(seconds[name], 1)}))
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    df["error"] = df["achieved"] - df["target"]
    # the exact zeros alone reach the target: every rule returns 0 and prunes nothing
    df["zeros_suffice"] = df["p0"] >= df["target"]
    df.attrs["seconds"] = seconds
    return df


def _stats(d: pd.DataFrame) -> dict:
    e = d["error"]
    return {"mean_abs_error": float(e.abs().mean()), "max_abs_error": float(e.abs().max()),
            "mean_error": float(e.mean()), "cases": int(len(d))}


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per rule, over the cases where pruning is needed (``p0 < target``): mean
    |achieved - target|, mean signed error, the fraction within 0.005, and the worst case."""
    out = []
    df = df[~df["zeros_suffice"]]
    for rule in RULES:
        d = df[df["rule"] == rule]
        if not len(d):
            continue
        worst = d.loc[d["error"].abs().idxmax()]
        out.append({"rule": rule, "mean_abs_error": float(d["error"].abs().mean()),
                    "mean_error": float(d["error"].mean()),
                    "within_0.005": float((d["error"].abs() <= 0.005).mean()),
                    "worst_error": float(worst["error"]),
                    "worst_case": f"{worst['model']}:{worst['layer']}@{worst['step']} S={worst['target']:g}"})
    return pd.DataFrame(out)


def by_type(df: pd.DataFrame, rules=RULES) -> pd.DataFrame:
    """Per rule, layer type and phase (and ``all`` layers): mean, max and mean signed
    |achieved - target| and the number of cases."""
    df = df[~df["zeros_suffice"]]
    out = []
    for rule in rules:
        d = df[df["rule"] == rule]
        if not len(d):
            continue
        for t in sorted(set(d["type"])) + ["all"]:
            dt = d if t == "all" else d[d["type"] == t]
            for ph in PHASES + ("all",):
                dp = dt if ph == "all" else dt[dt["phase"] == ph]
                if len(dp):
                    out.append({"rule": rule, "type": t, "phase": ph, **_stats(dp)})
    return pd.DataFrame(out)


def per_model(df: pd.DataFrame) -> pd.DataFrame:
    """Mean |achieved - target| per model and rule."""
    df = df[~df["zeros_suffice"]]
    return (df.assign(abs_error=df["error"].abs())
              .pivot_table(index="rule", columns="model", values="abs_error", aggfunc="mean")
              .reindex([r for r in RULES if r in set(df["rule"])]))


def markdown_table(df: pd.DataFrame, rules=TABLE_RULES) -> str:
    """The table of docs/pruning.md: per rule, mean / max |achieved - target| for each layer type
    at initialisation and in training, and over all layers."""
    bt = by_type(df, rules).set_index(["rule", "type", "phase"])
    cols = [(t, ph) for t in TYPES for ph in PHASES] + [("all", "all")]
    head = "| rule | " + " | ".join(f"{t}, {ph}" if t != "all" else "all layers" for t, ph in cols) + " |"
    lines = [head, "|---|" + "---:|" * len(cols)]
    for rule in rules:
        cells = []
        for c in cols:
            key = (rule, *c)
            if key in bt.index:
                r = bt.loc[key]
                cells.append(f"{r['mean_abs_error']:.4f} / {r['max_abs_error']:.4f}")
            else:
                cells.append("-")
        lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def misses(df: pd.DataFrame, rule: str = "histogram", tol: float = 0.005) -> pd.DataFrame:
    """Cases where ``rule`` misses its target by more than ``tol``, with diagnostics."""
    d = df[(df["rule"] == rule) & (df["error"].abs() > tol) & ~df["zeros_suffice"]]
    cols = ["model", "layer", "type", "step", "n", "p0", "sigma", "skew", "kurt", "target", "achieved",
            "error"]
    return d[cols].sort_values("error", key=np.abs, ascending=False)


def weighted(df: pd.DataFrame, phase: str = "training") -> pd.DataFrame:
    """Per rule and target, the achieved sparsity over the tensors of ``phase`` weighted by their
    element counts: the sparsity a whole network would see (zeros already present included)."""
    d = df[df["phase"] == phase]
    out = []
    for (rule, S), g in d.groupby(["rule", "target"]):
        out.append({"rule": rule, "target": float(S), "phase": phase,
                    "achieved": float((g["achieved"] * g["n"]).sum() / g["n"].sum())})
    return pd.DataFrame(out)


def results(df: pd.DataFrame, configs: dict, runtime_s: float) -> dict:
    """The summary written to experiments/results/pruning_real.json."""
    feas = df[~df["zeros_suffice"]]
    tensors = df[["model", "layer", "step"]].drop_duplicates()
    draw = feas[feas["rule"].isin(DRAW_RULES)]
    return {"experiment": "pruning_real", "configs": configs, "targets": sorted(set(df["target"])),
            "runtime_s": round(runtime_s, 1),
            "runtime_s_per_model": {k: round(v, 1) for k, v in df.attrs.get("seconds", {}).items()},
            "n_tensors": int(len(tensors)),
            "n_cases": int(len(feas[feas["rule"] == RULES[0]])),
            "tensors_per_type": {k: int(v) for k, v in
                                 df[df["rule"] == RULES[0]].drop_duplicates(["model", "layer", "step"])
                                 .groupby("type").size().items()},
            "by_type": by_type(df).to_dict("records"),
            "summary": summarize(df).to_dict("records"),
            "per_model": {r: {m: float(v) for m, v in row.items() if not pd.isna(v)}
                          for r, row in per_model(df).iterrows()},
            "draw_mean_abs_error": {r: float((d["achieved_draw"] - d["target"]).abs().mean())
                                    for r, d in draw.groupby("rule")},
            "weighted_by_elements": weighted(df).to_dict("records"),
            "table_markdown": markdown_table(df)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/out", help="directory for the CSVs and the figure")
    ap.add_argument("--results", default=None,
                    help="the summary JSON (default experiments/results/pruning_real.json; with --quick "
                         "DIR/pruning_real_quick.json)")
    ap.add_argument("--quick", action="store_true", help="a few steps per model (smoke test)")
    ap.add_argument("--fresh", action="store_true", help="recompute every model (ignore the kept rows)")
    ap.add_argument("--all-layers", action="store_true",
                    help="also the norm and embedding layers (by default conv, linear and attention)")
    args = ap.parse_args(argv)
    configs = {k: {**v, "steps": 6} for k, v in CONFIGS.items()} if args.quick else CONFIGS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    types = None if args.all_layers else TYPES
    t0 = time.perf_counter()
    if args.fresh:
        for name in configs:
            for f in _cache_files(out, name, _settings(name, configs[name], TARGETS, 0, types)):
                f.unlink(missing_ok=True)
    df = run_experiment(configs, cache=out, types=types)
    df.to_csv(out / "pruning_real.csv", index=False)
    runtime = sum(df.attrs["seconds"].values())
    pd.set_option("display.width", 220)
    pd.set_option("display.max_columns", 20)
    n_tensors = df[["model", "layer", "step"]].drop_duplicates().shape[0]
    n_zs = int(df[df["rule"] == RULES[0]]["zeros_suffice"].sum())
    print(f"\n{n_tensors} layer tensors x {len(TARGETS)} targets; achieved = expected zero "
          f"fraction of the operator on each tensor; {n_zs} (tensor, target) cases where the "
          "exact zeros alone reach the target (threshold 0, nothing pruned) are left out")
    print("\nMean / max |achieved - target| per rule and layer type:\n")
    print(markdown_table(df))
    print("\nPer rule (all models, layers, steps, targets):")
    print(summarize(df).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print("\nMean |achieved - target| per model:")
    print(per_model(df).to_string(float_format=lambda v: f"{v:.4f}"))
    feas = df[~df["zeros_suffice"] & df["rule"].isin(DRAW_RULES)]
    draw = feas.assign(e=(feas["achieved_draw"] - feas["target"]).abs()).groupby("rule")["e"].mean()
    print("\nOne actual draw of the operator, mean |achieved - target|:")
    print(draw.to_string(float_format=lambda v: f"{v:.4f}"))
    w = weighted(df)
    w = w[w["rule"].isin(TABLE_RULES)].pivot(index="rule", columns="target", values="achieved")
    print("\nAchieved sparsity in training, weighted by the tensors' element counts:")
    print(w.reindex([r for r in TABLE_RULES if r in w.index]).to_string(float_format=lambda v: f"{v:.4f}"))
    m = misses(df)
    print(f"\nDefault rule of a statistics row (histogram): {len(m)} of "
          f"{int(((df['rule'] == 'histogram') & ~df['zeros_suffice']).sum())} cases miss by more than 0.005:")
    if len(m):
        print(m.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    res = Path(args.results) if args.results else (
        out / "pruning_real_quick.json" if args.quick else Path(__file__).resolve().parent / "results" / "pruning_real.json")
    res.parent.mkdir(parents=True, exist_ok=True)
    res.write_text(json.dumps(results(df, configs, runtime), indent=1) + "\n")
    from gradstats.plots.pruning import plot_achieved_vs_target

    plot_achieved_vs_target(df[~df["zeros_suffice"] & (df["rule"] != "lognormal_skew")],
                            path=out / "pruning_achieved_vs_target.png",
                            title="Real gradients (CNN, ResNet-20, MLP on Fashion-MNIST; transformer on "
                                  "Shakespeare)")
    print(f"\nwrote {out / 'pruning_real.csv'}, {out / 'pruning_achieved_vs_target.png'} and {res} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
