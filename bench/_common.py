"""Shared pieces of the training-step benchmarks: fixed batches, timed blocks, interleaving."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_seconds(fn: Callable[[], Any], repeats: int, *, clock: Callable[[], float] = time.process_time,
               warm_up: bool = False) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` on ``clock`` (default: this process's CPU time),
    after one untimed call when ``warm_up``."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def composed_operators():
    """Within it, block-scaled formats run as the composed operators (``stochastic_prune``, then ``quantize``'s
    chunked torch path), the C block kernel offered to neither: the peer the kernel replaces."""
    from gradstats.ops import cpu_blocks

    keep = cpu_blocks.takes
    cpu_blocks.takes = lambda *a: False
    try:
        yield
    finally:
        cpu_blocks.takes = keep


@contextlib.contextmanager
def gradient_hooks(model: nn.Module, layers: list[str], fn: Callable[[str, torch.Tensor], Any]):
    """Within it, the output gradient of each of ``layers`` passes through ``fn(layer, g)`` (its result
    replaces ``g``; None leaves it): a forward hook that registers a tensor hook, nothing else. The least a
    hook-based tool costs around its own work: the benchmarks' floor configurations put a kernel alone in it."""
    from gradstats.tracer.capture import first_grad_tensor

    modules = dict(model.named_modules())

    def forward_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            out = first_grad_tensor(output)
            if out is not None:
                out.register_hook(lambda g: fn(name, g))
        return hook

    handles = [modules[n].register_forward_hook(forward_hook(n)) for n in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def fixed_batches(model_name: str, n: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` training batches of Fashion-MNIST (the committed subset) for a built-in model."""
    from gradstats.zoo.data import load_fashion_mnist

    size = 32 if model_name == "resnet18" else None
    data = load_fashion_mnist(split="train", source="subset", subset=max(batch * 4, 1000), size=size)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(data), (batch,), generator=g)
        out.append((data.images[idx], data.labels[idx]))
    return out


#: the clock of :func:`time_block`: the wall clock, or (``--clock cpu``) the process's CPU time
CLOCK: Callable[[], float] = time.perf_counter


def time_block(model: nn.Module, opt: torch.optim.Optimizer, batches, after_step: Callable[[], None] | None = None,
               finish: Callable[[], None] | None = None,
               loss_fn: Callable[[nn.Module, Any, Any], torch.Tensor] | None = None) -> float:
    """Mean seconds per training step over one block of batches (``finish`` included); ``loss_fn(model,
    x, y)``: the step's loss (default: cross-entropy of ``model(x)``)."""
    t0 = CLOCK()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y) if loss_fn is not None else nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
    if finish is not None:
        finish()
    return (CLOCK() - t0) / len(batches)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a ``transformers`` causal language model (``model(x).logits``)."""
    logits = model(x).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def text_batches(n: int, batch: int, seq_len: int = 64, seed: int = 0) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """``n`` batches of ``batch`` windows of ``seq_len`` Shakespeare characters, and the vocabulary size."""
    from gradstats.zoo.text import load_shakespeare

    text = load_shakespeare()
    g = torch.Generator().manual_seed(seed)
    return [text.get_batch(batch, seq_len, generator=g) for _ in range(n)], text.vocab_size


def gpt_neox_tiny(vocab: int, seed: int = 0) -> nn.Module:
    """A ``transformers`` GPT-NeoX from a tiny config (2 layers, width 128, 4 heads: the one of
    ``experiments/four_bit_fidelity.py``)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=128, intermediate_size=512,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256))


def _rounds(configs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each configuration's block once per round, in turn, the order reversed every other round
    (no configuration always runs after the same one, whose traces in the caches and the
    allocator it would inherit): the seconds of every block."""
    times: dict[str, list[float]] = {k: [] for k in configs}
    order = list(configs.items())
    for r in range(rounds):
        for label, run in (order if r % 2 == 0 else order[::-1]):
            times[label].append(run())
    return times


def interleaved(configs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Run each configuration's block once per round, in turn; median seconds per step."""
    return {k: statistics.median(v) for k, v in _rounds(configs, rounds).items()}


def median_ci(values: list[float], level: float = 0.90) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (independent rounds):
    the order statistics ``j < k`` with ``P(X_(j) <= median <= X_(k)) >= level`` under the binomial
    law of how many values fall below the median. Too few values for ``level``: their range."""
    from scipy.stats import binom

    xs, n = sorted(values), len(values)
    for j in range(n // 2, 0, -1):           # j-th smallest and j-th largest, 1-based, widening
        if binom.cdf(n - j, n, 0.5) - binom.cdf(j - 1, n, 0.5) >= level:
            return xs[j - 1], xs[n - j]
    return xs[0], xs[-1]


def interleaved_ratios(configs: dict[str, Callable[[], float]], rounds: int,
                       reference: str = "plain") -> dict[str, tuple[float, ...]]:
    """Like :func:`interleaved`, but each round's time is also divided by the reference's time of
    the same round: on a shared machine whose speed drifts, paired ratios are steadier than a
    ratio of medians. Returns ``{label: (median seconds, median ratio, ratio q1, ratio q3, 90%
    confidence interval of the median ratio: low, high)}``."""
    times = _rounds(configs, rounds)
    out = {}
    for k, v in times.items():
        ratios = sorted(a / b for a, b in zip(v, times[reference]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[k] = (statistics.median(v), statistics.median(ratios), q[0], q[2], *median_ci(ratios))
    return out


def verdict(ratio_ci: tuple[float, float], target: float) -> str:
    """Whether a median ratio meets ``target`` (at most), given its confidence interval:
    ``met`` (the interval lies at or below it), ``not met`` (above it) or ``within noise``."""
    lo, hi = ratio_ci
    return "met" if hi <= target else "not met" if lo > target else "within noise"


def print_table(rows: list[tuple], header: str, targets: dict | None = None) -> None:
    """Rows ``(model, configuration, seconds, ratio)``, optionally followed by the ratio's quartiles
    and the 90% confidence interval of its median; ``targets``: configuration (or ``(model,
    configuration)``, which comes first) -> the most its ratio may be, shown with a verdict (see
    :func:`verdict`)."""
    print(header)
    iqr = any(len(r) > 4 for r in rows)
    ci = any(len(r) > 6 for r in rows)
    w = max([34] + [len(r[1]) for r in rows])
    print(f"{'model':<10} {'configuration':<{w}} {'ms/step':>9} {'ratio':>7}" + ("   ratio q1-q3" if iqr else "")
          + ("   90% CI of median" if ci else "") + ("   target" if targets else ""))
    for model, label, t, ratio, *q in rows:
        line = f"{model:<10} {label:<{w}} {t * 1e3:9.1f} {ratio:7.3f}"
        if q:
            line += f"   {q[0]:.3f}-{q[1]:.3f}"
        if len(q) > 2:
            line += f"   {q[2]:.3f}-{q[3]:.3f}       "
        target = (targets or {}).get((model, label), (targets or {}).get(label))
        if target is not None:
            line += f"   <= {target:.2f}: " + (verdict((q[2], q[3]), target) if len(q) > 2 else "")
        print(line)


def step_benchmark_main(doc: str, title: str, bench_model: Callable[[str, argparse.Namespace], dict],
                        *, models: list[str], rounds: int, block: int, targets: dict[str, float] | None = None,
                        add_args: Callable[[argparse.ArgumentParser], Any] | None = None,
                        batch: int | None = 128) -> None:
    """The command line of a training-step benchmark: ``--models``, ``--rounds``, ``--block``,
    ``--batch`` (and what ``add_args`` adds); ``bench_model(name, args)`` gives one model's
    :func:`interleaved_ratios`; one table is printed, headed by ``title`` (formatted with the
    arguments) and the set-up."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=models)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--block", type=int, default=block)
    ap.add_argument("--batch", type=int, default=batch, help="batch size (default: " + (
        "each model's own" if batch is None else str(batch)) + ")")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time; cpu: the process's CPU time on one thread (torch and the kernels "
                         "alike), what the steps cost without the time other work on a shared machine takes")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    global CLOCK
    if args.clock == "cpu":
        torch.set_num_threads(1)
        CLOCK = time.process_time
    rows = []
    for name in args.models:
        rows += [(name, label, *r) for label, r in bench_model(name, args).items()]
    print_table(rows, f"{title.format(**vars(args))}: {describe()}, batch "
                      f"{'per model' if args.batch is None else args.batch}, {args.rounds} rounds x "
                      f"{args.block} steps per configuration (medians), {args.clock} clock", targets)


def describe() -> dict[str, Any]:
    import platform

    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
