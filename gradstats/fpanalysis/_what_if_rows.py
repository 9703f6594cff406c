"""The same predictions for many rows at once (what_if_stats): the laws of all rows as padded arrays,
the format's cells tabulated per binade. With a power-of-two scale (per tensor at "amax", or an MX
block scale) every binade of the law maps onto one binade of the format, whose cells cut it at the
same relative places in every row; the integrals of a piece are linear in the law's within-binade
primitives at those places, so one matrix product per moment gives every row's every binade at every
scale.

:func:`predict_rows` gives, per row, the columns of :data:`gradstats.fpanalysis.what_if.WHAT_IF_COLUMNS`
in that order (``underflow``, ``overflow``, ``rel_mse``, ``bias``, ``log2_scale``); :func:`rows_apply`
says which schemes it covers (all but NVFP4's E4M3 block scales). Any per-tensor multiplier
``r 2**k`` works the same way, the tables made for its mantissa ``r``. The one path of
:func:`gradstats.fpanalysis.what_if.predict_from_stats` and ``what_if_stats``: a single row is a
table of one row."""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Union

import numpy as np

from gradstats.formats import FPFormat, amax_scale
from gradstats.scheme import E8M0, Scheme
from gradstats.stats import HIST_MIN_EXP
from gradstats.stats.law import MAX_SLOPE, TOP_FIELD, expm1_ratio

#: the four sums of a prediction: mass flushed to zero, mass saturated, squared error, signed error
_SUMS = ("flushed", "saturated", "sq", "signed")
#: the prediction columns, in the order of :data:`gradstats.fpanalysis.what_if.WHAT_IF_COLUMNS`
_N_COLUMNS = 5


def _grid(fmt: FPFormat) -> np.ndarray:
    """The format's non-negative finite values, ascending (0 first)."""
    v = fmt.values().numpy()
    return np.unique(np.abs(v))



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


def _floor_log2(x: float) -> int:
    """``floor(log2(x))`` of a positive float, exact at powers of two."""
    return math.frexp(x)[1] - 1


@functools.lru_cache(maxsize=64)
def _tables(fmt: FPFormat, rounding: str, r: float = 1.0) -> dict[str, Any]:
    """The format's pieces within each binade ``m`` of the values ``y 2**k`` quantised at the
    multiplier ``r 2**k`` (``1 <= r < 2``; a power-of-two scale has ``r = 1``), from ``m0`` (a binade
    below half the smallest positive value) to ``emax`` (that of the largest), as coefficients on
    the law's primitives at the relative cuts ``cuts`` (``1 <= c <= 2``): ``coef[q][k]`` ``(C, M)``
    such that quantity ``q`` of binade ``m0 + j`` is ``sum_k G_k @ coef[q][k][:, j]`` (units of the
    binade's lower edge). Cached: read-only."""
    u = _grid(fmt) / r                                  # the grid in the units of y 2**k
    vmax, u1 = float(u[-1]), float(u[1])
    m0 = _floor_log2(u1) - 1
    emax = _floor_log2(vmax)
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


def rows_apply(sch: Scheme) -> bool:
    """Whether :func:`predict_rows` covers a scheme: a per-tensor scale (``"amax"`` or any
    multiplier) or MX (E8M0) block scales; NVFP4's E4M3 block scales are continuous per tensor."""
    return sch.block_size is None or sch.scale_format == E8M0


def predict_rows(rows: Mapping[str, Any], sch: Scheme, *, rounding: str, scale: Union[str, float] = "amax",
                 chunk: int = 512) -> np.ndarray:
    """The :data:`~gradstats.fpanalysis.what_if.WHAT_IF_COLUMNS` of every row of ``rows`` (a
    statistics table, or a mapping of its columns: one row is a table of one row) quantised with
    the scheme ``sch`` (:func:`rows_apply`) at ``rounding``: an ``(R, 5)`` array, one row per row.
    ``scale``: ``"amax"`` or a multiplier (per tensor; ignored with blocks)."""
    fmt, block_size = sch.element, sch.block_size
    hist = np.stack([np.asarray(h, dtype=np.float64) for h in rows["hist"]]) if len(rows["n"]) else np.zeros((0, 1))
    R = hist.shape[0]
    K = max((np.asarray(t).size for t in rows[TOP_FIELD]), default=0) if TOP_FIELD in rows else 0
    top = np.zeros((R, K))
    if K:
        for i, t in enumerate(rows[TOP_FIELD]):
            t = np.asarray(t, dtype=np.float64).reshape(-1)
            top[i, :t.size] = t
    n = np.asarray(rows["n"], dtype=np.int64)
    nz = n - np.asarray(rows["n_zero"], dtype=np.int64)
    max_abs = np.asarray(rows["max_abs"], dtype=np.float64)
    empty = (nz <= 0) | (hist.sum(axis=1) <= 0)
    out = np.full((R, _N_COLUMNS), np.nan)
    out[empty, :4] = 0.0
    per_tensor = block_size is None and not isinstance(scale, str)
    r = float(scale) / math.ldexp(1.0, _floor_log2(float(scale))) if per_tensor else 1.0
    tab = _tables(fmt, rounding, r)
    live = np.flatnonzero(~empty)
    # rows of similar binade spans together: a chunk's arrays are as wide as its widest row
    nzb = hist[live] > 0
    span = hist.shape[1] - np.argmax(nzb[:, ::-1], axis=1) - np.argmax(nzb, axis=1)
    live = live[np.argsort(span, kind="stable")]
    for s0 in range(0, live.size, chunk):
        i = live[s0:s0 + chunk]
        out[i] = _predict_chunk(hist[i], top[i], max_abs[i], n[i], nz[i], fmt, tab, rounding, block_size, scale)
    return out


def _predict_chunk(hist, top, max_abs, n, nz, fmt, tab, rounding, block_size, scale) -> np.ndarray:
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
        extra = (slice(None), slice(None)) + (None,) * (len(shape) - 2)
        fk = {k: full[k][extra] for k in range(3)}
        high = None
        if block_size is None:     # a per-tensor scale: the binades above the largest value saturate whole
            vm = tab["vmax"] / np.exp2(m.astype(np.float64))            # the largest value, binade units
            high = {"flushed": 0.0 * fk[0], "saturated": fk[0], "sq": vm * vm * fk[0] - 2 * vm * fk[1] + fk[2],
                    "signed": vm * fk[0] - fk[1]}
        # (E8M0 blocks: an entry's binade lies above emax only beside a block maximum below it, whose
        # weight is 0, or beyond float32's range)
        res = {}
        for q in _SUMS:
            tabbed = np.take_along_axis(Q[q], mi, axis=2).reshape(shape)
            if high is not None:
                tabbed = np.where(m > tab["emax"], high[q], tabbed)
            res[q] = np.where(m < m0, _deep(q, rounding, fk, m, u1), tabbed) * scale_of[q][extra]
        return res

    atoms, aw = law["atoms"], law["aw"]
    has_atom = atoms > 0
    _, ex = np.frexp(np.where(has_atom, atoms, 1.0))
    Ja = ex.astype(np.int64) - 1
    tot = {}
    if block_size is None:
        if isinstance(scale, str):              # "amax": a power of two per row
            k = np.array([math.log2(amax_scale(fmt, float(v))) for v in max_abs])
            log2_scale = k
        else:                                   # a multiplier r 2**k, the same for every row
            k = np.full(R, float(_floor_log2(float(scale))))
            log2_scale = np.full(R, math.log2(float(scale)))
        terms = binade_terms(J + k[:, None].astype(np.int64))
        for q in _SUMS:
            tot[q] = terms[q].sum(axis=1)
        at = _atom_terms(tab, rounding, atoms, np.broadcast_to(k[:, None], atoms.shape), per_tensor=True)
        for q in _SUMS:
            tot[q] = tot[q] + aw * np.sum(np.where(has_atom, at[q], 0.0), axis=1)
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
    res = np.empty((R, _N_COLUMNS))
    res[:, 0] = tot["flushed"]
    res[:, 1] = tot["saturated"]
    res[:, 2] = np.where(energy > 0, tot["sq"] / np.where(energy > 0, energy, 1.0), 0.0)
    res[:, 3] = np.where(mean > 0, tot["signed"] / np.where(mean > 0, mean, 1.0), 0.0)
    res[:, 4] = log2_scale
    return res
