"""Benchmark: the statistics of real gradient tensors (what the tracer computes per capture and
``gradstats.apply`` per refresh), our CPU kernel against the same statistics from torch ops.

    python bench/stats_kernel.py [--models cnn resnet20] [--repeats 9]

For each model the neural gradients of one training batch (batch 128, Fashion-MNIST subset) of
every module with parameters are captured once; each row then computes the statistics of all of
them, one tensor after another, as the tracer does in a step:

  native, full          the C kernel as built for this CPU (AVX-512 where it has it, else the
                        portable loop, its binade counts in AVX2 where it has that):
                        scalar statistics, binade counts and top 64
  native, scalars       the same, scalar statistics alone (``full=False``: apply's refresh)
  native, full + blocks the same pass also counting every block of 16 and of 32 (per-block
                        dynamic ranges: ``trace(..., blocks=(16, 32))``)
  torch, blocks sampled ``gradstats.stats.blocks.blocks_stats(g, (16, 32), sample=2048)``: what
                        the tracer runs for blocks without the kernel (a GPU), for scale
  native portable, full the C kernel's portable loop in plain C (CPUs without AVX-512 run it
                        with the binade counts in AVX2 where they have AVX2)
  torch ops, full       the same statistics from torch reductions (the reference path; what runs
                        without a C compiler)
  torch.histc only      one ``torch.histc`` over ``log2|g|`` (a single ingredient, for scale)

Times are medians of interleaved repeats in ms per step and ns per gradient value; "x torch" is
the torch-ops time over the row's time. The rows run in turn, so each finds the tensors where the
previous row's traffic left them (mostly outside the per-core caches, as a training step's
backward pass leaves them; in-situ numbers in RESULTS.md).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable

import numpy as np
import torch
from _common import describe, fixed_batches

import gradstats.stats as stats_mod  # noqa: E402
import gradstats.stats.kernel as kernel_mod  # noqa: E402
from gradstats.stats.blocks import BLOCK_SIZES, RANGE_BINS, blocks_stats  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402


def gradients(name: str, batch: int) -> list[torch.Tensor]:
    """The neural gradients of every module with parameters for one batch."""
    model = build_model(name, seed=0)
    grads: list[torch.Tensor] = []
    handles = []
    for _, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            def fwd(mod, inp, out):
                out.register_hook(lambda g: grads.append(g.detach().clone()))
            handles.append(m.register_forward_hook(fwd))
    x, y = fixed_batches(name, 1, batch)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    return grads


@contextlib.contextmanager
def using(kernel):
    """``gradstats.stats`` with ``kernel`` (None: the torch path) as its C kernel, for the block."""
    saved = kernel_mod._native_kernel
    kernel_mod._native_kernel = lambda: kernel
    try:
        yield
    finally:
        kernel_mod._native_kernel = saved


def with_kernel(kernel, full: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(g: torch.Tensor) -> torch.Tensor:
        with using(kernel):
            return stats_mod.tensor_stats_vector(g, full=full)
    return run


def with_blocks(kernel) -> Callable[[torch.Tensor], None]:
    rows = stats_mod.VectorRows()
    counts = np.empty((len(BLOCK_SIZES), 1 + RANGE_BINS), np.int64)

    def run(g: torch.Tensor) -> None:
        with using(kernel):
            stats_mod.write_stats(g.contiguous(), rows.claim(), blocks=counts)
        rows.take()
    return run


def blocks_sampled(g: torch.Tensor) -> None:
    blocks_stats(g, (16, 32), sample=2048)


def histc_only(g: torch.Tensor) -> torch.Tensor:
    a = g.detach().reshape(-1).abs()
    return torch.histc(torch.log2(a[a > 0]), bins=277, min=-149, max=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet20"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    native, portable = kernel_mod._native_kernel(), kernel_mod._native_kernel(portable=True)
    rows: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    if native is not None:
        rows["native, full"] = with_kernel(native, True)
        rows["native, scalars"] = with_kernel(native, False)
        rows["native portable, full"] = with_kernel(portable, True)
        rows["native, full + blocks"] = with_blocks(native)
    rows["torch, blocks sampled"] = blocks_sampled
    rows["torch ops, full"] = with_kernel(None, True)
    rows["torch.histc only"] = histc_only
    print(f"statistics kernel: {describe()}, batch {args.batch}, medians of {args.repeats} interleaved repeats")
    print(f"{'model':<10} {'values':>8} {'row':<26} {'ms/step':>8} {'ns/value':>9} {'x torch':>8}")
    for name in args.models:
        grads = gradients(name, args.batch)
        n = sum(g.numel() for g in grads)
        times: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(args.repeats):
            for label, fn in rows.items():
                t0 = time.perf_counter()
                for g in grads:
                    fn(g)
                times[label].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for label, t in med.items():
            print(f"{name:<10} {n / 1e6:7.2f}M {label:<26} {t * 1e3:8.2f} {t / n * 1e9:9.3f} "
                  f"{med['torch ops, full'] / t:8.2f}")


if __name__ == "__main__":
    main()
