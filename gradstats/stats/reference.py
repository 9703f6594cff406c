"""The reference computation of the statistics with torch reductions: what every device computes
(on CUDA without a host synchronisation) and what the C kernel is tested against. One
:class:`Pass` over a tensor holds what several statistics share (``|x|``, the exponent fields, the
logs); each statistic's ``compute`` (:data:`gradstats.stats.fields.STATISTICS`) reads it.

Example:
    >>> import torch
    >>> v = reduce(torch.tensor([0.0, 1.0, -2.0]))
    >>> v[:3].tolist()
    [3.0, 1.0, 0.0]
"""
from __future__ import annotations

import functools
import math

import torch

from gradstats.stats.fields import HIST_BINS, HIST_MIN_EXP, STATISTICS, TOP_K

_SUBNORMAL_FIELD = 0
_NONFINITE_FIELD = 255
_TINY = 2.0 ** -149  # smallest float32 subnormal
_F64 = torch.float64


def _histogram(a: torch.Tensor, field: torch.Tensor, counts: torch.Tensor,
               n_sub_present: bool) -> torch.Tensor:
    """Binade histogram of the non-zero finite entries of ``a = |x|`` from the counts of the
    biased exponent ``field``; subnormals (field 0) are binned by a second, masked pass."""
    hist = counts.new_zeros(HIST_BINS)
    # normal numbers: biased exponent field f in 1..254 is binade f - 127
    hist[1 - 127 - HIST_MIN_EXP: 255 - 127 - HIST_MIN_EXP] = counts[1:255]
    if n_sub_present:
        sub = (field == _SUBNORMAL_FIELD) & (a > 0)
        _, e = torch.frexp(torch.where(sub, a, 1.0))
        idx = torch.where(sub, e - 1 - HIST_MIN_EXP, HIST_BINS)
        hist += torch.bincount(idx.reshape(-1), minlength=HIST_BINS + 1)[:HIST_BINS]
    return hist


class Pass:
    """What the statistics of a flat non-empty float32 tensor ``x`` share. Sums are computed in
    float32 and only the results widened; counts are exact. On the CPU, tensors without inf/NaN
    take a path of plain arithmetic passes (boolean masks and ``log(0)`` are slow there).

    Attributes: ``n`` (elements), ``n_zero``, ``n_nonfinite`` (float64 tensors), ``xs`` and ``as_``
    (``x`` and ``|x|`` with non-finite entries set to 0); :attr:`log_sums`, :attr:`hist`,
    :attr:`min_abs`, :attr:`max_abs`, :attr:`top` on demand.

    Example:
        >>> float(Pass(torch.tensor([0.0, 4.0])).max_abs)
        4.0
    """

    def __init__(self, x: torch.Tensor) -> None:
        n = x.numel()
        self.x = x
        self.a = a = x.abs()
        bits = a.view(torch.int32)
        # the biased exponent field of |x|: 0 for zeros and subnormals, 255 for inf/NaN
        self.field = bits >> 23
        self.counts = counts = torch.bincount(self.field, minlength=256)
        on_cpu = x.device.type == "cpu"
        self.n = torch.tensor(float(n), dtype=_F64, device=x.device)
        if on_cpu and int(counts[_NONFINITE_FIELD]) == 0:
            s = torch.sign(a)  # 0 for zeros, 1 otherwise
            acc = _F64 if n > 2 ** 24 else torch.float32  # integer-exact count
            self.n_nz = s.sum(dtype=acc).to(_F64)
            self.n_zero = n - self.n_nz
            self.n_nonfinite = torch.zeros((), dtype=_F64)
            self._lg = torch.log(a.clamp_min(_TINY)).mul_(s)
            self.xs, self.as_ = x, a
            # smallest positive |x|: non-negative floats order as their bit patterns; zeros
            # (bits 0) become the largest int32 through the wrap of bits - 1
            m = ((bits - 1) & 0x7FFFFFFF).min() + 1
            self.amin = m.reshape(1).view(torch.float32)[0]
            self.has_sub = int(counts[_SUBNORMAL_FIELD]) > int(self.n_zero)
        else:
            finite = self.field != _NONFINITE_FIELD
            nz = finite & (a > 0)
            self.n_nonfinite = counts[_NONFINITE_FIELD].to(_F64)
            self.n_zero = (a == 0).sum().to(_F64)
            self.n_nz = n - self.n_zero - self.n_nonfinite
            self.xs = torch.where(finite, x, 0.0)
            self.as_ = torch.where(finite, a, 0.0)
            self._lg = torch.log(torch.where(nz, a, 1.0))
            self.amin = torch.where(nz, a, math.inf).min()
            self.has_sub = (not on_cpu) or int(counts[_SUBNORMAL_FIELD]) > int(self.n_zero)

    @functools.cached_property
    def log_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums of ``ln|x|`` and of ``ln^2|x|`` over the non-zero finite entries: the logs are
        summed, then squared in place (no second tensor of the input's size) and summed again."""
        lg = self._lg
        total = lg.sum()
        return total, lg.square_().sum()

    @functools.cached_property
    def _nan(self) -> torch.Tensor:
        return torch.tensor(math.nan, dtype=_F64, device=self.x.device)

    @property
    def hist(self) -> torch.Tensor:
        return _histogram(self.a, self.field, self.counts, self.has_sub)

    @property
    def min_abs(self) -> torch.Tensor:
        return torch.where(self.n_nz > 0, self.amin.to(_F64), self._nan)

    @property
    def max_abs(self) -> torch.Tensor:
        return torch.where(self.n_nz > 0, self.as_.max().to(_F64), self._nan)

    @property
    def top(self) -> torch.Tensor:
        top = torch.full((TOP_K,), math.nan, dtype=_F64, device=self.x.device)
        vals = self.as_.topk(min(TOP_K, self.x.numel())).values.to(_F64)  # zeros (and non-finite, set to 0) sort last
        top[: vals.numel()] = torch.where(vals > 0, vals, self._nan)
        return top


def reduce(x: torch.Tensor) -> torch.Tensor:
    """All statistics of a flat float32 tensor as one float64 vector on ``x``'s device, in the layout
    of :data:`gradstats.stats.fields.LAYOUT`: each statistic's ``compute`` over one :class:`Pass`."""
    if x.numel() == 0:
        return torch.cat([torch.full((s.length,), s.empty, dtype=_F64) for s in STATISTICS]).to(x.device)
    p = Pass(x)
    return torch.cat([torch.as_tensor(s.compute(p)).to(device=x.device, dtype=_F64).reshape(s.length)
                      for s in STATISTICS])
