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

Blocks (``block_size=B``, OCP MX: an E8M0 power-of-two scale per block from the block's largest
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

from gradstats.formats import FPFormat, amax_scale, parse
from gradstats.fpanalysis.histogram import HistogramLaw
from gradstats.scheme import E4M3, Scheme, names_scheme
from gradstats.stats import HIST_MIN_EXP, StatsRow
from gradstats.stats.law import MAX_SLOPE, TOP_FIELD, expm1_ratio, law_flushed, tensor_scale

__all__ = ["what_if", "what_if_stats", "predict_from_stats", "WHAT_IF_COLUMNS"]

#: the prediction columns of :func:`what_if` (besides ``step``, ``layer``, ``format``, ...)
WHAT_IF_COLUMNS = ("underflow", "overflow", "rel_mse", "bias", "log2_scale")
from gradstats.formats import PREDICTED_ROUNDINGS as ROUNDINGS  # noqa: E402


def _grid(fmt: FPFormat) -> np.ndarray:
    """The format's non-negative finite values, ascending (0 first)."""
    v = fmt.values().numpy()
    return np.unique(np.abs(v))


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


_SUMS = ("flushed", "saturated", "sq", "signed")


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")


def predict_from_stats(stats: StatsRow | Mapping[str, Any], fmt: Union[FPFormat, Scheme, str], *, scale: Union[str, float] = "amax",
                       rounding: str = "nearest", block_size: Optional[int] = None,
                       scale_format: str = "e8m0") -> dict[str, float]:
    """What quantising the tensor a statistics row describes (``hist``, ``max_abs``, ``top_abs``,
    ``n``, ``n_zero``: :func:`gradstats.stats.tensor_stats` or a row of ``Run.stats()``) with ``fmt``
    would do: the :data:`WHAT_IF_COLUMNS` (see the module doc), fractions per non-zero entry.

    ``scale``: ``"amax"`` (the largest power of two that keeps the tensor's maximum representable,
    as ``apply`` does) or a number (the multiplier); ignored with ``block_size``, whose scales are
    per block: ``scale_format`` ``"e8m0"`` (MX, power of two) or ``"e4m3"`` (NVFP4: the block's amax
    over the format's maximum, rounded to e4m3fn, times a per-tensor float32 scale that maps the
    tensor's amax to 448; :func:`gradstats.ops.quantization.block_scales`). ``fmt`` may be a scheme
    (``"nvfp4"``), which brings its own blocks, scale format and non-nearest rounding. Example: see the module.
    """
    _, sch = _schemes([fmt], block_size, scale_format)[0]
    f, block_size, scale_format = sch.element, sch.block_size, sch.scale_format_name or scale_format
    rounding = sch.rounding if sch.rounding != "nearest" else rounding
    _check_rounding(rounding)
    n, nz = int(stats.get("n", 0)), int(stats.get("n", 0)) - int(stats.get("n_zero", 0))
    nan = {k: math.nan for k in WHAT_IF_COLUMNS}
    if nz <= 0 or not np.asarray(stats.get("hist", [])).sum():
        return {**nan, "underflow": 0.0, "overflow": 0.0, "rel_mse": 0.0, "bias": 0.0}
    law = HistogramLaw.from_stats(stats)
    grid = _grid(f)
    if block_size is None:
        s = tensor_scale(f, scale, float(stats["max_abs"]))
        pc = _pieces(law, grid, s, rounding)
        c = {k: float(pc[k].sum()) for k in _SUMS} | {"mean": pc["mean"], "energy": pc["energy"]}
        c["flushed"] = law_flushed(law, f, s, rounding)   # the one home of the flush law (the alarms use it)
        log2_scale = math.log2(s)
    else:
        if isinstance(block_size, bool) or int(block_size) < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if scale_format == "e8m0":
            c = _blocks(law, grid, f, int(block_size), rounding, zero_fraction=1.0 - nz / n)
        elif scale_format == "e4m3":
            c = _nvfp4_blocks(law, grid, f, int(block_size), rounding, zero_fraction=1.0 - nz / n,
                              tensor_amax=float(stats["max_abs"]))
        else:
            raise ValueError(f"scale_format must be 'e8m0' (MX) or 'e4m3' (NVFP4), got {scale_format!r}")
        log2_scale = math.nan
    return {"underflow": c["flushed"], "overflow": c["saturated"],
            "rel_mse": c["sq"] / c["energy"] if c["energy"] > 0 else 0.0,
            "bias": c["signed"] / c["mean"] if c["mean"] > 0 else 0.0, "log2_scale": log2_scale}


def _blocks(law: HistogramLaw, grid: np.ndarray, fmt: FPFormat, block: int, rounding: str, *,
            zero_fraction: float) -> dict[str, float]:
    """MX blocks of exchangeable entries: an entry of binade ``j`` in a block whose maximum is in
    binade ``L >= j`` is quantised at the block scale of ``L``; ``P(L | j)`` from the law of the
    block's other ``block - 1`` entries (zeros included)."""
    lo_e, hi_e = _binade_range(law)
    edges = np.exp2(np.arange(lo_e, hi_e + 2, dtype=np.float64))
    cdf = zero_fraction + (1 - zero_fraction) * law.partial_moments(edges, 0, np.zeros(1))[0]
    others = np.clip(cdf, 0.0, 1.0) ** (block - 1)                     # P(the others' max < 2**(lo_e + i))
    total = {k: 0.0 for k in _SUMS}
    mean = energy = 0.0
    for L in range(lo_e, hi_e + 1):
        e = max(min(L - fmt.emax, 127), -127)                          # mx_shared_exponent of such a block
        pc = _pieces(law, grid, math.ldexp(1.0, -e), rounding)
        mean, energy = pc["mean"], pc["energy"]
        i = L - lo_e
        # an entry of binade j < L: the others' max in binade L; of binade L itself: all others below 2**(L+1)
        w_lower = others[i + 1] - others[i]
        j = pc["binade"]
        w = np.where(j < L, w_lower, np.where(j == L, others[i + 1], 0.0))
        for k in _SUMS:
            total[k] += float(np.sum(w * pc[k]))
    return total | {"mean": mean, "energy": energy}


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


def _schemes(formats: Any, block_size: Optional[int], scale_format: str) -> list[tuple[str, Scheme]]:
    """``(label, scheme)`` of each of ``formats`` (a name, a format, a scheme, a list of them, or a
    comma-separated text): a scheme or preset name (``"nvfp4"``) brings its own blocks, labelled by
    its name; a plain format gets the call's ``block_size`` and ``scale_format``, labelled by the format."""
    if isinstance(formats, (str, FPFormat, Scheme)):
        formats = [p.strip() for p in formats.split(",") if p.strip()] if isinstance(formats, str) else [formats]
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
                                   or block_size < 1):
        raise ValueError(f"block_size must be a positive int (an MX block size such as 32) or None, got {block_size!r}")
    if block_size is not None and scale_format not in ("e8m0", "e4m3"):
        raise ValueError(f"scale_format must be 'e8m0' (MX) or 'e4m3' (NVFP4), got {scale_format!r}")
    out = []
    for f in formats:
        if names_scheme(f):
            sch = Scheme.parse(f)
            if sch.scale_rounding not in (None, "floor"):
                raise ValueError(f"scheme {str(sch)!r}: what_if predicts E8M0 scales rounded by the OCP rule "
                                 f"('floor'); drop ':scale_rounding={sch.scale_rounding}'")
            out.append((str(sch), sch))
        else:
            fmt = parse(f)
            out.append((str(fmt), Scheme(fmt, block_size=None if block_size is None else int(block_size),
                                         scale_format=None if block_size is None else scale_format)))
    return out


def what_if(run: Any, formats: Union[str, FPFormat, Scheme, Iterable[Union[str, FPFormat, Scheme]]], *,
            block_size: Optional[int] = None, rounding: str = "nearest", scale: Union[str, float] = "amax",
            scale_format: str = "e8m0", orientation: str = "rows",
            steps: Union[None, int, Sequence[int]] = None, layers: Union[None, str, Sequence[str]] = None,
            kind: str = "grad") -> pd.DataFrame:
    """What each format would do to each traced tensor of ``run``, from its statistics alone.

    Args:
        run: a :class:`gradstats.run.Run` or the path of one.
        formats: format names or :class:`FPFormat` objects (or one; ``"e4m3fn,e5m2"`` works too), or
            schemes (:class:`~gradstats.scheme.Scheme`, a preset such as ``"nvfp4"`` or ``"mxfp8_e4m3"``),
            which bring their own blocks, scale format and (when not nearest) rounding; their rows are
            labelled by the scheme's name.
        block_size: None (per-tensor scale) or a block size (a scale per block of exchangeable
            entries, see the module doc) for the plain formats: MX with ``scale_format="e8m0"`` (32),
            NVFP4 with ``"e4m3"`` (16).
        rounding: ``"nearest"`` or ``"stochastic"`` (a scheme's own non-nearest rounding wins).
        scale: ``"amax"`` or a multiplier (per tensor).
        orientation: with ``block_size``, how the blocks run (:data:`gradstats.stats.blocks.ORIENTATIONS`):
            ``"rows"`` (along the last dim, as ``quantize``'s ``block_dim=-1``), ``"columns"`` (down
            the flattened leading dims: the weight-gradient GEMM's) or ``"2d"`` (``B x B`` tiles).
            Where the run recorded the blocks (``trace(..., blocks=)``) the MX underflow is read from
            them (``estimate`` ``"blocks"``); elsewhere it is the exchangeable model's, the same for
            every orientation (``"exchangeable"``).
        steps: None (every step), a step, or a list of steps.
        layers: None (every layer), a glob, ``"re:PATTERN"`` or a list of names/globs.
        kind: which tensors (``"grad"``: the neural gradients).

    Returns a DataFrame, one row per (step, layer, format): ``step``, ``layer``, ``format``,
    ``block_size``, ``rounding``, ``n`` (entries, every call and rank of the step), then
    :data:`WHAT_IF_COLUMNS`, ``orientation`` and ``estimate`` (with ``block_size``, which estimate
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

    fmts = _schemes(formats, block_size, scale_format)
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
    return what_if_stats(st, formats, block_size=block_size, rounding=rounding, scale=scale, order=r.layers,
                         scale_format=scale_format, orientation=orientation, blocks=blocks)


def what_if_stats(stats: pd.DataFrame, formats: Union[str, FPFormat, Scheme, Iterable[Union[str, FPFormat, Scheme]]], *,
                  block_size: Optional[int] = None,
                  rounding: str = "nearest", scale: Union[str, float] = "amax",
                  order: Optional[Sequence[str]] = None, scale_format: str = "e8m0", orientation: str = "rows",
                  blocks: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """:func:`what_if` on a statistics table (rows as ``Run.stats()`` gives them, of one kind), in
    ``order`` of layers (default: as they first appear): what a live sink computes on each commit.
    ``blocks``: the run's ``"blocks"`` table (``Run.table("blocks")``), whose rows of ``block_size``
    and ``orientation`` give the MX underflow of the captures they match (see :func:`what_if`).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = dict(tensor_stats(torch.randn(1000) * 1e-3), step=0, layer="fc", call=0, rank=0)
        >>> what_if_stats(pd.DataFrame([row]), ["e4m3fn"])[["layer", "format"]].values.tolist()
        [['fc', 'e4m3fn']]
    """
    fmts = _schemes(formats, block_size, scale_format)
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
        f, block_size, scale_format = sch.element, sch.block_size, sch.scale_format_name
        rnd = sch.rounding if sch.rounding != "nearest" else rounding
        below = _recorded_blocks(st, blocks, block_size, orientation) if block_size and scale_format == "e8m0" else None
        if block_size:
            used = np.bincount(grp, weights=(below[1] if below is not None else np.zeros(len(st))), minlength=n_g)
            each = np.bincount(grp, minlength=n_g)
            estimate = np.where(used == each, "blocks", np.where(used == 0, "exchangeable", "mixed")).astype(object)
        else:
            estimate = np.full(n_g, None, dtype=object)
        p = _predictions(st, f, scale=scale, rounding=rnd, block_size=block_size, scale_format=scale_format)
        if below is not None and below[1].any():
            from gradstats.stats.blocks import flush_probability

            h, has = below
            tot = h.sum(axis=1)
            from_blocks = h @ flush_probability(f, scale_format="e8m0", rounding=rnd) / np.where(tot > 0, tot, 1.0)
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
                     orientation: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The ``below_hist`` of the recorded blocks (``block_size``, ``orientation``) of each row of
    ``stats`` (``(R, BELOW_BINS)``, zeros where none) and whether it has them; None when the table
    has none (no blocks traced, or a run from before they were recorded by orientation)."""
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
    return h, has & (h.sum(axis=1) > 0)


def _predictions(stats: pd.DataFrame, fmt: FPFormat, *, scale: Union[str, float], rounding: str,
                 block_size: Optional[int], scale_format: str) -> pd.DataFrame:
    """The :data:`WHAT_IF_COLUMNS` of every row of ``stats`` (index kept): all rows at once where
    :func:`_fast_applies`, else :func:`predict_from_stats` row by row."""
    if _fast_applies(fmt, scale, block_size, scale_format):
        return _predict_rows(stats, fmt, rounding=rounding, block_size=block_size)
    return pd.DataFrame([predict_from_stats(x, fmt, scale=scale, rounding=rounding, block_size=block_size,
                                            scale_format=scale_format) for x in stats.to_dict("records")],
                        columns=list(WHAT_IF_COLUMNS), index=stats.index)


# ---------------------------------------------------------------------------------------------
# The same predictions for many rows at once (what_if_stats): the laws of all rows as padded
# arrays, the format's cells tabulated per binade. With a power-of-two scale (per tensor at
# "amax", or an MX block scale) every binade of the law maps onto one binade of the format, whose
# cells cut it at the same relative places in every row; the integrals of a piece are linear in
# the law's within-binade primitives at those places, so one matrix product per moment gives
# every row's every binade at every scale.

def _row_laws(hist: np.ndarray, top: np.ndarray, max_abs: np.ndarray) -> dict[str, np.ndarray]:
    """:meth:`HistogramLaw.from_stats` of many rows at once (``shape="slope"``): ``hist`` ``(R,
    HIST_BINS)`` counts, ``top`` ``(R, K)`` largest magnitudes (0 or NaN: padding), ``max_abs``.
    Returns, in a window of ``W`` binades per row starting at binade ``lo`` (absolute exponent; the
    L-window of :func:`_blocks`): ``w``, ``beta``, ``ratio`` (a binade's upper over lower edge),
    ``atoms`` ``(R, K)`` (0: none), ``aw`` and ``hi`` (floor(log2 amax))."""
    R = hist.shape[0]
    c = hist.astype(np.float64)
    n = c.sum(axis=1)
    t = np.abs(np.nan_to_num(top.astype(np.float64), nan=0.0))
    t = -np.sort(-t, axis=1)
    has_t = t[:, 0] > 0 if t.shape[1] else np.zeros(R, bool)
    rest = c.copy()
    if t.shape[1]:
        _, ex = np.frexp(np.where(t > 0, t, 1.0))
        j = np.where(t > 0, ex - 1 - HIST_MIN_EXP, -1)
        rr, kk = np.nonzero(j >= 0)
        np.subtract.at(rest, (rr, j[rr, kk]), 1.0)
    live = rest > 0
    any_live = live.any(axis=1)
    lo_b = np.where(any_live, np.argmax(live, axis=1), 0)
    hi_b = np.where(any_live, rest.shape[1] - 1 - np.argmax(live[:, ::-1], axis=1), -1)
    amax = np.where(has_t, t[:, 0] if t.shape[1] else 0.0, max_abs.astype(np.float64))
    _, ex_amax = np.frexp(amax)
    hi = ex_amax.astype(np.int64) - 1
    tmin = np.where(t > 0, t, np.inf).min(axis=1) if t.shape[1] else np.full(R, np.inf)
    _, ex_tmin = np.frexp(np.where(np.isfinite(tmin), tmin, 1.0))
    lo = np.where(any_live, lo_b + HIST_MIN_EXP, ex_tmin.astype(np.int64) - 1)
    W = int(max(1, (hi - lo + 1).max()))
    idx = np.arange(W)
    nb = np.where(any_live, hi_b - lo_b + 1, 0)                       # binades of the law
    inb = idx[None, :] < nb[:, None]
    cols = np.clip(lo_b[:, None] + idx[None, :], 0, c.shape[1] - 1)
    w = np.where(inb, np.take_along_axis(rest, cols, axis=1), 0.0) / np.where(n > 0, n, 1.0)[:, None]
    lower = np.exp2((lo[:, None] + idx[None, :]).astype(np.float64))
    upper = 2 * lower
    top_i = np.maximum(nb - 1, 0)
    cap = np.where(has_t, tmin, amax)                                 # where the top binade ends
    ub = np.take_along_axis(upper, top_i[:, None], axis=1)[:, 0]
    lb = np.take_along_axis(lower, top_i[:, None], axis=1)[:, 0]
    top_edge = np.maximum(np.minimum(cap, ub), lb * (1 + 2.0 ** -30))
    np.put_along_axis(upper, top_i[:, None], np.where(any_live, top_edge, ub)[:, None], axis=1)
    ratio = upper / lower
    # slopes: numpy.gradient of the log-densities at the binades' centres, row by row
    width = np.log(ratio)
    centre = np.log(lower) + width / 2
    f = np.log(np.maximum(w, 1e-12) / width)
    beta = np.zeros_like(w)
    if W > 1:
        dx = np.diff(centre, axis=1)
        df = np.diff(f, axis=1)
        first = df[:, 0] / dx[:, 0]
        if W > 2:
            d1, d2 = dx[:, :-1], dx[:, 1:]
            a = -d2 / (d1 * (d1 + d2))
            b = (d2 - d1) / (d1 * d2)
            cc = d1 / (d2 * (d1 + d2))
            beta[:, 1:-1] = a * f[:, :-2] + b * f[:, 1:-1] + cc * f[:, 2:]
        last_i = np.maximum(nb - 1, 1)
        last = (np.take_along_axis(df, (last_i - 1)[:, None], axis=1)[:, 0]
                / np.take_along_axis(dx, (last_i - 1)[:, None], axis=1)[:, 0])
        beta[:, 0] = first
        np.put_along_axis(beta, last_i[:, None], last[:, None], axis=1)
        beta = np.where(inb & (nb[:, None] > 1), np.clip(beta, -MAX_SLOPE, MAX_SLOPE), 0.0)
    aw = np.where(has_t, 1.0 / np.where(n > 0, n, 1.0), 0.0)
    return {"w": w, "beta": beta, "ratio": ratio, "lo": lo, "hi": hi, "atoms": np.where(t > 0, t, 0.0), "aw": aw,
            "W": W}


def _tables(fmt: FPFormat, rounding: str) -> dict[str, Any]:
    """The format's pieces within each binade ``m`` of the scaled values from ``m0`` (the binade of
    half the smallest positive value) to ``emax``, as coefficients on the law's primitives at the
    relative cuts ``cuts`` (``1 <= c <= 2``): ``coef[q][k]`` ``(C, M)`` such that quantity ``q`` of
    binade ``m0 + j`` is ``sum_k G_k @ coef[q][k][:, j]`` (units of the binade's lower edge)."""
    u = _grid(fmt)
    vmax, u1 = float(u[-1]), float(u[1])
    m0 = int(round(math.log2(u1))) - 1
    emax = int(math.floor(math.log2(vmax)))
    cells = np.concatenate([[0.0], (u[:-1] + u[1:]) / 2]) if rounding == "nearest" else u
    per_m = []
    for m in range(m0, emax + 1):
        lo_m, hi_m = math.ldexp(1.0, m), math.ldexp(1.0, m + 1)
        inner = np.concatenate([cells, [vmax]])
        pts = np.unique(np.concatenate([[lo_m, hi_m], inner[(inner > lo_m) & (inner < hi_m)]]))
        per_m.append((m, pts))
    cuts = np.unique(np.concatenate([pts / math.ldexp(1.0, m) for m, pts in per_m]))
    C, M = cuts.size, len(per_m)
    coef = {q: {k: np.zeros((C, M)) for k in range(3)} for q in _SUMS}

    def add(q: str, k: int, j: int, ia: np.ndarray, ib: np.ndarray, v: np.ndarray) -> None:
        np.add.at(coef[q][k][:, j], ib, v)
        np.add.at(coef[q][k][:, j], ia, -v)

    for j, (m, pts) in enumerate(per_m):
        sc = math.ldexp(1.0, m)
        a, b = pts[:-1], pts[1:]
        ia, ib = np.searchsorted(cuts, a / sc), np.searchsorted(cuts, b / sc)
        ci = np.searchsorted(cells, a, side="right") - 1
        one = np.ones(a.size)
        add("saturated", 0, j, ia, ib, np.where(a >= vmax, 1.0, 0.0))
        if rounding == "nearest":
            q = u[ci] / sc
            add("sq", 0, j, ia, ib, q * q), add("sq", 1, j, ia, ib, -2 * q), add("sq", 2, j, ia, ib, one)
            add("signed", 0, j, ia, ib, q), add("signed", 1, j, ia, ib, -one)
            add("flushed", 0, j, ia, ib, np.where(ci == 0, 1.0, 0.0))
        else:
            last = ci >= len(u) - 1
            lo_v = u[np.minimum(ci, len(u) - 1)] / sc
            hi_v = u[np.minimum(ci + 1, len(u) - 1)] / sc
            vm = vmax / sc
            add("sq", 0, j, ia, ib, np.where(last, vm * vm, -lo_v * hi_v))
            add("sq", 1, j, ia, ib, np.where(last, -2 * vm, lo_v + hi_v))
            add("sq", 2, j, ia, ib, np.where(last, 1.0, -1.0))
            add("signed", 0, j, ia, ib, np.where(last, vm, 0.0)), add("signed", 1, j, ia, ib, np.where(last, -1.0, 0.0))
            add("flushed", 0, j, ia, ib, np.where(ci == 0, 1.0, 0.0))
            add("flushed", 1, j, ia, ib, np.where(ci == 0, -sc / u1, 0.0))
    return {"cuts": cuts, "coef": coef, "m0": m0, "emax": emax, "u": u, "cells": cells, "vmax": vmax, "u1": u1}


def _deep(q: str, rounding: str, full: dict[int, np.ndarray], m: np.ndarray, u1: float) -> np.ndarray:
    """Quantity ``q`` of binades wholly below the format's first cell boundary (``m < m0``), from
    the binades' full primitives ``full[k]`` (units of the lower edge), at scaled binade ``m``."""
    if rounding == "nearest":
        return {"flushed": full[0], "saturated": 0.0 * full[0], "sq": full[2], "signed": -full[1]}[q]
    p2m = np.exp2(m.astype(np.float64))
    return {"flushed": full[0] - full[1] * p2m / u1, "saturated": 0.0 * full[0],
            "sq": -full[2] + (u1 / p2m) * full[1], "signed": 0.0 * full[0]}[q]


def _atom_terms(tab: dict[str, Any], rounding: str, y: np.ndarray, ls: np.ndarray,
                per_tensor: bool) -> dict[str, np.ndarray]:
    """Each quantity for atoms ``y`` (original units) quantised at scales ``2**ls``."""
    u, cells, vmax, u1 = tab["u"], tab["cells"], tab["vmax"], tab["u1"]
    s = np.exp2(ls)
    ys = y * s
    ci = np.searchsorted(cells, ys, side="right") - 1
    out = {"saturated": (ys >= vmax).astype(np.float64)}
    if rounding == "nearest":
        q = u[ci]
        out["sq"] = ((q - ys) / s) ** 2
        out["signed"] = (q - ys) / s
        out["flushed"] = ((ci == 0) | ((ys == cells[1]) if per_tensor else False)).astype(np.float64)
    else:
        last = ci >= len(u) - 1
        lo_v, hi_v = u[np.minimum(ci, len(u) - 1)], u[np.minimum(ci + 1, len(u) - 1)]
        out["sq"] = np.where(last, (vmax - ys) ** 2, (ys - lo_v) * (hi_v - ys)) / s ** 2
        out["signed"] = np.where(last, (vmax - ys) / s, 0.0)
        out["flushed"] = np.where(ci == 0, 1 - ys / u1, 0.0)
    return out


def _fast_applies(fmt: FPFormat, scale: Union[str, float], block_size: Optional[int], scale_format: str) -> bool:
    """Whether :func:`_predict_rows` covers a call: power-of-two scales (per tensor at ``"amax"``,
    MX blocks) on a format whose smallest positive value is a power of two."""
    u1 = float(_grid(fmt)[1])
    pow2 = math.log2(u1) == round(math.log2(u1))
    return pow2 and ((block_size is None and isinstance(scale, str) and scale == "amax")
                     or (block_size is not None and scale_format == "e8m0"))


def _predict_rows(rows: pd.DataFrame, fmt: FPFormat, *, rounding: str, block_size: Optional[int],
                  chunk: int = 512) -> pd.DataFrame:
    """:func:`predict_from_stats` of every row of ``rows`` at once (``scale="amax"`` or MX blocks,
    :func:`_fast_applies`): a DataFrame of the :data:`WHAT_IF_COLUMNS`, one row per row, equal to
    the row-by-row predictions within float rounding."""
    hist = np.stack([np.asarray(h, dtype=np.float64) for h in rows["hist"]]) if len(rows) else np.zeros((0, 1))
    K = max((np.asarray(t).size for t in rows[TOP_FIELD]), default=0) if TOP_FIELD in rows else 0
    top = np.zeros((len(rows), K))
    if K:
        for i, t in enumerate(rows[TOP_FIELD]):
            t = np.asarray(t, dtype=np.float64).reshape(-1)
            top[i, :t.size] = t
    n = rows["n"].to_numpy(np.int64)
    nz = n - rows["n_zero"].to_numpy(np.int64)
    max_abs = rows["max_abs"].to_numpy(np.float64)
    empty = (nz <= 0) | (hist.sum(axis=1) <= 0)
    out = np.full((len(rows), len(WHAT_IF_COLUMNS)), np.nan)
    out[empty, :4] = 0.0
    tab = _tables(fmt, rounding)
    live = np.flatnonzero(~empty)
    # rows of similar binade spans together: a chunk's arrays are as wide as its widest row
    nzb = hist[live] > 0
    span = hist.shape[1] - np.argmax(nzb[:, ::-1], axis=1) - np.argmax(nzb, axis=1)
    live = live[np.argsort(span, kind="stable")]
    for s0 in range(0, live.size, chunk):
        r = live[s0:s0 + chunk]
        out[r] = _predict_chunk(hist[r], top[r], max_abs[r], n[r], nz[r], fmt, tab, rounding, block_size)
    return pd.DataFrame(out, columns=list(WHAT_IF_COLUMNS), index=rows.index)


def _predict_chunk(hist, top, max_abs, n, nz, fmt, tab, rounding, block_size) -> np.ndarray:
    law = _row_laws(hist, top, max_abs)
    R, W = hist.shape[0], law["W"]
    w, beta, ratio, lo = law["w"], law["beta"], law["ratio"], law["lo"]
    cuts, m0, u1 = tab["cuts"], tab["m0"], tab["u1"]
    J = lo[:, None] + np.arange(W)[None, :]                              # (R, W) binade exponents
    width = np.log(ratio)
    norm = expm1_ratio(beta, width)
    wn = np.where(w > 0, w / np.where(w > 0, norm, 1.0), 0.0)
    tau = np.log(np.minimum(cuts[None, None, :], ratio[:, :, None]))     # (R, W, C)
    G = {k: expm1_ratio((k + beta)[:, :, None], tau) for k in range(3)}
    full = {k: expm1_ratio(k + beta, width) for k in range(3)}
    unit = {"flushed": 0, "saturated": 0, "sq": 2, "signed": 1}          # the power of the lower edge
    a = np.exp2(J.astype(np.float64))
    scale_of = {q: wn * a ** unit[q] for q in _SUMS}
    M = tab["coef"]["flushed"][0].shape[1]
    Q = {q: sum((G[k].reshape(R * W, -1) @ cm for k, cm in tab["coef"][q].items() if cm.any()),
                np.zeros((R * W, M))).reshape(R, W, M) for q in _SUMS}

    def binade_terms(m: np.ndarray) -> dict[str, np.ndarray]:           # m: (R, W, ...) scaled binades
        shape = m.shape
        mi = np.clip(m - m0, 0, M - 1).reshape(R, W, -1)
        res = {}
        for q in _SUMS:
            tabbed = np.take_along_axis(Q[q], mi, axis=2).reshape(shape)
            extra = (slice(None), slice(None)) + (None,) * (len(shape) - 2)
            deep = _deep(q, rounding, {k: full[k][extra] for k in range(3)}, m, u1)
            res[q] = np.where(m < m0, deep, tabbed) * scale_of[q][extra]
        return res

    atoms, aw = law["atoms"], law["aw"]
    has_atom = atoms > 0
    _, ex = np.frexp(np.where(has_atom, atoms, 1.0))
    Ja = ex.astype(np.int64) - 1
    tot = {}
    if block_size is None:
        k = np.array([math.log2(amax_scale(fmt, float(v))) for v in max_abs])    # the "amax" scale, per row
        terms = binade_terms(J + k[:, None].astype(np.int64))
        for q in _SUMS:
            tot[q] = terms[q].sum(axis=1)
        at = _atom_terms(tab, rounding, atoms, np.broadcast_to(k[:, None], atoms.shape), per_tensor=True)
        for q in _SUMS:
            tot[q] = tot[q] + aw * np.sum(np.where(has_atom, at[q], 0.0), axis=1)
        tot["flushed_only"] = None
        log2_scale = k
    else:
        # P(the other block_size - 1 entries' largest < 2**L), L = lo .. lo + W
        L = lo[:, None] + np.arange(W + 1)[None, :]
        cdf = np.concatenate([np.zeros((R, 1)), np.cumsum(w, axis=1)], axis=1)
        if atoms.shape[1]:
            cdf = cdf + aw[:, None] * np.sum(has_atom[:, None, :] & (atoms[:, None, :] < np.exp2(L.astype(np.float64))[:, :, None]),
                                             axis=2)
        z = (1.0 - nz / n)[:, None]
        others = np.clip(z + (1 - z) * cdf, 0.0, 1.0) ** (block_size - 1)
        others = np.where(L <= law["hi"][:, None] + 1, others, 1.0)        # no block maximum above amax
        step = np.diff(others, axis=1)                                    # (R, W): P(others' max in binade L)
        li = np.arange(W)
        # omega[r, i, l]: an entry of binade i in a block whose maximum is in binade l
        omega = np.where(li[None, None, :] > li[None, :, None], step[:, None, :], 0.0)
        diag = others[:, 1:]
        omega = omega + np.where(li[None, None, :] == li[None, :, None], diag[:, :, None], 0.0)
        omega = np.where((lo[:, None, None] + li[None, None, :]) <= law["hi"][:, None, None], omega, 0.0)
        Lb = lo[:, None, None] + li[None, None, :]
        e = np.clip(Lb - fmt.emax, -127, 127)
        m = J[:, :, None] - e                                             # (R, W, W)
        terms = binade_terms(m)
        for q in _SUMS:
            tot[q] = np.sum(omega * terms[q], axis=(1, 2))
        if atoms.shape[1]:
            ia = np.clip(Ja - lo[:, None], 0, W - 1)                      # (R, K)
            for d in range(0, int(np.max(np.where(has_atom, law["hi"][:, None] - Ja, 0))) + 1):
                l = ia + d
                ok = has_atom & (l < W)
                lc = np.minimum(l, W - 1)
                om = omega[np.arange(R)[:, None], ia, lc]
                ls = -np.clip(lo[:, None] + lc - fmt.emax, -127, 127).astype(np.float64)
                at = _atom_terms(tab, rounding, atoms, ls, per_tensor=False)
                for q in _SUMS:
                    tot[q] = tot[q] + aw * np.sum(np.where(ok, om * at[q], 0.0), axis=1)
        log2_scale = np.full(R, np.nan)
    mean = np.sum(wn * a * full[1], axis=1) + aw * np.sum(atoms, axis=1)
    energy = np.sum(wn * a * a * full[2], axis=1) + aw * np.sum(atoms * atoms, axis=1)
    res = np.empty((R, len(WHAT_IF_COLUMNS)))
    res[:, 0] = tot["flushed"]
    res[:, 1] = tot["saturated"]
    res[:, 2] = np.where(energy > 0, tot["sq"] / np.where(energy > 0, energy, 1.0), 0.0)
    res[:, 3] = np.where(mean > 0, tot["signed"] / np.where(mean > 0, mean, 1.0), 0.0)
    res[:, 4] = log2_scale
    return res
