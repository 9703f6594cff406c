"""Near-lognormal, quantified: how far the neural gradients of each model and layer type are from
lognormal over training, and where that costs the lognormal's predictions.

Each model of the study at scale (``scale_study.PROTOCOL``: the CNN and ResNet-20 on full
Fashion-MNIST, the character transformer on Shakespeare) is trained from scratch with the tracer
keeping whole gradient tensors at five steps spread over the run (seed 0; the CNN one epoch,
ResNet-20 150 steps, the transformer 300 steps of its schedule). For every sampled (layer, step):

* the skewness and excess kurtosis of ln|g| over the non-zero entries (a lognormal has 0 and 0);
* the threshold error: the expected sparsity that stochastic pruning reaches at the threshold
  each rule sets for the targets 0.85 and 0.9, from the tensor itself (exact, no draw), minus the
  target, for the lognormal rule and for the histogram rule (from the tensor's statistics row);
* the format-error error: the relative MSE of rounding to e3m2fn (FP6) and e2m1fn (FP4) at the
  amax scale, predicted by the lognormal (``fpanalysis.expected_error`` from mu, sigma, the zero
  fraction, given the tensor's maximum) and by the histogram law (``fpanalysis.predict_from_stats``), against the measured
  one (``quantize`` of the tensor), as log2 of predicted over measured.

Grouped by model and layer type: median and extremes over layers and steps; the worst
(layer, step) of the lognormal, and the histogram rule's error there.

    python experiments/near_lognormal.py [--quick] [--out DIR]

Writes ``near_lognormal.json`` to ``--out`` (default ``experiments/results``).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from _accuracy import RESULTS, environment, write_json  # noqa: E402
from _common import log_shape  # noqa: E402
from scale_study import PROTOCOL, QUICK  # noqa: E402

import gradstats  # noqa: E402

STEPS = {"cnn": 469, "resnet20": 150, "transformer": 300}
TARGETS = (0.85, 0.9)
FORMATS = ("e3m2fn", "e2m1fn")


def layer_type(model: torch.nn.Module, name: str) -> str:
    """conv, linear, attention (q/k/v/out projections) or mlp (a transformer block's fc layers);
    the output layer is typed "output" by the caller."""
    mod = dict(model.named_modules())[name]
    if type(mod).__name__.startswith("Conv") and type(mod).__name__ != "Conv1D":
        return "conv"
    if ".attn." in name or name.endswith("_proj"):
        return "attention"
    if name.startswith("blocks."):
        return "mlp"
    return "linear"


def expected_sparsity(g: torch.Tensor, threshold: float) -> float:
    """The expected fraction of zeros after stochastic pruning at ``threshold`` (values below it
    become 0 with probability 1 - |x|/threshold, the rest are kept): exact, from the tensor."""
    a = g.abs().double().flatten()
    below = a < threshold
    return float(((a == 0) | below).double().mul(torch.where(a == 0, 1.0, 1.0 - a / threshold)).mean())


def measure(g: torch.Tensor) -> dict:
    """The shape of ln|g|, the two rules' threshold errors and the two laws' format-error errors."""
    from gradstats import pruning
    from gradstats.fpanalysis import expected_error, predict_from_stats
    from gradstats.stats import lognormal_moments, tensor_stats
    from gradstats.stats.law import tensor_scale

    st = tensor_stats(g)
    mu, sigma = lognormal_moments(st)
    p0 = st["n_zero"] / st["n"]
    out = log_shape(g)
    for t in TARGETS:
        for rule in ("lognormal", "histogram"):
            if rule == "lognormal":
                thr = float(pruning.threshold(t, mu=mu, sigma=sigma, p0=p0, threshold_rule="lognormal"))
            else:
                thr = float(pruning.threshold(t, st, threshold_rule="histogram"))
            out[f"miss_{rule}_{t}"] = expected_sparsity(g, thr) - t
    energy = float(g.double().pow(2).sum())
    for name in FORMATS:
        fmt = gradstats.FPFormat.parse(name)
        s = tensor_scale(fmt, "amax", float(st["max_abs"]))
        q = gradstats.quantize(g, fmt, scale=s)
        measured = float((q.double() - g.double()).pow(2).sum()) / energy if energy else math.nan
        ln = float(expected_error(fmt, mu=mu, sigma=sigma, scale=s, p0=p0, amax=float(st["max_abs"]),
                                  numel=st["n"]).total)
        hist = float(predict_from_stats(st, fmt, scale="amax")["rel_mse"])
        out[f"mse_{name}"] = measured
        out[f"err_lognormal_{name}"] = math.log2(ln / measured) if measured > 0 and ln > 0 else math.nan
        out[f"err_histogram_{name}"] = math.log2(hist / measured) if measured > 0 and hist > 0 else math.nan
    return out


def run_model(model: str, steps: int, proto: dict, workdir: Path) -> pd.DataFrame:
    from gradstats.zoo.training import prepare

    torch.set_num_threads(1)
    task = prepare(model, seed=0, **proto["prepare"])
    sample_steps = sorted({int(round(f * (steps - 1))) for f in (0.02, 0.25, 0.5, 0.75, 1.0)})
    path = workdir / model
    with gradstats.trace(task.model, path, every=sample_steps, sample_every=sample_steps, samples=None,
                         seed=0) as tracer:
        task.run(steps, **{"schedule": "cosine", "progress": False, **proto["train"]},
                 callback=lambda step, loss: tracer.step())
    run = gradstats.open_run(path)
    idx = run.sample_index()
    idx = idx[idx["kind"] == "grad"][["layer", "step"]].drop_duplicates()
    matmul = set(gradstats.Plan.uniform(output_layer=False).resolve(task.model))     # every plannable layer
    output = matmul - set(gradstats.Plan.uniform().resolve(task.model))
    rows = []
    for layer, step in idx.itertuples(index=False):
        if layer not in matmul:
            continue
        g = run.samples(layer, int(step))
        if int((g != 0).sum()) < 1000:
            continue
        rows.append({"model": model, "layer": layer, "type": "output" if layer in output else layer_type(task.model, layer), "step": int(step),
                     **measure(g)})
    return pd.DataFrame(rows)


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and layer type: the shape of ln|g| (median, range) and the median |error| of each
    rule and law, over layers and steps."""
    rows = []
    for (model, typ), g in df.groupby(["model", "type"], sort=False):
        r = {"model": model, "type": typ, "tensors": len(g),
             "skew_median": float(g["skew"].median()), "skew_min": float(g["skew"].min()),
             "skew_max": float(g["skew"].max()), "kurt_median": float(g["kurt"].median()),
             "kurt_min": float(g["kurt"].min()), "kurt_max": float(g["kurt"].max())}
        for rule in ("lognormal", "histogram"):
            r[f"miss_{rule}"] = float(pd.concat([g[f"miss_{rule}_{t}"] for t in TARGETS]).abs().median())
            r[f"err_{rule}"] = float(pd.concat([g[f"err_{rule}_{f}"] for f in FORMATS]).abs().median())
        rows.append(r)
    return pd.DataFrame(rows)


def worst(df: pd.DataFrame) -> pd.DataFrame:
    """Per model: the (layer, step) where the lognormal's threshold misses most, with its shape and
    the histogram rule's miss there; and likewise for the format error."""
    rows = []
    for model, g in df.groupby("model", sort=False):
        miss = pd.concat([g[f"miss_lognormal_{t}"].abs() for t in TARGETS], axis=1).max(axis=1)
        i = miss.idxmax()
        r = g.loc[i]
        t = max(TARGETS, key=lambda t: abs(r[f"miss_lognormal_{t}"]))
        rows.append({"model": model, "what": f"threshold at {t}", "layer": r["layer"], "step": int(r["step"]),
                     "skew": r["skew"], "kurt": r["kurt"], "lognormal": r[f"miss_lognormal_{t}"],
                     "histogram": r[f"miss_histogram_{t}"]})
        err = pd.concat([g[f"err_lognormal_{f}"].abs() for f in FORMATS], axis=1).max(axis=1)
        j = err.idxmax()
        r = g.loc[j]
        f = max(FORMATS, key=lambda f: abs(r[f"err_lognormal_{f}"]) if r[f"err_lognormal_{f}"] == r[f"err_lognormal_{f}"] else -1)
        rows.append({"model": model, "what": f"{f} relative MSE (log2 pred/meas)", "layer": r["layer"],
                     "step": int(r["step"]), "skew": r["skew"], "kurt": r["kurt"],
                     "lognormal": r[f"err_lognormal_{f}"], "histogram": r[f"err_histogram_{f}"]})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps (the tests)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    frames = []
    with tempfile.TemporaryDirectory(prefix="gradstats-nearln-") as tmp:
        for model in PROTOCOL:
            proto = {**PROTOCOL[model], **(QUICK[model] if args.quick else {})}
            steps = 4 if args.quick else STEPS[model]
            frames.append(run_model(model, steps, proto, Path(tmp)))
    df = pd.concat(frames, ignore_index=True)
    summary, worst_rows = summarise(df), worst(df)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    write_json(out / "near_lognormal.json", {
        "command": "python experiments/near_lognormal.py" + (" --quick" if args.quick else ""),
        "steps": STEPS, "targets": TARGETS, "formats": FORMATS, "seeds": [0],
        "wall_s": round(time.perf_counter() - t0, 1), "environment": environment(),
        "summary": summary.to_dict("records"), "worst": worst_rows.to_dict("records"),
        "tensors": df.to_dict("records")})
    return summary


if __name__ == "__main__":
    main()
