"""The exponent/mantissa splits of a bit width ranked for lognormal gradients: :func:`best_format`.

Every split ``E = 1..bits-2``, ``M = bits-1-E``, each at its own best scale
(:func:`~gradstats.fpanalysis.optimal_scale`) or under a block-scaling rule, ranked per layer by
predicted error. Vectorised over layers: 100 layers at bit widths 4..8 take a fraction of a second.

Which formats compete is ``candidates=``: the formats that exist, as presets named after what
users target (:data:`CANDIDATE_PRESETS`: ``"ocp"``, ``"torchao"``, ``"te"``), every split of the
width (``"any"``, research), a convention of :func:`candidate_formats`, or a list of formats;
:func:`preset_formats` resolves a name for one width and granularity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import numpy as np

from gradstats.formats import FPFormat, parse
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis.error import default_tensor_amax, integrals
from gradstats.fpanalysis.granularity import BlockViews, granularity_layout, granularity_of
from gradstats.fpanalysis.scale import _mode, _optimal
from gradstats.scheme import E4M3, Scheme

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["best_format", "BestFormat", "FormatChoice", "candidate_formats", "preset_formats",
           "CANDIDATE_PRESETS", "CANDIDATE_NAMES", "DEFAULT_CANDIDATES"]

#: the OCP formats: FP8 ``e4m3fn`` (max 448) and ``e5m2`` (the ieee convention, with inf, as
#: ``torch.float8_e5m2``), FP6 ``e2m3fn`` (max 7.5) and ``e3m2fn`` (max 28), FP4 ``e2m1fn`` (max 6);
#: also the MX element types (and NVFP4's element)
_OCP = ("e4m3fn", "e5m2", "e2m3fn", "e3m2fn", "e2m1fn")
_FP8 = ("e4m3fn", "e5m2")
_FP4 = ("e2m1fn",)

#: Candidate presets, named after what users target: preset -> granularity -> format names.
#: Granularities (:mod:`gradstats.fpanalysis.granularity`): ``"tensor"`` (one scale per tensor),
#: ``"mx"`` (blocks of 32, E8M0 scales), ``"nvfp4"`` (blocks of 16, E4M3 scales); other layouts take
#: the preset's formats of every granularity.
#:
#: - ``"ocp"``: the OCP formats (FP8 e4m3fn and e5m2, FP6 e2m3fn and e3m2fn, FP4 e2m1fn), whatever
#:   the scaling;
#: - ``"torchao"``: torchao's training recipes for gradients: ``torchao.float8`` per tensor
#:   (``float8_e4m3fn``, ``float8_e5m2``), its MX formats (MXFP8 e4m3fn/e5m2, MXFP6 e2m3fn/e3m2fn,
#:   MXFP4 e2m1fn) and NVFP4 (e2m1fn);
#: - ``"te"``: Transformer Engine's recipes: FP8 e4m3 (the ``fn`` convention, max 448) and e5m2 per
#:   tensor (delayed or current scaling), MXFP8 (e4m3, or e5m2 for gradients in its hybrid
#:   format), NVFP4 (e2m1fn).
CANDIDATE_PRESETS: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "ocp": MappingProxyType({"tensor": _OCP, "mx": _OCP, "nvfp4": _OCP}),
    "torchao": MappingProxyType({"tensor": _FP8, "mx": _OCP, "nvfp4": _FP4}),
    "te": MappingProxyType({"tensor": _FP8, "mx": _FP8, "nvfp4": _FP4}),
})
#: the convention names of :func:`candidate_formats` (every split of the width)
_CONVENTIONS = ("hardware", "fn", "ieee", "fnuz")
#: every name ``candidates=`` accepts: the presets, ``"any"`` (every split of the width as an ``fn``
#: format: research splits such as e2m5fn that no hardware or library implements), the conventions
CANDIDATE_NAMES = (*CANDIDATE_PRESETS, "any", *_CONVENTIONS)
#: what :func:`gradstats.recommend` chooses from unless told otherwise: formats that exist
DEFAULT_CANDIDATES = "ocp"
_GRANULARITY_TEXT = {"tensor": "per tensor", "mx": "in MX blocks", "nvfp4": "in NVFP4 blocks"}


def _granularity_key(granularity: Any) -> Optional[str]:
    """The key of :data:`CANDIDATE_PRESETS` a granularity selects (:func:`~gradstats.fpanalysis.granularity.
    granularity_layout` reads it): ``"tensor"``, ``"mx"``, ``"nvfp4"``, or None (every granularity: None,
    or a layout of no name, such as blocks of 64)."""
    return None if granularity is None else granularity_of(granularity_layout(granularity))


def _names_text(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def preset_formats(preset: str, bits: Optional[int] = None, *, granularity: Any = None) -> list[FPFormat]:
    """The formats a ``candidates=`` name stands for, of ``bits`` bits (every width when None) at
    a ``granularity`` (``"tensor"``, ``"mx"``, ``"nvfp4"``, an int block size with E8M0 scales:
    :func:`~gradstats.fpanalysis.granularity.granularity_layout`; None or a layout of no name, such
    as blocks of 64: every granularity).

    ``preset``: a key of :data:`CANDIDATE_PRESETS` (``"ocp"``, ``"torchao"``, ``"te"``), ``"any"``
    (every exponent/mantissa split of the width, ``fn``: research), or a convention of
    :func:`candidate_formats` (``"hardware"``, ``"fn"``, ``"ieee"``, ``"fnuz"``; every split too).
    A width the preset has no format of is a ``ValueError`` naming the widths it has.

    Example:
        >>> [str(f) for f in preset_formats("ocp", 8)]
        ['e4m3fn', 'e5m2']
        >>> [str(f) for f in preset_formats("torchao", 6, granularity="mx")]
        ['e2m3fn', 'e3m2fn']
        >>> [str(f) for f in preset_formats("any", 6)]
        ['e1m4fn', 'e2m3fn', 'e3m2fn', 'e4m1fn']
    """
    if not isinstance(preset, str) or preset not in CANDIDATE_NAMES:
        raise ValueError(f"unknown candidates {preset!r}: expected one of {_names_text(CANDIDATE_NAMES)} or a "
                         "list of formats")
    key = _granularity_key(granularity)
    if preset not in CANDIDATE_PRESETS:
        if bits is None:
            raise ValueError(f"candidates={preset!r} is every split of a width: it needs bits")
        return candidate_formats(bits, "fn" if preset == "any" else preset)
    table = CANDIDATE_PRESETS[preset]
    names = table[key] if key is not None else tuple(dict.fromkeys(n for v in table.values() for n in v))
    fmts = [parse(n) for n in names]
    if bits is None:
        return fmts
    bits = P.check_bits(bits)
    mine = [f for f in fmts if f.bits == bits]
    if not mine:
        widths = ", ".join(str(b) for b in sorted({f.bits for f in fmts}))
        elsewhere = [g for g, v in table.items() if g != key and any(parse(n).bits == bits for n in v)]
        where, hint = "", ""
        if key is not None and elsewhere:   # the width exists at another granularity
            where = f" {_GRANULARITY_TEXT[key]}"
            hint = (f"; its {bits}-bit formats are {' or '.join(_GRANULARITY_TEXT[g] for g in elsewhere)} "
                    f"(granularity={' or '.join(repr(g) for g in elsewhere)})")
        raise ValueError(f"candidates={preset!r} has no {bits}-bit format{where}: its formats "
                         f"({', '.join(names)}) have {widths} bits{hint}; pass candidates='any' for every "
                         f"exponent/mantissa split of {bits} bits (research formats that no hardware or "
                         "library implements)")
    return mine


def _resolve(candidates: Any, bits: int, granularity: Any) -> list[FPFormat]:
    """The candidate formats of ``bits`` bits: None is every split (``fn``), a name as
    :func:`preset_formats`, a list of formats of that width."""
    if candidates is None or isinstance(candidates, str):
        return preset_formats(candidates or "any", bits, granularity=granularity)
    cands = [P.check_format(parse(c)) for c in candidates]
    if not cands:
        raise ValueError("candidates is empty")
    wrong = [str(c) for c in cands if c.bits != bits]
    if wrong:
        raise ValueError(f"candidates {wrong} do not have {bits} bits")
    return cands


def candidate_formats(bits: int, special: str = "fn", *, subnormals: bool = True) -> list[FPFormat]:
    """Every exponent/mantissa split of a ``bits``-wide format: ``E = 1 .. bits-2``, ``M = bits-1-E``.

    ``special="fn"`` (default): finite, saturating, with subnormals, as the OCP FP8/FP6/FP4
    formats (``e4m3fn``, ``e3m2fn``, ``e2m1fn``); ``"ieee"`` (inf/NaN reserve the top binade,
    ``E >= 2``), ``"fnuz"``; ``"hardware"``: ``e5m2`` (ieee) at 8 bits, ``fn`` otherwise.
    Exponent bits are capped at 8 (float32 range).

    Example:
        >>> [str(f) for f in candidate_formats(6)]
        ['e1m4fn', 'e2m3fn', 'e3m2fn', 'e4m1fn']
    """
    bits = P.check_bits(bits)
    if special not in ("fn", "ieee", "fnuz", "hardware"):
        raise ValueError(f"candidates: convention must be 'fn', 'ieee', 'fnuz' or 'hardware', got {special!r}")
    out = []
    for e in range(1, min(bits - 2, 8) + 1):
        m = bits - 1 - e
        if m > 23:
            continue
        sp = special
        if special == "hardware":
            sp = "ieee" if (e, m) == (5, 2) else "fn"
        if sp == "ieee" and e < 2:
            continue
        out.append(FPFormat(e, m, special=sp, subnormals=subnormals))
    if not out:
        raise ValueError(f"no {special} format has {bits} bits")
    return out


@dataclass(frozen=True)
class FormatChoice:
    """One candidate of :func:`best_format` for one layer: ``format``, ``scale``, ``error``, ``rank``.

    Example:
        >>> best_format(8, mu=-9.0, sigma=1.5).choices()[0].format
        FPFormat('e4m3fn')
    """

    format: FPFormat
    scale: float
    error: float
    rank: int

    @property
    def log2_scale(self) -> float:
        return math.log2(self.scale) if self.scale == self.scale else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return {"format": str(self.format), "exp_bits": self.format.exp_bits, "man_bits": self.format.man_bits,
                "scale": self.scale, "log2_scale": self.log2_scale, "error": self.error, "rank": self.rank}

    def to_dataframe(self) -> "pd.DataFrame":
        """pandas view: one row."""
        import pandas as pd

        return pd.DataFrame([self.to_dict()])


@dataclass(frozen=True)
class BestFormat(BlockViews):
    """Candidates of one bit width ranked by predicted error, per layer (see :func:`best_format`).

    Attributes:
        bits: the bit width; candidates: the formats compared.
        errors, scales: ``(layers, candidates)`` arrays (``(candidates,)`` for one layer); scales are
            NaN under block scaling (the block rule sets them).
        order: candidate indices per layer, best first.
        format, scale, error, exp_bits: the winner per layer (a single value for one layer).
        mu, sigma, p0, names, amax: the inputs; rounding, criterion, power_of_two: the setting;
        blocks: the block layout (:attr:`~gradstats.scheme.Scheme.block_layout`; None: one scale per
        tensor), whose ``block_size`` and ``scale_format_name`` the properties of the same names give.

    Example:
        >>> b = best_format(6, mu=[-8.0, -8.0], sigma=[1.0, 2.5])
        >>> [str(f) for f in b.format], b.exp_bits.tolist()
        (['e3m2fn', 'e4m1fn'], [3, 4])
    """

    bits: int
    candidates: tuple[FPFormat, ...]
    errors: np.ndarray
    scales: np.ndarray
    order: np.ndarray
    mu: Any
    sigma: Any
    p0: Any
    names: Optional[tuple[str, ...]] = None
    rounding: str = "nearest"
    criterion: str = "mse"
    blocks: Optional[Scheme] = None
    power_of_two: bool = True
    amax: Any = None

    @property
    def single(self) -> bool:
        return self.errors.ndim == 1

    def _top(self, a: np.ndarray) -> Any:
        a2 = a.reshape(-1, len(self.candidates))
        o2 = self.order.reshape(-1, len(self.candidates))
        v = a2[np.arange(a2.shape[0]), o2[:, 0]]
        return float(v[0]) if self.single else v.reshape(self.errors.shape[:-1])

    @property
    def error(self) -> Any:
        return self._top(self.errors)

    @property
    def scale(self) -> Any:
        return self._top(self.scales)

    @property
    def format(self) -> Union[FPFormat, list[FPFormat]]:
        o2 = self.order.reshape(-1, len(self.candidates))[:, 0]
        f = [self.candidates[i] for i in o2]
        return f[0] if self.single else f

    @property
    def exp_bits(self) -> Any:
        e = np.array([self.candidates[i].exp_bits for i in self.order.reshape(-1, len(self.candidates))[:, 0]])
        return int(e[0]) if self.single else e.reshape(self.errors.shape[:-1])

    def choices(self, layer: int = 0) -> list[FormatChoice]:
        """The ranked candidates of one layer (index into the flattened layers)."""
        e = self.errors.reshape(-1, len(self.candidates))[layer]
        s = self.scales.reshape(-1, len(self.candidates))[layer]
        o = self.order.reshape(-1, len(self.candidates))[layer]
        return [FormatChoice(self.candidates[i], float(s[i]), float(e[i]), r) for r, i in enumerate(o)]

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per (layer, candidate): layer, rank, format, exp_bits, man_bits, scale, log2_scale, error."""
        import pandas as pd

        k = len(self.candidates)
        e = self.errors.reshape(-1, k)
        rows = []
        mu, sg = np.ravel(self.mu), np.ravel(self.sigma)
        for li in range(e.shape[0]):
            name = self.names[li] if self.names else li
            for c in self.choices(li):
                rows.append({"layer": name, "mu": mu[li], "sigma": sg[li], "sigma_log2": sg[li] / P.LN2,
                             **c.to_dict()})
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict: setting, candidates, and per layer the ranked choices."""
        n = self.errors.reshape(-1, len(self.candidates)).shape[0]
        return {"bits": self.bits, "candidates": [str(c) for c in self.candidates], "rounding": self.rounding,
                "criterion": self.criterion, "block_size": self.block_size, "scale_format": self.scale_format,
                "power_of_two": self.power_of_two,
                "layers": [{"layer": self.names[i] if self.names else i,
                            "mu": float(np.ravel(self.mu)[i]), "sigma": float(np.ravel(self.sigma)[i]),
                            "choices": [c.to_dict() for c in self.choices(i)]} for i in range(n)]}

    def plot(self, *, crossovers: Any = None, **kw: Any) -> Any:
        """Per-layer sigma with the chosen format (:func:`gradstats.plots.fpanalysis.plot_layer_formats`),
        over the sigma ranges where each split is best when ``crossovers`` is given (a
        :func:`~gradstats.fpanalysis.crossover_table` of this width; ``gradstats.figures.crossovers_for(best)``
        makes the one over the layers' sigma range; the study's ``format_ranges`` figure draws both).

        Example:
            >>> b = best_format(8, mu=[-9.0, -12.0], sigma=[1.0, 2.5], names=["fc1", "conv1"])
            >>> len(b.plot().axes)
            1
        """
        from gradstats.plots.fpanalysis import plot_layer_formats

        if crossovers is True:
            raise ValueError("crossovers takes a CrossoverTable (gradstats.figures.crossovers_for(best) makes the "
                             "one over these layers' sigma range), or None for no bands")
        table = crossovers
        return plot_layer_formats(self, crossovers=table, **kw)


def best_format(
    bits: int,
    *,
    mu: P.ArrayLike,
    sigma: P.ArrayLike,
    p0: P.ArrayLike = 0.0,
    candidates: Union[None, str, Sequence[Union[FPFormat, str]]] = None,
    granularity: str | int | Scheme | None = None,
    rounding: str = "nearest",
    criterion: str = "mse",
    power_of_two: bool = True,
    numel: P.ArrayLike | None = None,
    names: Sequence[str] | None = None,
    amax: P.ArrayLike | None = None,
) -> BestFormat:
    """Rank the exponent/mantissa splits of a bit width by predicted error, each at its best scale.

    Vectorised over layers; 100 layers at 8 bits take a few tens of milliseconds.

    Args:
        bits: total width, 3..16.
        mu, sigma, p0: the layers' lognormal parameters (``ln|g|``) and zero fractions.
        candidates: ``None`` (default: every split as an ``fn`` saturating format with subnormals,
            the OCP convention; the analysis primitive, as the crossover table), a preset of formats
            that exist (``"ocp"``, ``"torchao"``, ``"te"``: :data:`CANDIDATE_PRESETS`, at the
            granularity of the block rule), ``"any"`` (every split), a convention name (see
            :func:`candidate_formats`), or a list of formats of ``bits`` bits.
        granularity: None or ``"tensor"`` (one scale per tensor, at its best value), or rank under block
            scaling (:func:`~gradstats.fpanalysis.granularity.granularity_layout`: ``"mx"``, ``"nvfp4"``, an
            int block size with E8M0 scales, or a scheme's layout; NVFP4 with ``numel`` entries per tensor,
            default 2**20).
        rounding, criterion, power_of_two: as in :func:`optimal_scale`.
        names: optional layer names (kept in the result and its table).
        amax: the layers' largest magnitudes, if known (per-tensor scales): rank for each tensor
            given its maximum (and ``numel`` entries; see :func:`~gradstats.fpanalysis.expected_error`).

    Example:
        >>> b = best_format(8, mu=-9.0, sigma=3.0 * 0.6931)
        >>> [(str(c.format), c.log2_scale) for c in b.choices()[:2]]
        [('e4m3fn', 1.0), ('e5m2fn', 1.0)]
    """
    bits = P.check_bits(bits)
    P.check_choice("rounding", rounding, P.PREDICTED_ROUNDINGS)
    P.check_choice("criterion", criterion, P.CRITERIA)
    layout = granularity_layout("tensor" if granularity is None else granularity)
    block_size = layout.block_size
    cands = _resolve(candidates, bits, granularity_of(layout))
    for c in cands:
        P.check_format(c)
    if amax is not None and block_size is not None:
        raise ValueError("amax conditions per-tensor scales; it does not apply with block scales (granularity)")
    shape, arrs = P.lognormal(mu, sigma, p0, *([("amax", amax)] if amax is not None else []))
    mu_, s_, p0_ = arrs[:3]
    am = P.check_amax(arrs[3]) if amax is not None else None
    nn = P.numel_array(numel, shape)
    nz = None if (am is None or nn is None) else (1 - p0_) * nn
    if names is not None:
        names = tuple(str(n) for n in names)
        if len(names) != mu_.size:
            raise ValueError(f"names has {len(names)} entries for {mu_.size} layers")
    k = len(cands)
    errs = np.empty((mu_.size, k))
    scales = np.full((mu_.size, k), np.nan)
    mode = _mode(criterion)
    tamax = (default_tensor_amax(mu_, s_, p0_, 2.0 ** 20 if nn is None else nn)
             if layout.scale_format == E4M3 else None)
    for i, f in enumerate(cands):
        if block_size is None:
            j, e = _optimal(f, mu_, s_, power_of_two=bool(power_of_two), rounding=rounding, criterion=criterion,
                            amax=am, n_nonzero=nz)
            errs[:, i], scales[:, i] = e, np.exp2(j)
        else:
            r = integrals(f, mu_, s_, p0_, np.zeros_like(mu_), rounding=rounding, overflow="saturate", mode=mode,
                          blocks=layout.replace(element=f, rounding=rounding), tensor_amax=tamax,
                          n_nonzero=None if nn is None else (1 - p0_) * nn)
            errs[:, i] = r[:, :4].sum(axis=1)
    order = np.argsort(errs, axis=1, kind="stable")
    rs = lambda a: a.reshape(*shape, k)  # noqa: E731
    return BestFormat(bits=bits, candidates=tuple(cands), errors=rs(errs), scales=rs(scales), order=rs(order),
                      mu=P.out(mu_, shape), sigma=P.out(s_, shape), p0=P.out(p0_, shape), names=names,
                      rounding=rounding, criterion=criterion, blocks=None if block_size is None else layout,
                      power_of_two=bool(power_of_two),
                      amax=None if am is None else P.out(am, shape))
