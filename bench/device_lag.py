"""What the device path's lag costs: apply on the CPU's native engine (settings solved from the
current gradient, read in the backward pass) against the device path (settings solved from the
previous step's statistics and corrected on the device for the drift of the gradient's location,
nothing read back), on the same training.

Both train the same MLP (64-256-256-128-10, batch 64, SGD lr 0.05 with momentum, random data
with a fixed teacher) for ``--steps`` steps from the same initialisation with
``Plan.uniform(format="e4m3fn", sparsity=0.85, rounding="stochastic")``; per engine, over every
recorded call: the mean achieved sparsity, the mean absolute gap to the 0.85 target, the largest
gap, the mean fraction clipped at the format's maximum, and the mean magnitude gain. The device
path runs on the CPU through Triton's interpreter (``GRADSTATS_ENGINE=triton TRITON_INTERPRET=1``).

    python bench/device_lag.py [--steps 30]
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch
from torch import nn


def run(engine: str, steps: int):
    import gradstats

    if engine == "triton":
        os.environ["GRADSTATS_ENGINE"] = "triton"
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("GRADSTATS_ENGINE", None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.85, rounding="stochastic")
    with gradstats.apply(model, plan) as applied:
        for _ in range(steps):
            x = torch.randn(64, 64, generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1)).backward()
            opt.step()
    df = applied.to_dataframe()
    gap = (df["achieved_sparsity"] - 0.85).abs()
    return {"engine": engine, "calls": len(df), "achieved sparsity": df["achieved_sparsity"].mean(),
            "mean |gap|": gap.mean(), "max |gap|": gap.max(), "clipped": df["overflow_fraction"].mean(),
            "gain": df["gain"].mean()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    import pandas as pd

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rows = [run("native", args.steps), run("triton", args.steps)]
    print(f"apply, Plan.uniform(format='e4m3fn', sparsity=0.85, rounding='stochastic'), MLP, {args.steps} steps")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.4f}"))


if __name__ == "__main__":
    main()
