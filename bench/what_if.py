"""what_if on a long run: milliseconds per (step, layer, format), one row at a time and all rows at once.

Builds a synthetic run through the tracer: a 24-layer MLP (Linear 64 -> 64 + tanh, batch 64,
random data) trained 300 steps with statistics of every layer on every step (7,200 statistics
rows), then times ``gradstats.what_if(run, ["e4m3fn", "e5m2", "e2m1fn"], granularity=32)``
(MX blocks) and the same per tensor, as medians of repeats:

- ``row by row``: :func:`gradstats.fpanalysis.predict_from_stats` on each row (the same predictor
  on a table of one row: its fixed cost per call), on the rows of ``--ref-steps`` steps;
- ``all rows at once``: ``what_if`` on the whole run (reading the run included).

The target is at most 0.5 ms per (step, layer, format) with blocks. The largest difference
between the two on the rows timed row by row is printed too (rows padded together with rows of
other binade spans predict as they do alone, within float rounding).

    python bench/what_if.py [--steps 300] [--layers 24] [--repeats 5] [--ref-steps 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradstats  # noqa: E402
from gradstats.fpanalysis import predict_from_stats, what_if  # noqa: E402

FORMATS = ("e4m3fn", "e5m2", "e2m1fn")
TARGET_MS = 0.5


def build_run(path: Path, steps: int, layers: int) -> gradstats.run.Run:
    """``steps`` steps of a ``layers``-layer MLP traced with statistics of every layer every step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with gradstats.trace(model, path, every=1, sample_every=None, alarms=False, flush_secs=60.0) as tr:
        for _ in range(steps):
            x = torch.randn(64, 64, generator=g)
            opt.zero_grad()
            (model(x) - x).pow(2).mean().backward()
            opt.step()
            tr.step()
    return gradstats.open_run(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ref-steps", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = build_run(Path(tmp) / "run", a.steps, a.layers)
        st = run.stats(kinds=["grad"])
        print(f"run: {len(run.steps)} steps, {len(run.layers)} layers, {len(st)} rows "
              f"(built in {time.perf_counter() - t0:.0f} s)")
        rows = []
        for block in (32, None):
            ref_rows = st[st["step"].isin(run.steps[:a.ref_steps])].to_dict("records")
            per = []
            for _ in range(max(1, a.repeats // 2)):
                t = time.perf_counter()
                ref = [[predict_from_stats(x, f, granularity=block) for f in FORMATS] for x in ref_rows]
                per.append((time.perf_counter() - t) / (len(ref_rows) * len(FORMATS)))
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                df = what_if(run, FORMATS, granularity=block)
                times.append((time.perf_counter() - t) / len(df))
            diff = 0.0
            for x, preds in zip(ref_rows, ref):
                for f, p in zip(FORMATS, preds):
                    got = df[(df.step == x["step"]) & (df.layer == x["layer"]) & (df.format == f)].iloc[0]
                    for c in ("underflow", "overflow", "rel_mse", "bias"):
                        diff = max(diff, abs(float(got[c]) - p[c]) / max(abs(p[c]), 1e-12) if p[c] else abs(float(got[c])))
            name = "MX blocks of 32" if block else "per tensor (amax)"
            rows.append((name, statistics.median(per) * 1e3, statistics.median(times) * 1e3,
                         statistics.median(per) / statistics.median(times), diff))
        print(f"\n{'what_if':<20} {'row by row ms':>14} {'all at once ms':>15} {'speed-up':>9} {'max rel diff':>13}"
              f"   (per (step, layer, format); target <= {TARGET_MS} ms with blocks)")
        for name, r, f, s, d in rows:
            print(f"{name:<20} {r:>14.3f} {f:>15.4f} {s:>8.0f}x {d:>13.1e}")
        ok = rows[0][2] <= TARGET_MS
        print(f"\nwith blocks: {rows[0][2]:.4f} ms per (step, layer, format): target {'met' if ok else 'NOT met'}; "
              f"{len(st) * len(FORMATS)} predictions in {rows[0][2] * len(st) * len(FORMATS) / 1e3:.2f} s")


if __name__ == "__main__":
    main()
