"""``fit_run``: every layer, step and kind of a run, one row per family."""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import pandas as pd
import torch

from gradstats.families import FAMILIES
from gradstats.fitting._compare import check_families
from gradstats.fitting._exact import fit
from gradstats.fitting._parallel import default_workers, torch_single_thread
from gradstats.fitting._result import FitResult, failed_rows
from gradstats.fitting._stats import fit_many_stats
from gradstats.run import RunCorruptError, as_run
from gradstats.run.select import layer_matcher, layer_stats, select_layers, select_steps  # noqa: F401 - their home
from gradstats.stats import merge_stats

log = logging.getLogger(__name__)

KEY_COLUMNS = ("layer", "step", "kind", "family")


def _error_rows(key: tuple[str, int, str], fams: Sequence[str], source: str, status: str) -> list[dict]:
    """Rows of a group that was not fitted: the columns of a fitted group, numbers NaN."""
    return [{"layer": key[0], "step": key[1], "kind": key[2], **r, "status": status}
            for r in failed_rows(fams, source)]


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
    that cannot be fitted gives rows whose numbers are NaN and whose ``status`` says why, and
    the rest of the run is fitted: ``"error: ..."`` for values no family fits (all zeros,
    all non-finite, fewer than 10 non-zero finite values, constant magnitudes) and
    ``"damaged: ..."`` for raw samples whose file is damaged on disk (the
    :class:`~gradstats.run.RunCorruptError` naming the file). Fitted rows have
    ``status == "ok"``; :func:`failed_groups` lists the others.

    Args:
        run: a :class:`gradstats.Run`, the path of a run directory (or anything with ``layers``, ``steps``, ``stats()``,
            ``sample_index()`` and ``samples(layer, step, kind=, call=, rank=)``).
        layers: None (all), a glob (``"conv*"``), ``"re:PATTERN"``, a compiled regex, or a
            list of names and patterns (the tracer's pattern language).
        steps: None (all), an int, a slice/range, or a list of steps.
        kinds: which captured kinds (``"grad"``, ``"act"``, ...).
        families, ks, max_samples: passed to :func:`fit` for sampled steps.
        use_samples: False fits every step from its statistics.
        progress: a progress bar (default: on when there are more than 50 groups; drawn on a terminal
            only, see :mod:`gradstats._progress`).
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
    from gradstats._progress import progress_bar

    if isinstance(run, (str, os.PathLike)) or not hasattr(run, "stats"):
        run = as_run(run)
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
    bar = progress_bar(total=len(keys), desc="fit", unit="group", progress=progress, leave=True, logger=log,
                       note=f"fitting {len(keys)} group(s) (layer, step, kind) of {len(lay)} layer(s), "
                            f"{len(samp_keys)} of them from raw samples")
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    merged = [merge_stats(groups[k]) if len(groups[k]) > 1 else groups[k][0] for k in stat_keys]
    for k, res in zip(stat_keys, fit_many_stats(merged, fams)):
        results[k] = _error_rows(k, fams, "stats", f"error: {res}") if isinstance(res, ValueError) \
            else _rows(k, res)
    bar.update(len(stat_keys))

    def one(k: tuple[str, int, str]) -> list[dict[str, Any]]:
        try:
            parts = [run.samples(k[0], k[1], kind=k[2], call=c, rank=r) for r, c in sorted(set(sampled[k]))]
        except RunCorruptError as exc:  # the file of these samples is damaged: report it, fit the rest
            return _error_rows(k, fams, "samples", f"damaged: {exc}")
        vals = parts[0] if len(parts) == 1 else torch.cat([torch.as_tensor(p) for p in parts])
        try:
            return _rows(k, fit(vals, families=fams, ks=ks, max_samples=max_samples, workers=1))
        except ValueError as exc:
            return _error_rows(k, fams, "samples", f"error: {exc}")

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
    bad = [k for k in keys if results[k][0]["status"] != "ok"]
    if bad:
        n_dam = sum(results[k][0]["status"].startswith("damaged") for k in bad)
        log.warning("fit: %d of %d groups (layer, step, kind) could not be fitted%s; their rows hold NaN numbers and "
                    "a status saying why (the rest is fitted); first: layer %s, %s, step %d: %s", len(bad), len(keys),
                    f", {n_dam} of them from damaged sample files" if n_dam else "", bad[0][0], bad[0][2], bad[0][1],
                    results[bad[0]][0]["status"])
    return df


def failed_groups(df: Any) -> pd.DataFrame:
    """The groups of a :func:`fit_run` table that were not fitted, one row per layer, kind and
    status (the reason) with the ``steps`` (a list) it applies to, their number ``n_steps`` and
    the ``source`` of those fits (``"samples"``, ``"stats"`` or both, comma-separated); empty
    when every group was fitted.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"layer": ["a", "a", "b"], "step": [0, 1, 0], "kind": "grad",
        ...                    "family": "lognormal", "source": "stats",
        ...                    "status": ["ok", "error: all zeros", "error: all zeros"]})
        >>> failed_groups(df)[["layer", "steps", "status"]].values.tolist()
        [['a', [1], 'error: all zeros'], ['b', [0], 'error: all zeros']]
    """
    cols = ["layer", "kind", "source", "status", "steps", "n_steps"]
    bad = df[df["status"] != "ok"].drop_duplicates(["layer", "step", "kind"])
    rows = []
    for (layer, kind, status), g in bad.groupby(["layer", "kind", "status"], sort=False):
        steps = sorted(int(s) for s in g["step"])
        rows.append({"layer": layer, "kind": kind, "source": ", ".join(sorted(set(g["source"]))),
                     "status": status, "steps": steps, "n_steps": len(steps)})
    return pd.DataFrame(rows, columns=cols)


def steps_text(steps: Sequence[int], limit: int = 8) -> str:
    """``"step 3"``, ``"steps 0, 2, 4"``, or ``"12 steps 0..110"`` beyond ``limit`` steps."""
    steps = list(steps)
    if len(steps) == 1:
        return f"step {steps[0]}"
    if len(steps) > limit:
        return f"{len(steps)} steps {steps[0]}..{steps[-1]}"
    return "steps " + ", ".join(str(s) for s in steps)


def failure_lines(failed: Any, *, kind: bool = True, source: bool = True) -> list[str]:
    """One indented text line per row of :func:`failed_groups`: layer (and kind), steps (and
    the source of the fits), and the status saying why.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"layer": ["a", "a"], "step": [0, 1], "kind": "grad", "family": "lognormal",
        ...                    "source": "stats", "status": ["error: all zeros"] * 2})
        >>> failure_lines(failed_groups(df))
        ['  a (grad), steps 0, 1 [stats]: error: all zeros']
    """
    out = []
    for r in failed.to_dict("records"):
        what = r["layer"] + (f" ({r['kind']})" if kind else "")
        src = f" [{r['source']}]" if source else ""
        out.append(f"  {what}, {steps_text(r['steps'])}{src}: {r['status']}")
    return out


def layer_verdicts(df: Any) -> Any:
    """Per layer and kind: wins per family over steps, the winner, its margin over the runner-up
    (median difference in mean log-likelihood per value and median Vuong effect size), the
    median KS of each family, and how many groups were not fitted and why.

    Columns: ``layer, kind, groups`` (steps fitted), ``winner`` (None when no step was fitted),
    ``wins_{family}``, ``margin_loglik``, ``vuong_effect``, ``ks_from``, ``ks_{family}``,
    ``sigma`` (NaN when nothing was fitted), ``failed`` (steps not fitted) and ``failure`` (their
    distinct ``status`` texts joined by ``"; "``, None when all were fitted). Layers none of
    whose steps fitted are rows too, so every layer of the table is accounted for."""
    fams = [f for f in FAMILIES if f in set(df["family"])] if len(df) else []
    rows = []
    for (layer, kind), g in df.groupby(["layer", "kind"], sort=False):
        ok = g[g["status"] == "ok"]
        bad = g[g["status"] != "ok"].drop_duplicates(["step"])
        row: dict[str, Any] = {"layer": layer, "kind": kind, "groups": 0, "winner": None}
        row.update({f"wins_{fam}": 0 for fam in ("lognormal", "normal", "laplace")})
        row.update({"margin_loglik": math.nan, "vuong_effect": math.nan, "ks_from": None})
        row.update({f"ks_{fam}": math.nan for fam in fams})
        row["sigma"] = math.nan
        if len(ok):
            is_best = ok["best"].fillna(False).astype(bool)
            best = ok[is_best]
            wins = best["family"].value_counts()
            row["groups"] = int(best.shape[0])
            row["winner"] = wins.index[0] if len(wins) else None
            for fam in ("lognormal", "normal", "laplace"):
                row[f"wins_{fam}"] = int(wins.get(fam, 0))
            margin = ok[~is_best].groupby("step")["delta_loglik"].max()  # runner-up vs best, per step
            row["margin_loglik"] = float(-margin.median()) if len(margin) else math.nan
            row["vuong_effect"] = float(best["vuong_effect"].median())
            # exact KS where the layer has raw samples; otherwise midpoints of the histogram bounds
            exact = ok[ok["ks_method"].isin(["exact", "subsample"])]
            src = exact if len(exact) else ok
            row["ks_from"] = "samples" if len(exact) else "stats (bounds)"
            for fam, fg in src.groupby("family"):
                row[f"ks_{fam}"] = float(fg["ks"].median())
            row["sigma"] = float(ok["sigma"].median())
        row["failed"] = int(bad.shape[0])
        row["failure"] = "; ".join(dict.fromkeys(bad["status"])) if len(bad) else None
        rows.append(row)
    return pd.DataFrame(rows)
