"""Training-step time with and without the tracer, as ratios measured in the same run.

Configurations, per model (small CNN with BatchNorm and ResNet-20 on Fashion-MNIST, batch 128):

- ``plain``: no tracer;
- ``stats every step``: statistics of every traced layer on every step, samples every 100th;
- ``stats /10, samples /100``: what a long run would use;
- ``naive``: hooks that copy each gradient to the CPU as numpy and compute the same
  statistics there (the way one would write it by hand), every step.

Configurations run interleaved in short blocks, several rounds, and the median step time of
each is reported (the machine is shared and noisy: compare ratios, not absolute times).

    python bench/trace_overhead.py [--models cnn resnet20] [--rounds 5] [--block 6]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradstats  # noqa: E402
from gradstats.data import load_fashion_mnist  # noqa: E402
from gradstats.models import build_model  # noqa: E402


class NaiveHooks:
    """The hand-written way: copy every gradient to numpy and reduce it there."""

    def __init__(self, model: nn.Module) -> None:
        self.handles = []
        self.rows = []
        for name, m in model.named_modules():
            if any(True for _ in m.parameters(recurse=False)):
                self.handles.append(m.register_forward_hook(self._fwd(name)))

    def _fwd(self, name):
        def hook(m, i, out):
            if out.requires_grad:
                out.register_hook(lambda g: self._stats(name, g))
        return hook

    def _stats(self, name, g):
        x = g.detach().cpu().numpy().astype(np.float32).ravel()
        a = np.abs(x)
        fin = np.isfinite(x)
        nz = a[fin & (a > 0)]
        ln = np.log(nz)
        hist = np.bincount(np.frexp(nz)[1] + 148, minlength=277)
        self.rows.append((name, x.size, int((a == 0).sum()), float(x[fin].sum()), float(a[fin].sum()),
                          float((x[fin] ** 2).sum()), float(ln.sum()), float((ln ** 2).sum()), hist))

    def step(self):
        self.rows.clear()

    def detach(self):
        for h in self.handles:
            h.remove()


def time_block(model, opt, batches, tracer) -> float:
    """Mean seconds per step over one block, the tracer's final flush included."""
    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if tracer is not None:
            tracer.step()
    if tracer is not None:
        tracer.detach()
    return (time.perf_counter() - t0) / len(batches)


def bench_model(name: str, rounds: int, block: int, batch: int) -> dict[str, float]:
    data = load_fashion_mnist(split="train", source="subset", subset=batch * 4)
    model = build_model(name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(block):
        idx = torch.randint(0, len(data), (batch,), generator=g)
        batches.append((data.images[idx], data.labels[idx]))
    tmp = Path(tempfile.mkdtemp(prefix="gradstats-bench-"))
    # one tracer per configuration, re-attached for each block: its step counter runs on, so
    # over all rounds the schedules are those of one long run
    tracers = {
        "plain": None,
        "stats every step": gradstats.Tracer(model, tmp / "every", every=1, sample_every=100),
        "stats /10, samples /100": gradstats.Tracer(model, tmp / "tenth", every=10, sample_every=100),
        "naive numpy hooks": "naive",
    }
    times: dict[str, list[float]] = {k: [] for k in tracers}
    time_block(model, opt, batches[:2], None)                      # warm up
    for _ in range(rounds):
        for label, tr in tracers.items():
            if tr == "naive":
                tr = NaiveHooks(model)
            elif tr is not None:
                tr.attach()
            times[label].append(time_block(model, opt, batches, tr))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet20"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"{args.rounds} rounds x {args.block} steps per configuration (medians)")
    print(f"{'model':<10} {'configuration':<26} {'ms/step':>9} {'ratio':>7}")
    for name in args.models:
        res = bench_model(name, args.rounds, args.block, args.batch)
        base = res["plain"]
        for label, t in res.items():
            print(f"{name:<10} {label:<26} {t * 1e3:9.1f} {t / base:7.3f}")


if __name__ == "__main__":
    main()
