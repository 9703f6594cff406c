"""Throughput of gradstats.quantize against its peers, 1e7 float32 values (medians of interleaved rounds).

CPU table: torch's native float8_e5m2 round-trip cast (the reference speed), our nearest-even for
e5m2 and for arbitrary formats (e3m3, e6m1), our stochastic rounding, ml_dtypes ``astype`` round
trips, qtorch 0.3 ``float_quantize`` when it imports (its C++ extension is built on first use;
if that fails the table says so), and the operator :func:`gradstats.apply` runs per gradient,
``prune_quantize`` (pruning, rounding, counts and float64 sums in one pass of the C kernel), beside
the same computed with torch ops (the path without a C compiler), and the same for NVFP4 and MXFP4 blocks
(the C block kernel beside the composed operators it replaces). Each row is timed with torch's default intra-op threads and with
one thread; ratios are against the native cast measured in the same run and setting.

GPU (only when ``torch.cuda.is_available()``): the Triton kernel on a 256M-element float32 tensor,
achieved GB/s (4 bytes read + 4 written per element) against a measured device-to-device copy.

Run: ``.venv/bin/python bench/quantize.py`` (``--n``, ``--rounds`` to change the size and repeats).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import composed_operators, describe, interleaved  # noqa: E402
from gradstats.ops.fused import _composed_on_device, prune_quantize  # noqa: E402
from gradstats.ops.quantization import quantize  # noqa: E402
from gradstats.scheme import Scheme  # noqa: E402

#: the row a row's "vs ours" divides by, where it is not our nearest (or stochastic) e5m2
REFERENCE = {"the same, torch ops (no-compiler path)": "gradstats prune_quantize e5m2, fused",
             "gradstats prune_quantize e5m2, fused": "gradstats prune_quantize e5m2, fused",
             "gradstats prune_quantize nvfp4, fused": "gradstats prune_quantize nvfp4, fused",
             "the same, composed operators (nvfp4)": "gradstats prune_quantize nvfp4, fused",
             "gradstats prune_quantize mxfp4, fused": "gradstats prune_quantize mxfp4, fused",
             "the same, composed operators (mxfp4)": "gradstats prune_quantize mxfp4, fused"}


def timed(fn):
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def composed(run):
    """``run`` with block formats through the composed operators (``bench._common.composed_operators``)."""
    def call():
        with composed_operators():
            return run()
    return call


def peers(x: torch.Tensor):
    """name -> (callable, note) for every row of the CPU table."""
    import ml_dtypes

    xn = x.numpy()
    g = torch.Generator().manual_seed(0)
    rows = {
        "torch native float8_e5m2 round trip": (lambda: x.to(torch.float8_e5m2).to(torch.float32), ""),
        "gradstats nearest e5m2": (lambda: quantize(x, "e5m2", overflow="nonfinite"), ""),
        "gradstats nearest e3m3": (lambda: quantize(x, "e3m3"), ""),
        "gradstats nearest e6m1": (lambda: quantize(x, "e6m1"), ""),
        "gradstats stochastic e5m2": (lambda: quantize(x, "e5m2", rounding="stochastic", generator=g), ""),
        "gradstats stochastic e3m3": (lambda: quantize(x, "e3m3", rounding="stochastic", generator=g), ""),
        "ml_dtypes astype e5m2 round trip": (lambda: xn.astype(ml_dtypes.float8_e5m2).astype(np.float32), ""),
        # what apply runs per gradient: pruning (half the entries of randn below 0.67) and rounding
        # in one pass, with the counts and float64 sums of the training log
        "gradstats prune_quantize e5m2, fused": (lambda: prune_quantize(x, 0.67, "e5m2", seed=1), ""),
        "the same, torch ops (no-compiler path)": (
            lambda: _composed_on_device(x, 0.67, Scheme.of("e5m2"), 1.0, 1), ""),
        # the block-scaled formats: the C block kernel, and the operators it replaces
        "gradstats prune_quantize nvfp4, fused": (lambda: prune_quantize(x, 0.67, "nvfp4", seed=1), ""),
        "the same, composed operators (nvfp4)": (
            composed(lambda: _composed_on_device(x, 0.67, Scheme.of("nvfp4"), 1.0, 1)), ""),
        "gradstats prune_quantize mxfp4, fused": (lambda: prune_quantize(x, 0.67, "mxfp4", seed=1), ""),
        "the same, composed operators (mxfp4)": (
            composed(lambda: _composed_on_device(x, 0.67, Scheme.of("mxfp4"), 1.0, 1)), ""),
    }
    try:
        from qtorch.quant import float_quantize

        float_quantize(x[:16], exp=5, man=2, rounding="nearest")  # builds the extension
        rows["qtorch 0.3 float_quantize e5m2 nearest"] = (
            lambda: float_quantize(x, exp=5, man=2, rounding="nearest"), "")
        rows["qtorch 0.3 float_quantize e5m2 stochastic"] = (
            lambda: float_quantize(x, exp=5, man=2, rounding="stochastic"), "")
    except Exception as e:  # not installed, or its JIT extension did not build
        rows["qtorch 0.3 float_quantize"] = (None, f"not measured: {type(e).__name__}: {str(e)[:60]}")
    return rows


def cpu_table(n: int, rounds: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    rows = peers(x)
    same = torch.equal(quantize(x, "e5m2", overflow="nonfinite"), x.to(torch.float8_e5m2).float())
    default_threads = torch.get_num_threads()
    results = {}
    for threads in (default_threads, 1):
        torch.set_num_threads(threads)
        runnable = {k: timed(f) for k, (f, _) in rows.items() if f is not None}
        for f in runnable.values():
            f()  # warm up
        results[threads] = interleaved(runnable, rounds)
    torch.set_num_threads(default_threads)
    info = describe()
    print(f"quantize, {n:.0e} float32 values, median of {rounds} interleaved rounds; torch {info['torch']}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; "
          f"our e5m2 == native cast bit for bit: {same}")
    cols = [default_threads, 1] if default_threads != 1 else [1]
    head = f"{'':44}" + "".join(f"{f'{t} thread' + ('s' if t > 1 else ''):>28}" for t in cols)
    print(head)
    print(f"{'method':44}" + "".join(f"{'ms':>10}{'vs native':>10}{'vs ours':>8}" for _ in cols))
    for name, (f, note) in rows.items():
        line = f"{name:44}"
        if f is None:
            print(line + "  " + note)
            continue
        for t in cols:
            r = results[t]
            nat = r["torch native float8_e5m2 round trip"]
            ours = r[REFERENCE.get(name, "gradstats stochastic e5m2" if "stochastic" in name
                                   else "gradstats nearest e5m2")]
            line += f"{r[name] * 1e3:10.1f}{r[name] / nat:9.2f}x{r[name] / ours:7.1f}x"
        print(line)
    print("('vs ours': time relative to our nearest e5m2, to our stochastic e5m2 for stochastic rows, and to "
          "the fused prune_quantize of the same format for the rows that prune)")


def gpu_table(n: int = 256 * 2 ** 20, reps: int = 20) -> None:
    from gradstats.ops.triton import use_triton

    dev = torch.device("cuda")
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)

    def cuda_ms(fn) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    copy_ms = cuda_ms(lambda: y.copy_(x))
    copy_gbs = 8 * n / copy_ms / 1e6
    print(f"\nGPU {torch.cuda.get_device_name(dev)}: {n / 2 ** 20:.0f}M float32, Triton path: {use_triton('cuda')}; "
          f"device copy {copy_ms:.2f} ms = {copy_gbs:.0f} GB/s")
    print(f"{'kernel':40}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    xh = x.to(torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    cases = {
        "nearest e4m3fn": (lambda: quantize(x, "e4m3fn"), 8),
        "nearest e2m1fn": (lambda: quantize(x, "e2m1fn"), 8),
        "nearest e3m3 nonfinite": (lambda: quantize(x, "e3m3", overflow="nonfinite"), 8),
        "stochastic e4m3fn (CUDA generator)": (lambda: quantize(x, "e4m3fn", rounding="stochastic", generator=g), 8),
        "stochastic e5m2 (default generator)": (lambda: quantize(x, "e5m2", rounding="stochastic"), 8),
        "nearest e4m3fn, bf16 in/out": (lambda: quantize(xh, "e4m3fn"), 4),
        "MX e4m3fn, blocks of 32": (lambda: quantize(x, "e4m3fn", block_size=32), 8),
    }
    for name, (fn, bytes_per) in cases.items():
        ms = cuda_ms(fn)
        gbs = bytes_per * n / ms / 1e6
        print(f"{name:40}{ms:9.2f}{gbs:9.0f}{gbs / copy_gbs:8.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    cpu_table(args.n, args.rounds)
    if torch.cuda.is_available():
        gpu_table()
    else:
        print("\nGPU: not measured (no CUDA device on this machine)")


if __name__ == "__main__":
    main()
