"""recommend's speed: a plan for each of 5 widths over a 100-layer run, from its statistics.

The targets (bench/RESULTS.md): at most 1 s of CPU time for 100 layers and 5 widths, without the
check against the samples (a run traced without samples has none to replay), and at most 5 ms for
the check's own cost on a run with samples, per layer and calibration step (what ``check=True``
adds: the replays, the repairs and the second round of the noise bound they cause). Medians of
repeats, process CPU time.

    python bench/recommend.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradstats  # noqa: E402
from bench._common import median_seconds  # noqa: E402

#: the most the check may add per planned layer and calibration step (CPU seconds)
CHECK_TARGET_S = 0.005


def deep_run(path: str, n_layers: int = 100, sample_every=None) -> "gradstats.Run":
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n_layers):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    with gradstats.trace(model, path, sample_every=sample_every) as t:
        for _ in range(8):
            model(torch.randn(32, 16)).square().mean().backward()
            t.step()
    return gradstats.open_run(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    logging.getLogger("gradstats").setLevel(logging.ERROR)     # the plans' check warnings: timed, not read
    plain = deep_run(tempfile.mkdtemp())
    plain.stats()
    widths = [4, 5, 6, 7, 8]
    kw = dict(sparsity=0.85, candidates="any", objective="mse", rounding="nearest", output_layer=False,
              threshold_rule="lognormal", prune_at=False, steps="latest")
    gradstats.recommend_each(plain, bits=[8], **kw)              # warm the format analysis' caches
    t_choice = median_seconds(lambda: gradstats.recommend_each(plain, bits=widths, check=False, **kw), args.repeats)
    sampled = deep_run(tempfile.mkdtemp(), n_layers=20, sample_every=2)
    sampled.stats()
    t_check = median_seconds(lambda: gradstats.recommend(sampled, bits=6, sparsity=0.85), max(1, args.repeats // 2))
    t_nocheck = median_seconds(lambda: gradstats.recommend(sampled, bits=6, sparsity=0.85, check=False),
                           max(1, args.repeats // 2))
    n_steps = 4
    per_check = (t_check - t_nocheck) / (20 * n_steps)
    print("| what | CPU time (median) | target |")
    print("|---|---|---|")
    print(f"| recommend_each, 100 layers x 5 widths, no check | {t_choice:.3f} s | <= 1 s |")
    print(f"| recommend(bits=6, sparsity=0.85), 20 layers, checked on {n_steps} steps | {t_check:.3f} s | - |")
    print(f"| the same, check=False | {t_nocheck:.3f} s | - |")
    print(f"| the check, per layer and calibration step | {per_check * 1e3:.1f} ms | <= 5 ms |")
    return 0 if t_choice <= 1.0 and per_check <= CHECK_TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
