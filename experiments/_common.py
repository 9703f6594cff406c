"""What the real-gradient experiments share: the model configurations, tracing a built-in model,
walking the sampled gradient tensors of a run, and the shape statistics of a tensor."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

import gradstats
from gradstats.stats import lognormal_moments, tensor_stats

#: (registry name, training steps, keyword arguments for prepare / run)
CONFIGS = {
    "cnn": dict(steps=120, prepare={}, run={}),
    "mlp": dict(steps=300, prepare={}, run={}),
    "transformer": dict(steps=80, prepare={"d_model": 128, "n_layers": 4}, run={"batch_size": 16}),
}


def trace_model(name: str, steps: int, path: Path, *, prepare_kw: dict | None = None,
                run_kw: dict | None = None, sample_steps: list[int] | None = None,
                samples: int | None = None, seed: int = 0) -> gradstats.run.Run:
    """Train a built-in model for ``steps`` steps with the tracer, keeping ``samples`` entries
    (``None``: whole tensors) of every layer's gradient at ``sample_steps`` (default: the last
    step); return the run."""
    from gradstats.zoo.training import prepare

    task = prepare(name, seed=seed, **(prepare_kw or {}))
    sample_steps = sample_steps or [steps - 1]
    with gradstats.trace(task.model, path, every=sample_steps, sample_every=sample_steps,
                         samples=samples, seed=seed) as tracer:
        task.run(steps, callback=lambda step, loss: tracer.step(), progress=False, **(run_kw or {}))
    return gradstats.open_run(path)


def layer_tensors(configs: dict, workdir: str | Path | None, *, prefix: str, min_nonzero: int,
                  samples: int | None = None, default_sample_steps=None, seed: int = 0,
                  verbose: bool = True) -> Iterator[tuple[str, str, int, torch.Tensor]]:
    """Trace each configured model and yield ``(model, layer, step, gradient)`` for every sampled
    gradient tensor with at least ``min_nonzero`` non-zero entries."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        steps = cfg["steps"]
        sample_steps = cfg.get("sample_steps") or (default_sample_steps(steps) if default_sample_steps else None)
        run = trace_model(name, steps, workdir / name, prepare_kw=cfg.get("prepare"), run_kw=cfg.get("run"),
                          sample_steps=sample_steps, samples=samples, seed=seed)
        idx = run.sample_index()
        idx = idx[idx["kind"] == "grad"][["layer", "step"]].drop_duplicates()
        for layer, step in idx.itertuples(index=False):
            g = run.samples(layer, int(step))
            if int((g != 0).sum()) >= min_nonzero:
                yield name, layer, int(step), g
        if verbose:
            print(f"# {name}: {steps} steps, {len(idx)} layer tensors, {time.perf_counter() - t0:.1f} s",
                  flush=True)


def log_shape(g: torch.Tensor) -> dict:
    """n, zero fraction, mu and sigma of ln|g| (the MLE), and the skewness and excess kurtosis of
    ln|g| over the non-zero entries (lognormal: 0, 0)."""
    st = tensor_stats(g)
    mu, sigma = lognormal_moments(st)
    lg = g[g != 0].abs().double().log()
    z = (lg - mu) / sigma if sigma > 0 else lg * 0
    return {"n": st["n"], "p0": st["n_zero"] / st["n"], "mu": mu, "sigma": sigma,
            "skew": float(z.pow(3).mean()), "kurt": float(z.pow(4).mean() - 3)}


def parse_args(doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, dict, Path]:
    """The experiments' command line: ``--out DIR`` and ``--quick`` (a few steps per model).
    Returns the arguments, the configurations to run and the output directory (created)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default="experiments/out", help="directory for the CSV and figure")
    ap.add_argument("--quick", action="store_true", help="a few steps per model (smoke test)")
    args = ap.parse_args(argv)
    configs = {k: {**v, "steps": 6} for k, v in CONFIGS.items()} if args.quick else CONFIGS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, configs, out
