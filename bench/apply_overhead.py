"""Training-step time with a plan applied to every conv and linear layer, against plain steps.

The plan (the issue's reference setting): FP6 (e3m2fn) neural gradients with lognormal-optimal
per-layer scales, plus 85% stochastic pruning, on every convolution and linear layer; refreshed
every step, with the lognormal threshold rule and with the binade-histogram rule. Also: pruning
only, quantisation only, the plan refreshed every 10th gradient, and ``Plan.uniform``'s defaults
for FP6 + 85% (whatever rounding, scale and threshold rules and layers they choose). Small CNN and ResNet-20 on
Fashion-MNIST, batch 128; interleaved blocks: ms/step is the median block, ratio the median over
rounds of a block's time over the plain block of the same round (quartiles and the 90%
confidence interval of the median beside it). The plan's alerts (it flushes most of the values
FP6 sees at the MSE-optimal scale) are silenced here.

    python bench/apply_overhead.py [--models cnn resnet20] [--rounds 5] [--block 10]
"""
from __future__ import annotations

import logging

import torch
from _common import fixed_batches, interleaved_ratios, step_benchmark_main, time_block

import gradstats  # noqa: E402
from gradstats.plan import CONV_LINEAR_TYPES, Plan, PlanEntry, Rule  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402

#: the most the reference plan's ratio may be, on this CPU
TARGETS = {"fp6 + 85% sparsity": 1.20, "fp6 + 85%, histogram rule": 1.20}


def every_conv_linear(**rule) -> Plan:
    """One rule on every convolution and linear layer, the output layer included (the reference
    setting, independent of ``Plan.uniform``'s defaults)."""
    return Plan([PlanEntry("*", types=CONV_LINEAR_TYPES)], Rule(**rule))


def bench_model(name: str, rounds: int, block: int, batch: int, scale: str) -> dict[str, float]:
    logging.getLogger("gradstats.apply").setLevel(logging.ERROR)
    model = build_model(name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = fixed_batches(name, block, batch)
    fp6 = {"format": "e3m2fn", "scale": scale, "rounding": "nearest"}
    prune = {"sparsity": 0.85, "threshold_rule": "lognormal"}
    plans = {
        "fp6 + 85% sparsity": (every_conv_linear(**fp6, **prune), 1),
        "fp6 + 85%, histogram rule": (every_conv_linear(**fp6, **dict(prune, threshold_rule="histogram")), 1),
        "fp6 + 85%, refresh /10": (every_conv_linear(**fp6, **prune), 10),
        "85% sparsity only": (every_conv_linear(**prune), 1),
        "fp6 only": (every_conv_linear(**fp6), 1),
        "fp6 + 85%, Plan.uniform defaults": (Plan.uniform(format="e3m2fn", sparsity=0.85), 1),
    }

    def applied(plan, refresh):
        handle = gradstats.apply(model, plan, refresh_every=refresh, record=False)
        return time_block(model, opt, batches, None, handle.remove)

    time_block(model, opt, batches[:2])
    configs = {"plain": lambda: time_block(model, opt, batches)}
    configs.update({label: (lambda p=p, r=r: applied(p, r)) for label, (p, r) in plans.items()})
    return interleaved_ratios(configs, rounds)


def main() -> None:
    step_benchmark_main(__doc__, "apply overhead (scale rule {scale})",
                        lambda name, a: bench_model(name, a.rounds, a.block, a.batch, a.scale),
                        models=["cnn", "resnet20"], rounds=5, block=10, targets=TARGETS,
                        add_args=lambda ap: ap.add_argument("--scale", default="lognormal",
                                                            choices=["lognormal", "amax"]))


if __name__ == "__main__":
    main()
