"""Training-step time with a plan applied, against plain steps of the same model in the same run.

The plans a user gets: ``gradstats.recommend(run, bits=8)`` (the default) and ``recommend(run,
bits=6, sparsity=0.85)``, made from a short trace (``--trace-steps``, 8) of the same model, applied
with ``gradstats.apply``'s defaults (refreshed on every gradient, records kept, alerts on). Models:
the zoo's MobileNetV2-style CNN (``mobilenet``, Fashion-MNIST 28x28, batch 64), ResNet-20
(``resnet20``, batch 128) and a ``transformers`` GPT-NeoX from a tiny config (``gpt_neox``: 2 layers,
width 128, 16 windows of 64 Shakespeare characters). With ``--reference``, also the earlier reference
setting: FP6 (e3m2fn) at lognormal-optimal per-layer scales, nearest rounding, plus 85% stochastic
pruning on every convolution and linear layer, with the lognormal and the histogram threshold rule.
With ``--refresh-every N``, also the recommended plans with ``apply(..., refresh_every=N)``: what
refreshing less often would save. With ``--floor``, also each recommended plan's floor,
``<plan>, kernels alone`` (:func:`kernels_alone`): its statistics and prune + quantise kernels in bare
hooks, no solve, checks or records; ``apply``'s ratio less the floor's is what ``apply`` adds to the
per-value work its plan asks for; and ``<plan>, prune + quantise alone``, the rounding kernel without the
statistics: the least any design costs that rounds every gradient with that kernel; and ``<plan>, a copy
alone``, each planned gradient replaced by a copy of itself: the least any hook costs that hands back a new
gradient. With ``--four-bit``, also the four-bit block formats on every matmul layer (``Plan.uniform(format="nvfp4")``
and ``"mxfp4"``; the output layer exact), each through the fused C block kernel and, as its peer in the same
run, through the composed operators it replaces (``gradstats.quantize`` after ``stochastic_prune``).

Interleaved blocks: ms/step is the median block, ratio the median over rounds of a block's time over
the plain block of the same round (quartiles and the 90% confidence interval of the median beside
it), against a target of 1.20x. The plans' alerts are silenced (logged at ERROR only).

On a shared machine the wall clock measures the neighbours too: ``--clock cpu`` times the process's
CPU time on one thread (torch's and the kernels' alike), the work a step costs.

    python bench/apply_overhead.py [--models mobilenet resnet20 gpt_neox] [--rounds 7] [--block 6] [--clock cpu]
                                   [--reference] [--four-bit] [--floor]
"""
from __future__ import annotations

import logging
import tempfile
from typing import Any, Callable

import numpy as np
import torch
from _common import (
    composed_operators,
    fixed_batches,
    gpt_neox_tiny,
    gradient_hooks,
    interleaved_ratios,
    lm_loss,
    step_benchmark_main,
    text_batches,
    time_block,
)

import gradstats  # noqa: E402
from gradstats.ops.fused import NativeCall, prune_quantize  # noqa: E402
from gradstats.plan import CONV_LINEAR_TYPES, Plan, PlanEntry, Rule  # noqa: E402
from gradstats.pruning.rules import THRESHOLD_RULES  # noqa: E402
from gradstats.stats import VECTOR_LEN  # noqa: E402
from gradstats.stats.kernel import kernel_applies, write_stats_raw  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402

#: the most a plan's ratio to a plain step may be, on this CPU
TARGET = 1.20
PLANS = {"recommend(bits=8)": {"bits": 8}, "recommend(bits=6, sparsity=0.85)": {"bits": 6, "sparsity": 0.85}}
REFERENCE = ("fp6 + 85%, lognormal rule", "fp6 + 85%, histogram rule")
TARGETS = {label: TARGET for label in (*PLANS, *REFERENCE)}
#: the four-bit block formats of --four-bit (no target: the composed operators are their peer)
FOUR_BIT = ("nvfp4", "mxfp4")
COMPOSED = " (composed operators)"
#: the label suffix of a plan's floor configuration (--floor)
FLOOR = ", kernels alone"
#: ... and of its prune + quantise kernel alone (--floor)
ROUNDING_FLOOR = ", prune + quantise alone"
#: ... and of a copy of each gradient alone (--floor): what any hook that hands back a new tensor costs
COPY_FLOOR = ", a copy alone"
#: each model's batch (GPT-NeoX: windows of 64 characters)
BATCH = {"mobilenet": 64, "resnet20": 128, "cnn": 128, "gpt_neox": 16}


def every_conv_linear(**rule: Any) -> Plan:
    """One rule on every convolution and linear layer, the output layer included (the reference
    setting, independent of ``recommend``'s choices)."""
    return Plan([PlanEntry("*", types=CONV_LINEAR_TYPES)], Rule(**rule))


def workload(name: str, n: int, batch: int | None) -> tuple[torch.nn.Module, list, Callable | None]:
    """``(model, n batches, loss function or None for cross-entropy of model(x))``."""
    b = batch or BATCH.get(name, 128)
    if name == "gpt_neox":
        batches, vocab = text_batches(n, b)
        return gpt_neox_tiny(vocab), batches, lm_loss
    return build_model(name, seed=0), fixed_batches(name, n, b), None


def recommended(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, loss_fn: Callable | None,
                steps: int) -> dict[str, Plan]:
    """The plans of :data:`PLANS`, recommended from a trace of ``steps`` training steps."""
    path = tempfile.mkdtemp(prefix="apply-overhead-")
    with gradstats.trace(model, path) as t:
        time_block(model, opt, (batches * steps)[:steps], t.step, loss_fn=loss_fn)
    return {label: gradstats.recommend(path, **kw) for label, kw in PLANS.items()}


def composed_blocks(run: Callable[[], float]) -> float:
    """``run()`` with block formats through the composed operators (:func:`_common.composed_operators`)."""
    with composed_operators():
        return run()


def kernels_alone(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, loss_fn: Callable | None,
                  plan: Plan, stats: bool = True) -> Callable[[], float]:
    """A block of training steps in which each planned layer's output gradient meets only the plan's C kernels,
    in bare hooks (:func:`_common.gradient_hooks`): the statistics kernel (with the binade counts where the
    layer's rule reads them, as ``apply``'s refresh) and the fused prune + quantise kernel, at the threshold and
    scale ``apply`` reached after two steps, with a fixed seed. No solve, no checks, no records: the least a
    plan costs that reads each gradient's statistics and rounds it on this CPU (``apply`` less this row: its
    fixed costs). ``stats=False``: the prune + quantise kernel alone, the least any design costs that rounds
    every gradient with it (one that gathered the statistics in the same pass would cost more)."""
    handle = gradstats.apply(model, plan)
    time_block(model, opt, batches[:2], loss_fn=loss_fn)
    parts = {}
    for name, rule in handle.rules.items():
        st = handle.state[name]
        full = rule.prunes and THRESHOLD_RULES[rule.threshold_rule].needs_histogram
        scheme = rule.scheme if rule.quantizes else None
        row = np.empty(VECTOR_LEN)                # its address taken once, as apply's refresh does
        parts[name] = (full, NativeCall(scheme), scheme, st.threshold if rule.prunes else 0.0, st.scale, row,
                       row.ctypes.data)
    handle.remove()

    def kernels(name: str, g: torch.Tensor) -> torch.Tensor:
        full, call, scheme, threshold, scale, _, at = parts[name]
        if kernel_applies(g) and call.covers(scale):     # (kernel_applies: the tensor check takes makes)
            if stats:
                write_stats_raw(g.data_ptr(), g.numel(), at, full=full)
            return call(g, threshold, scale, seed=1)[0]
        return prune_quantize(g, threshold, scheme, scale=scale, seed=1)[0]      # (not a flat float32 gradient)

    def run() -> float:
        with gradient_hooks(model, list(parts), kernels):
            return time_block(model, opt, batches, loss_fn=loss_fn)
    return run


def copy_alone(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, loss_fn: Callable | None,
               plan: Plan) -> Callable[[], float]:
    """A block of training steps in which each planned layer's output gradient is replaced by a copy of itself,
    in bare hooks: the least any hook costs that hands back a new gradient (its allocation, the pass that writes
    it, and what that pass costs the backward around it), whatever it computes."""
    handle = gradstats.apply(model, plan)
    layers = list(handle.rules)
    handle.remove()

    def run() -> float:
        with gradient_hooks(model, layers, lambda name, g: g.clone()):
            return time_block(model, opt, batches, loss_fn=loss_fn)
    return run


def bench_model(name: str, rounds: int, block: int, batch: int | None, trace_steps: int,
                reference: bool, four_bit: bool = False, refresh_every: int | None = None, floor: bool = False
                ) -> dict[str, tuple[float, ...]]:
    logging.getLogger("gradstats.apply").setLevel(logging.ERROR)
    logging.getLogger("gradstats").setLevel(logging.ERROR)
    model, batches, loss_fn = workload(name, block, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    plans = recommended(model, opt, batches, loss_fn, trace_steps)
    if reference:
        fp6 = {"format": "e3m2fn", "scale": "lognormal", "rounding": "nearest", "sparsity": 0.85}
        plans[REFERENCE[0]] = every_conv_linear(**fp6, threshold_rule="lognormal")
        plans[REFERENCE[1]] = every_conv_linear(**fp6, threshold_rule="histogram")

    def applied(plan: Plan, **options: Any) -> float:
        handle = gradstats.apply(model, plan, **options)
        return time_block(model, opt, batches, None, handle.remove, loss_fn=loss_fn)

    time_block(model, opt, batches[:2], loss_fn=loss_fn)
    configs: dict[str, Callable[[], float]] = {"plain": lambda: time_block(model, opt, batches, loss_fn=loss_fn)}
    configs.update({label: (lambda p=p: applied(p)) for label, p in plans.items()})
    if floor:
        for label, p in plans.items():
            if label in PLANS:
                configs[label + FLOOR] = kernels_alone(model, opt, batches, loss_fn, p)
                configs[label + ROUNDING_FLOOR] = kernels_alone(model, opt, batches, loss_fn, p, stats=False)
                configs[label + COPY_FLOOR] = copy_alone(model, opt, batches, loss_fn, p)
    if refresh_every:
        configs.update({f"{label}, refresh_every={refresh_every}": (lambda p=p: applied(p, refresh_every=refresh_every))
                        for label, p in plans.items() if label in PLANS})
    if four_bit:
        for fmt in FOUR_BIT:
            p = Plan.uniform(format=fmt)
            label = f"Plan.uniform(format={fmt!r})"
            configs[label] = lambda p=p: applied(p)
            configs[label + COMPOSED] = lambda p=p: composed_blocks(lambda: applied(p))
    return interleaved_ratios(configs, rounds)


def main() -> None:
    step_benchmark_main(__doc__, "apply overhead",
                        lambda name, a: bench_model(name, a.rounds, a.block, a.batch, a.trace_steps, a.reference,
                                                    a.four_bit, a.refresh_every, a.floor),
                        models=["mobilenet", "resnet20", "gpt_neox"], rounds=7, block=6, targets=TARGETS,
                        batch=None, add_args=lambda ap: (
                            ap.add_argument("--trace-steps", type=int, default=8),
                            ap.add_argument("--reference", action="store_true",
                                            help="also the FP6 + 85%% reference plan on every conv and linear layer"),
                            ap.add_argument("--four-bit", action="store_true",
                                            help="also NVFP4 and MXFP4 on every matmul layer, fused and composed"),
                            ap.add_argument("--refresh-every", type=int, default=None, metavar="N",
                                            help="also the recommended plans applied with refresh_every=N (the "
                                                 "statistics, threshold and scale solved on every N-th gradient)"),
                            ap.add_argument("--floor", action="store_true",
                                            help="also each recommended plan's C kernels alone in bare hooks "
                                                 "(the least it can cost; apply less that: its fixed costs), its "
                                                 "rounding kernel alone, and a copy of each gradient alone")))


if __name__ == "__main__":
    main()
