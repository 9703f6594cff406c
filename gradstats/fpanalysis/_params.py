"""Input checking and broadcasting shared by the format-analysis verbs."""
from __future__ import annotations

import math
from typing import Any, Union

import numpy as np
import torch

# the value layer's names, read by the verbs as P.OVERFLOWS and P.PREDICTED_ROUNDINGS
from gradstats.formats import OVERFLOWS, PREDICTED_ROUNDINGS, FPFormat, parse  # noqa: F401

ArrayLike = Union[float, int, np.ndarray, torch.Tensor, list, tuple]


CRITERIA = ("mse", "elementwise")

#: largest sigma (of ln|g|) accepted: std of log2|g| about 17 binades, far beyond gradients (1.5-5)
SIGMA_MAX = 12.0
#: scales must be float32 normal numbers (the quantiser multiplies in float32; E8M0 holds the
#: powers of two 2**-127..2**127)
LOG2_SCALE_RANGE = (-126, 127)
LN2 = math.log(2.0)


def as_array(name: str, v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", torch.float64).numpy()
    try:
        return np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or an array of numbers, got {type(v).__name__}") from None


def check_format(fmt: Any) -> FPFormat:
    fmt = parse(fmt)
    if not fmt.signed or not fmt.has_zero:
        raise ValueError(f"format {fmt} is unsigned (a scale type: no sign bit); it cannot hold "
                         "signed gradients: pick a signed format such as 'e4m3fn'")
    if fmt.bits > 16:
        raise ValueError(f"format {fmt} has {fmt.bits} bits; the analysis enumerates quantisation "
                         "cells and handles formats of 3 to 16 bits")
    return fmt


def check_choice(name: str, v: Any, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {v!r}")
    return v


def check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 3 <= int(bits) <= 16:
        raise ValueError(f"bits must be an integer in 3..16 (sign + at least one exponent and one "
                         f"mantissa bit, at most 16), got {bits!r}")
    return int(bits)


def lognormal(mu: Any, sigma: Any, p0: Any = 0.0, *extra: tuple[str, Any]) -> tuple[tuple[int, ...], list[np.ndarray]]:
    """Validate and broadcast ``mu``, ``sigma``, ``p0`` (and named extras); flat arrays + shape."""
    if mu is None or sigma is None:
        raise ValueError("mu and sigma (mean and std of ln|g|, natural log) are required")
    muv, sv, pv = as_array("mu", mu), as_array("sigma", sigma), as_array("p0", p0)
    if not np.isfinite(muv).all():
        raise ValueError(f"mu (mean of ln|g|) must be finite, got {muv.reshape(-1)[:5]}")
    bad = ~(np.isfinite(sv) & (sv > 0) & (sv <= SIGMA_MAX))
    if bad.any():
        raise ValueError(f"sigma (std of ln|g|, natural log) must be in (0, {SIGMA_MAX:g}]; got "
                         f"{sv[bad].reshape(-1)[:5]} (a constant tensor has sigma = 0 and needs no analysis)")
    if not ((pv >= 0) & (pv < 1)).all():
        raise ValueError(f"p0 (fraction of exact zeros) must be in [0, 1), got {pv[~((pv >= 0) & (pv < 1))][:5]}")
    arrays = [muv, sv, pv] + [as_array(n, v) for n, v in extra]
    try:
        b = np.broadcast_arrays(*arrays)
    except ValueError:
        raise ValueError(f"mu, sigma, p0{''.join(', ' + n for n, _ in extra)} do not broadcast together: "
                         f"shapes {[a.shape for a in arrays]}") from None
    return b[0].shape, [np.ascontiguousarray(a, dtype=np.float64).ravel() for a in b]


def check_scale(scale: np.ndarray) -> np.ndarray:
    if not (np.isfinite(scale) & (scale > 0)).all():
        raise ValueError(f"scale must be positive and finite, got {scale[~(np.isfinite(scale) & (scale > 0))][:5]}")
    l2 = np.log2(scale)
    lo, hi = LOG2_SCALE_RANGE
    bad = (l2 < lo) | (l2 > hi)
    if bad.any():
        raise ValueError(f"scale {scale[bad][:3]} lies outside 2**{lo}..2**{hi}: the quantiser multiplies "
                         "in float32 (and an E8M0 scale holds 2**-127..2**127), which cannot represent it")
    return scale


def check_amax(amax: np.ndarray) -> np.ndarray:
    if not (np.isfinite(amax) & (amax > 0)).all():
        raise ValueError(f"amax (largest |g| of the tensor) must be positive and finite, got "
                         f"{amax[~(np.isfinite(amax) & (amax > 0))][:5]}")
    return amax


def numel_array(numel: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """Entries per tensor (zeros included), broadcast to the layers' shape, flat; None stays None."""
    if numel is None:
        return None
    v = as_array("numel", numel)
    if not (np.isfinite(v) & (v >= 1)).all():
        raise ValueError(f"numel (entries per tensor) must be >= 1, got {v[~(np.isfinite(v) & (v >= 1))][:5]}")
    try:
        return np.broadcast_to(v, shape).astype(np.float64).ravel()
    except ValueError:
        raise ValueError(f"numel of shape {v.shape} does not broadcast to the layers' shape {shape}") from None


def out(v: np.ndarray, shape: tuple[int, ...]) -> Any:
    """Reshape a flat result; a float for scalar inputs."""
    v = np.asarray(v).reshape(shape)
    return float(v) if v.ndim == 0 else v
