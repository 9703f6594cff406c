"""Speed of the format analysis: the analytic error against a Monte Carlo estimate of it, and
best_format for a whole model against an empirical search over the same choices.

    python bench/fpanalysis.py

Section 1: one expected_error evaluation (e4m3fn, one layer) against quantising 1e6 lognormal
samples with gradstats.quantize (the cheapest Monte Carlo estimate with ~0.3% standard error).
Section 2: best_format for 100 layers and the bit widths 4..8 (every fn split, each at its best
power-of-two scale) -- the plan contributor's target is under a second -- against the brute-force
search the analysis replaces, measured on 2**16 sampled entries of each layer (every split, 17
powers of two), extrapolated from 5 layers. Medians of repeats; ratios within one run.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import median_seconds  # noqa: E402

from gradstats import fpanalysis as fa  # noqa: E402
from gradstats.ops.quantization import quantize  # noqa: E402


def median_time(fn, repeats: int) -> float:
    """Median wall seconds, after a warm-up call (caches of cells, the first quantize call)."""
    return median_seconds(fn, repeats, clock=time.perf_counter, warm_up=True)


def main() -> int:
    torch.manual_seed(0)
    mu, sigma = -9.0, 2.0
    g = torch.Generator().manual_seed(0)
    x = torch.exp(mu + sigma * torch.randn(10 ** 6, generator=g))

    def mc():
        q = quantize(x, "e4m3fn", scale=2.0 ** 13)
        return float(((q - x).double() ** 2).sum() / (x.double() ** 2).sum())

    t_an = median_time(lambda: fa.expected_error("e4m3fn", mu=mu, sigma=sigma, scale=2.0 ** 13), 50)
    t_mc = median_time(mc, 7)
    print("1) one error evaluation, e4m3fn, one layer")
    print(f"{'method':<52} {'ms':>9} {'ratio':>8}")
    print(f"{'expected_error (exact, partial moments)':<52} {t_an * 1e3:9.3f} {1.0:8.2f}")
    print(f"{'Monte Carlo: quantize 1e6 samples + sums':<52} {t_mc * 1e3:9.3f} {t_mc / t_an:8.1f}")

    rng = np.random.default_rng(0)
    mus, sigs = rng.uniform(-20, -5, 100), rng.uniform(0.7, 3.5, 100)

    def plan():
        for bits in range(4, 9):
            fa.best_format(bits, mu=mus, sigma=sigs)

    t_plan = median_time(plan, 5)

    def brute(n_layers=5):
        for i in range(n_layers):
            xs = torch.exp(float(mus[i]) + float(sigs[i]) * torch.randn(1 << 16, generator=g))
            for bits in range(4, 9):
                for f in fa.candidate_formats(bits):
                    j0 = -round(float(mus[i]) / math.log(2))
                    fa.measured_error(xs, f, scale=[2.0 ** j for j in range(j0 - 8, j0 + 9)])

    t_brute = median_time(brute, 3) * 100 / 5
    print("\n2) best format for 100 layers x bit widths 4..8 (20 splits, best power-of-two scale each)")
    print(f"{'method':<52} {'s':>9} {'ratio':>8}")
    print(f"{'best_format (analytic, vectorised over layers)':<52} {t_plan:9.3f} {1.0:8.2f}")
    print(f"{'brute force on 2**16 samples/layer (17 scales)':<52} {t_brute:9.3f} {t_brute / t_plan:8.1f}")
    print(f"\ntarget: best_format under 1 s -> {'met' if t_plan < 1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
