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


def interleaved(configs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Run each configuration's block once per round, in turn; median seconds per step."""
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for label, run in configs.items():
            times[label].append(run())
    return {k: statistics.median(v) for k, v in times.items()}


def print_table(rows: list[tuple[str, str, float, float]], header: str) -> None:
    print(header)
    print(f"{'model':<10} {'configuration':<34} {'ms/step':>9} {'ratio':>7}")
    for model, label, t, ratio in rows:
        print(f"{model:<10} {label:<34} {t * 1e3:9.1f} {ratio:7.3f}")


def describe() -> dict[str, Any]:
    import platform

    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
