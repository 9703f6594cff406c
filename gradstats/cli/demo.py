"""``gradstats demo``: the main job (what ``make demo`` runs).

Trains the built-in small CNN on Fashion-MNIST (the full set when the Debian package is
installed, else the committed subset; it says which) with the tracer attached, then runs the
report pipeline of ``gradstats report`` on the run: fits of every layer, pruning thresholds for
85% and 90% sparsity, the recommended FP8, FP6 and FP4 formats per layer, ``plan.json``,
``report.md`` and the figures, and prints the per-layer summary.
"""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: train and trace the small CNN on Fashion-MNIST, then report",
                       description="Train the built-in small CNN on Fashion-MNIST with the tracer attached "
                                   "(neural gradients, activations and weights), then fit every layer, derive "
                                   "pruning thresholds and recommended formats, and write the plans, figures "
                                   "and report.md into the output directory.")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--every", type=int, default=2, help="statistics every this many steps (default 2)")
    p.add_argument("--sample-steps", type=int, default=4,
                   help="number of steps, evenly spread, on which raw samples are kept (default 4)")
    p.add_argument("--samples", type=int, default=65536, help="raw values kept per layer and sampled step")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--data", default="auto", choices=["auto", "full", "subset"],
                   help="Fashion-MNIST source: the full Debian set when installed, else the committed "
                        "subset (auto, default); or force one")
    p.add_argument("--subset", type=int, default=None, help="train on this many images (balanced) only")
    p.add_argument("--test-subset", type=int, default=None, help="evaluate on this many test images only")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, or 1 when the machine is busier than its cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo-out", help="output directory (default demo-out); the run goes in OUT/run")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are drawn on a terminal only; GRADSTATS_PROGRESS=1 draws them anywhere)")
    p.set_defaults(func=run)


def sample_steps(steps: int, every: int, count: int) -> list[int]:
    """``count`` steps with statistics, evenly spread from the first to the last.

    Example:
        >>> sample_steps(300, 2, 4)
        [0, 100, 198, 298]
    """
    if steps < 1 or every < 1 or count < 1:
        raise ValueError(f"steps, every and count must be positive, got {steps}, {every}, {count}")
    last = ((steps - 1) // every) * every
    import numpy as np

    marks = np.linspace(0, last, min(count, last // every + 1))
    return sorted({int(round(m / every)) * every for m in marks})


def _threads(requested: int | None) -> str:
    import os

    import torch

    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be positive, got {requested}")
        torch.set_num_threads(requested)
        return f"{requested} thread(s), as asked"
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    if cores > 1 and load > cores:
        torch.set_num_threads(1)
        return f"1 thread (the machine is busy: load {load:.1f} on {cores} cores; --threads to override)"
    return f"{torch.get_num_threads()} thread(s)"


def run(args: argparse.Namespace) -> int:
    import shutil
    import time
    from pathlib import Path

    import gradstats
    from gradstats.report import report
    from gradstats.zoo.training import make_optimizer, prepare, train

    if args.steps < 1 or args.every < 1 or args.samples < 1:
        raise ValueError("--steps, --every and --samples must be positive")
    t0 = time.perf_counter()
    out = Path(args.out)
    run_dir = out / "run"
    threads = _threads(args.threads)
    source = {"auto": "auto", "full": "full", "subset": "subset"}[args.data]
    task = prepare("cnn", source=source, subset=args.subset, test_subset=args.test_subset, seed=args.seed)
    tr, te = task.train_data, task.test_data
    data_line = (f"Fashion-MNIST, {tr.source} ({len(tr):,} training / {len(te):,} test images"
                 f"{', ' + str(tr.path) if tr.path else ''})")
    print(f"gradstats demo: small CNN on {data_line}")     # (the data loader warns where it is not the full set)
    samp = sample_steps(args.steps, args.every, args.sample_steps)
    print(f"training {args.steps} steps (batch {args.batch_size}, {threads}); statistics of gradients, "
          f"activations and weights every {args.every} step(s), raw samples at steps {samp}")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    opt = make_optimizer(task.model, task.hparams["optimizer"], lr=task.hparams["lr"])
    with gradstats.trace(task.model, run_dir, every=args.every, sample_every=samp, samples=args.samples,
                         kinds=("grad", "act", "weight"), optimizer=opt, seed=args.seed):
        result = train(task.model, tr, test=te, steps=args.steps, batch_size=args.batch_size, optimizer=opt,
                       seed=args.seed, progress=not args.no_progress)
    t_train = time.perf_counter() - t0
    print(f"trained in {t_train:.0f} s ({result.step_time * 1e3:.0f} ms/step with the tracer), final loss "
          f"{result.losses[-1]:.3f}, test accuracy {result.test_accuracy:.3f}; run in {run_dir}")
    context = {"data": data_line,
               "training": f"{result.steps} steps of SGD (lr {task.hparams['lr']}, momentum 0.9), batch "
                           f"{args.batch_size}, seed {args.seed}; final loss {result.losses[-1]:.3f}, test accuracy "
                           f"{result.test_accuracy:.3f}"}
    t1 = time.perf_counter()
    rep = report(run_dir, out, figures=not args.no_figures, progress=not args.no_progress, context=context)
    t_rep = time.perf_counter() - t1
    print()
    print(rep)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s (training {t_train:.0f} s, analysis and report {t_rep:.0f} s); "
          f"open {rep.markdown}")
    return 0
