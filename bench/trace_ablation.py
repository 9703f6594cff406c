"""Where the tracer's cost in a training step comes from: the tracer taken apart, as ratios to
the plain step measured in the same run (statistics on every step, no samples).

- ``forward hooks only``: a no-op forward hook on every traced module;
- ``+ tensor hooks``: forward hooks that register a no-op gradient hook on each output (the
  least any hook-based capture costs);
- ``tracer, no kernel``: the tracer with the statistics kernel call replaced by zeroing the row
  (hooks, checks, rows, keys, commits: everything but the statistics);
- ``tracer, plain read``: the same with ``torch.sum`` of the gradient instead of the kernel (the
  cost of reading the gradients once more);
- ``tracer``: the real thing.

Configurations run interleaved; ratio = median over rounds of a block's time over the plain
block of the same round (quartiles beside it).

    python bench/trace_ablation.py [--models resnet20] [--rounds 31] [--block 5]
"""
from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import torch
from _common import fixed_batches, interleaved_ratios, step_benchmark_main, time_block

import gradstats  # noqa: E402
import gradstats.tracer.capture as tracer_module  # noqa: E402
from gradstats.stats import VECTOR_LEN  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402


def bench_model(name: str, rounds: int, block: int, batch: int) -> dict[str, tuple]:
    model = build_model(name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = fixed_batches(name, block, batch)
    traced_modules = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    real_write = tracer_module.write_stats

    def hooks_only(with_tensor_hook: bool) -> float:
        def tensor_hook(grad):
            return None

        def forward_hook(module, inputs, output):
            if with_tensor_hook and output.requires_grad:
                output.register_hook(tensor_hook)

        handles = [m.register_forward_hook(forward_hook) for m in traced_modules]
        t = time_block(model, opt, batches)
        for h in handles:
            h.remove()
        return t

    tmp = Path(tempfile.mkdtemp(prefix="gradstats-ablation-"))
    tracers = {k: gradstats.Tracer(model, tmp / k, every=1, sample_every=None, resume=True)   # re-attached per block
               for k in ("none", "read", "full")}
    row_bytes = VECTOR_LEN * 8      # rows the kernel does not write are zeroed (no statistics)
    writes = {"none": lambda x, address: ctypes.memset(address, 0, row_bytes),
              "read": lambda x, address: (x.sum(), ctypes.memset(address, 0, row_bytes)),
              "full": real_write}

    def traced(kind: str) -> float:
        tracer_module.write_stats = writes[kind]
        tr = tracers[kind]
        tr.attach()
        try:
            return time_block(model, opt, batches, tr.step, tr.flush)
        finally:
            tr.detach()
            tracer_module.write_stats = real_write

    time_block(model, opt, batches[:2])                                    # warm up
    return interleaved_ratios({"plain": lambda: time_block(model, opt, batches),
                               "forward hooks only": lambda: hooks_only(False),
                               "+ tensor hooks": lambda: hooks_only(True),
                               "tracer, no kernel": lambda: traced("none"),
                               "tracer, plain read": lambda: traced("read"),
                               "tracer": lambda: traced("full")}, rounds)


def main() -> None:
    step_benchmark_main(__doc__, "tracer ablation", lambda name, a: bench_model(name, a.rounds, a.block, a.batch),
                        models=["resnet20"], rounds=31, block=5)


if __name__ == "__main__":
    main()
