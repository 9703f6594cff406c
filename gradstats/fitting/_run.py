"""``fit_run``: every layer, step and kind of a run, one row per family."""
from __future__ import annotations

import fnmatch
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import pandas as pd
import torch

from ..stats import merge_stats
from ._exact import fit
from ._parallel import default_workers, torch_single_thread
from ._families import FAMILIES, check_families
from ._result import FitResult
from ._stats import fit_many_stats

log = logging.getLogger(__name__)

KEY_COLUMNS = ("layer", "step", "kind", "family")


def select_layers(names: Sequence[str], layers: str | Iterable[str] | None) -> list[str]:
    """Layers of ``names`` matching ``layers``: None (all), a glob, or a list of names/globs."""
    if layers is None:
        return list(names)
    pats = [layers] if isinstance(layers, str) else list(layers)
    out = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]
    if not out:
        raise ValueError(f"no layer matches {pats}; the run's layers are {list(names)}")
    return out


def select_steps(all_steps: Sequence[int], steps: int | slice | Iterable[int] | None) -> list[int]:
    """Steps of ``all_steps`` selected by None (all), an int, a slice/range or a list."""
    if steps is None:
        return list(all_steps)
    if isinstance(steps, int):
        steps = [steps]
    if isinstance(steps, slice):
        lo = -math.inf if steps.start is None else steps.start
        hi = math.inf if steps.stop is None else steps.stop
        st = steps.step or 1
        base = 0 if steps.start is None else steps.start
        out = [s for s in all_steps if lo <= s < hi and (s - base) % st == 0]
    else:
        want = {int(s) for s in steps}
        out = [s for s in all_steps if s in want]
    if not out:
        raise ValueError(f"no step of the run is selected by {steps!r}; the run has steps "
                         f"{list(all_steps)[:10]}{'...' if len(all_steps) > 10 else ''}")
    return out


def _error_rows(key: tuple[str, int, str], fams: Sequence[str], source: str, exc: Exception) -> list[dict]:
    return [{"layer": key[0], "step": key[1], "kind": key[2], "family": f, "source": source,
             "status": f"error: {exc}"} for f in fams]


def _rows(key: tuple[str, int, str], res: FitResult) -> list[dict[str, Any]]:
    return [{"layer": key[0], "step": key[1], "kind": key[2], **r, "status": "ok"} for r in res.rows()]


def fit_run(run: Any, *, layers: str | Iterable[str] | None = None,
            steps: int | slice | Iterable[int] | None = None, kinds: Sequence[str] = ("grad",),
            families: Sequence[str] = FAMILIES, use_samples: bool = True, ks: str = "exact",
            max_samples: int | None = None, progress: bool | None = None,
            workers: int | None = None) -> pd.DataFrame:
    """Fit every selected layer, step and kind of a run; one row per family.

    Where a step has raw samples (``run.sample_index()``), they are fitted exactly with
    :func:`fit` (``source="samples"``: all ranks and calls of the layer concatenated);
    otherwise the streamed statistics of all ranks and calls are merged and fitted with
    :func:`fit_stats` (``source="stats"``, KS with a proven bound, no Vuong test). A group
    that cannot be fitted (all zeros, constant magnitudes, ...) gives rows whose ``status``
    says why; fitted rows have ``status == "ok"``.

    Args:
        run: a :class:`gradstats.Run` (or anything with ``layers``, ``steps``, ``stats()``,
            ``sample_index()`` and ``samples(layer, step, kind=, call=, rank=)``).
        layers: None (all), a glob (``"conv*"``) or a list of names or globs.
        steps: None (all), an int, a slice/range, or a list of steps.
        kinds: which captured kinds (``"grad"``, ``"act"``, ...).
        families, ks, max_samples: passed to :func:`fit` for sampled steps.
        use_samples: False fits every step from its statistics.
        progress: tqdm bar (default: on when there are more than 50 groups).
        workers: threads fitting sampled groups side by side (default: torch's CPU threads,
            at most 2; torch itself runs single-threaded meanwhile).

    Returns a DataFrame with columns ``layer, step, kind, family, source, status`` and those
    of :meth:`FitResult.to_dataframe`.

    Example:
        >>> import tempfile, torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> with gradstats.trace(model, tempfile.mkdtemp(), sample_every=2) as tr:
        ...     for _ in range(3):
        ...         model(torch.randn(64, 8)).square().mean().backward(); tr.step()
        >>> df = gradstats.fit_run(gradstats.open_run(tr.path), progress=False)
        >>> sorted(df["source"].unique()), len(df) == 2 * 3 * 3
        (['samples', 'stats'], True)
    """
    from tqdm.auto import tqdm

    fams = check_families(families)
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    lay = select_layers(list(run.layers), layers)
    stp = select_steps(sorted(int(s) for s in run.steps), steps)
    order = {name: i for i, name in enumerate(lay)}
    stats = run.stats()
    if len(stats):
        stats = stats[stats["layer"].isin(lay) & stats["step"].isin(stp) & stats["kind"].isin(kinds)]
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rec in stats.to_dict("records") if len(stats) else []:
        groups.setdefault((rec["layer"], int(rec["step"]), rec["kind"]), []).append(rec)
    sampled: dict[tuple[str, int, str], list[tuple[int, int]]] = {}
    if use_samples:
        idx = run.sample_index()
        if len(idx):
            idx = idx[idx["layer"].isin(lay) & idx["step"].isin(stp) & idx["kind"].isin(kinds)]
            for rec in idx.to_dict("records"):
                sampled.setdefault((rec["layer"], int(rec["step"]), rec["kind"]), []).append(
                    (int(rec["rank"]), int(rec["call"])))
    keys = sorted(set(groups) | set(sampled), key=lambda k: (order[k[0]], k[1], k[2]))
    if not keys:
        raise ValueError(f"the run has no statistics or samples for layers {lay}, kinds {list(kinds)} "
                         f"at the selected steps")
    stat_keys = [k for k in keys if k not in sampled]
    samp_keys = [k for k in keys if k in sampled]
    if progress is None:
        progress = len(keys) > 50
    bar = tqdm(total=len(keys), desc="fit", unit="group", disable=not progress)
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    merged = [merge_stats(groups[k]) if len(groups[k]) > 1 else groups[k][0] for k in stat_keys]
    for k, res in zip(stat_keys, fit_many_stats(merged, fams)):
        results[k] = _error_rows(k, fams, "stats", res) if isinstance(res, ValueError) else _rows(k, res)
    bar.update(len(stat_keys))

    def one(k: tuple[str, int, str]) -> list[dict[str, Any]]:
        parts = [run.samples(k[0], k[1], kind=k[2], call=c, rank=r) for r, c in sorted(set(sampled[k]))]
        vals = parts[0] if len(parts) == 1 else torch.cat([torch.as_tensor(p) for p in parts])
        try:
            return _rows(k, fit(vals, families=fams, ks=ks, max_samples=max_samples, workers=1))
        except ValueError as exc:
            return _error_rows(k, fams, "samples", exc)

    if workers is None:
        workers = default_workers()
    with torch_single_thread():
        if workers > 1 and len(samp_keys) > 1:
            with ThreadPoolExecutor(workers) as pool:
                for k, rows in zip(samp_keys, pool.map(one, samp_keys)):
                    results[k] = rows
                    bar.update(1)
        else:
            for k in samp_keys:
                results[k] = one(k)
                bar.update(1)
    bar.close()
    rows = [r for k in keys for r in results[k]]
    df = pd.DataFrame(rows)
    front = ["layer", "step", "kind", "family", "source", "status"]
    df = df[front + [c for c in df.columns if c not in front]]
    n_err = int((df["status"] != "ok").sum()) // len(fams)
    if n_err:
        log.warning("%d of %d groups could not be fitted (see the status column)", n_err, len(keys))
    return df


def layer_verdicts(df: Any) -> Any:
    """Per layer and kind: wins per family over steps, the winner, its margin over the runner-up
    (median difference in mean log-likelihood per value and median Vuong effect size) and the
    median KS of each family."""
    ok = df[df["status"] == "ok"]
    rows = []
    for (layer, kind), g in ok.groupby(["layer", "kind"], sort=False):
        best = g[g["best"]]
        wins = best["family"].value_counts()
        winner = wins.index[0]
        margin = g[~g["best"]].groupby("step")["delta_loglik"].max()  # runner-up vs best, per step
        row: dict[str, Any] = {"layer": layer, "kind": kind, "groups": int(best.shape[0]), "winner": winner}
        for fam in ("lognormal", "normal", "laplace"):
            row[f"wins_{fam}"] = int(wins.get(fam, 0))
        row["margin_loglik"] = float(-margin.median()) if len(margin) else math.nan
        row["vuong_effect"] = float(best["vuong_effect"].median())
        # exact KS where the layer has raw samples; otherwise midpoints of the histogram bounds
        exact = g[g["ks_method"].isin(["exact", "subsample"])]
        src = exact if len(exact) else g
        row["ks_from"] = "samples" if len(exact) else "stats (bounds)"
        for fam, fg in src.groupby("family"):
            row[f"ks_{fam}"] = float(fg["ks"].median())
        row["sigma"] = float(g["sigma"].median())
        rows.append(row)
    return pd.DataFrame(rows)
