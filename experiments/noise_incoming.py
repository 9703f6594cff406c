"""What later layers send back, predicted against measured, per layer: the noise a plan's other
layers add to one layer's weight gradient, apart from the noise its own operator adds.

The model and trace are ``noise_fidelity``'s (38 steps, the last eight with the model fixed: four
sampled steps and their pairs). For the plan (default ``recommend(bits="auto")``) and each chosen
layer ``l``, two plans are probed with :func:`gradstats.noise_probe` (8 batches x 2 draws) and
predicted with :func:`gradstats.predicted_noise`:

* *own*: ``l``'s operator alone (every other layer exact);
* *incoming*: every other layer's operator, ``l`` exact.

Each is compared as the variance added to ``l``'s weight gradient (ratio times minibatch noise, so
that the two estimates of the minibatch noise do not enter). The incoming part is predicted twice:
with the gains as :func:`gradstats.noise.gains` reads them (in the weight gradient) and with the
relative noise of the output gradient (the ``gain`` column of the run's ``noise_gain`` table, the
reading before 2026-12-07).

    python experiments/noise_incoming.py                       # ResNet-20, bits="auto", about 5 minutes
    python experiments/noise_incoming.py --model decoder --layers layers.0.q_proj layers.1.up_proj

Writes ``experiments/results/noise_incoming.{json,txt}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import noise_fidelity as nf  # noqa: E402

import gradstats  # noqa: E402
from gradstats.plan import PlanEntry  # noqa: E402
from gradstats.plan.noise_budget import bits_of  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def output_gains(path: Any) -> dict[tuple[str, str], float]:
    """The gains as the relative noise of the output gradient (the table's ``gain`` column)."""
    from gradstats.run import as_run

    df = as_run(path).table("noise_gain")
    df = df[df["step"] == df["step"].max()]
    return {(str(r["source"]), str(r["layer"])): float(r["gain"]) for r in df.to_dict("records")}


def added(path: str, plan, layer: str, sampled: list[int], model, batches, loss_fn) -> dict[str, float]:
    """``layer``'s predicted and measured added weight-gradient variance under ``plan``; the
    predicted one also with the output gradient's gains."""
    import gradstats.plan.noise_prediction as npred

    pred = gradstats.predicted_noise(path, plan, steps=sampled).to_dataframe().set_index("layer")
    reading = npred.gains
    npred.gains = output_gains          # the same prediction with the other reading of the gains
    try:
        old = gradstats.predicted_noise(path, plan, steps=sampled).to_dataframe().set_index("layer")
    finally:
        npred.gains = reading
    meas = gradstats.noise_probe(model, batches, plan, loss_fn, draws=2).to_dataframe().set_index("layer")
    return {"predicted": float(pred.loc[layer, "noise"] * pred.loc[layer, "minibatch"]),
            "predicted_output_gains": float(old.loc[layer, "noise"] * old.loc[layer, "minibatch"]),
            "measured": float(meas.loc[layer, "ratio"] * meas.loc[layer, "minibatch"])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20", choices=nf.MODELS + nf.EXTRA_MODELS)
    ap.add_argument("--plan", default="recommend(bits='auto')", choices=list(nf.ALL_PLANS))
    ap.add_argument("--layers", nargs="*", default=None,
                    help="default: the plan's layers at 8 bits per tensor (what later layers send back dominates)")
    ap.add_argument("--out", type=Path, default=RESULTS / "noise_incoming.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, path, sampled, batches, loss_fn = nf.calibrated(args.model, 38, 8)
    plan = nf.ALL_PLANS[args.plan](path)
    rules = plan.resolve(model)
    planned = [n for n, r in rules.items() if not r.is_identity]
    layers = args.layers or [n for n in planned if rules[n].format is not None and bits_of(rules[n]) == 8]
    rows = []
    for layer in layers:
        alone = plan.with_entries(*(PlanEntry(n, format=None, sparsity=None) for n in planned if n != layer))
        others = plan.with_entries(PlanEntry(layer, format=None, sparsity=None))
        own = added(path, alone, layer, sampled, model, batches, loss_fn)
        inc = added(path, others, layer, sampled, model, batches, loss_fn)
        rows.append({"layer": layer, "format": str(rules[layer].scheme) if rules[layer].format is not None else None,
                     "own": own, "incoming": inc})
        print(f"{layer:24s} own: predicted/measured {own['predicted'] / own['measured']:.2f}   incoming: "
              f"{inc['predicted'] / inc['measured']:.2f} (output-gradient gains: "
              f"{inc['predicted_output_gains'] / inc['measured']:.2f})", flush=True)
    payload = {"command": "python experiments/noise_incoming.py " + " ".join(argv or sys.argv[1:]),
               "model": args.model, "plan": args.plan, "probe": "8 batches x 2 draws", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    lines = [f"# What later layers send back: {args.model}, {args.plan} (added weight-gradient variance, "
             "predicted / measured)", "", f"{'layer':24s} {'own':>6s} {'incoming':>9s} {'(output gains)':>15s}"]
    lines += [f"{r['layer']:24s} {r['own']['predicted'] / r['own']['measured']:6.2f} "
              f"{r['incoming']['predicted'] / r['incoming']['measured']:9.2f} "
              f"{r['incoming']['predicted_output_gains'] / r['incoming']['measured']:15.2f}" for r in rows]
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return payload


if __name__ == "__main__":
    main()
