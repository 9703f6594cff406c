"""Training-step time with and without the tracer, as ratios measured in the same run.

Per model: the zoo's MobileNetV2-style CNN (``mobilenet``, Fashion-MNIST 28x28, batch 64), ResNet-20
(``resnet20``, batch 128) and a ``transformers`` GPT-NeoX from a tiny config (``gpt_neox``: 2 layers,
width 128, 16 windows of 64 Shakespeare characters), the workloads of ``apply_overhead.py``; also
``linear48``, a stack of 48 small Linear layers (width 128) whose step is mostly the tracer's fixed
cost per layer-call, and the small ``cnn``:

- ``plain``: no tracer;
- ``stats every step``: ``trace``'s defaults: statistics of every traced layer (modules with
  parameters) on every step, samples (and the per-block statistics) every 100th;
- ``stats every step, alarms off``: the same without the alarms (checked on the writer thread,
  :mod:`gradstats.alarms`): what they cost;
- ``stats every step + blocks (16, 32)``: with the per-block statistics on every step
  (:mod:`gradstats.stats.blocks`);
- ``stats /10, samples /100``: what a long run would use;
- ``stats kernel alone``: the floor of ``stats every step``: each traced layer's gradient meets only
  the statistics kernel, in bare hooks (``trace`` less this row: what its hooks, records, commits and
  alarms add to the per-value work);
- ``naive numpy hooks``: hooks that copy each gradient to the CPU as numpy and compute the
  same statistics there (the way one would write it by hand), every step.

One tracer per configuration is re-attached for each block, so its step counter runs on and
over all rounds the schedules are those of one long run; a block's time includes committing its
steps to disk (``tracer.flush()``: about one commit per second of training, as the default
``flush_secs`` gives), not attaching and detaching, which a training run does once.
Configurations run interleaved, several rounds; ms/step is the median block, ratio the median
over rounds of a block's time over the plain block of the same round (quartiles beside it, then a
90% confidence interval of the median, and the verdict against the target: "met" when the
interval lies at or below it, "not met" above it, "within noise" when it straddles it). With
``--clock cpu`` the process's CPU time on one thread (the writer thread's included) is timed
instead of the wall clock, which on a shared machine measures the neighbours too.

    python bench/trace_overhead.py [--models mobilenet resnet20 gpt_neox linear48] [--rounds 5] [--block 20] [--clock cpu]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import fixed_batches, gradient_hooks, interleaved_ratios, step_benchmark_main, time_block
from apply_overhead import workload
from torch import nn

import gradstats  # noqa: E402
from gradstats.stats import VECTOR_LEN  # noqa: E402
from gradstats.stats.kernel import kernel_applies, write_stats_raw  # noqa: E402


class NaiveHooks:
    """The hand-written way: copy every gradient to numpy and reduce it there."""

    def __init__(self, model: nn.Module) -> None:
        self.handles = []
        for name, m in model.named_modules():
            if any(True for _ in m.parameters(recurse=False)):
                self.handles.append(m.register_forward_hook(self._fwd()))

    def _fwd(self):
        def hook(m, i, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
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


def kernel_alone(model: nn.Module, opt: torch.optim.Optimizer, batches: list, loss_fn, layers: list[str]):
    """A block of training steps in which each traced layer's output gradient meets only the statistics
    kernel (the full row ``trace`` writes: moments, binade counts, top magnitudes), in bare hooks
    (:func:`_common.gradient_hooks`), into a row of its own: the least ``trace``'s defaults can cost on this
    CPU without reading less (``trace`` less this row: its fixed costs)."""
    rows = {n: np.empty(VECTOR_LEN) for n in layers}
    rows_at = {n: (row, row.ctypes.data) for n, row in rows.items()}   # each row kept alive beside its address,
    #                                                                    taken once as apply's refresh does

    def stats(name: str, g: torch.Tensor) -> None:
        if kernel_applies(g):
            write_stats_raw(g.data_ptr(), g.numel(), rows_at[name][1])

    def run() -> float:
        with gradient_hooks(model, layers, stats):
            return time_block(model, opt, batches, loss_fn=loss_fn)
    return run


def bench_model(name: str, rounds: int, block: int, batch: int | None) -> dict[str, float]:
    if name == "linear48":
        model, batches, loss_fn = linear48(), fixed_batches("cnn", block, batch or 128), None
    else:
        model, batches, loss_fn = workload(name, block, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tmp = Path(tempfile.mkdtemp(prefix="gradstats-bench-"))
    # resume=True: each block re-attaches and continues the configuration's own run
    every = gradstats.Tracer(model, tmp / "every", resume=True)
    tenth = gradstats.Tracer(model, tmp / "tenth", every=10, resume=True)
    quiet = gradstats.Tracer(model, tmp / "quiet", resume=True, alarms=False)
    blocks = gradstats.Tracer(model, tmp / "blocks", resume=True, blocks=(16, 32))

    def timed(after=None, finish=None) -> float:
        return time_block(model, opt, batches, after, finish, loss_fn=loss_fn)

    def traced(tr):
        tr.attach()                    # once per training in real use: not timed
        t = timed(tr.step, tr.flush)   # the block's commit is timed
        tr.detach()
        return t

    def naive():
        hooks = NaiveHooks(model)
        return timed(None, hooks.detach)

    time_block(model, opt, batches[:2], loss_fn=loss_fn)                    # warm up
    return interleaved_ratios({"plain": timed,
                               "stats every step": lambda: traced(every),
                               "stats kernel alone": kernel_alone(model, opt, batches, loss_fn, list(every.modules)),
                               "stats every step, alarms off": lambda: traced(quiet),
                               "stats every step + blocks (16, 32)": lambda: traced(blocks),
                               "stats /10, samples /100": lambda: traced(tenth),
                               "naive numpy hooks": naive}, rounds)


def main() -> None:
    step_benchmark_main(__doc__, "trace overhead", lambda name, a: bench_model(name, a.rounds, a.block, a.batch),
                        models=["mobilenet", "resnet20", "gpt_neox"], rounds=5, block=20, targets=TARGETS,
                        batch=None)


if __name__ == "__main__":
    main()
