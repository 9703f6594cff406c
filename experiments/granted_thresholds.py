"""Does a bounded plan export the threshold it enforces? The default ``recommend`` against ``apply``.

``recommend(calibration, sparsity=0.85)`` (and ``sparsity="auto"``), the noise bound at its
default, lowers each layer's sparsity below the request where the bound needs it. The plan then
predicts, and ``plan.export("json")`` hands to other training code, a per-layer pruning threshold.
This check applies each plan for a few steps and compares, per planned layer, the exported
threshold with the median threshold ``apply`` set over the layer's calls (and, for contrast, with
the threshold of the *requested* sparsity, which the plans exported before the noise bound's
granted sparsity was carried into it), and the predicted sparsity with the achieved one.

    python experiments/granted_thresholds.py [--models lstm resnet20] [--steps 60] [--quick]

Prints one line per model and request; writes nothing.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from _accuracy import calibrate  # noqa: E402
from noise_study import CALIBRATION_STEPS, PROTOCOL, QUICK, SAMPLE_EVERY  # noqa: E402

REQUESTS = (0.85, "auto")


def check(model: str, steps: int, quick: bool) -> pd.DataFrame:
    """Per request, the exported threshold over the applied one (median, min, max over layers),
    the same for the requested sparsity's threshold, and the predicted and achieved sparsity."""
    import torch

    import gradstats
    from gradstats.zoo.training import prepare

    proto = {**PROTOCOL[model], **(QUICK[model] if quick else {})}
    calib = calibrate(model, prepare_kw=proto["prepare"], steps=proto.get("calibration_steps", CALIBRATION_STEPS),
                      train_kw=proto["train"], sample_every=proto.get("sample_every", SAMPLE_EVERY))
    rows = []
    for asked in REQUESTS:
        plan = gradstats.recommend(calib, sparsity=asked)
        exported = plan.export("json")["layers"]
        unbounded = gradstats.recommend(calib, sparsity=0.99 if asked == "auto" else asked, noise_bound=None)
        requested = {e.layer: e.predicted.threshold for e in unbounded.entries}
        torch.manual_seed(0)
        task = prepare(model, seed=0, **proto["prepare"])
        applied = gradstats.apply(task.model, plan, seed=0)
        try:
            task.run(steps, **{"schedule": "cosine", "progress": False, **proto["train"]})
            calls = applied.to_dataframe()
        finally:
            applied.remove()
        now, before, pred, got = [], [], [], []
        for layer, g in calls.groupby("layer", sort=False):
            if exported[layer]["threshold"] is None:
                continue
            a = float(g["threshold"].median())
            now.append(exported[layer]["threshold"] / a)
            before.append(requested[layer] / a)
            pred.append(exported[layer]["predicted"]["sparsity"])
            got.append(float((g["achieved_sparsity"] * g["n"]).sum() / g["n"].sum()))
        pruned = sum(1 for r in plan.resolve(task.model).values() if r.prunes)
        rows.append({"model": model, "sparsity": repr(asked), "layers": len(now), "pruned layers": pruned,
                     **_spread("exported / applied", now), **_spread("requested's / applied", before),
                     "predicted sparsity": round(float(np.mean(pred)), 3),
                     "achieved sparsity": round(float(np.mean(got)), 3)})
    return pd.DataFrame(rows)


def _spread(name: str, v: list[float]) -> dict[str, float]:
    """The median of a ratio over the layers and its range."""
    return {name: float(np.median(v)), f"{name}, min": min(v), f"{name}, max": max(v)}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["lstm", "resnet20"], choices=list(PROTOCOL))
    ap.add_argument("--steps", type=int, default=60, help="training steps under each plan")
    ap.add_argument("--quick", action="store_true", help="tiny models and data (smoke test)")
    args = ap.parse_args(argv)
    logging.getLogger("gradstats").setLevel(logging.ERROR)    # the plans' alerts are not the question here
    table = pd.concat([check(m, args.steps, args.quick) for m in args.models], ignore_index=True)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return table


if __name__ == "__main__":
    main()
