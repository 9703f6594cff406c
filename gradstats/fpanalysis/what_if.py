"""What a format would do to every traced tensor, from the run's statistics alone.

A run keeps, per captured tensor, the binade histogram of ``|g|`` and its 64 largest magnitudes
(:mod:`gradstats.stats`): read as a law (:class:`gradstats.fpanalysis.histogram.HistogramLaw`:
each binade holds its observed mass, log-linear within, the 64 largest as exact point masses),
they say what quantising the tensor with any format, scale and rounding would do, after the fact,
without the tensor. :func:`what_if` gives, per step, layer and format:

* ``underflow``: the fraction of the non-zero entries that become zero (with stochastic
  rounding: the expected fraction);
* ``overflow``: the fraction that exceed the format's largest value and saturate;
* ``rel_mse``: ``E[(Q(g) - g)^2] / E[g^2]``;
* ``bias``: the signed magnitude bias, ``E[|Q(g)| - |g|] / E[|g|]`` (flush-to-zero and saturation
  shrink: negative);
* ``log2_scale``: the per-tensor scale used (``Q(g) = quantize(g * s) / s``); NaN with blocks.

The cells of the format are integrated against the law exactly (partial moments at the cell
boundaries), so the only modelled part is the shape of ``|g|`` *within* a binade, outside the 64
largest. With a power-of-two scale the underflow boundary of round-to-nearest (half the smallest
subnormal) is a binade boundary, so ``underflow`` is exact for nearest rounding; ``overflow`` is
exact where the values above the format's maximum are among the 64 largest (always, at the
``"amax"`` scale). The error bound on real runs is in ``docs/fpanalysis.md`` (measured against
quantising the stored samples, ``tests/fpanalysis/test_what_if.py``).

Blocks (a block-scaled scheme such as ``"mxfp8_e4m3"``, or ``granularity=B``; OCP MX: an E8M0 power-of-two scale per block from the block's largest
magnitude, :func:`gradstats.ops.quantization.mx_shared_exponent`) are predicted for exchangeable entries: a
block is ``B`` entries drawn from the tensor at random, so the binade of a block's maximum, given
one of its entries, follows from the law of the others (``P(max < 2**L) = F(2**L)**(B-1)``). This
is exact for the stored samples (a uniform random sample) and for tensors without structure along
the blocked dimension; real tensors whose neighbouring entries share a scale (a channel, a token)
do better in blocks than predicted.

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> g = torch.exp(-12 + 2.0 * torch.randn(200_000, generator=torch.Generator().manual_seed(0)))
    >>> p = predict_from_stats(tensor_stats(g), "e4m3fn")
    >>> from gradstats.ops.quantization import quantize
    >>> s = 2.0 ** p["log2_scale"]
    >>> measured = (quantize(g * s, "e4m3fn", overflow="saturate") == 0).double().mean().item()
    >>> abs(p["underflow"] - measured) < 1e-3
    True
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd

from gradstats.formats import FPFormat
from gradstats.fpanalysis._what_if_rows import _SUMS, _grid, predict_rows, rows_apply
from gradstats.fpanalysis.granularity import analysed_scheme, granularity_layout
from gradstats.fpanalysis.histogram import HistogramLaw
from gradstats.scheme import E4M3, Scheme, names_scheme
from gradstats.stats import StatsRow
from gradstats.stats.law import tensor_scale

__all__ = ["what_if", "what_if_stats", "predict_from_stats", "WHAT_IF_COLUMNS"]

#: the prediction columns of :func:`what_if` (besides ``step``, ``layer``, ``format``, ...)
WHAT_IF_COLUMNS = ("underflow", "overflow", "rel_mse", "bias", "log2_scale")
from gradstats.formats import PREDICTED_ROUNDINGS as ROUNDINGS  # noqa: E402


def _binade_range(law: HistogramLaw) -> tuple[int, int]:
    lows = ([float(law.edges[0])] if law.weights.size else []) + ([float(law.atoms.min())] if law.atoms.size else [])
    return int(math.floor(math.log2(min(lows)))), int(math.floor(math.log2(law.amax)))


def _pieces(law: HistogramLaw, grid: np.ndarray, s: float, rounding: str,
            extra_cuts: Sequence[float] = ()) -> dict[str, np.ndarray]:
    """Quantising ``y * s`` on ``grid`` (saturating), integrated over the law of the non-zero
    entries piece by piece: the pieces are the format's rounding cells cut at every binade boundary
    (so that each lies in one binade, ``binade``: its floor(log2)), each with its mass flushed to
    zero and saturated, squared error and signed error (in the tensor's units)."""
    u = grid / s                                        # the grid in the tensor's units
    vmax = u[-1]
    lo_e, hi_e = _binade_range(law)
    cells = (np.concatenate([[0.0], (u[:-1] + u[1:]) / 2]) if rounding == "nearest" else u)   # cell starts
    cuts = np.exp2(np.arange(lo_e, hi_e + 2, dtype=np.float64))
    pts = np.unique(np.concatenate([cells, cuts, [vmax], np.asarray(extra_cuts, dtype=np.float64)]))
    pts = pts[np.isfinite(pts)]
    pts = pts[pts > 0]
    a = np.concatenate([[0.0], pts])                    # piece starts (each ends at the next)
    m = [law.partial_moments(np.concatenate([a, [np.inf]]), k, np.zeros(1))[0] for k in range(3)]
    p, e1, e2 = (np.diff(mk) for mk in m)
    ci = np.searchsorted(cells, a, side="right") - 1   # the cell of each piece
    with np.errstate(divide="ignore"):
        binade = np.where(a > 0, np.floor(np.log2(np.where(a > 0, a, 1.0))), lo_e - 1).astype(np.int64)
    above = a >= vmax
    if rounding == "nearest":
        q = u[ci]
        sq = q * q * p - 2 * q * e1 + e2
        signed = q * p - e1
        flushed = np.where(ci == 0, p, 0.0)
    else:
        last = ci >= len(u) - 1
        lo = u[np.minimum(ci, len(u) - 1)]
        hi = u[np.minimum(ci + 1, len(u) - 1)]
        inside = -e2 + (lo + hi) * e1 - lo * hi * p                      # unbiased, variance (y-lo)(hi-y)
        sq = np.where(last, vmax * vmax * p - 2 * vmax * e1 + e2, inside)
        signed = np.where(last, vmax * p - e1, 0.0)
        flushed = np.where(ci == 0, p - e1 / u[1], 0.0)                   # E[(u1 - y) / u1] below u1
    return {"binade": binade, "start": a, "flushed": flushed, "saturated": np.where(above, p, 0.0), "sq": sq,
            "signed": signed, "mean": float(m[1][-1]), "energy": float(m[2][-1])}


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")


def predict_from_stats(stats: StatsRow | Mapping[str, Any], fmt: Union[FPFormat, Scheme, str], *, scale: Union[str, float] = "amax",
                       rounding: str = "nearest",
                       granularity: Union[str, int, Scheme, None] = None) -> dict[str, float]:
    """What quantising the tensor a statistics row describes (``hist``, ``max_abs``, ``top_abs``,
    ``n``, ``n_zero``: :func:`gradstats.stats.tensor_stats` or a row of ``Run.stats()``) with ``fmt``
    would do: the :data:`WHAT_IF_COLUMNS` (see the module doc), fractions per non-zero entry.

    ``scale``: ``"amax"`` (the largest power of two that keeps the tensor's maximum representable,
    as ``apply`` does) or a number (the multiplier); ignored with blocks, whose scales are per block:
    E8M0 (MX, power of two) or E4M3 (NVFP4: the block's amax over the format's maximum, rounded to
    e4m3fn, times a per-tensor float32 scale that maps the tensor's amax to 448;
    :func:`gradstats.ops.quantization.block_scales`). ``fmt`` may be a scheme (``"nvfp4"``), which brings
    its own blocks, scale format and non-nearest rounding; a plain format takes ``granularity``'s blocks
    (``"mx"``, ``"nvfp4"``, a block size: :func:`~gradstats.fpanalysis.granularity.analysed_scheme`).
    Example: see the module.
    """
    _, sch = _schemes([fmt], granularity)[0]
    rounding = sch.rounding if sch.rounding != "nearest" else rounding
    _check_rounding(rounding)
    if sch.block_size is None:
        tensor_scale(sch.element, scale, 1.0)             # a ValueError for a bad scale
    if rows_apply(sch):                                   # one row: a table of one row
        cols = {k: [v] for k, v in stats.items()}
        got = predict_rows(cols, sch, rounding=rounding, scale=scale)[0].tolist()
        return {k: v if v == v else math.nan for k, v in zip(WHAT_IF_COLUMNS, got)}   # NaN: math.nan itself
    return _nvfp4_row(stats, sch, rounding)


def _nvfp4_row(stats: StatsRow | Mapping[str, Any], sch: Scheme, rounding: str) -> dict[str, float]:
    """:func:`predict_from_stats` of one row under NVFP4's E4M3 block scales (:func:`_nvfp4_blocks`)."""
    f = sch.element
    n, nz = int(stats.get("n", 0)), int(stats.get("n", 0)) - int(stats.get("n_zero", 0))
    nan = {k: math.nan for k in WHAT_IF_COLUMNS}
    if nz <= 0 or not np.asarray(stats.get("hist", [])).sum():
        return {**nan, "underflow": 0.0, "overflow": 0.0, "rel_mse": 0.0, "bias": 0.0}
    law = HistogramLaw.from_stats(stats)
    c = _nvfp4_blocks(law, _grid(f), f, int(sch.block_size or 0), rounding, zero_fraction=1.0 - nz / n,
                      tensor_amax=float(stats["max_abs"]))
    return {"underflow": c["flushed"], "overflow": c["saturated"],
            "rel_mse": c["sq"] / c["energy"] if c["energy"] > 0 else 0.0,
            "bias": c["signed"] / c["mean"] if c["mean"] > 0 else 0.0, "log2_scale": math.nan}


def _nvfp4_blocks(law: HistogramLaw, grid: np.ndarray, fmt: FPFormat, block: int, rounding: str, *,
                  zero_fraction: float, tensor_amax: float) -> dict[str, float]:
    """NVFP4 blocks of exchangeable entries: the block scale ``X = e4m3(m / (fmt.max * t)) * t`` of a
    block whose largest magnitude is ``m`` takes the values of the e4m3fn grid times ``t``; block
    maxima in ``[lo_k, hi_k)`` give the ``k``-th. An entry ``y`` of a block is quantised at ``X_k``
    with probability ``P(max(y, M') in [lo_k, hi_k))``, ``M'`` the largest of the other ``block - 1``
    entries. ``X = 0`` (a block too small for the smallest scale) encodes zeros."""
    e4 = E4M3
    scales = _grid(e4)                                          # 0, the subnormals, ..., 448
    t = tensor_amax / (fmt.max * e4.max) if tensor_amax > 0 else 1.0
    mids = (scales[:-1] + scales[1:]) / 2 * fmt.max * t
    lo_m, hi_m = np.concatenate([[0.0], mids]), np.concatenate([mids, [np.inf]])
    z = zero_fraction

    def cdf(x: np.ndarray) -> np.ndarray:                      # P(|Y'| < x), zeros included
        return np.clip(z + (1 - z) * law.partial_moments(np.asarray(x, dtype=np.float64), 0, np.zeros(1))[0], 0, 1)

    f_lo, f_hi = cdf(lo_m) ** (block - 1), cdf(np.where(np.isfinite(hi_m), hi_m, law.amax * 2)) ** (block - 1)
    total = {k: 0.0 for k in _SUMS}
    mean = float(law.partial_moments(np.array([np.inf]), 1, np.zeros(1))[0, 0])
    energy = float(law.partial_moments(np.array([np.inf]), 2, np.zeros(1))[0, 0])
    for k, v in enumerate(scales):
        lo, hi = lo_m[k], hi_m[k]
        if lo > law.amax:
            break
        w_below, w_in = f_hi[k] - f_lo[k], f_hi[k]
        if v == 0:                                              # the block encodes zeros: all flushed
            m = [law.partial_moments(np.array([lo, min(hi, law.amax * 2)]), q, np.zeros(1))[0] for q in range(3)]
            below = [mq[0] for mq in m]
            inside = [mq[1] - mq[0] for mq in m]
            total["flushed"] += w_below * below[0] + w_in * inside[0]
            total["sq"] += w_below * below[2] + w_in * inside[2]
            total["signed"] -= w_below * below[1] + w_in * inside[1]
            continue
        pc = _pieces(law, grid, 1.0 / (float(v) * t), rounding, extra_cuts=[lo, hi])
        a = pc["start"]
        w = np.where(a < lo, w_below, np.where(a < hi, w_in, 0.0))
        for key in _SUMS:
            total[key] += float(np.sum(w * pc[key]))
    return total | {"mean": mean, "energy": energy}


def _schemes(formats: Any, granularity: Union[str, int, Scheme, None]) -> list[tuple[str, Scheme]]:
    """The door of :func:`what_if`, :func:`what_if_stats` and :func:`predict_from_stats`: ``(label,
    scheme)`` of each of ``formats`` (a name, a format, a scheme, a list of them, or a
    comma-separated text), resolved once; everything below takes the :class:`~gradstats.scheme.Scheme`.
    A scheme or preset name (``"nvfp4"``) brings its own blocks, labelled by its name; a plain format
    gets the call's ``granularity`` (:func:`~gradstats.fpanalysis.granularity.analysed_scheme`), labelled by
    the format."""
    if isinstance(formats, (str, FPFormat, Scheme)):
        formats = [p.strip() for p in formats.split(",") if p.strip()] if isinstance(formats, str) else [formats]
    if granularity is not None:
        granularity_layout(granularity)        # a ValueError naming the granularities, with no format to blame
    out = []
    for f in formats:
        s = analysed_scheme(f, None if names_scheme(f) else granularity, what="what_if")
        out.append((str(s) if names_scheme(f) else str(s.element), s))
    return out


def what_if(run: Any, formats: Union[str, FPFormat, Scheme, Iterable[Union[str, FPFormat, Scheme]]], *,
            granularity: Union[str, int, Scheme, None] = None, rounding: str = "nearest",
            scale: Union[str, float] = "amax", orientation: str = "rows",
            steps: Union[None, int, Sequence[int]] = None, layers: Union[None, str, Sequence[str]] = None,
            kind: str = "grad") -> pd.DataFrame:
    """What each format would do to each traced tensor of ``run``, from its statistics alone.

    Args:
        run: a :class:`gradstats.run.Run` or the path of one.
        formats: format names or :class:`FPFormat` objects (or one; ``"e4m3fn,e5m2"`` works too), or
            schemes (:class:`~gradstats.scheme.Scheme`, a preset such as ``"nvfp4"`` or ``"mxfp8_e4m3"``),
            which bring their own blocks, scale format and (when not nearest) rounding; their rows are
            labelled by the scheme's name.
        granularity: where the plain formats' scales live (a scheme keeps its own): None or ``"tensor"``
            (one per tensor), or a scale per block of exchangeable entries (see the module doc): ``"mx"``
            (32, E8M0), ``"nvfp4"`` (16, E4M3 under a float32 scale), an int block size (E8M0).
        rounding: ``"nearest"`` or ``"stochastic"`` (a scheme's own non-nearest rounding wins).
        scale: ``"amax"`` or a multiplier (per tensor).
        orientation: with blocks, how they run (:data:`gradstats.stats.blocks.ORIENTATIONS`):
            on the gradient's channels-last matrix (:mod:`gradstats.ops.layout`): ``"rows"`` (along
            the channels: the data-gradient GEMM's, as ``quantize`` and ``apply`` lay blocks out),
            ``"columns"`` (along the tokens: the weight-gradient GEMM's) or ``"2d"`` (``B x B`` tiles).
            Where the run recorded the blocks (``trace``'s default records blocks of 16 and 32 on its
            sampled steps) the MX and NVFP4 underflow is read from them (``estimate`` ``"blocks"``;
            for NVFP4 up to the e4m3 rounding of its block scales); elsewhere it is the exchangeable
            model's, the same for every orientation (``"exchangeable"``).
        steps: None (every step), a step, or a list of steps.
        layers: None (every layer), a glob, ``"re:PATTERN"`` or a list of names/globs.
        kind: which tensors (``"grad"``: the neural gradients).

    Returns a DataFrame, one row per (step, layer, format): ``step``, ``layer``, ``format``,
    ``block_size``, ``scale_format``, ``rounding``, ``n`` (entries, every call and rank of the step), then
    :data:`WHAT_IF_COLUMNS`, ``orientation`` and ``estimate`` (with blocks, which estimate
    ``underflow`` is: ``"blocks"``, from the recorded blocks of every call and rank of the step,
    ``"exchangeable"``, or ``"mixed"``; None without blocks). The calls and ranks of a step are each quantised on their own (each has
    its own amax) and combined: fractions weighted by non-zero entries, ``rel_mse`` by energy,
    ``bias`` by magnitude; ``log2_scale`` is the median over them.

    Example:
        >>> import gradstats
        >>> df = what_if(gradstats.zoo.data.data_dir() / "sample-run", ["e4m3fn", "e2m1fn"], steps=[0], layers="conv*")
        >>> df[["layer", "format"]].values.tolist()
        [['conv1', 'e4m3fn'], ['conv1', 'e2m1fn'], ['conv2', 'e4m3fn'], ['conv2', 'e2m1fn']]
        >>> bool((df.loc[df.format == "e2m1fn", "underflow"].values > df.loc[df.format == "e4m3fn", "underflow"].values).all())
        True
    """
    from gradstats.run import Run, open_run

    r = run if isinstance(run, Run) else open_run(run)

    fmts = _schemes(formats, granularity)
    if not fmts:
        raise ValueError("what_if needs at least one format (names such as 'e4m3fn', 'e5m2', 'e2m1fn', 'nvfp4')")
    _check_rounding(rounding)
    from gradstats.run.select import layer_stats
    from gradstats.stats.blocks import check_orientation

    check_orientation(orientation)

    st = layer_stats(r, [kind], layers)
    if steps is not None:
        want = [int(steps)] if isinstance(steps, (int, np.integer)) else [int(s) for s in steps]
        st = st[st["step"].isin(want)]
    if not len(st):
        raise ValueError(f"no {kind!r} statistics in {r.path} for steps={steps!r}, layers={layers!r}; the run "
                         f"has steps {r.steps[:5]}{' ...' if len(r.steps) > 5 else ''} and layers {r.layers}")
    blocks = r.table("blocks") if any(sch.block_size is not None for _, sch in fmts) else None
    return what_if_stats(st, formats, granularity=granularity, rounding=rounding, scale=scale, order=r.layers,
                         orientation=orientation, blocks=blocks)


def what_if_stats(stats: pd.DataFrame, formats: Union[str, FPFormat, Scheme, Iterable[Union[str, FPFormat, Scheme]]], *,
                  granularity: Union[str, int, Scheme, None] = None,
                  rounding: str = "nearest", scale: Union[str, float] = "amax",
                  order: Optional[Sequence[str]] = None, orientation: str = "rows",
                  blocks: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """:func:`what_if` on a statistics table (rows as ``Run.stats()`` gives them, of one kind), in
    ``order`` of layers (default: as they first appear): what a live sink computes on each commit.
    ``blocks``: the run's ``"blocks"`` table (``Run.table("blocks")``), whose rows of ``block_size``
    and ``orientation`` give the MX underflow of the captures they match (see :func:`what_if`, which
    documents the other arguments).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = dict(tensor_stats(torch.randn(1000) * 1e-3), step=0, layer="fc", call=0, rank=0)
        >>> what_if_stats(pd.DataFrame([row]), ["e4m3fn"])[["layer", "format"]].values.tolist()
        [['fc', 'e4m3fn']]
    """
    fmts = _schemes(formats, granularity)
    _check_rounding(rounding)
    for label, sch in fmts:
        if sch.rounding != "nearest":
            _check_rounding(sch.rounding)
    from gradstats.stats.blocks import check_orientation

    check_orientation(orientation)
    cols = ["step", "layer", "format", "block_size", "scale_format", "rounding", "n", *WHAT_IF_COLUMNS,
            "orientation", "estimate"]
    if not len(stats):
        return pd.DataFrame([], columns=cols)
    rank_of = {n: i for i, n in enumerate(order if order is not None else dict.fromkeys(stats["layer"]))}
    st = stats.reset_index(drop=True)
    key = pd.DataFrame({"step": st["step"].astype(np.int64), "rank": st["layer"].map(lambda x: rank_of.get(x, len(rank_of))),
                        "layer": st["layer"]})
    # the groups (step, layer) in order of step, then of layer
    grp = key.groupby(["step", "rank", "layer"], sort=True).ngroup().to_numpy()
    first = key.drop_duplicates(["step", "rank", "layer"]).sort_values(["step", "rank", "layer"])
    n_g = len(first)
    nz = (st["n"].to_numpy(np.float64) - st["n_zero"].to_numpy(np.float64))
    weights = {"underflow": nz, "overflow": nz, "rel_mse": st["sum_sq"].to_numpy(np.float64),
               "bias": st["sum_abs"].to_numpy(np.float64)}
    n_sum = np.bincount(grp, weights=st["n"].to_numpy(np.float64), minlength=n_g)
    out = []
    for label, sch in fmts:
        block_size, scale_format = sch.block_size, sch.scale_format_name
        rnd = sch.rounding if sch.rounding != "nearest" else rounding
        below = _recorded_blocks(st, blocks, block_size, orientation) if block_size else None
        if block_size:
            used = np.bincount(grp, weights=(below[1] if below is not None else np.zeros(len(st))), minlength=n_g)
            each = np.bincount(grp, minlength=n_g)
            estimate = np.where(used == each, "blocks", np.where(used == 0, "exchangeable", "mixed")).astype(object)
        else:
            estimate = np.full(n_g, None, dtype=object)
        p = _predictions(st, sch, scale=scale, rounding=rnd)
        if below is not None and below[1].any():
            from gradstats.stats.blocks import flushed_entries

            h, has, top = below                # top: NVFP4's blocks flushed whole (None in older runs)
            from_blocks = flushed_entries(h, sch, rounding=rnd, top_hist=top)
            p["underflow"] = np.where(has, from_blocks, p["underflow"].to_numpy())
        df = pd.DataFrame({"step": first["step"].to_numpy(), "layer": first["layer"].to_numpy(), "format": label,
                           "block_size": block_size, "scale_format": scale_format if block_size else None,
                           "rounding": rnd, "n": n_sum.astype(np.int64), "_g": np.arange(n_g)})
        for col, w in weights.items():
            num = np.bincount(grp, weights=w * p[col].to_numpy(), minlength=n_g)
            den = np.bincount(grp, weights=w, minlength=n_g)
            df[col] = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
        df["log2_scale"] = p["log2_scale"].groupby(grp).median().reindex(range(n_g)).to_numpy()
        df["orientation"] = orientation if block_size else None
        df["estimate"] = estimate
        out.append(df)
    res = pd.concat(out, ignore_index=True)
    res["_f"] = np.repeat(np.arange(len(fmts)), n_g)
    res = res.sort_values(["_g", "_f"], kind="stable").drop(columns=["_g", "_f"]).reset_index(drop=True)
    return res[cols]


def _recorded_blocks(stats: pd.DataFrame, blocks: Optional[pd.DataFrame], block_size: int,
                     orientation: str) -> Optional[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """The ``below_hist`` of the recorded blocks (``block_size``, ``orientation``) of each row of
    ``stats`` (``(R, BELOW_BINS)``, zeros where none), whether it has them, and their ``top_hist``
    (None for runs recorded before it); None when the table has none (no blocks traced, or a run from
    before they were recorded by orientation)."""
    from gradstats.stats.blocks import BELOW_BINS

    if blocks is None or not len(blocks) or "below_hist" not in blocks or "orientation" not in blocks:
        return None
    b = blocks[(blocks["block_size"] == block_size) & (blocks["orientation"] == orientation)]
    if "kind" in b and "kind" in stats:
        b = b[b["kind"].isin(stats["kind"].unique())]
    if not len(b):
        return None
    keys = [k for k in ("step", "layer", "call", "rank", "kind") if k in b and k in stats]
    b = b.drop_duplicates(keys, keep="last")
    pos = {tuple(k): i for i, k in enumerate(b[keys].itertuples(index=False, name=None))}
    hb = np.stack([np.asarray(h, dtype=np.float64) for h in b["below_hist"]])
    where = np.array([pos.get(tuple(k), -1) for k in stats[keys].itertuples(index=False, name=None)], dtype=np.int64)
    has = (where >= 0)
    h = np.zeros((len(stats), BELOW_BINS))
    h[has] = hb[where[has]]
    top = None
    if "top_hist" in b and b["top_hist"].map(lambda v: v is not None and len(v) == BELOW_BINS).all():
        tb = np.stack([np.asarray(t, dtype=np.float64) for t in b["top_hist"]])
        top = np.zeros((len(stats), BELOW_BINS))
        top[has] = tb[where[has]]
    return h, has & (h.sum(axis=1) > 0), top


def _predictions(stats: pd.DataFrame, sch: Scheme, *, scale: Union[str, float], rounding: str) -> pd.DataFrame:
    """The :data:`WHAT_IF_COLUMNS` of every row of ``stats`` (index kept) under the scheme ``sch``:
    all rows at once (:func:`~gradstats.fpanalysis._what_if_rows.predict_rows`); NVFP4's E4M3 block
    scales row by row."""
    if sch.block_size is None:
        tensor_scale(sch.element, scale, 1.0)             # a ValueError for a bad scale
    if rows_apply(sch):
        return pd.DataFrame(predict_rows(stats, sch, rounding=rounding, scale=scale),
                            columns=list(WHAT_IF_COLUMNS), index=stats.index)
    return pd.DataFrame([_nvfp4_row(x, sch, rounding) for x in stats.to_dict("records")],
                        columns=list(WHAT_IF_COLUMNS), index=stats.index)
