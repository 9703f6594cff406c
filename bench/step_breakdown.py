"""Where the tracer's and a plan's cost per training step goes: the kernels against the Python around them.

Per model (the workloads of ``apply_overhead.py``), on the gradients of one real training step:

- ``plain step``: a training step without gradstats (median of ``--repeats`` steps);
- trace: ``stats kernel``, the fused statistics kernel (``gradstats.stats.write_stats``) over every traced
  layer's output gradient, which ``trace``'s defaults read on every step: the least the tracer can cost
  without reading less;
- apply (``recommend(bits=6, sparsity=0.85)``, or ``--plan``): per planned layer, one call of the hook's
  work on its real gradient, split into the statistics kernel (``refresh``'s sweep), the prune + quantise
  kernel, the histogram rule's distribution (where the layer's rule uses it), and the rest (the
  threshold and scale solve, the counts, records and alerts, the Python glue).

Every part is the median of ``--repeats`` calls on the same tensors (their data warm in the caches, so
this is a floor: in a training step the kernels meet gradients fresh from the backward pass, and
``apply_overhead.py``/``trace_overhead.py``, interleaved with plain steps, measure the whole). CPU time,
one thread.

With ``--in-step``, the same parts measured inside training steps instead (what the warm floor above
leaves out: the kernels meet gradients fresh from the backward pass, and the Python runs between the
backward's own kernels, its data gone from the caches): per plan (``recommend(bits=8)`` and the plan
above), blocks of applied steps interleaved with blocks of plain steps, and in each applied step the CPU
time of the two C kernels (the statistics and the prune + quantise kernels, per-tensor formats), of the
planned layers' hooks as a whole (the rest of it: the Python), and of the step less the plain step's
(what is left outside the hooks). Medians over the steps. And first, the statistics kernel of ``trace``
(``trace: stats alone (N M)``, N million gradient values a step): the same blocks with bare hooks on every
layer ``trace`` reads by default that write each gradient's full statistics row (moments, binade counts, top
magnitudes) and nothing else; the kernel's time per step and per value. Its "hooks: rest" is the step's time
less the plain step's and the kernel's: the hooks' machinery and what the kernel's pass costs the backward
around it.

    python bench/step_breakdown.py [--models mobilenet resnet20 gpt_neox] [--repeats 30] [--in-step]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import _common
import torch
from _common import median_seconds, time_block
from apply_overhead import workload

import gradstats  # noqa: E402
from gradstats.apply import refresh  # noqa: E402
from gradstats.ops.fused import prune_quantize  # noqa: E402
from gradstats.pruning.rules import THRESHOLD_RULES  # noqa: E402
from gradstats.stats import VectorRows, kernel_applies, write_stats  # noqa: E402


def median_us(f, repeats: int) -> float:
    return median_seconds(f, repeats) * 1e6


def traced_gradients(model, batches, loss_fn) -> dict[str, torch.Tensor]:
    """The output gradient of every module with parameters (what ``trace`` reads), one step."""
    grads: dict[str, torch.Tensor] = {}
    handles = []
    for name, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            def fwd(mod, i, out, name=name):
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))
            handles.append(m.register_forward_hook(fwd))
    x, y = batches[0]
    (loss_fn(model, x, y) if loss_fn else torch.nn.functional.cross_entropy(model(x), y)).backward()
    for h in handles:
        h.remove()
    return grads


def bench_model(name: str, plan_kw: dict, repeats: int) -> dict[str, float]:
    logging.getLogger("gradstats").setLevel(logging.ERROR)
    model, batches, loss_fn = workload(name, 4, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step_us = statistics.median(time_block(model, opt, batches[:1], loss_fn=loss_fn) for _ in range(repeats)) * 1e6
    rows = VectorRows()
    stats_us = 0.0
    grads = traced_gradients(model, batches, loss_fn)
    for g in grads.values():
        g = g.contiguous()
        if kernel_applies(g):
            address = rows.claim()
            stats_us += median_us(lambda: write_stats(g, address), repeats)
    import tempfile

    path = tempfile.mkdtemp(prefix="step-breakdown-")
    with gradstats.trace(model, path) as t:              # the plan a user gets from 8 traced steps
        time_block(model, opt, (batches * 8)[:8], t.step, loss_fn=loss_fn)
    handle = gradstats.apply(model, gradstats.recommend(path, **plan_kw))
    calls: dict[str, torch.Tensor] = {}
    compress = handle._compress_on

    def grab(layer: str, g: torch.Tensor) -> torch.Tensor:
        calls[layer] = g.detach().clone()
        return compress(layer, g)

    handle._compress_on = grab
    x, y = batches[0]
    (loss_fn(model, x, y) if loss_fn else torch.nn.functional.cross_entropy(model(x), y)).backward()
    handle._compress_on = compress
    parts = {"call": 0.0, "stats": 0.0, "prune": 0.0, "hist": 0.0}
    for layer, g in calls.items():
        rule, st = handle.rules[layer], handle.state[layer]
        hist = rule.prunes and THRESHOLD_RULES[rule.threshold_rule].needs_histogram
        parts["call"] += median_us(lambda: compress(layer, g), repeats)
        parts["stats"] += median_us(lambda: refresh.stats_vector(g, hist), repeats)
        v = refresh.stats_vector(g, hist)
        if hist:
            parts["hist"] += median_us(lambda: refresh.histogram_of(v), repeats)
        q = handle._quantize_args(layer, rule, g)
        fmt = q.pop("fmt")
        parts["prune"] += median_us(lambda: prune_quantize(g, st.threshold if rule.prunes else 0.0, fmt,
                                                           scale=st.scale, generator=handle.generator, **q), repeats)
    handle.remove()
    return {"step": step_us, "trace_layers": len(grads), "trace_stats": stats_us, "apply_layers": len(calls),
            **parts}


class _Timed:
    """A C kernel's function, its calls' CPU time added to ``spent[key]``."""

    def __init__(self, fn, spent: dict[str, float], key: str) -> None:
        self.fn, self.spent, self.key = fn, spent, key

    def __call__(self, *args):
        t0 = time.process_time()
        try:
            return self.fn(*args)
        finally:
            self.spent[self.key] += time.process_time() - t0


def in_step(name: str, plans: dict[str, dict], rounds: int) -> dict[str, dict[str, float]]:
    """Per plan: the median per-step ms of the plain step, the applied step, and in the applied step the
    statistics kernel, the prune + quantise kernel, the hooks' rest, and what lies outside the hooks."""
    from gradstats.ops import fused
    from gradstats.stats import kernel as skernel

    logging.getLogger("gradstats").setLevel(logging.ERROR)
    model, batches, loss_fn = workload(name, 6, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    import tempfile

    path = tempfile.mkdtemp(prefix="step-breakdown-")
    with gradstats.trace(model, path) as t:              # the plans a user gets from 8 traced steps
        time_block(model, opt, (batches * 8)[:8], t.step, loss_fn=loss_fn)
    spent = {"stats": 0.0, "prune": 0.0, "hook": 0.0}
    stats_fn, prune_fn = skernel._native_kernel(), fused._native()
    keep = skernel._native_kernel, fused._native
    skernel._native_kernel = lambda portable=False: _Timed(stats_fn, spent, "stats")
    fused._native = lambda: _Timed(prune_fn, spent, "prune")

    def steps(handle=None) -> list[tuple[float, ...]]:
        rows = []
        for x, y in batches:
            for k in spent:
                spent[k] = 0.0
            t0 = time.process_time()
            opt.zero_grad(set_to_none=True)
            (loss_fn(model, x, y) if loss_fn else torch.nn.functional.cross_entropy(model(x), y)).backward()
            opt.step()
            rows.append((time.process_time() - t0, spent["stats"], spent["prune"], spent["hook"]))
        return rows

    out = {}
    try:
        traced = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        rows = VectorRows()
        values = {"n": 0.0}

        def stats_alone(layer: str, g: torch.Tensor) -> None:      # trace's floor: the full row, nothing else
            if kernel_applies(g):
                values["n"] += g.numel()
                write_stats(g, rows.claim())
                rows.take()
        plain, traced_steps = [], []
        for r in range(rounds):
            plain += steps()
            values["n"] = 0.0
            with _common.gradient_hooks(model, traced, stats_alone):
                traced_steps += steps()
        med = lambda rows_, i: statistics.median(r_[i] for r_ in rows_) * 1e3  # noqa: E731
        per_step = values["n"] / len(batches)
        out[f"trace: stats alone ({per_step / 1e6:.2f} M)"] = {
            "plain": med(plain, 0), "step": med(traced_steps, 0), "stats": med(traced_steps, 1), "prune": 0.0,
            "hook": med(traced_steps, 0) - med(plain, 0), "ns_per_value": med(traced_steps, 1) * 1e6 / per_step}
        for label, kw in plans.items():
            plan = gradstats.recommend(path, **kw)
            plain, applied = [], []
            for r in range(rounds):
                plain += steps()
                handle = gradstats.apply(model, plan)
                compress = handle._compress_on

                def timed(layer, g, compress=compress):
                    t0 = time.process_time()
                    try:
                        return compress(layer, g)
                    finally:
                        spent["hook"] += time.process_time() - t0

                handle._compress_on = timed
                applied += steps()
                handle.remove()
            med = lambda rows, i: statistics.median(r[i] for r in rows) * 1e3  # noqa: E731
            out[label] = {"plain": med(plain, 0), "step": med(applied, 0), "stats": med(applied, 1),
                          "prune": med(applied, 2), "hook": med(applied, 3)}
    finally:
        skernel._native_kernel, fused._native = keep
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mobilenet", "resnet20", "gpt_neox"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--bits", type=int, default=6)
    ap.add_argument("--sparsity", type=float, default=0.85)
    ap.add_argument("--in-step", action="store_true", help="the parts inside training steps (see above)")
    ap.add_argument("--rounds", type=int, default=5, help="--in-step: blocks of 6 steps per configuration")
    a = ap.parse_args()
    torch.set_num_threads(1)
    _common.CLOCK = time.process_time                     # the plain step in CPU time too
    if a.in_step:
        plans = {"recommend(bits=8)": {"bits": 8},
                 f"recommend(bits={a.bits}, sparsity={a.sparsity})": {"bits": a.bits, "sparsity": a.sparsity}}
        print(f"in the step: torch {torch.__version__}, 1 thread, CPU time, medians of {a.rounds} x 6 steps; ms per "
              "step (share of the plain step)")
        print(f"{'model':10s} {'plan':34s} {'plain':>7s} {'applied':>8s} {'added':>14s} {'stats kernel':>14s} "
              f"{'prune+quantise':>15s} {'hooks: rest':>14s} {'outside hooks':>14s}")
        for name in a.models:
            for label, r in in_step(name, plans, a.rounds).items():
                pct = lambda ms: f"{ms:5.1f} ({ms / r['plain'] * 100:4.1f}%)"  # noqa: E731
                rest = r["hook"] - r["stats"] - r["prune"]
                print(f"{name:10s} {label:34s} {r['plain']:7.1f} {r['step']:8.1f} {pct(r['step'] - r['plain']):>14s} "
                      f"{pct(r['stats']):>14s} {pct(r['prune']):>15s} {pct(rest):>14s} "
                      f"{pct(r['step'] - r['plain'] - r['hook']):>14s}"
                      + (f"   statistics kernel {r['ns_per_value']:.2f} ns a value" if "ns_per_value" in r else ""))
        return
    print(f"step breakdown: torch {torch.__version__}, 1 thread, CPU time, medians of {a.repeats}; "
          f"apply: recommend(bits={a.bits}, sparsity={a.sparsity}); us per step (share of the plain step)")
    head = (f"{'model':10s} {'plain step':>10s} | {'trace: layers':>13s} {'stats kernel':>16s} | "
            f"{'apply: layers':>13s} {'stats kernel':>16s} {'prune+quantise':>16s} {'histogram':>14s} "
            f"{'rest (Python)':>16s} {'all':>16s}")
    print(head)
    for name in a.models:
        r = bench_model(name, {"bits": a.bits, "sparsity": a.sparsity}, a.repeats)
        pct = lambda us: f"{us:7.0f} ({us / r['step'] * 100:4.1f}%)"  # noqa: E731
        rest = r["call"] - r["stats"] - r["prune"] - r["hist"]
        print(f"{name:10s} {r['step']:10.0f} | {r['trace_layers']:13d} {pct(r['trace_stats']):>16s} | "
              f"{r['apply_layers']:13d} {pct(r['stats']):>16s} {pct(r['prune']):>16s} {pct(r['hist']):>14s} "
              f"{pct(rest):>16s} {pct(r['call']):>16s}")


if __name__ == "__main__":
    main()
