"""Shared pieces of the training-step benchmarks: fixed batches, timed blocks, interleaving."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fixed_batches(model_name: str, n: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` training batches of Fashion-MNIST (the committed subset) for a built-in model."""
    from gradstats.data import load_fashion_mnist

    size = 32 if model_name == "resnet18" else None
    data = load_fashion_mnist(split="train", source="subset", subset=max(batch * 4, 1000), size=size)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(data), (batch,), generator=g)
        out.append((data.images[idx], data.labels[idx]))
    return out


def time_block(model: nn.Module, opt: torch.optim.Optimizer, batches, after_step: Callable[[], None] | None = None,
               finish: Callable[[], None] | None = None) -> float:
    """Mean seconds per training step over one block of batches (``finish`` included)."""
    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step()
    if finish is not None:
        finish()
    return (time.perf_counter() - t0) / len(batches)


def _rounds(configs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each configuration's block once per round, in turn: the seconds of every block."""
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for label, run in configs.items():
            times[label].append(run())
    return times


def interleaved(configs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Run each configuration's block once per round, in turn; median seconds per step."""
    return {k: statistics.median(v) for k, v in _rounds(configs, rounds).items()}


def interleaved_ratios(configs: dict[str, Callable[[], float]], rounds: int,
                       reference: str = "plain") -> dict[str, tuple[float, float, float, float]]:
    """Like :func:`interleaved`, but each round's time is also divided by the reference's time of
    the same round: on a shared machine whose speed drifts, paired ratios are steadier than a
    ratio of medians. Returns ``{label: (median seconds, median ratio, ratio q1, ratio q3)}``."""
    times = _rounds(configs, rounds)
    out = {}
    for k, v in times.items():
        ratios = sorted(a / b for a, b in zip(v, times[reference]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[k] = (statistics.median(v), statistics.median(ratios), q[0], q[2])
    return out


def print_table(rows: list[tuple], header: str) -> None:
    """Rows ``(model, configuration, seconds, ratio)`` or with the ratio's quartiles appended."""
    print(header)
    iqr = any(len(r) > 4 for r in rows)
    print(f"{'model':<10} {'configuration':<34} {'ms/step':>9} {'ratio':>7}" + ("   ratio q1-q3" if iqr else ""))
    for model, label, t, ratio, *q in rows:
        print(f"{model:<10} {label:<34} {t * 1e3:9.1f} {ratio:7.3f}" + (f"   {q[0]:.3f}-{q[1]:.3f}" if q else ""))


def describe() -> dict[str, Any]:
    import platform

    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
