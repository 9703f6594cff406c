"""The pruning operators on tensors: unbiased stochastic pruning, estimate-and-prune, and the
exact (sort/selection based) thresholds the analytic rules are compared against.

Devices: on the CPU, float32 tensors are pruned by the C kernel that the apply module's
fused prune/quantise also runs (``gradstats/_native/prune_quant.c``, prune-only; uniforms from
a counter-based hash of ``(seed, index)``, the seed drawn from the torch generator); float64
tensors, explicit ``uniforms=``, and machines without a C compiler (or with
``GRADSTATS_NATIVE=0``) use the cache-blocked numpy engine of :mod:`gradstats.pruning._cpu`
(uniforms from a PCG64 stream seeded from the torch generator). On CUDA the Triton kernel of
:mod:`gradstats.kernels.prune` runs when Triton is installed; everything else (other dtypes,
other devices) goes through the plain torch reference path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
from typing import Any

import numpy as np
import torch

from ..kernels import prune as kprune
from ..kernels import use_triton
from ..stats import SCALAR_FIELDS, has_native_kernel, tensor_stats, tensor_stats_vector
from . import _cpu
from .thresholds import DEFAULT_RULE, RULES, threshold as _threshold

log = logging.getLogger(__name__)

#: threshold rules accepted by :func:`prune`: the analytic ones and ``"exact"``
METHODS = RULES + ("exact",)


def _check_tensor(x: Any, what: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{what} is empty: there is nothing to prune or estimate from")
    return x


def _check_target(target: Any) -> float:
    try:
        s = float(target)
    except (TypeError, ValueError):
        raise ValueError(f"target sparsity must be a number in [0, 1), got {target!r}") from None
    if not (0.0 <= s < 1.0):
        raise ValueError(f"target sparsity must lie in [0, 1) (a fraction of zeros below 1), got {s}")
    return s


def _check_threshold(threshold: Any) -> float:
    """The threshold as a float; a finite number >= 0 or a ValueError saying so."""
    try:
        a = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}") from None
    if not (math.isfinite(a) and a >= 0):
        raise ValueError(f"threshold must be a finite number >= 0, got {a}")
    return a


def _check_out(out: torch.Tensor | None, x: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype \
            or out.device != x.device:
        got = ((tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ValueError(f"out must be a tensor of x's shape {tuple(x.shape)}, dtype {x.dtype} and "
                         f"device {x.device}; got {got}")


def _check_generator(generator: Any) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def _draw(generator: torch.Generator | None, k: int = 1) -> list[int]:
    """``k`` 62-bit integers drawn from ``generator`` (or torch's default generator)."""
    dev = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(0, 2 ** 62, (k,), generator=generator, device=dev).tolist()


def stochastic_prune(x: torch.Tensor, threshold: float, *, generator: torch.Generator | None = None,
                     out: torch.Tensor | None = None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Unbiased stochastic pruning at ``threshold`` ``a``: entries with ``|x| >= a`` are kept;
    each smaller entry becomes ``sign(x) * a`` with probability ``|x| / a`` and 0 otherwise, so
    ``E[T(x)] = x`` and the variance added to an entry is ``a|x| - x^2``.

    ``generator`` makes the result reproducible (its state is advanced); ``out`` receives the
    result (it may be ``x`` itself, for in-place pruning); ``uniforms`` (a tensor of ``x``'s
    shape with values in [0, 1)) replaces the random draws: an entry is kept when
    ``u * a < |x|``. The threshold is first rounded to ``x``'s dtype. Pruned entries are zeros
    (of either sign); inf is kept, NaN stays NaN. Half-precision tensors are computed in float32.

    Random draws: float32 CPU tensors take one seed from the generator and hash it with each
    entry's index in the C kernel shared with :func:`gradstats.compress.prune_quantize` (so
    ``prune_quantize(x, a, None, generator=g)`` gives the same values); the result does not
    depend on ``torch.get_num_threads()``. Without a C compiler, and for float64, a PCG64
    stream keyed by four draws from the generator is used instead (equal in distribution, not
    bit for bit). CUDA tensors use the Triton kernel's hash (:mod:`gradstats.kernels.prune`).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.tensor([0.5, -0.01, 0.02, -2.0])
        >>> y = stochastic_prune(x, 0.1, generator=g)
        >>> sorted(set(y.abs().tolist()) - {0.0, 2.0, 0.5}) in ([], [0.10000000149011612])
        True
        >>> torch.equal(y, stochastic_prune(x, 0.1, generator=torch.Generator().manual_seed(0)))
        True
    """
    _check_tensor(x)
    _check_out(out, x)
    _check_generator(generator)
    a = _check_threshold(threshold)
    if uniforms is not None:
        if not isinstance(uniforms, torch.Tensor) or uniforms.shape != x.shape:
            raise ValueError(f"uniforms must be a tensor of x's shape {tuple(x.shape)}")
        uniforms = uniforms.to(device=x.device)
    a = float(torch.tensor(a, dtype=x.dtype)) if x.dtype != torch.float64 else a
    if math.isinf(a):
        a = float(torch.finfo(x.dtype).max)
    if a == 0.0:
        if out is None:
            return x.clone()
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return out
    dev = x.device.type
    if dev == "cpu" and x.dtype in (torch.float32, torch.float64) and not use_triton("cpu"):
        xc = x.detach().contiguous().reshape(-1)
        direct = out is not None and out.is_contiguous()
        res = out if direct else torch.empty_like(xc)
        if uniforms is None and x.dtype == torch.float32 and _cpu.native_kernel() is not None:
            _cpu.native_stochastic_prune(xc.numpy(), a, res.reshape(-1).numpy(), _draw(generator)[0])
        else:
            u = None
            if uniforms is not None:
                u = uniforms.detach().to(x.dtype).contiguous().reshape(-1).numpy()
            _cpu.stochastic_prune(xc.numpy(), a, res.reshape(-1).numpy(),
                                  key=None if u is not None else tuple(_draw(generator, 4)), uniforms=u)
        if direct:
            return out  # type: ignore[return-value]
        res = res.reshape(x.shape)
        return out.copy_(res) if out is not None else res
    if use_triton(dev) and x.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return kprune.stochastic_prune(x, a, seed=None if uniforms is not None else _draw(generator)[0],
                                       uniforms=uniforms, out=out)
    return kprune.stochastic_prune_torch(x, a, generator=generator, uniforms=uniforms, out=out)


def hard_prune(x: torch.Tensor, threshold: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic hard thresholding: ``x`` where ``|x| >= threshold``, else 0 (biased).
    NaN and inf are kept; ``out`` may be ``x``.

    Example:
        >>> import torch
        >>> hard_prune(torch.tensor([0.5, 0.01, -2.0]), 0.1).tolist()
        [0.5, 0.0, -2.0]
    """
    _check_tensor(x)
    _check_out(out, x)
    a = _check_threshold(threshold)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        xc = x.detach().contiguous().reshape(-1)
        direct = out is not None and out.is_contiguous()
        res = out if direct else torch.empty_like(xc)
        _cpu.hard_prune(xc.numpy(), a, res.reshape(-1).numpy())
        if direct:
            return out  # type: ignore[return-value]
        res = res.reshape(x.shape)
        return out.copy_(res) if out is not None else res
    res = torch.where(x.abs() < a, torch.zeros_like(x), x)
    return out.copy_(res) if out is not None else res


def exact_threshold(x: torch.Tensor, target: float, *, stochastic: bool = False) -> float:
    """The exact threshold of a tensor for a target sparsity (the sort/selection baseline).

    ``stochastic=False``: the hard-threshold quantile by ``torch.kthvalue``: with
    ``k = round(target * n)``, the ``(k+1)``-th smallest ``|x|``, so that hard thresholding
    zeros exactly ``k`` entries when there are no ties (0 when the zeros already reach
    ``k``). ``stochastic=True``: the threshold whose expected sparsity under
    :func:`stochastic_prune` *on this very tensor* is ``target``, from the sorted ``|x|`` and
    their prefix sums: ``S(a) = (1/n) * sum_{|x_i| < a} (1 - |x_i|/a)`` (an O(n log n) oracle).

    Example:
        >>> import torch
        >>> x = torch.tensor([0.0, 1.0, -2.0, 3.0, 4.0])
        >>> exact_threshold(x, 0.4)
        2.0
        >>> a = exact_threshold(x, 0.4, stochastic=True)
        >>> round((1 + (1 - 1 / a) + (1 - 2 / a)) / 5, 12) if 2 < a <= 3 else a
        0.4
    """
    _check_tensor(x)
    s = _check_target(target)
    ax = x.detach().reshape(-1).abs()
    n = ax.numel()
    if not stochastic:
        k = min(int(round(s * n)), n - 1)
        return float(torch.kthvalue(ax.cpu() if ax.device.type == "mps" else ax, k + 1).values)
    v = torch.sort(ax.double()).values
    if s == 0.0:
        return 0.0
    csum = torch.cumsum(v, 0)
    k = torch.arange(n, dtype=torch.float64, device=v.device)
    # S at a = v[k]: the k entries before it are below a (ties at a contribute 0 either way)
    prev = torch.cat([v.new_zeros(1), csum[:-1]])
    with torch.no_grad():
        s_at = torch.where(v > 0, (k - prev / v) / n, torch.zeros_like(v))
    j = int(torch.searchsorted(s_at, torch.tensor([s], dtype=torch.float64, device=v.device),
                               right=True)[0]) - 1
    if j < 0:
        return 0.0
    # a in [v[j], v[j+1]): the j+1 entries v[0..j] are below a (or equal, contributing 0)
    if float(s_at[j]) == s:
        return float(v[j])
    num, cnt = float(csum[j]), j + 1
    return num / (cnt - n * s)


#: bins per binade of the histogram rule in :func:`prune` (``2**HIST_MBITS``)
HIST_MBITS = 2


@functools.lru_cache(maxsize=1)
def _native_log2_hist():
    from .._native import function

    return function("stats", "gs_log2_hist_f32",
                    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int])


def _histogram(x: torch.Tensor):
    """The LogHistogram of ``x`` at ``2**HIST_MBITS`` bins per binade, in one sweep."""
    from .histogram import LogHistogram

    fn = _native_log2_hist() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if fn is not None:   # the C counting kernel (one sweep, threads as torch's)
        xc = x.detach().contiguous().reshape(-1)
        counts = np.zeros(256 << HIST_MBITS, dtype=np.int64)
        if fn(xc.data_ptr(), xc.numel(), HIST_MBITS, counts.ctypes.data, torch.get_num_threads()) == 0:
            return LogHistogram.from_counts(counts, mbits=HIST_MBITS, float64=False, n=x.numel())
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        counts = _cpu.log2_histogram(x.detach().contiguous().reshape(-1).numpy(), HIST_MBITS)
        return LogHistogram.from_counts(counts, mbits=HIST_MBITS, float64=x.dtype == torch.float64,
                                        n=x.numel())
    bits = x.detach().reshape(-1).float().view(torch.int32) & 0x7FFFFFFF
    counts = torch.bincount(bits >> (23 - HIST_MBITS), minlength=256 << HIST_MBITS)
    return LogHistogram.from_counts(counts.cpu().numpy(), mbits=HIST_MBITS, float64=False,
                                    n=x.numel())


def _estimate(x: torch.Tensor, method: str) -> dict[str, Any]:
    """Statistics of ``x`` needed by ``method`` (n, n_zero, sums), in one sweep."""
    logs = method in ("lognormal", "naive_lognormal")
    if x.device.type == "cpu" and x.dtype == torch.float32 and has_native_kernel():
        # the fused one-pass C kernel: every sum, the zero count and the maximum at once
        st = dict(zip(SCALAR_FIELDS, tensor_stats_vector(x.detach()).tolist()))
        if st["n_nonfinite"] == 0:
            for k in ("n", "n_zero", "n_nonfinite"):
                st[k] = int(st[k])
            return st
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        st = _cpu.moments(x.detach().contiguous().reshape(-1).numpy(), logs=logs, sums=not logs)
        if st.pop("finite"):
            return st
    elif x.device.type != "cpu":
        xf = x.detach().reshape(-1).double()  # float64 sums: cheap on a GPU, no precision worries
        ax = xf.abs()
        nz = ax > 0
        fin = torch.isfinite(ax)
        if bool(fin.all()):
            lg = torch.log(torch.where(nz, ax, 1.0))
            v = torch.stack([nz.sum(), ax.sum(), torch.dot(ax, ax), lg.sum(),
                             torch.dot(lg, lg)]).double().cpu()
            n = xf.numel()
            return {"n": n, "n_zero": n - int(v[0]), "n_nonfinite": 0, "sum_abs": float(v[1]),
                    "sum_sq": float(v[2]), "sum_ln_abs": float(v[3]), "sum_ln_abs_sq": float(v[4])}
    return dict(tensor_stats(x))


def prune(x: torch.Tensor, target: float, *, method: str = DEFAULT_RULE, stochastic: bool = True,
          generator: torch.Generator | None = None, out: torch.Tensor | None = None,
          return_threshold: bool = False) -> Any:
    """Estimate the threshold for ``target`` sparsity from ``x`` itself and apply it.

    ``method``: ``"histogram"`` (the default, model-free: one sweep counting ``|x|`` in
    quarter-binade bins, see :mod:`gradstats.pruning.histogram`; the most accurate sort-free
    rule on real gradients, within about 1e-4 of the target on average), a model rule of
    :func:`gradstats.pruning.threshold` (``"lognormal"``, the study's closed form,
    ``"naive_lognormal"``, ``"normal"``, ``"laplace"``; the parameters come from one sweep
    over ``x``: zero count and the sums of ``ln|x|``, ``ln^2|x|``, ``|x|``, ``x^2``),
    or ``"exact"`` (``torch.kthvalue`` for the hard operator, the sort-based oracle of
    :func:`exact_threshold` for the stochastic one). ``stochastic=True`` applies
    :func:`stochastic_prune` with the threshold solved for that operator;
    ``stochastic=False`` hard-thresholds at the rule's quantile. Returns the pruned tensor, or
    ``(tensor, threshold)`` with ``return_threshold=True``.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(200_000, generator=g).mul(2).exp() * torch.randn(200_000, generator=g).sign()
        >>> y = prune(x, 0.9, generator=g)
        >>> abs((y == 0).float().mean().item() - 0.9) < 0.005
        True
    """
    _check_tensor(x)
    s = _check_target(target)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_out(out, x)
    _check_generator(generator)
    if method == "exact":
        a = exact_threshold(x, s, stochastic=stochastic)
    elif method == "histogram":
        a = min(_histogram(x).threshold(s, stochastic=stochastic), float(torch.finfo(x.dtype).max))
    else:
        st = _estimate(x, method)
        if int(st["n"]) - int(st["n_zero"]) - int(st.get("n_nonfinite", 0)) <= 0:
            a = 0.0  # all zero (or non-finite): nothing to prune
        else:
            model = "lognormal" if method == "naive_lognormal" else method
            sto = stochastic and method != "naive_lognormal"
            a = float(_threshold(s, st, model=model, stochastic=sto))
    if stochastic:
        y = stochastic_prune(x, a, generator=generator, out=out)
    else:
        y = hard_prune(x, a, out=out)
    return (y, a) if return_threshold else y
