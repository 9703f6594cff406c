"""Do four-bit block plans do what they say? NVFP4 and MX plans on models no test tunes for.

For a MobileNetV2-style CNN (Fashion-MNIST; conv outputs 14, 7 and 4 wide), a ``transformers``
GPT-NeoX and a Mamba from tiny configs (Shakespeare characters), and a ConvNeXt-style CNN of our own
(depthwise 7x7 convolutions, GroupNorm): trace 30 steps with samples every 5th, then **freeze** the
model (learning rate 0: nothing drifts) and for each four-bit plan of ``recommend(run, bits=4, ...)``
with its defaults (``granularity="nvfp4"``, ``"mx"`` and the NVFP4 training recipe ``"nvfp4_training"``),
four bits on every layer (``noise_bound=None``: the plans as the width makes them, which the
whole-plan noise bound would widen in places),

1. ``plan.verify(run)``: the plan passes its own check on its calibration steps;
2. apply it for 6 steps, with probes that read each planned layer's gradient before and after the
   plan's operator (tensor hooks registered before and after apply's): per layer apply's flushed and
   clipped fractions (its in-kernel counts, mean over calls) against the plan's predictions, and the
   gain ``<out, g> / <g, g>`` measured by the probes against the plan's predicted gain.

A layer passes when flushed and clipped are within ``max(0.5 x predicted, 0.01)`` of the plan's
prediction, the gain within 0.01 of the plan's and within 0.02 of 1.

    python experiments/four_bit_fidelity.py              # all models, about 5 minutes on 2 cores
    python experiments/four_bit_fidelity.py --quick      # the MobileNet only, fewer steps

Writes experiments/results/four_bit_fidelity.json and prints the per-layer tables.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradstats  # noqa: E402
from gradstats.zoo.models import MobileNetV2Tiny  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_fidelity import ConvNeXtTiny, run_applied  # noqa: E402  (the probes and the ConvNeXt of that study)

log = logging.getLogger("four_bit_fidelity")
RESULTS = Path(__file__).resolve().parent / "results" / "four_bit_fidelity.json"
#: the four-bit plans themselves, on every layer (``noise_bound=None``: the whole-plan noise bound
#: would give some layers a wider format, which is not what this measures)
PLANS = {"nvfp4": dict(bits=4, granularity="nvfp4", noise_bound=None),
         "mx": dict(bits=4, granularity="mx", noise_bound=None),
         "nvfp4_training": dict(bits=4, granularity="nvfp4_training", noise_bound=None)}


# --------------------------------------------------------------------------- models
def gpt_neox(vocab: int) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=128, intermediate_size=512,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256))


def mamba(vocab: int) -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=128, state_size=16, num_hidden_layers=2,
                                        expand=2, conv_kernel=4, use_mambapy=False))


def workload(name: str):
    """(model, optimizer, loss of one step's batch) for a model name."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name in ("mobilenet", "convnext"):
        from gradstats.zoo.data import load_fashion_mnist

        data = load_fashion_mnist(split="train", source="subset", subset=2000)
        model: nn.Module = MobileNetV2Tiny() if name == "mobilenet" else ConvNeXtTiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def loss() -> torch.Tensor:
            i = torch.randint(0, len(data.labels), (64,), generator=gen)
            return nn.functional.cross_entropy(model(data.images[i]), data.labels[i])
        return model, opt, loss
    from gradstats.zoo.text import load_shakespeare

    text = load_shakespeare()
    model = gpt_neox(text.vocab_size) if name == "gpt_neox" else mamba(text.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss() -> torch.Tensor:
        x, y = text.get_batch(16, 64, generator=gen)
        logits = model(x).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return model, opt, loss


def within(got: float, pred: float | None) -> bool:
    if pred is None or not math.isfinite(pred):
        return False
    return abs(got - pred) <= max(0.5 * pred, 0.01)


def above(got: float, pred: float | None) -> bool:
    """More than the plan's bound above its prediction (apply's block_band; no prediction: above 0.01)."""
    p = pred if pred is not None and math.isfinite(pred) else 0.0
    return got > p + max(0.5 * p, 0.01)


def measure(name: str, steps: int, apply_steps: int, train_steps: int) -> dict:
    model, opt, loss = workload(name)
    path = tempfile.mkdtemp(prefix=f"fourbit-{name}-")
    with gradstats.trace(model, path, sample_every=5) as t:
        for _ in range(steps):
            opt.zero_grad()
            loss().backward()
            opt.step()
            t.step()
    lrs = [g["lr"] for g in opt.param_groups]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    for g in opt.param_groups:            # frozen: nothing drifts between calibration and apply
        g["lr"] = 0.0
    out = {"model": name, "plans": {}}
    for label, kw in PLANS.items():
        plan = gradstats.recommend(path, **kw)
        v = plan.verify(path)
        vt = v.per_layer()
        rules = plan.resolve(model)
        names = [n for n, r in rules.items() if not r.is_identity]
        applied, seen = run_applied(model, opt, loss, plan, names, apply_steps)
        hist = applied.to_dataframe()
        layers = []
        for n in names:
            rule = rules[n]
            pairs = seen.get(n, [])
            gin = [g for k, g in pairs if k == "in"]
            gout = [g for k, g in pairs if k == "out"]
            dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(gin, gout))
            nrm = sum(float((a.double() ** 2).sum()) for a in gin)
            h = hist[hist["layer"] == n]
            p = rule.predicted
            row = {"layer": n, "rule": rule.describe(),
                   "flushed": float(h["underflow_fraction"].mean()), "predicted_flushed": getattr(p, "flushed", None),
                   "clipped": float(h["overflow_fraction"].mean()), "predicted_clipped": getattr(p, "overflow", None),
                   "gain": dot / nrm if nrm else math.nan, "predicted_gain": getattr(p, "gain", None),
                   "running_predicted_flushed": float(h["predicted_underflow"].mean()),
                   "alerts": sorted(applied.alerts.get(n, {})),
                   "verify_ok": bool(vt.loc[vt["layer"] == n, "ok"].all()) if n in set(vt["layer"]) else True}
            if not rule.quantizes:       # kept in full precision by the check: nothing to compare
                row["ok"] = True
            else:
                pg = row["predicted_gain"]
                row["ok"] = (within(row["flushed"], row["predicted_flushed"])
                             and within(row["clipped"], row["predicted_clipped"])
                             and pg is not None and abs(row["gain"] - pg) <= 0.01 and abs(row["gain"] - 1) <= 0.02)
            layers.append(row)
        out["plans"][label] = {"verify_ok": bool(v.ok), "layers": layers,
                               "training": training(model, opt, loss, plan, state, opt_state, lrs, train_steps)}
        model.load_state_dict(state)
        opt.load_state_dict(opt_state)
        for g in opt.param_groups:
            g["lr"] = 0.0
    return out


def training(model, opt, loss, plan, state, opt_state, lrs, steps: int) -> dict:
    """The plan applied with the learning rate on, from the calibrated model: per layer and call,
    whether it departs from the plan (flushes or clips more than ``max(0.5 x predicted, 0.01)`` above
    the plan's prediction, or a gain more than 0.02 off 1) and the call at which its first alert
    fired: a layer that departs on 3 calls in a row must have alerted by the third."""
    model.load_state_dict(state)
    opt.load_state_dict(opt_state)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    rules = plan.resolve(model)
    names = [n for n, r in rules.items() if r.quantizes]
    first_alert: dict[str, int] = {}

    def note_alerts(k: int, applied) -> None:
        for n in names:
            if applied.alerts.get(n) and n not in first_alert:
                first_alert[n] = k
    applied, seen = run_applied(model, opt, loss, plan, names, steps, note_alerts)
    hist = applied.to_dataframe()
    layers = {}
    for n in names:
        p = rules[n].predicted
        h = hist[hist["layer"] == n].reset_index(drop=True)
        gin = [g for key, g in seen.get(n, []) if key == "in"]
        gout = [g for key, g in seen.get(n, []) if key == "out"]
        departs = []
        for i in range(min(len(h), len(gin), len(gout))):
            gain = float((gin[i].double() * gout[i].double()).sum() / (gin[i].double() ** 2).sum())
            departs.append(above(float(h.loc[i, "underflow_fraction"]), getattr(p, "flushed", None))
                           or above(float(h.loc[i, "overflow_fraction"]), getattr(p, "overflow", None))
                           or abs(gain - 1) > 0.02)
        k0 = departs.index(True) if any(departs) else None
        fa = first_alert.get(n)
        layers[n] = {"departs_at": k0, "departing_calls": int(sum(departs)), "first_alert": fa,
                     "ok": k0 is None or sum(departs[k0:k0 + 3]) < 3 or (fa is not None and fa <= k0 + 2)}
    return layers


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the MobileNet only, fewer steps")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    names = args.models or (["mobilenet"] if args.quick else ["mobilenet", "gpt_neox", "mamba", "convnext"])
    steps, apply_steps = (15, 3) if args.quick else (30, 6)
    results = [measure(n, steps, apply_steps, 4 if args.quick else 10) for n in names]
    bad = []
    for r in results:
        for label, p in r["plans"].items():
            print(f"\n== {r['model']}: recommend(bits=4, granularity={label!r}): verify(run) "
                  f"{'ok' if p['verify_ok'] else 'FAILS'}; applied {apply_steps} steps (frozen)")
            print(f"{'layer':<44} {'flushed':>15} {'clipped':>15} {'gain':>13}  rule / verdict")
            print(f"{'':<44} {'plan / apply':>15} {'plan / apply':>15} {'plan / apply':>13}")

            def f(v, fmt):
                return "-" if v is None or not math.isfinite(v) else format(v, fmt)
            for row in p["layers"]:
                print(f"{row['layer']:<44} {f(row['predicted_flushed'], '.4f') + ' / ' + f(row['flushed'], '.4f'):>15} "
                      f"{f(row['predicted_clipped'], '.4f') + ' / ' + f(row['clipped'], '.4f'):>15} "
                      f"{f(row['predicted_gain'], '.3f') + ' / ' + f(row['gain'], '.3f'):>13}  {row['rule']}"
                      f"{'' if row['ok'] else '  FAIL'}{' alerts: ' + ','.join(row['alerts']) if row['alerts'] else ''}")
                if not row["ok"]:
                    bad.append((r["model"], label, row["layer"]))
            if not p["verify_ok"]:
                bad.append((r["model"], label, "verify"))
            t = p["training"]
            dep = {n: v for n, v in t.items() if v["departs_at"] is not None}
            print(f"-- in training (learning rate on): {len(dep)} of {len(t)} layers departed from the plan"
                  + "".join(f"; {n}: from call {v['departs_at']} ({v['departing_calls']} calls), first alert "
                            f"{'-' if v['first_alert'] is None else 'call ' + str(v['first_alert'])}"
                            for n, v in dep.items()))
            bad += [(r["model"], label, n, "no alert in training") for n, v in t.items() if not v["ok"]]
    print(f"\nlayers outside the bounds: {len(bad)} {bad}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=float) + "\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
