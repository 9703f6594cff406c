"""Benchmark: threshold estimation + pruning of a 1e7-element tensor, ours against the exact
quantile (torch.kthvalue / torch.topk) + pruning, with the achieved sparsity of each.

    python bench/pruning.py [--n 10000000] [--repeats 7] [--targets 0.85 0.95] [--markdown]

Rows (each timed end to end from the raw tensor to the pruned tensor, allocating its output):
  ours                  one statistics sweep, analytic lognormal threshold, stochastic prune
  ours, hard            one statistics sweep, lognormal quantile, hard threshold
  ours, histogram       one counting sweep (quarter-binade bins), model-free threshold,
                        stochastic prune
  ours, numpy engine    (CPU) "ours" with the C prune kernel switched off: the numpy
                        engine used without a C compiler (GRADSTATS_NATIVE=0)
  kthvalue + hard       exact quantile by torch.kthvalue, hard threshold (the baseline)
  topk + hard           exact quantile by torch.topk, hard threshold
  kthvalue + stochastic the exact quantile fed to the stochastic operator (undershoots)
  sort oracle + stoch.  exact threshold for the stochastic operator from a full sort
  prune only, float32   (CPU) the stochastic operator alone at a fixed threshold (C kernel)
  prune only, float64   (CPU) the same on a float64 copy (numpy engine, 53-bit uniforms)
  torch ops             the same method as "ours" in plain whole-tensor torch ops
                        (gradstats.stats.tensor_stats + the torch reference operator)
Timings are medians of interleaved repeats; "x ours" is a row's time over ours (higher =
ours faster). GPU rows are added when CUDA is available (ours runs the Triton kernel there).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

from gradstats.ops import cpu as _cpu
from gradstats.ops.triton.prune import stochastic_prune_torch
from gradstats.pruning import exact_threshold, hard_prune, prune, stochastic_prune, threshold
from gradstats.stats import tensor_stats


def make_tensor(n: int, sigma: float, p0: float, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).mul_(sigma).add_(-12.0).exp_()
    x.mul_(torch.randint(0, 2, (n,), generator=g, dtype=torch.float32).mul_(2).sub_(1))
    if p0:
        x[torch.rand(n, generator=g) < p0] = 0.0
    return x.to(device)


def topk_threshold(x: torch.Tensor, target: float) -> float:
    n = x.numel()
    keep = n - min(int(round(target * n)), n - 1)
    return float(torch.topk(x.abs().reshape(-1), keep, sorted=False).values.min())


def without_native_prune(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` run with the C prune kernel reported unavailable (the no-compiler fallback)."""
    def run() -> torch.Tensor:
        saved = _cpu.native_kernel
        _cpu.native_kernel = lambda: None
        try:
            return fn()
        finally:
            _cpu.native_kernel = saved
    return run


def methods(x: torch.Tensor, S: float, device: str) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(1)
    m = {
        "ours": lambda: prune(x, S, generator=g),
        "ours, hard": lambda: prune(x, S, stochastic=False),
        "ours, histogram": lambda: prune(x, S, threshold_rule="histogram", generator=g),
    }
    if device == "cpu":
        m["ours, numpy engine"] = without_native_prune(lambda: prune(x, S, generator=g))
    m |= {
        "kthvalue + hard": lambda: hard_prune(x, exact_threshold(x, S)),
        "topk + hard": lambda: hard_prune(x, topk_threshold(x, S)),
        "kthvalue + stochastic": lambda: stochastic_prune(x, exact_threshold(x, S), generator=g),
        "sort oracle + stoch.": lambda: stochastic_prune(x, exact_threshold(x, S, stochastic=True),
                                                         generator=g),
    }
    if device == "cpu":
        a = float(torch.tensor(float(threshold(S, tensor_stats(x)))))
        x64 = x.double()
        m["prune only, float32"] = lambda: stochastic_prune(x, a, generator=g)
        m["prune only, float64"] = lambda: stochastic_prune(x64, a, generator=g)
        m["torch ops"] = lambda: stochastic_prune_torch(
            x, float(torch.tensor(float(threshold(S, tensor_stats(x))))), generator=g)
    return m


def bench(x: torch.Tensor, S: float, device: str, repeats: int) -> list[dict]:
    fns = methods(x, S, device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    achieved: dict[str, list[float]] = {k: [] for k in fns}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for k, f in fns.items():  # warm-up (kernel compilation, thread pool, caches)
        f()
    sync()
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            y = f()
            sync()
            times[k].append(time.perf_counter() - t0)
            achieved[k].append(float((y == 0).double().mean()))
            del y
    ours = statistics.median(times["ours"])
    rows = []
    for k in fns:
        t = statistics.median(times[k])
        a = statistics.mean(achieved[k])
        rows.append({"device": device, "target": S, "method": k, "ms": 1e3 * t, "x_ours": t / ours,
                     "achieved": a, "error": abs(a - S)})
    return rows


def monte_carlo(n: int, sigmas=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
                targets=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)) -> list[dict]:
    """Achieved sparsity of stochastic_prune at the analytic threshold on exact lognormal
    samples (positive, so that the mean of T(g) - g is a real test), and the z statistic of
    that mean against the closed-form added variance."""
    import math

    from gradstats.pruning import added_variance

    rows = []
    for sigma in sigmas:
        g = torch.Generator().manual_seed(int(sigma * 100))
        x = torch.randn(n, generator=g, dtype=torch.float64).mul_(sigma).sub_(6.0).exp_()
        xf, xd = x.float(), x.float().double()
        for S in targets:
            a = float(torch.tensor(float(threshold(S, mu=-6.0, sigma=sigma))))
            y = stochastic_prune(xf, a, generator=g)
            d = y.double() - xd
            var = float(added_variance(a, mu=-6.0, sigma=sigma))
            achieved = float((y == 0).double().mean())
            rows.append({"sigma": sigma, "target": S, "achieved": achieved, "error": achieved - S,
                         "se": math.sqrt(S * (1 - S) / n),
                         "z_mean": float(d.mean()) / math.sqrt(var / n)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--montecarlo", type=int, default=0, metavar="N",
                    help="instead: the Monte Carlo table with N lognormal samples per sigma")
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--targets", type=float, nargs="+", default=[0.85, 0.95])
    ap.add_argument("--sigma", type=float, default=2.2, help="sigma of ln|g| of the test tensor")
    ap.add_argument("--p0", type=float, default=0.3, help="fraction of exact zeros")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    if args.montecarlo:
        rows = monte_carlo(args.montecarlo)
        print(f"# Monte Carlo: {args.montecarlo:.0e} exact lognormal samples per sigma; "
              "achieved sparsity of stochastic_prune at the analytic threshold")
        print("| sigma | target | achieved | error | std. error | z (mean of T(g)-g) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['sigma']:g} | {r['target']:.2f} | {r['achieved']:.5f} | "
                  f"{r['error']:+.5f} | {r['se']:.5f} | {r['z_mean']:+.2f} |")
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(f"# worst |error| {abs(worst['error']):.5f} (sigma {worst['sigma']:g}, target "
              f"{worst['target']:.2f}); max |z| {max(abs(r['z_mean']) for r in rows):.2f}")
        return 0
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"# gradient pruning: n = {args.n:.0e}, lognormal sigma = {args.sigma} (ln), "
          f"p0 = {args.p0}, {args.repeats} repeats, torch threads = {torch.get_num_threads()}, "
          f"load average before = {os.getloadavg()[0]:.1f}")
    rows = []
    for dev in devices:
        x = make_tensor(args.n, args.sigma, args.p0, dev)
        for S in args.targets:
            rows += bench(x, S, dev, args.repeats)
    if args.markdown:
        print("| device | target | method | median ms | x ours | achieved | abs error |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['device']} | {r['target']:.2f} | {r['method']} | {r['ms']:.1f} | "
                  f"{r['x_ours']:.2f} | {r['achieved']:.4f} | {r['error']:.4f} |")
    else:
        print(f"{'device':6} {'target':>6}  {'method':24} {'median ms':>10} {'x ours':>7} "
              f"{'achieved':>9} {'abs error':>9}")
        for r in rows:
            print(f"{r['device']:6} {r['target']:6.2f}  {r['method']:24} {r['ms']:10.1f} "
                  f"{r['x_ours']:7.2f} {r['achieved']:9.4f} {r['error']:9.4f}")
    print(f"# load average after = {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
