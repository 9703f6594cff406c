"""Training-step time with and without the tracer, as ratios measured in the same run.

Per model (small CNN with BatchNorm, ResNet-20 and a stack of 48 small Linear layers, width 128,
whose step is mostly the tracer's fixed cost per layer-call; Fashion-MNIST, batch 128):

- ``plain``: no tracer;
- ``stats every step``: statistics of every traced layer (default selection: modules with
  parameters) on every step, samples every 100th;
- ``stats every step, alarms off``: the same without the alarms (checked on the writer thread,
  :mod:`gradstats.alarms`): what they cost;
- ``stats every step + blocks (16, 32)``: with the per-block statistics (:mod:`gradstats.stats.blocks`);
- ``stats /10, samples /100``: what a long run would use;
- ``naive numpy hooks``: hooks that copy each gradient to the CPU as numpy and compute the
  same statistics there (the way one would write it by hand), every step.

One tracer per configuration is re-attached for each block, so its step counter runs on and
over all rounds the schedules are those of one long run; a block's time includes committing its
steps to disk (``tracer.flush()``: about one commit per second of training, as the default
``flush_secs`` gives), not attaching and detaching, which a training run does once.
Configurations run interleaved, several rounds; ms/step is the median block, ratio the median
over rounds of a block's time over the plain block of the same round (quartiles beside it, then a
90% confidence interval of the median, and the verdict against the target: "met" when the
interval lies at or below it, "not met" above it, "within noise" when it straddles it).

    python bench/trace_overhead.py [--models cnn resnet20 linear48] [--rounds 5] [--block 20]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import fixed_batches, interleaved_ratios, step_benchmark_main, time_block
from torch import nn

import gradstats  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402


class NaiveHooks:
    """The hand-written way: copy every gradient to numpy and reduce it there."""

    def __init__(self, model: nn.Module) -> None:
        self.handles = []
        for name, m in model.named_modules():
            if any(True for _ in m.parameters(recurse=False)):
                self.handles.append(m.register_forward_hook(self._fwd()))

    def _fwd(self):
        def hook(m, i, out):
            if out.requires_grad:
                out.register_hook(self._stats)
        return hook

    @staticmethod
    def _stats(g):
        x = g.detach().cpu().numpy().astype(np.float32).ravel()
        a = np.abs(x)
        fin = np.isfinite(x)
        nz = a[fin & (a > 0)]
        ln = np.log(nz)
        np.bincount(np.frexp(nz)[1] + 148, minlength=277)
        _ = (x.size, int((a == 0).sum()), x[fin].sum(), a[fin].sum(), (x[fin] ** 2).sum(), ln.sum(), (ln ** 2).sum())
        # returns None: the gradient flows on unchanged

    def detach(self):
        for h in self.handles:
            h.remove()


def linear48(width: int = 128) -> nn.Sequential:
    """48 small Linear layers (784 -> width, 46 x width -> width with ReLU, width -> 10): a model
    whose step is mostly the fixed cost of each traced layer-call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, width), nn.ReLU()]
    for _ in range(46):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


#: the most each configuration's ratio may be, on this CPU (the 48 small layers: 1.3)
TARGETS = {"stats every step": 1.10, "stats /10, samples /100": 1.03, ("linear48", "stats every step"): 1.30}


def bench_model(name: str, rounds: int, block: int, batch: int) -> dict[str, float]:
    model = linear48() if name == "linear48" else build_model(name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = fixed_batches("cnn" if name == "linear48" else name, block, batch)
    tmp = Path(tempfile.mkdtemp(prefix="gradstats-bench-"))
    # resume=True: each block re-attaches and continues the configuration's own run
    every = gradstats.Tracer(model, tmp / "every", every=1, sample_every=100, resume=True)
    tenth = gradstats.Tracer(model, tmp / "tenth", every=10, sample_every=100, resume=True)
    quiet = gradstats.Tracer(model, tmp / "quiet", every=1, sample_every=100, resume=True, alarms=False)
    blocks = gradstats.Tracer(model, tmp / "blocks", every=1, sample_every=100, resume=True, blocks=(16, 32))

    def traced(tr):
        tr.attach()                    # once per training in real use: not timed
        t = time_block(model, opt, batches, tr.step, tr.flush)    # the block's commit is timed
        tr.detach()
        return t

    def naive():
        hooks = NaiveHooks(model)
        return time_block(model, opt, batches, None, hooks.detach)

    time_block(model, opt, batches[:2])                                    # warm up
    return interleaved_ratios({"plain": lambda: time_block(model, opt, batches),
                        "stats every step": lambda: traced(every),
                        "stats every step, alarms off": lambda: traced(quiet),
                        "stats every step + blocks (16, 32)": lambda: traced(blocks),
                        "stats /10, samples /100": lambda: traced(tenth),
                        "naive numpy hooks": naive}, rounds)


def main() -> None:
    step_benchmark_main(__doc__, "trace overhead", lambda name, a: bench_model(name, a.rounds, a.block, a.batch),
                        models=["cnn", "resnet20", "linear48"], rounds=5, block=20, targets=TARGETS)


if __name__ == "__main__":
    main()
