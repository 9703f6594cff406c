"""Which criterion predicts the accuracy a plan costs: the rank correlation, over the
configurations of ``recommend_accuracy.py``, between each candidate criterion and the accuracy
lost in training.

The criteria are measured on the CNN after the calibration run (50 plain steps, seed 0), on a
few fixed training batches, with each configuration's plan applied; stochastic rules are drawn
``--draws`` times per batch, so expectations and biases are separated from noise:

* predicted by the lognormal model at each call's running statistics (what ``apply`` records):
  the relative MSE of the neural gradient (``predicted_error``), its magnitude bias
  (``fpanalysis.expected_error(...).bias``) and the flushed fraction (``predicted_underflow``);
* measured on the neural gradient leaving each planned layer: relative MSE
  ``|Q(g) - g|^2 / |g|^2``, magnitude bias ``(sum|Q(g)| - sum|g|) / sum|g|`` and the fraction
  flushed;
* measured end to end on every weight gradient (all convolution and linear layers, planned or
  not): the relative MSE, the relative bias ``|E[dW_q] - dW| / |dW|`` (debiased for the draws'
  own noise) and the alignment ``|cos(w_c, dW_c)|`` of the layers feeding a BatchNorm
  (:func:`gradstats.fpanalysis.weight_gradient_alignment`; 0 exactly without compression);
* achieved in training: the underflow fraction over the 400 steps (from the accuracy jobs).

Each criterion is averaged over layers (magnitudes of biases), then ranked against the
accuracy loss (``-diff_mean`` of ``recommend_accuracy.json``) with Spearman's rho, over the
quantising configurations (pruning alone has no rounding criteria) and over all of them.

    python experiments/criteria_correlation.py [--quick] [--out DIR] [--batches N] [--draws N]

Reads ``recommend_accuracy.json`` in ``--out`` (run ``recommend_accuracy.py`` first; with
``--quick`` the losses are those of the quick run) and writes ``criteria_correlation.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from _accuracy import CALIBRATION_STEPS, QUICK_PREPARE, RESULTS, calibrate, environment, write_json  # noqa: E402
from recommend_accuracy import plans  # noqa: E402
from torch import nn  # noqa: E402

import gradstats  # noqa: E402
from gradstats.fpanalysis import batchnorm_inputs, expected_error, weight_gradient_alignment  # noqa: E402
from gradstats.zoo.training import prepare  # noqa: E402

CRITERIA = {
    "predicted_mse": "predicted relative MSE (neural gradient)",
    "predicted_bias": "predicted |magnitude bias| (neural gradient)",
    "predicted_flushed": "predicted flushed fraction",
    "mse": "measured relative MSE (neural gradient)",
    "bias": "measured |magnitude bias| (neural gradient)",
    "flushed": "measured flushed fraction",
    "wgrad_mse": "weight-gradient relative MSE",
    "wgrad_bias": "weight-gradient relative bias |E dW_q - dW| / |dW|",
    "bn_cos": "|cos(w_c, dW_c)| of the layers feeding a BatchNorm",
    "train_underflow": "underflow fraction achieved in training",
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, one batch, two draws (smoke test)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of recommend_accuracy.json and the output")
    ap.add_argument("--batches", type=int, default=4, help="fixed training batches of 128")
    ap.add_argument("--draws", type=int, default=8, help="draws of the stochastic rules per batch")
    a = ap.parse_args(argv)
    a.out = Path(a.out)
    if a.quick:
        a.batches, a.draws = 1, 2
    return a


def _weight_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    mods = dict(model.named_modules())
    return {n: mods[n].weight.grad.detach().clone().double() for n in _weight_layers(model)}


def _capture(model: nn.Module, names, into: dict[str, torch.Tensor]) -> list:
    """Forward hooks whose tensor hooks keep the gradient arriving at each named layer's output:
    registered before ``apply``'s they see the raw gradient, after it the compressed one (a
    tensor hook receives what the hooks registered before it returned)."""
    mods = dict(model.named_modules())

    def hook(name: str):
        def keep(g: torch.Tensor) -> None:
            into[name] = g.detach().double().clone()

        def fwd(m: nn.Module, i, o) -> None:
            o.register_hook(keep)
        return fwd
    return [mods[n].register_forward_hook(hook(n)) for n in names]


def measure(model: nn.Module, plan: gradstats.Plan, batches: list, draws: int, bn_layers: list[str],
            exact: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Every criterion but the achieved one, for one plan (means over layers and batches)."""
    out: dict[str, list[float]] = {k: [] for k in CRITERIA if k != "train_underflow"}
    planned = [n for n, r in plan.resolve(model).items() if not r.is_identity]
    for b, (x, y) in enumerate(batches):
        wgrads: list[dict[str, torch.Tensor]] = []
        for r in range(draws):
            raw: dict[str, torch.Tensor] = {}
            got: dict[str, torch.Tensor] = {}
            hooks = _capture(model, planned, raw)
            h = gradstats.apply(model, plan, seed=1000 * b + r, underflow_bound=None, sparsity_margin=None)
            hooks += _capture(model, planned, got)
            wgrads.append(_grads(model, x, y))
            for hk in hooks:
                hk.remove()
            h.remove()
            if bn_layers:
                a = weight_gradient_alignment(model, bn_layers)
                out["bn_cos"].append(float(np.mean([a.mean_abs_cos[n] for n in bn_layers])))
            for name in planned:                     # the layer's own rule: its output against its input
                g, q = raw[name], got[name]
                out["mse"].append(float((q - g).square().sum() / g.square().sum()))
                out["bias"].append(abs(float((q.abs().sum() - g.abs().sum()) / g.abs().sum())))
            for row in h.history:
                rule = h.rules[row["layer"]]
                if rule.quantizes and math.isfinite(row["scale"]) and math.isfinite(row["mu"]):
                    e = expected_error(rule.format, mu=row["mu"], sigma=max(row["sigma"], 1e-6),
                                       scale=row["scale"], rounding=rule.rounding, p0=row["p0"],
                                       amax=row["amax"], numel=row["n"])
                    out["predicted_bias"].append(abs(float(e.bias)))
                else:
                    out["predicted_bias"].append(0.0)
                pe = row["predicted_error"]
                out["predicted_mse"].append(float(pe) if math.isfinite(pe) else 0.0)
                out["predicted_flushed"].append(float(row["predicted_underflow"]))
                out["flushed"].append(float(row["underflow_fraction"]))
        for n in _weight_layers(model):              # end to end: every weight gradient
            dw = exact[b][n]
            d = torch.stack([w[n] for w in wgrads])
            mean = d.mean(0)
            mse = float(((d - dw) ** 2).sum(dim=tuple(range(1, d.dim()))).mean() / dw.square().sum())
            # |mean - dW|^2 carries the draws' own noise, var/draws: subtracted (unbiased)
            noise = float(((d - mean) ** 2).sum()) / (draws - 1) / draws if draws > 1 else 0.0
            bias2 = max(float((mean - dw).square().sum()) - noise, 0.0)
            out["wgrad_mse"].append(mse)
            out["wgrad_bias"].append(math.sqrt(bias2 / float(dw.square().sum())))
    return {k: float(np.mean(v)) if v else 0.0 for k, v in out.items()}


def spearman(table: pd.DataFrame, subset: pd.Series) -> dict[str, float]:
    from scipy.stats import spearmanr

    t = table[subset]
    return {k: float(spearmanr(t[k], t["loss"]).statistic) if t[k].nunique() > 1 else math.nan for k in CRITERIA}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse(argv)
    t0 = time.perf_counter()
    acc_path = args.out / "recommend_accuracy.json"
    if not acc_path.exists():
        raise SystemExit(f"{acc_path} is missing: run experiments/recommend_accuracy.py"
                         + (" --quick" if args.quick else "") + " first")
    acc = pd.DataFrame(json.loads(acc_path.read_text())["table"]).set_index("label")
    prep = QUICK_PREPARE if args.quick else {}
    steps = 3 if args.quick else CALIBRATION_STEPS
    calib = calibrate("cnn", prepare_kw=prep, steps=steps)
    torch.manual_seed(0)
    task = prepare("cnn", seed=0, **prep)
    task.run(steps, schedule="cosine", progress=False)          # the calibration run's model
    model = task.model
    n = len(task.train_data.labels)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.batches):
        idx = torch.randint(0, n, (128,), generator=g)
        batches.append((task.train_data.images[idx], task.train_data.labels[idx]))
    bn_layers = batchnorm_inputs(model, batches[0][0])
    exact = [_grads(model, x, y) for x, y in batches]
    rows = []
    from tqdm.auto import tqdm

    for label, info, plan in tqdm(plans("cnn", calib), desc="criteria"):
        if label not in acc.index:
            continue
        p = gradstats.Plan.from_dict(plan)
        quantizes = any(r.quantizes for r in p.resolve(model).values())
        crit = measure(model, p, batches, args.draws, bn_layers, exact)
        a = acc.loc[label]
        rows.append({"label": label, "kind": info["kind"], "quantizes": quantizes,
                     "loss": -float(a["diff_mean"]), "loss_se": float(a["diff_se"]),
                     **crit, "train_underflow": float(a["underflow"])})
    table = pd.DataFrame(rows)
    corr = pd.DataFrame([{"criterion": k, "description": CRITERIA[k],
                          "spearman_quantising": spearman(table, table["quantizes"])[k],
                          "spearman_all": spearman(table, table["loss"].notna())[k]} for k in CRITERIA])
    pd.set_option("display.width", 200)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(corr.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    write_json(args.out / "criteria_correlation.json", {
        "command": "python experiments/criteria_correlation.py" + (" --quick" if args.quick else ""),
        "batches": args.batches, "draws": args.draws, "calibration_steps": steps,
        "configurations": int(len(table)), "quantising": int(table["quantizes"].sum()),
        "wall_s": round(time.perf_counter() - t0, 1), "environment": environment(),
        "table": table.to_dict("records"), "correlation": corr.to_dict("records")})
    return corr


if __name__ == "__main__":
    main()
