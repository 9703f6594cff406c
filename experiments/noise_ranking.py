"""Does the noise ratio rank the study's pruning results? Predicted and measured, against the loss.

For each model of section 1 (the CNN, ResNet-20, the character transformer), the calibration of the
study is repeated with the noise records: the plain model traced for its first 50 steps, seed 0
(four sampled steps and the step after each). Then for every row of RESULTS.md section 1.2 (the
pruning table) the plan it trained (``scale_plans.json``, as the study made it) is
- predicted: :func:`gradstats.predicted_noise` from that trace, and
- measured: :func:`gradstats.noise_probe` on the calibrated model (8 batches x 2 draws),
each as the mean over the plan's layers of the ratio R; and both are set beside the row's paired
difference in units of its model's margin (0.3 points of accuracy, 0.01 nats): Spearman's rho over
all rows with a bootstrap 95% interval.

    python experiments/noise_ranking.py      # about 10 minutes on 2 cores

Writes ``experiments/results/noise_ranking.{json,txt}`` (resumable per model).
"""
from __future__ import annotations

import json
import logging
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from scale_study import CALIBRATION_STEPS, PROTOCOL  # noqa: E402

import gradstats  # noqa: E402

log = logging.getLogger("noise_ranking")
RESULTS = HERE / "results" / "noise_ranking.json"
SAMPLED = [10, 22, 34, 46]


def pruning_rows() -> list[dict]:
    """Model, configuration and paired difference of each row of RESULTS.md's table 1.2."""
    text = (HERE.parent / "docs" / "RESULTS.md").read_text()
    table = text.split("### 1.2 Pruning", 1)[1].split("*Command*", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] in PROTOCOL and re.match(r"^[+-]?\d", cells[3]):
            rows.append({"model": cells[0], "label": cells[1], "delta": float(cells[3]), "verdict": cells[5]})
    return rows


def calibrate(model: str):
    from gradstats.zoo.training import prepare

    proto = PROTOCOL[model]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    task = prepare(model, seed=0, **proto["prepare"])
    path = Path(tempfile.mkdtemp(prefix=f"noise-ranking-{model}-"))
    with gradstats.trace(task.model, path, sample_every=SAMPLED, seed=0) as tracer:
        task.run(CALIBRATION_STEPS, **{"schedule": "cosine", "progress": False, **proto["train"]},
                 callback=lambda s, loss: tracer.step())
    torch.set_num_threads(2)
    return task, path


def probe_batches(task, n: int, batch_size: int, seq_len: int = 128):
    from gradstats.zoo.data import CharDataset

    gen = torch.Generator().manual_seed(123)
    data = task.train_data
    if isinstance(data, CharDataset):
        return [data.get_batch(batch_size, seq_len, generator=gen) for _ in range(n)]
    idx = [torch.randint(0, len(data.labels), (batch_size,), generator=gen) for _ in range(n)]
    return [(data.images[i], data.labels[i]) for i in idx]


def measure(model: str, rows: list[dict]) -> list[dict]:
    from gradstats.zoo.training import loss_fn

    plans = json.loads((HERE / "results" / "scale_plans.json").read_text())
    prep = json.dumps(PROTOCOL[model]["prepare"], sort_keys=True)
    task, path = calibrate(model)
    batch_size = PROTOCOL[model]["train"].get("batch_size", task.hparams.get("batch_size", 128))
    batches = probe_batches(task, 8, batch_size)
    loss = lambda m, b: loss_fn(m(b[0]), b[1])      # noqa: E731
    out = []
    for row in rows:
        plan = gradstats.Plan.from_dict(plans[f"{model}/{row['label']}/{prep}"]["plan"])
        pred = gradstats.predicted_noise(path, plan, steps=SAMPLED).to_dataframe()
        meas = gradstats.noise_probe(task.model, batches, plan, loss, draws=2).to_dataframe()
        out.append({**row, "predicted": float(pred["noise"].mean()), "measured": float(meas["ratio"].mean()),
                    "predicted_max": float(pred["noise"].max()), "measured_max": float(meas["ratio"].max()),
                    "layers": len(pred)})
        log.info("%s %s: R predicted %.4g, measured %.4g (delta %+.3f)", model, row["label"], out[-1]["predicted"],
                 out[-1]["measured"], row["delta"])
    return out


def spearman(x, y, boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    from scipy.stats import spearmanr

    x, y = np.asarray(x, float), np.asarray(y, float)
    rho = float(spearmanr(x, y).statistic)
    rng = np.random.default_rng(seed)
    bs = []
    for _ in range(boot):
        i = rng.integers(0, len(x), len(x))
        if len(set(x[i])) > 1 and len(set(y[i])) > 1:
            bs.append(spearmanr(x[i], y[i]).statistic)
    lo, hi = np.nanpercentile(bs, [2.5, 97.5])
    return rho, float(lo), float(hi)


def summary(results: dict) -> dict:
    """The rows (with ``loss_margins``) and the rank correlations of ``results``."""
    rows = [dict(r) for model in results.values() for r in model]
    for r in rows:
        r["loss_margins"] = -r["delta"] / abs(PROTOCOL[r["model"]]["margin"])
    passed = [r for r in rows if "no loss" in r["verdict"] or "non-inferior" in r["verdict"]]
    lost = [r for r in rows if r["verdict"] == "**loss**"]
    return {"rows": rows,
            "predicted": spearman([r["predicted"] for r in rows], [r["loss_margins"] for r in rows]),
            "measured": spearman([r["measured"] for r in rows], [r["loss_margins"] for r in rows]),
            "agreement": spearman([r["predicted"] for r in rows], [r["measured"] for r in rows]),
            "passed_max": max(r["measured"] for r in passed), "lost_min": min(r["measured"] for r in lost)}


def report(results: dict) -> str:
    rows = summary(results)["rows"]
    lines = ["# The noise ratio R of the study's pruning rows (RESULTS.md 1.2) against their loss", "",
             "loss in margins: minus the paired difference over the model's margin (0.3 points, 0.01 nats)", "",
             f"{'model':12s} {'configuration':58s} {'loss/margin':>11s} {'R predicted':>11s} {'R measured':>10s}  verdict"]
    for r in sorted(rows, key=lambda r: r["measured"]):
        lines.append(f"{r['model']:12s} {r['label']:58s} {r['loss_margins']:11.2f} {r['predicted']:11.4g} "
                     f"{r['measured']:10.4g}  {r['verdict']}")
    lines.append("")
    for key in ("predicted", "measured"):
        rho, lo, hi = spearman([r[key] for r in rows], [r["loss_margins"] for r in rows])
        lines.append(f"Spearman of R {key} against the loss, {len(rows)} rows: {rho:.2f} [{lo:.2f}, {hi:.2f}]")
    rho, lo, hi = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    lines.append(f"Spearman of R predicted against R measured: {rho:.2f} [{lo:.2f}, {hi:.2f}]")
    passed = [r["measured"] for r in rows if "no loss" in r["verdict"] or "non-inferior" in r["verdict"]]
    lost = [r["measured"] for r in rows if r["verdict"] == "**loss**"]
    lines.append(f"Measured R: passed rows up to {max(passed):.4g}; rows that lost from {min(lost):.4g}")
    passed = [r["predicted"] for r in rows if "no loss" in r["verdict"] or "non-inferior" in r["verdict"]]
    lost = [r["predicted"] for r in rows if r["verdict"] == "**loss**"]
    lines.append(f"Predicted R: passed rows up to {max(passed):.4g}; rows that lost from {min(lost):.4g}")
    return "\n".join(lines) + "\n"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("gradstats").setLevel(logging.ERROR)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows = pruning_rows()
    for model in PROTOCOL:
        if model not in results:
            results[model] = measure(model, [r for r in rows if r["model"] == model])
            RESULTS.write_text(json.dumps(results, indent=1))
    text = report(results)
    RESULTS.with_suffix(".txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
