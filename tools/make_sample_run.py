"""Regenerate the committed sample run ``data/sample-run`` (``make sample-run``).

A short real training run of the built-in small CNN on the committed Fashion-MNIST subset,
traced with ``gradstats.trace``: statistics of the neural gradients, activations and weights of
every layer on every 4th step, raw samples of each on a handful of steps. Notebooks, the gallery
in ``figures/`` and the figure tests read it, so they work without training. Seeded: the run is
the same on every machine up to floating-point differences between CPUs and torch builds.

    python tools/make_sample_run.py [--out data/sample-run]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

import gradstats
from gradstats.zoo.training import make_optimizer, prepare, train

#: the settings of the committed sample run
STEPS = 200
EVERY = 4
SAMPLE_STEPS = [0, 64, 128, 196]
SAMPLES = 8192
KINDS = ("grad", "act", "weight")
SEED = 0


def make_sample_run(out: str | Path, *, steps: int = STEPS, every: int = EVERY,
                    sample_steps: list[int] | None = None, samples: int = SAMPLES, seed: int = SEED,
                    progress: bool = True) -> Path:
    """Train and trace the sample run into ``out`` (replaced if it exists); returns its path."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    task = prepare("cnn", source="subset", seed=seed)
    opt = make_optimizer(task.model, task.hparams["optimizer"], lr=task.hparams["lr"])
    with gradstats.trace(task.model, out, every=every, sample_every=sample_steps or SAMPLE_STEPS,
                         samples=samples, kinds=KINDS, optimizer=opt, seed=seed):
        result = train(task.model, task.train_data, test=task.test_data, steps=steps,
                       batch_size=task.hparams["batch_size"], optimizer=opt, seed=seed, progress=progress)
    print(f"{type(task.model).__name__} on Fashion-MNIST ({task.train_data.source}, {len(task.train_data)} "
          f"training images): {result.steps} steps, test accuracy {result.test_accuracy:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "data" / "sample-run"))
    p.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    t0 = time.perf_counter()
    out = make_sample_run(args.out, steps=args.steps)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    run = gradstats.open_run(out)
    print(f"wrote {out}: {len(run.layers)} layers, {len(run.steps)} steps with statistics, samples at "
          f"{sorted(run.sample_index()['step'].unique().tolist())}, {size / 1e6:.2f} MB, "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
