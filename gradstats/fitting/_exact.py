"""``fit``: the three-family comparison on raw values, exact and fast.

How the work is laid out (n values, m of them non-zero and finite):

1. signed fits on the finite values (mean/std; median and mean absolute deviation);
2. magnitudes ``a = |x|`` (one copy), sorted once in place (numpy's vectorised sort on the CPU,
   ``torch.sort`` elsewhere). Zeros sort first and inf/NaN last, so the non-zero finite
   magnitudes are one contiguous slice, found by two binary searches (the first non-finite
   value by ``isfinite``: comparisons with NaN are false, so ``searchsorted`` cannot find it);
3. pass 1 over cache-sized chunks: shifted sums of ``ln a`` and ``(ln a)^2`` and scaled
   sums of ``a`` and ``a^2`` (float64 accumulation) -> the MLE parameters;
4. pass 2 over the same chunks: ``u = (ln a - mu)/sigma``; the three model CDFs against the
   ECDF ramp ``j/m`` (per-chunk extremes of ``F - ramp``); the centred log-likelihood
   differences of the three pairs for Vuong's test; ``sum u^3``, ``sum u^4``; the
   Anderson-Darling sums of ``ln Phi(u)`` and ``ln Phi(-u)``;
5. exact KS: pass 2 runs in the input's precision (float32 for float32 data); every chunk
   whose float32 extreme lies within twice a proven rounding bound of the global extreme is
   recomputed in float64, so the reported KS is the float64 value (scipy's) at float32 speed.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from gradstats.families import FAMILIES
from gradstats.fitting._compare import MIN_NONZERO, check_families, too_few_message
from gradstats.fitting._parallel import CHUNK, _chunks, _map, default_workers, torch_single_thread
from gradstats.fitting._result import FitResult, assemble
from gradstats.fitting._signed import _signed

_SQRT2 = math.sqrt(2.0)
#: confidence of the DKW bound reported for KS on a subsample
SUBSAMPLE_CONFIDENCE = 0.999
#: quarter-binade bins for the stored log2 histogram of the magnitudes
_BINS_PER_BINADE = 4
_QQ_POINTS = 200


def _as_flat(x: Any) -> torch.Tensor:
    """The input as a flat tensor of the working dtype (float64 for float64 or integer input,
    float32 for other floating types)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"fit expects real gradient values, got a tensor of dtype {t.dtype}")
        if t.dtype != torch.float64:
            t = t.to(torch.float32) if t.is_floating_point() else t.to(torch.float64)
        return t.reshape(-1).contiguous()
    try:
        arr = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - anything that is not array-like
        raise ValueError(f"fit expects a tensor or array of gradient values, got {type(x).__name__}") from exc
    if arr.dtype.kind in "iu":
        arr = arr.astype(np.float64)
    elif arr.dtype.kind == "f":
        arr = arr if arr.dtype in (np.float32, np.float64) else arr.astype(np.float32)
    else:
        try:  # ml_dtypes' bfloat16 / float8 arrays convert; strings, objects, complex do not
            if arr.dtype.kind in "cbOSUM":
                raise TypeError
            arr = arr.astype(np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"fit expects real gradient values, got an array of dtype {arr.dtype}") from None
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(-1)))


def _sort_(a: torch.Tensor) -> None:
    if a.device.type == "cpu":
        a.numpy().sort()  # in place, vectorised; NaN last
    else:
        a.copy_(torch.sort(a).values)


def _finite_end(a: torch.Tensor) -> int:
    """Number of finite values of the sorted magnitudes ``a`` (inf, then NaN, sort last).

    A binary search on ``isfinite`` of single elements: ``searchsorted`` for inf cannot be
    used, its comparisons with NaN are false, so with NaN but no inf it counts the NaN as
    finite. Costs nothing when the last value is finite (the usual case)."""
    n = a.numel()
    if n == 0 or math.isfinite(float(a[-1])):
        return n
    lo, hi = 0, n - 1  # a[hi] is not finite; every index below lo is
    while lo < hi:
        mid = (lo + hi) // 2
        if math.isfinite(float(a[mid])):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _pass1(a: torch.Tensor, lo: int, hi: int, shift: float, scale: float) -> dict[str, Any]:
    """MLE sums over the magnitudes ``a[lo:hi]`` (all > 0 and finite), in float64 whatever
    the input's dtype (the parameters then match a float64 fit of the same values):
    ``sum(ln a - shift)``, ``sum((ln a - shift)^2)``, ``sum(a scale)``, ``sum((a scale)^2)``."""
    f64 = torch.float64
    b64 = torch.empty(min(CHUNK, hi - lo), dtype=f64, device=a.device)
    bl = torch.empty_like(b64)
    r: dict[str, Any] = {"s1": 0.0, "s2": 0.0, "sa": 0.0, "sa2": 0.0}
    for s, e in _chunks(lo, hi):
        k = e - s
        ch = b64[:k].copy_(a[s:e])
        l = torch.log(ch, out=bl[:k])
        l.sub_(shift)
        r["s1"] += float(l.sum())
        r["s2"] += float(torch.dot(l, l))
        w = ch.mul_(scale)
        r["sa"] += float(w.sum())
        r["sa2"] += float(torch.dot(w, w))
    return r


def _params(a: torch.Tensor, amax: float, pool: ThreadPoolExecutor | None) -> dict[str, float]:
    m = a.numel()
    # a shift near mu keeps the variance free of cancellation
    shift = float(torch.log(a[:CHUNK].to(torch.float64)).mean())
    scale = 2.0 ** -math.frexp(amax)[1]  # power of two: exact, keeps a^2 finite
    parts = _map(lambda lo, hi: _pass1(a, lo, hi, shift, scale), m, pool)
    s1, s2, sa, sa2 = (math.fsum(p[k] for p in parts) for k in ("s1", "s2", "sa", "sa2"))
    mean_d = s1 / m
    var = max(s2 / m - mean_d * mean_d, 0.0)
    return {"mu": shift + mean_d, "sigma": math.sqrt(var), "s": math.sqrt(sa2 / m) / scale,
            "b": sa / m / scale}


def _tolerances(mu: float, sigma: float, lmax: float, eps: float) -> dict[str, float]:
    """Proven bound (with a safety factor of 8 for library functions of up to ~4 ulp) on
    the difference between the working-precision and the exact value of ``F_i - i/m``.

    Lognormal: ``u = (l - mu)/sigma`` with ``l = ln a`` carries an error of at most
    ``eps (3|l| + 2|mu|)/sigma + 2 eps |u|``; ``Phi' <= 0.4`` and ``Phi'(u)|u| <= 0.25`` turn
    it into ``eps (0.4 (3 L + 2|mu|)/sigma + 0.5)`` on the CDF; erfc, the ramp and the
    subtraction add a few ``eps``. Half-normal and exponential: arguments carry relative
    error ``2 eps`` and ``t erf'(t) <= 0.5``, ``t e^-t <= 0.37``, so a few ``eps`` in all.
    """
    ln = 8.0 * eps * (0.4 * (3.0 * lmax + 2.0 * abs(mu)) / sigma + 6.0)
    return {"lognormal": ln, "normal": 8.0 * eps * 6.0, "laplace": 8.0 * eps * 6.0}


def _pass2(a: torch.Tensor, lo: int, hi: int, p: dict[str, float], *, vuong: bool, ks: bool
           ) -> dict[str, Any]:
    """Over ``a[lo:hi]``: Vuong and moment sums (``vuong``); per-chunk KS extremes and
    Anderson-Darling sums (``ks``; ``a`` must then be sorted, ``m = len(a)``)."""
    m = a.numel()
    dt, dev = a.dtype, a.device
    mu, sigma, s, b = p["mu"], p["sigma"], p["s"], p["b"]
    c = min(CHUNK, hi - lo)
    bu, bu2, bP, bF, bt, bd = (torch.empty(c, dtype=dt, device=dev) for _ in range(6))
    jr = torch.arange(c, dtype=torch.float64, device=dev)
    ramp0 = torch.arange(c, dtype=torch.float64, device=dev).div_(m).to(dt)
    out: dict[str, Any] = {"s3": 0.0, "s4": 0.0, "v": [0.0, 0.0, 0.0], "ad": 0.0,
                           "ext": {f: ([], []) for f in FAMILIES}}  # per-chunk (min, max) of F - ramp
    ext = out["ext"]
    inv_sigma, inv_b, inv_s = 1.0 / sigma, 1.0 / b, 1.0 / s
    for st, e in _chunks(lo, hi):
        ch = a[st:e]
        k = e - st
        u = torch.log(ch, out=bu[:k]).sub_(mu).mul_(inv_sigma)
        if vuong:
            # sums of products through torch's cascade reduction, not ``torch.dot``: BLAS dot
            # products accumulate per SIMD lane, with an error that differs by CPU
            u2 = torch.mul(u, u, out=bu2[:k])
            out["s3"] += float(torch.mul(u2, u, out=bd[:k]).sum())
            out["s4"] += float(torch.mul(u2, u2, out=bd[:k]).sum())
            # centred per-sample log-likelihoods: P (lognormal), -Q (half-normal), -R (exponential)
            P = torch.sub(u2, 1.0, out=bP[:k]).mul_(0.5).add_(u, alpha=sigma).neg_()
            Q = torch.mul(ch, inv_s, out=bt[:k]).square_().sub_(1.0).mul_(0.5)
            R = torch.mul(ch, inv_b, out=bF[:k]).sub_(1.0)
            d = torch.add(P, Q, out=bd[:k])
            out["v"][0] += float(d.square_().sum())
            d = torch.add(P, R, out=bd[:k])
            out["v"][1] += float(d.square_().sum())
            d = torch.sub(R, Q, out=bd[:k])
            out["v"][2] += float(d.square_().sum())
        if not ks:
            continue
        ramp = torch.add(ramp0[:k], st / m, out=bd[:k])
        # lognormal: F = Phi(u) = erfc(-u/sqrt2)/2; Anderson-Darling needs ln Phi(u), ln Phi(-u)
        t = torch.mul(u, -1.0 / _SQRT2, out=bt[:k])
        F = torch.erfc(t, out=bF[:k]).mul_(0.5)
        # the logs in float64: a float32 log's rounding can be biased (by ~0.01 ulp on some
        # CPUs), and m weighted terms turn a bias into an error that grows with m
        f64 = torch.float64
        if float(u[0]) < -12.0 or float(u[-1]) > 12.0:  # deep tails (sorted): log-CDF directly
            A64 = torch.special.log_ndtr(u.to(f64))
            B64 = torch.special.log_ndtr(-u.to(f64))
        else:
            A64 = F.to(f64, copy=True).log_()
            if float(F[-1]) <= 0.5:  # 1 - F >= 1/2 holds its precision
                B64 = F.to(f64, copy=True).neg_().log1p_()
            else:
                B64 = torch.erfc(t.neg_(), out=bu2[:k]).to(f64, copy=True).mul_(0.5).log_()
        w0 = (2.0 * st + 1.0) / m   # weights up to 2m: accumulate in float64
        out["ad"] += (w0 * float(A64.sum()) + 2.0 / m * float(torch.dot(jr[:k], A64))
                      + (2.0 - w0) * float(B64.sum()) - 2.0 / m * float(torch.dot(jr[:k], B64)))
        for fam in FAMILIES:
            if fam == "normal":
                F = torch.mul(ch, inv_s / _SQRT2, out=bF[:k])
                F = torch.erf(F, out=F)
            elif fam == "laplace":
                F = torch.mul(ch, -inv_b, out=bF[:k])
                F = torch.expm1(F, out=F).neg_()
            lo_, hi_ = torch.aminmax(F.sub_(ramp))
            ext[fam][0].append(lo_.item())  # floats: no small tensors kept between big buffers
            ext[fam][1].append(hi_.item())
    return out


def _moments(a: torch.Tensor, p: dict[str, float], *, vuong: bool, ks: bool,
             pool: ThreadPoolExecutor | None) -> dict[str, Any]:
    parts = _map(lambda lo, hi: _pass2(a, lo, hi, p, vuong=vuong, ks=ks), a.numel(), pool)
    out: dict[str, Any] = {k: math.fsum(q[k] for q in parts) for k in ("s3", "s4", "ad")}
    out["v"] = [math.fsum(q["v"][i] for q in parts) for i in range(3)]
    if ks:
        out["ext"] = {f: (torch.tensor([t for q in parts for t in q["ext"][f][0]], dtype=torch.float64),
                          torch.tensor([t for q in parts for t in q["ext"][f][1]], dtype=torch.float64))
                      for f in FAMILIES}
    return out


def _exact_ks(a: torch.Tensor, family: str, p: dict[str, float], ext: tuple[torch.Tensor, torch.Tensor],
              tol: float) -> float:
    """KS distance ``max(max_i (i+1)/m - F_i, max_i F_i - i/m)`` (0-based i) of sorted ``a``,
    exact in float64: only chunks whose working-precision extreme could hold the true
    extreme are recomputed."""
    from gradstats.families import cdf64

    m = a.numel()
    mins, maxs = ext
    params = {"mu": p["mu"], "sigma": p["sigma"], "scale": p["s"] if family == "normal" else p["b"]}
    hi_cands = torch.nonzero(maxs >= maxs.max() - 2 * tol).flatten().tolist()
    lo_cands = torch.nonzero(mins <= mins.min() + 2 * tol).flatten().tolist()
    best_hi, best_lo = -math.inf, math.inf
    for ci in sorted(set(hi_cands) | set(lo_cands)):
        st, e = ci * CHUNK, min(m, (ci + 1) * CHUNK)
        F = cdf64(family, a[st:e], params)
        F -= torch.arange(st, e, dtype=torch.float64, device=F.device) / m
        lo, hi = torch.aminmax(F)
        best_hi, best_lo = max(best_hi, float(hi)), min(best_lo, float(lo))
    return max(best_hi, 1.0 / m - best_lo)


def _log2_hist_sorted(a: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    lo = math.floor(math.log2(float(a[0])) * _BINS_PER_BINADE) / _BINS_PER_BINADE
    hi = (math.floor(math.log2(float(a[-1])) * _BINS_PER_BINADE) + 1) / _BINS_PER_BINADE
    edges = np.arange(lo, hi + 0.5 / _BINS_PER_BINADE, 1.0 / _BINS_PER_BINADE)
    pos = torch.searchsorted(a, torch.from_numpy(np.exp2(edges)).to(a.dtype).to(a.device))
    return edges, np.diff(pos.cpu().numpy()).astype(np.int64)


def _qq_sorted(a: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    m = a.numel()
    probs = (np.arange(_QQ_POINTS) + 0.5) / _QQ_POINTS
    idx = torch.from_numpy(np.minimum((probs * m).astype(np.int64), m - 1)).to(a.device)
    return probs, np.log(a[idx].double().cpu().numpy())


def fit(x: Any, *, families: Sequence[str] = FAMILIES, ks: str = "exact",
        max_samples: int | None = None, seed: int = 0, workers: int | None = None) -> FitResult:
    """Fit lognormal, normal and Laplace models to gradient values and compare them.

    The comparison is on the non-zero finite magnitudes ``|g|`` (lognormal, half-normal,
    exponential); signed normal and Laplace fits with a location are reported too. See
    ``docs/fitting.md`` for the formulas.

    Args:
        x: signed values (tensor, array or sequence; any real dtype).
        families: which of ``("lognormal", "normal", "laplace")`` to report.
        ks: ``"exact"`` (KS equals ``scipy.stats.kstest``; Anderson-Darling too), ``"hist"``
            (KS bounds from the binade histogram, as :func:`fit_stats` gives them;
            ``ks_error`` is the proven half-width), ``"none"`` (no KS, no Anderson-Darling).
        max_samples: with ``ks="exact"``, compute KS and Anderson-Darling on a random sample
            (with replacement) of this many magnitudes when there are more; ``ks_error`` is
            then the DKW bound holding with probability ``SUBSAMPLE_CONFIDENCE``. Parameters,
            likelihoods and Vuong's test always use every value.
        seed: seed of that sample.
        workers: Python worker threads (default: torch's thread count, at most 2); torch
            runs single-threaded inside the call.

    Raises ValueError for empty input, fewer than 10 non-zero finite values (all zeros, all
    non-finite) and constant magnitudes (``sigma = 0``, no continuous family fits).

    Example:
        >>> import torch, gradstats
        >>> g = torch.randn(100_000).mul(2.0).exp() * torch.sign(torch.randn(100_000))
        >>> r = gradstats.fit(g)
        >>> r.best, round(r.params["lognormal"]["sigma"], 1)
        ('lognormal', 2.0)
    """
    fams = check_families(families)
    if ks not in ("exact", "hist", "none"):
        raise ValueError(f"ks must be 'exact', 'hist' or 'none', got {ks!r}")
    if max_samples is not None and (not isinstance(max_samples, int) or max_samples < MIN_NONZERO):
        raise ValueError(f"max_samples must be None or an integer >= {MIN_NONZERO}, got {max_samples!r}")
    if workers is None:
        workers = default_workers()
    xf = _as_flat(x)
    if xf.numel() == 0:
        raise ValueError("fit got an empty input; pass at least 10 non-zero finite values")
    with torch_single_thread():
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                return _fit(xf, fams, ks, max_samples, seed, pool)
        return _fit(xf, fams, ks, max_samples, seed, None)


def _binade_hist(mags: torch.Tensor) -> np.ndarray | None:
    """Binade counts of sorted magnitudes (the layout of ``gradstats.stats``), or None when
    some lie outside float32's binades (float64 input)."""
    from gradstats.stats import HIST_BINS, HIST_MIN_EXP

    if float(mags[0]) < 2.0 ** HIST_MIN_EXP or float(mags[-1]) >= 2.0 ** (HIST_MIN_EXP + HIST_BINS):
        return None
    edges = torch.exp2(torch.arange(HIST_MIN_EXP, HIST_MIN_EXP + HIST_BINS + 1, dtype=torch.float64))
    pos = torch.searchsorted(mags, edges.to(mags.dtype).to(mags.device)).cpu().numpy()
    if mags.dtype == torch.float32:  # 2**128 rounds to inf in float32: all finite values lie below
        pos[-1] = mags.numel()
    return np.diff(pos).astype(np.int64)


def _fit(xf: torch.Tensor, fams: tuple[str, ...], ks: str, max_samples: int | None, seed: int,
         pool: ThreadPoolExecutor | None) -> FitResult:
    n = xf.numel()
    # the signed fits run beside the magnitude work (numpy's partition and sort release the GIL)
    signed_job = pool.submit(_signed, xf) if pool is not None else None
    a = xf.abs()
    eps = float(torch.finfo(a.dtype).eps) / 2.0
    # Sorting in place is the cheapest way to set zeros and inf/NaN aside (zeros first, inf
    # and NaN last: the non-zero finite magnitudes are one slice) and needs no further copy,
    # so it is done in every mode; it also gives the plot's histogram and quantiles.
    _sort_(a)
    n_fin = _finite_end(a)
    n_zero = int(torch.searchsorted(a[:n_fin], torch.zeros(1, dtype=a.dtype, device=a.device), right=True))
    mags = a[n_zero:n_fin]
    signed, n_finite = signed_job.result() if signed_job is not None else _signed(xf)
    m = mags.numel()
    n_nonfinite = n - n_finite
    if m < MIN_NONZERO:
        raise ValueError(too_few_message(m, n, n_zero, n_nonfinite))
    amin, amax = float(mags[0]), float(mags[-1])
    if amin == amax:
        raise ValueError(f"all {m} non-zero magnitudes equal {amin:g}: sigma = 0, so no continuous "
                         "family fits and the comparison is undefined")
    p = _params(mags, amax, pool)
    if p["sigma"] == 0.0:
        raise ValueError(f"the {m} non-zero magnitudes have sigma(ln|g|) = 0 to working precision; "
                         "no continuous family fits")
    ks_data = None
    if ks == "exact":
        if max_samples is None or m <= max_samples:
            ks_data = mags
        else:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            idx = torch.randint(m, (max_samples,), generator=gen).to(mags.device)
            ks_data = mags[idx]
            del idx
            _sort_(ks_data)
    sub = ks_data is not None and ks_data is not mags
    s2 = _moments(mags, p, vuong=True, ks=ks_data is mags, pool=pool)
    if sub:
        s2.update({k: v for k, v in _moments(ks_data, p, vuong=False, ks=True, pool=pool).items()
                   if k in ("ext", "ad")})
    ks_vals: dict[str, float] = {}
    ks_err: dict[str, float] = {}
    ad = None
    ks_method = "none"
    if ks_data is not None:
        k_n = ks_data.numel()
        lmax = max(abs(math.log(float(ks_data[0]))), abs(math.log(float(ks_data[-1]))))
        tol = _tolerances(p["mu"], p["sigma"], lmax, eps)
        for f in fams:
            ks_vals[f] = _exact_ks(ks_data, f, p, s2["ext"][f], tol[f])
        dkw = math.sqrt(math.log(2.0 / (1.0 - SUBSAMPLE_CONFIDENCE)) / (2.0 * k_n))
        ks_err = {f: dkw if sub else 0.0 for f in fams}
        ad = -k_n - s2["ad"]
        ks_method = "subsample" if sub else "exact"
    elif ks == "hist":
        from gradstats.fitting._stats import hist_ks_bounds

        hist = _binade_hist(mags)
        if hist is None:  # float64 values beyond float32's binades: the float32 view, as traced
            from gradstats.stats import tensor_stats

            st = tensor_stats(xf)
            hist, m_h, lo_v, hi_v = st["hist"], st["n"] - st["n_zero"] - st["n_nonfinite"], st["min_abs"], st["max_abs"]
        else:
            m_h, lo_v, hi_v = m, amin, amax
        lo, hi = hist_ks_bounds(hist[None, :], np.array([m_h]), np.array([lo_v]), np.array([hi_v]),
                                {"lognormal": {"mu": p["mu"], "sigma": p["sigma"]},
                                 "normal": {"scale": p["s"]}, "laplace": {"scale": p["b"]}})
        for f in fams:
            ks_vals[f] = float(0.5 * (lo[f][0] + hi[f][0]))
            ks_err[f] = float(0.5 * (hi[f][0] - lo[f][0]))
        ks_method = "hist"
    edges, hcounts = _log2_hist_sorted(mags)
    return assemble(
        fams, source="samples", n=n, n_zero=n_zero, n_nonfinite=n_nonfinite, m=m, p=p, signed=signed,
        vuong_sq=s2["v"], s3=s2["s3"], s4=s2["s4"], ks=ks_vals, ks_error=ks_err, ks_method=ks_method,
        ks_n=0 if ks_data is None else ks_data.numel(), ad=ad,
        ks_confidence=SUBSAMPLE_CONFIDENCE if sub else 1.0,
        log2_edges=edges, log2_counts=hcounts, qq=_qq_sorted(mags))
