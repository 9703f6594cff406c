"""What the accuracy experiments share: a training job under a plan, a calibration trace, worker
processes, and a results file that survives interruption.

A *job* trains one built-in model from scratch (one seed) with a :class:`gradstats.Plan` applied
to its neural gradients (or none: the baseline) and reports the final test accuracy beside what
the plan achieved (sparsity, underflow, saturation). Jobs run in worker processes with one torch
thread each; every finished job is appended to a JSON-lines file at once, so an interrupted
experiment resumes where it stopped and the baseline is trained once for every experiment that
needs it. :func:`aggregate` turns the job rows into a table of mean and standard deviation over
seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pandas as pd

RESULTS = Path(__file__).resolve().parent / "results"

#: the full experiments: model -> training steps (cosine schedule, batch 128, SGD lr 0.05)
STEPS = {"cnn": 400, "resnet20": 300}
SEEDS = (0, 1, 2)
#: the quick version (tests): tiny data, a few steps
QUICK_PREPARE = {"source": "subset", "subset": 256, "test_subset": 200}
QUICK_STEPS = 6
#: how a job on the quick data trains unless it says otherwise: batch 32 (the tests' smoke runs;
#: a CNN job takes about a third of the time it takes at the models' batch of 128)
QUICK_TRAIN = {"batch_size": 32}
#: steps of the plain model traced to calibrate global scales and recommendations
CALIBRATION_STEPS = 50


@dataclass(frozen=True)
class Job:
    """One training run: ``experiment``/``label`` name it, ``plan`` is a ``Plan.to_dict()`` (None:
    the plain baseline), ``info`` holds the table's keys (sparsity, format, scale mode...)."""

    experiment: str
    label: str
    model: str
    seed: int
    steps: int
    plan: dict | None = None
    info: dict = field(default_factory=dict)
    prepare: dict = field(default_factory=dict)
    #: keyword arguments of ``gradstats.apply`` (``warmup=``...) and of the training (``batch_size=``...)
    apply: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Names the job by what decides its result: experiment, model, label, seed, steps, data
        and a digest of what of the plan is enforced (a changed default makes a new job, not a
        stale match)."""
        data = "quick" if self.prepare else "full"
        if self.prepare and self.prepare != QUICK_PREPARE:
            data += "-" + _digest(self.prepare)
        if self.train:
            data += "/train-" + _digest(self.train)
        if self.apply and self.plan is not None:
            data += "/apply-" + _digest(self.apply)
        # the baseline is shared by every experiment
        if self.plan is None:
            return f"baseline/{self.model}/{self.label}/seed{self.seed}/steps{self.steps}/{data}"
        return (f"{self.experiment}/{self.model}/{self.label}/seed{self.seed}/steps{self.steps}/{data}/"
                f"plan-{plan_digest(self.plan)}")


def plan_digest(plan: dict) -> str:
    """The digest of what of a ``Plan.to_dict()`` apply enforces (the end of a planned job's key)."""
    return _digest(_enforced(plan))


def _enforced(plan: dict) -> dict:
    """What of a ``Plan.to_dict()`` decides what ``apply`` does: without the provenance and the
    entries' predictions (informational, never enforced)."""
    out = {k: v for k, v in plan.items() if k != "provenance"}
    out["layers"] = [{k: v for k, v in e.items() if k != "predicted"} for e in plan.get("layers", [])]
    return out


def _digest(obj: Any) -> str:
    """A short stable digest of plain data (sorted JSON)."""
    import hashlib

    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def train(job: Job) -> tuple[Any, Any, float]:
    """Train ``job.model`` for ``job.steps`` steps with the job's plan applied (one torch thread);
    the training's result, the applied plan (None for a baseline; its hooks removed) and the
    seconds from applying the plan to the end of training (the model's preparation not counted)."""
    import torch

    import gradstats
    from gradstats.zoo.training import prepare

    torch.set_num_threads(1)
    task = prepare(job.model, seed=job.seed, **job.prepare)
    t0 = time.perf_counter()
    applied = None
    if job.plan is not None:
        applied = gradstats.apply(task.model, gradstats.Plan.from_dict(job.plan), seed=job.seed, **job.apply)
    try:
        quick = QUICK_TRAIN if job.prepare == QUICK_PREPARE else {}
        res = task.run(job.steps, **{"schedule": "cosine", "progress": False, **quick, **job.train})
        return res, applied, time.perf_counter() - t0
    finally:
        if applied is not None:
            applied.remove()


def run_job(job: Job) -> dict[str, Any]:
    """Train ``job.model`` for ``job.steps`` steps with the job's plan; the result row."""
    t0 = time.perf_counter()   # for a failed job; a trained one reports train()'s own time
    row: dict[str, Any] = {"key": job.key, "experiment": job.experiment, "label": job.label,
                           "model": job.model, "seed": job.seed, "steps": job.steps, **job.info}
    try:
        res, applied, seconds = train(job)
    except Exception as exc:  # a failure is a result: recorded with its message, the others go on
        return {**row, "test_accuracy": math.nan, "test_loss": math.nan, "final_train_loss": math.nan,
                "diverged": False, "steps_done": 0, "wall_s": round(time.perf_counter() - t0, 2),
                "achieved_sparsity": math.nan, "underflow_fraction": math.nan, "overflow_fraction": math.nan,
                "planned_layers": 0, "error": f"{type(exc).__name__}: {exc}"}
    row.update(test_accuracy=res.test_accuracy, test_loss=res.test_loss,
               final_train_loss=float(pd.Series(res.losses[-20:]).mean()) if res.losses else math.nan,
               diverged=bool(res.diverged), steps_done=res.steps, wall_s=round(seconds, 2))
    if applied is not None:
        df = applied.to_dataframe()
        n = df["n"].astype(float)
        w = n.sum()
        for col in ("achieved_sparsity", "underflow_fraction", "overflow_fraction"):
            row[col] = float((df[col] * n).sum() / w) if w else math.nan
        row["planned_layers"] = len(applied.rules)
        # per layer over the run: entries and the element-weighted achieved and target sparsity
        layers = {}
        for name, g in df.groupby("layer", sort=False):
            ln = g["n"].astype(float)
            tot = float(ln.sum())
            def weighted(col: str) -> float:
                return float((g[col] * ln).sum() / tot) if tot else math.nan

            layers[name] = {"n": tot, "achieved_sparsity": weighted("achieved_sparsity"),
                            "target_sparsity": float(g["target_sparsity"].mean()),
                            "underflow_fraction": weighted("underflow_fraction"),
                            "overflow_fraction": weighted("overflow_fraction")}
        row["layers"] = layers
    else:
        row.update(achieved_sparsity=math.nan, underflow_fraction=0.0, overflow_fraction=0.0, planned_layers=0)
    return row


def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def load_rows(path: Path) -> dict[str, dict]:
    """The finished jobs of a results file, by key (a torn last line is ignored)."""
    rows: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[r["key"]] = r
    return rows


def _results(todo: list[Job], workers: int) -> Iterator[dict]:
    """The jobs' result rows as they finish: in worker processes, or here with ``workers=0``."""
    if workers <= 0:
        import torch

        threads = torch.get_num_threads()
        try:
            for j in todo:
                yield run_job(j)
        finally:
            torch.set_num_threads(threads)
        return
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx, initializer=_init_worker) as pool:
        for fut in as_completed([pool.submit(run_job, j) for j in todo]):
            yield fut.result()


def run_jobs(jobs: Iterable[Job], path: Path, *, workers: int = 2, desc: str = "jobs") -> pd.DataFrame:
    """Run every job whose key is not yet in ``path`` (JSON lines), appending each result as it
    finishes; return the rows of all ``jobs``, in their order. ``workers``: processes, one torch
    thread each; 0 runs the jobs one after another in this process (the quick runs of the tests:
    no interpreter to start per worker; the thread count is restored afterwards). Each row is
    appended to the file at ``path`` when its job ends (opened anew, synced): a file replaced while
    the jobs run (a checkout of the results) receives the rows, not an unlinked copy of the old one."""
    from tqdm.auto import tqdm

    jobs = list(jobs)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = load_rows(path)
    todo = list({j.key: j for j in jobs if j.key not in done}.values())
    for row in tqdm(_results(todo, workers), total=len(todo), desc=desc) if todo else ():
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        done[row["key"]] = row
    out = []
    for j in jobs:
        r = dict(done[j.key])
        r.update(experiment=j.experiment, label=j.label, **j.info)   # the shared baseline, relabelled
        out.append(r)
    return pd.DataFrame(out)


def aggregate(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Mean and standard deviation over seeds of the accuracy (in %) and the achieved numbers."""
    g = df.assign(acc=100 * df["test_accuracy"]).groupby(keys, sort=False, dropna=False)
    out = g.agg(seeds=("seed", "nunique"), acc_mean=("acc", "mean"), acc_std=("acc", "std"),
                acc_min=("acc", "min"), achieved_sparsity=("achieved_sparsity", "mean"),
                underflow=("underflow_fraction", "mean"), overflow=("overflow_fraction", "mean"),
                diverged=("diverged", "sum"), wall_s=("wall_s", "mean"),
                failed=("error", lambda e: int(e.notna().sum())) if "error" in df else ("seed", lambda s: 0),
                ).reset_index()
    return out


def compare_to_baseline(table: pd.DataFrame, is_base: pd.Series, column: str = "within_1std") -> pd.DataFrame:
    """Add ``acc_delta`` (mean accuracy minus the baseline's) and ``column``: whether the mean lies
    within one standard deviation (over seeds) of the baseline's mean."""
    base = table[is_base].iloc[0]
    std = 0.0 if base["acc_std"] != base["acc_std"] else float(base["acc_std"])
    table["acc_delta"] = table["acc_mean"] - base["acc_mean"]
    table[column] = table["acc_mean"] >= base["acc_mean"] - std
    return table


def save_results(args: argparse.Namespace, name: str, table: pd.DataFrame, jobs: pd.DataFrame, wall: float,
                 **extra: Any) -> None:
    """``{out}/{name}.json``: the command, data, seeds, steps, settings, wall time, environment, the
    table and every job's row."""
    write_json(args.out / f"{name}.json", {
        "command": f"python experiments/{name}.py" + (" --quick" if args.quick else ""),
        "data": "Fashion-MNIST " + ("committed subset" if args.quick else "full (60k train, 10k test)"),
        "seeds": list(args.seeds), "steps": args.steps("cnn"), **extra, "wall_s": round(wall, 1),
        "environment": environment(), "table": table.to_dict("records"), "jobs": jobs.to_dict("records")})


def calibrate(model: str, *, prepare_kw: dict, steps: int, seed: int = 0, train_kw: dict | None = None,
              sample_every: list[int] | tuple[int, ...] = ()) -> "Any":
    """Trace the plain model for ``steps`` steps (statistics every step; raw samples and noise
    records on ``sample_every`` and the step after each): the run that global scales and
    recommendations are derived from."""
    return calibrate_task(model, prepare_kw=prepare_kw, steps=steps, seed=seed, train_kw=train_kw,
                          sample_every=sample_every)[1]


def calibrate_task(model: str, *, prepare_kw: dict, steps: int, seed: int = 0, train_kw: dict | None = None,
                   sample_every: list[int] | tuple[int, ...] = ()) -> "tuple[Any, Any]":
    """:func:`calibrate`, with the task it trained: ``(task, run)``. ``task.model`` is the calibrated
    model (after its ``steps`` steps), where a noise probe measures the plans made from the run."""
    import atexit
    import shutil

    import gradstats
    from gradstats.zoo.training import prepare

    task = prepare(model, seed=seed, **prepare_kw)
    path = Path(tempfile.mkdtemp(prefix=f"gradstats-calib-{model}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)      # the process's own scratch run
    with gradstats.trace(task.model, path, every=1, sample_every=list(sample_every), seed=seed) as tracer:
        task.run(steps, **{"schedule": "cosine", "progress": False, **(train_kw or {})},
                 callback=lambda s, loss: tracer.step())
    return task, gradstats.open_run(path)


def global_scale(fmt: Any, run: Any, layers: list[str]) -> float:
    """The one power-of-two scale for every layer that minimises the mean over layers of each
    layer's predicted relative error (each layer's MSE over its own E[g^2]), from the layers' mu and
    sigma over the calibration run. (The optimum for the pooled gradients would serve the layer
    with the largest gradients alone: its E[g^2] dominates the pooled MSE.)"""
    import numpy as np

    from gradstats.fpanalysis import expected_error
    from gradstats.plan.recommend import layer_moments

    mom = layer_moments(run, steps=range(int(run.steps[0]), int(run.steps[-1]) + 1), layers=list(layers))
    mus, sigmas = mom["mu"].to_numpy(float), mom["sigma"].to_numpy(float)
    best = (math.inf, 1.0)
    for k in range(-40, 100):
        err = float(np.mean(expected_error(fmt, mu=mus, sigma=sigmas, scale=2.0 ** k).total))
        best = min(best, (err, 2.0 ** k))
    return best[1]


def parse_args(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """``--quick`` (tiny data and steps, one seed: the tests), ``--out`` (results directory),
    ``--workers`` (processes, one torch thread each)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps, one seed (smoke test)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of the JSON results and figures")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each; 0: in this process)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, dest="seed_list",
                    help="seeds to train (default: the experiment's own)")
    args = ap.parse_args(argv)
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    args.seeds = tuple(args.seed_list) if args.seed_list else ((0,) if args.quick else SEEDS)
    args.prepare = QUICK_PREPARE if args.quick else {}
    args.steps = (lambda m: QUICK_STEPS) if args.quick else (lambda m: STEPS[m])
    args.calibration_steps = 3 if args.quick else CALIBRATION_STEPS
    return args


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` (tables as lists of records) atomically."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_jsonable))
    os.replace(tmp, path)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    if isinstance(v, (set, tuple)):
        return list(v)
    return str(v)


def environment() -> dict[str, Any]:
    """Versions and machine, for the results' provenance."""
    import platform

    import torch

    import gradstats
    return {"gradstats": gradstats.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count()}


__all__ = ["Job", "train", "run_job", "run_jobs", "aggregate", "compare_to_baseline", "save_results", "calibrate", "calibrate_task", "global_scale", "parse_args",
           "write_json", "environment"]
