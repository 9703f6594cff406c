"""The rules of a plan: :class:`Rule` (complete, what a module gets) and :class:`PlanEntry` (a layer
pattern and the fields it sets), with their validation and JSON form; the informational values
:class:`Prediction` and :class:`Provenance` are in :mod:`gradstats.plan._values`. See :mod:`gradstats.plan`."""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# rounding modes, block scale formats (MX ``e8m0``, NVFP4 ``e4m3``) and MX scale roundings: the
# value layer's names (those of :func:`gradstats.quantize`), re-exported as the plan's vocabulary
from gradstats.formats import PREDICTED_ROUNDINGS, ROUNDINGS, FPFormat
from gradstats.formats import amax_scale as _amax_scale
from gradstats.plan._values import Prediction, _check_keys, _err, _opt_float
from gradstats.pruning.rules import THRESHOLD_RULES as _THRESHOLD_RULE_REGISTRY
from gradstats.scheme import E8M0, HADAMARD_SIZES, SCALE_FORMATS, SCALE_ROUNDINGS, Scheme, names_scheme, scale_format_of

#: scale rules: a fixed multiplier, the power of two that maps the step's amax to the format's
#: max, or the optimal power of two for the running lognormal mu and sigma
SCALE_RULES = ("fixed", "amax", "lognormal")
#: pruning threshold rules: the names of the registry :data:`gradstats.pruning.THRESHOLD_RULES`
THRESHOLD_RULES: tuple[str, ...] = tuple(_THRESHOLD_RULE_REGISTRY)

_PATTERN_CHARS = re.compile(r"[*?\[]")

class _Inherit:
    """Marker of a rule field an entry does not set (it inherits); a singleton."""

    _instance: "_Inherit | None" = None

    def __new__(cls) -> "_Inherit":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "INHERIT"

    def __reduce__(self) -> str:
        return "INHERIT"


#: the value of a :class:`PlanEntry` field that the entry leaves to the defaults and earlier entries
INHERIT: Any = _Inherit()


# --------------------------------------------------------------------------- checks
def _choice(v: Any, name: str, options: Sequence[str], where: str) -> str:
    if v not in options:
        raise _err(where, f"unknown {name} {v!r}; expected one of {list(options)}")
    return v


def _format(v: Any, where: str) -> FPFormat | None:
    if v is None:
        return None
    try:
        return FPFormat.parse(v)
    except ValueError as exc:
        msg = str(exc)
        raise _err(where, msg if msg.startswith(("unknown format", "format")) else f"format {v!r}: {msg}") from None


def amax_scale(fmt: FPFormat, amax: float) -> float:
    """The largest power of two ``s`` with ``amax * s <= fmt.max`` (1 when ``amax`` is 0 or not finite);
    :func:`gradstats.formats.amax_scale`.

    Example:
        >>> amax_scale(FPFormat.parse("e4m3fn"), 3.0)
        128.0
    """
    return _amax_scale(fmt, amax)


# --------------------------------------------------------------------------- value classes
#: the rules made so far, by their fields as given (with their types: ``True`` is not ``1``): the checked
#: fields and the scheme, so that the same rule made again (a plan resolved once per width, a sparsity set
#: back) costs no second check. Rules are frozen and their schemes immutable: they share them.
_MADE: dict[Any, tuple[dict[str, Any], Any]] = {}
_MADE_MAX = 4096
_RULE_NAMES = ("format", "scale", "scale_value", "scale_shift", "rounding", "block_size", "scale_format",
               "scale_rounding", "sparsity", "threshold_rule", "predicted", "hadamard")


@dataclass(frozen=True)
class Rule:
    """The complete treatment of one layer's neural gradient ``g`` in the backward pass:
    prune (when ``sparsity`` is set), then quantise (when ``format`` is set).

    Attributes:
        format: an :class:`~gradstats.formats.FPFormat` (a name is parsed), or None: no quantisation.
            A :class:`~gradstats.scheme.Scheme` or its name (``"nvfp4"``, ``"mxfp8_e4m3"``) is spelled
            out on construction: its element format, ``block_size``, ``scale_format``,
            ``scale_rounding``, ``hadamard``, a non-default ``rounding``, and ``scale="amax"`` with blocks
            (fields given that contradict it are an error). :attr:`scheme` gives the value back.
        scale: ``"fixed"`` (the multiplier ``scale_value``), ``"amax"`` (per step, the largest power
            of two ``s`` with ``amax * s <= format.max``), or ``"lognormal"`` (the optimal power of
            two for the running mu and sigma, :func:`gradstats.fpanalysis.optimal_scale`). The
            gradient is stored as ``quantize(g * s) / s``.
        scale_value: the multiplier of ``scale="fixed"`` (positive); None for the other rules.
        scale_shift: with ``scale="amax"``, binades of the scale relative to the amax scale
            (``s = amax_scale * 2**scale_shift``; negative leaves headroom, positive lets the largest
            values saturate): how a training-aware recommendation states its scale, relative to each
            step's running maximum, so that what was predicted is what is applied. 0 otherwise.
        rounding: ``"nearest"`` (ties to even), ``"stochastic"`` or ``"toward_zero"``.
        block_size: elements per shared-scale block (MX 32, NVFP4 16) or None (one scale per
            tensor). Block scales come from each block's amax, so it needs ``scale="amax"``.
        scale_format: the block scale type, ``"e8m0"`` (MX, the default with blocks) or
            ``"e4m3"`` (NVFP4); None without blocks.
        scale_rounding: how an ``"e8m0"`` block scale is rounded from the block's amax
            (:data:`gradstats.ops.quantization.SCALE_ROUNDINGS`: ``"floor"``, the OCP rule; ``"ceil"``, ``"even"``,
            ``"rceil"``, torchao's MX training default); None: ``"floor"`` with MX blocks.
        sparsity: target fraction of zeros in ``[0, 1)`` after stochastic pruning, or None.
        threshold_rule: how the pruning threshold is set from the gradient's statistics:
            ``"histogram"`` (the default: model-free, from the histogram of each refresh's
            statistics; the most accurate sort-free rule on real gradients, see
            ``docs/pruning.md``), ``"lognormal"`` (the study's closed form),
            ``"naive_lognormal"``, ``"normal"``, ``"laplace"`` or ``"exact"``.
        predicted: informational :class:`Prediction` (recommendations fill it), or None.
        hadamard: None, or the size (16 in NVFP4 training, the ``"nvfp4_training"`` preset) of a random
            Hadamard transform along the tokens before block quantisation along them (see
            :func:`gradstats.quantize`); needs ``block_size`` when a format is set (inert without one).

    Example:
        >>> r = Rule(format="e4m3", scale="amax", rounding="stochastic", sparsity=0.85)
        >>> r.format.max, r.quantizes, r.prunes, r.is_identity
        (240.0, True, True, False)
        >>> r.scale_for(amax=3.0)   # amax * s <= 240 with s a power of two
        64.0
    """

    format: FPFormat | None = None
    scale: str = "lognormal"
    scale_value: float | None = None
    scale_shift: int = 0
    rounding: str = "nearest"
    block_size: int | None = None
    scale_format: str | None = None
    scale_rounding: str | None = None
    sparsity: float | None = None
    threshold_rule: str = "histogram"
    predicted: Prediction | None = None
    hadamard: int | None = None

    def __post_init__(self) -> None:
        given = tuple(getattr(self, k) for k in _RULE_NAMES)
        key: Any = tuple(zip(map(type, given), given))
        try:
            made = _MADE.get(key)
        except TypeError:            # an unhashable field (a prediction given as a dict): checked, not kept
            made, key = None, None
        if made is not None:         # these very fields were checked before: their checked values and scheme
            _set_fields(self, made[0])
            object.__setattr__(self, "_scheme", made[1])
            return
        _set_fields(self, _check_fields(dict(zip(_RULE_NAMES, given)), ""))
        _check_combination(self, "")
        object.__setattr__(self, "_scheme", None if self.format is None else Scheme(
            self.format, block_size=self.block_size, scale_format=self.scale_format,
            scale_rounding=self.scale_rounding, rounding=self.rounding, hadamard=self.hadamard))
        if key is not None:
            if len(_MADE) >= _MADE_MAX:
                _MADE.clear()
            _MADE[key] = ({k: getattr(self, k) for k in _RULE_NAMES}, self._scheme)

    # -- what it does
    @property
    def quantizes(self) -> bool:
        """Whether the gradient is quantised (a format is set)."""
        return self.format is not None

    @property
    def prunes(self) -> bool:
        """Whether the gradient is pruned (a positive sparsity target is set)."""
        return self.sparsity is not None and self.sparsity > 0.0

    @property
    def is_identity(self) -> bool:
        """True when the rule leaves the gradient unchanged (no format, no pruning)."""
        return not (self.quantizes or self.prunes)

    def describe(self) -> str:
        """The rule in a few words, for logs and tables.

        Example:
            >>> Rule(format="e3m2fn", rounding="stochastic", scale="amax", sparsity=0.85).describe()
            'e3m2fn stochastic amax; sparsity 0.85 (histogram)'
            >>> Rule().describe()
            'full precision; no pruning'
            >>> Rule(format="nvfp4_training").describe()
            'e2m1fn stochastic amax (blocks of 16, e4m3 scales, Hadamard 16); no pruning'
            >>> Rule(format="mxfp4:scale_rounding=rceil").describe()
            'e2m1fn nearest amax (blocks of 32, e8m0 scales rounded up: rceil); no pruning'
        """
        if self.quantizes:
            fmt = f"{self.format} {self.rounding} {self.scale}"
            if self.block_size is not None:
                sr = self.scale_rounding if self.scale_rounding not in (None, "floor") else None
                how = {"rceil": "rounded up: rceil", "ceil": "rounded up: ceil", "even": "rounded: even"}
                scales = f", {self.scale_format or 'e8m0'} scales" + (f" {how[sr]}" if sr else "")
                rht = "" if self.hadamard is None else f", Hadamard {self.hadamard}"
                fmt += f" (blocks of {self.block_size}{scales}{rht})"
        else:
            fmt = "full precision"
        prune = f"sparsity {self.sparsity:g} ({self.threshold_rule})" if self.prunes else "no pruning"
        return f"{fmt}; {prune}"

    @property
    def scheme(self) -> Scheme | None:
        """How the rule quantises, as one :class:`~gradstats.scheme.Scheme` (None without a format): what
        the operators take (``prune_quantize(g, threshold, rule.scheme, scale=rule.scale_for(...))``),
        resolved once, when the rule is made.

        Example:
            >>> Rule(format="nvfp4").scheme, Rule(format="e4m3fn").scheme
            (Scheme('nvfp4'), Scheme('e4m3fn'))
            >>> Rule(format="e2m1fn", scale="amax", block_size=32).scheme.preset
            'mxfp4'
        """
        return self._scheme  # type: ignore[attr-defined,no-any-return]

    def scale_for(self, *, mu: float | None = None, sigma: float | None = None,
                  amax: float | None = None) -> float:
        """The per-tensor scale multiplier ``s`` (``quantize(g * s) / s``) for the current statistics.

        ``"fixed"``: ``scale_value``. ``"amax"``: :func:`amax_scale`, the largest power of two
        with ``amax * s <= format.max`` (1 when ``amax`` is 0 or not finite). ``"lognormal"``: the
        power of two :func:`gradstats.fpanalysis.optimal_scale` finds for ``mu``, ``sigma`` (of
        ``ln|g|``) and the rule's rounding, floored at :func:`amax_scale` when ``amax`` is given: a
        smaller scale leaves the largest value below the format's top binade and, on the data at
        hand, only loses resolution (no value saturates either way). The floor matters when the
        lognormal's upper tail, which dominates the mean squared error for large sigma, reaches
        far beyond the largest value the tensor holds. Block-scaled rules have no per-tensor scale.

        Example:
            >>> Rule(format="e5m2", scale="fixed", scale_value=0.5).scale_for()
            0.5
            >>> Rule(format="e5m2", scale="amax").scale_for(amax=1e-6)
            34359738368.0
            >>> r = Rule(format="e3m2fn")
            >>> r.scale_for(mu=-12.0, sigma=2.5), r.scale_for(mu=-12.0, sigma=2.5, amax=1e-3)
            (1.0, 16384.0)
        """
        if self.format is None:
            raise ValueError("this rule has no format: there is no scale")
        if self.block_size is not None:
            raise ValueError("a block-scaled rule takes its scales from each block's amax "
                             "(gradstats.ops.quantization.quantize with block_size); it has no per-tensor scale")
        if self.scale == "fixed":
            return float(self.scale_value)  # type: ignore[arg-type]
        if self.scale == "amax":
            if amax is None:
                raise ValueError("scale='amax' needs amax= (the largest |g| of the step)")
            s = amax_scale(self.format, amax)
            if self.scale_shift:
                s = math.ldexp(s, self.scale_shift)
                s = min(max(s, 2.0 ** -127), 2.0 ** 127)    # the range quantize accepts
            return s
        if mu is None or sigma is None:
            raise ValueError("scale='lognormal' needs mu= and sigma= (mean and std of ln|g|)")
        from gradstats import fpanalysis

        rounding = self.rounding if self.rounding in PREDICTED_ROUNDINGS else "nearest"
        has_amax = amax is not None and math.isfinite(float(amax)) and float(amax) > 0
        try:
            s = float(fpanalysis.optimal_scale(self.format, mu=mu, sigma=sigma, rounding=rounding).scale)
        except ValueError:
            # the population optimum lies outside float32's powers of two (a very wide layer's tail
            # drags it below 2**-126, or a tiny one above 2**127); the tensor's own maximum decides
            if not has_amax:
                raise
            return amax_scale(self.format, amax)
        if has_amax:
            s = max(s, amax_scale(self.format, amax))
        return s

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (the format as its canonical name)."""
        return _fields_to_json({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def replace(self, **changes: Any) -> "Rule":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


#: the fields of a :class:`Rule`, in order
RULE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Rule))


def _spell_scheme(values: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """``values`` with a scheme given as ``format`` (``"nvfp4"``, a :class:`Scheme`) spelled out as
    the rule fields it sets; a field given that contradicts the scheme is an error."""
    v = values.get("format", INHERIT)
    if not names_scheme(v):
        return values
    try:
        s = Scheme.parse(v)
    except ValueError as exc:
        raise _err(where, str(exc)) from None
    spelled: dict[str, Any] = {"block_size": s.block_size, "scale_format": s.scale_format_name,
                               "scale_rounding": None if s.scale_rounding == "floor" else s.scale_rounding,
                               "hadamard": s.hadamard}
    # fields whose value given here gives way to the scheme's (unset, or the Rule default)
    yields: dict[str, tuple[Any, ...]] = {"block_size": (None,), "scale_format": (None,), "scale_rounding": (None,),
                                          "hadamard": (None,)}
    if s.rounding != "nearest":
        spelled["rounding"], yields["rounding"] = s.rounding, ("nearest",)
    if s.block_size is not None:
        spelled["scale"], yields["scale"] = "amax", ("lognormal",)
    out = {**values, "format": s.element}
    for k, sv in spelled.items():
        given = values.get(k, INHERIT)
        if given is INHERIT or given in yields[k] or given == sv:
            out[k] = sv
        else:
            raise _err(where, f"format {str(s)!r} sets {k} {sv!r}; {k} {given!r} contradicts it: remove {k}, "
                              f"or give the scheme with it (e.g. '{s.element}:block=N:scale=e8m0')")
    return out


def _check_fields(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate the rule fields present in ``values`` one by one; returns them normalised."""
    values = _spell_scheme(values, where)
    out: dict[str, Any] = {}
    for k, v in values.items():
        if v is INHERIT:
            out[k] = v
        elif k == "format":
            out[k] = _format(v, where)
        elif k == "scale":
            out[k] = _choice(v, "scale rule", SCALE_RULES, where)
        elif k == "scale_value":
            out[k] = _opt_float(v, "scale_value", where, lo=0.0, lo_open=True)
            if out[k] is not None and not 2.0 ** -127 <= out[k] <= 2.0 ** 127:
                raise _err(where, f"scale_value must lie in [2**-127, 2**127] (the multipliers quantize accepts: "
                                  f"g * scale must stay a float32), got {out[k]:g}")
        elif k == "scale_shift":
            if isinstance(v, bool) or not isinstance(v, int) or not -64 <= v <= 64:
                raise _err(where, f"scale_shift must be an int number of binades in -64..64, got {v!r}")
            out[k] = v
        elif k == "rounding":
            out[k] = _choice(v, "rounding", ROUNDINGS, where)
        elif k == "block_size":
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise _err(where, f"block_size must be a positive int or null, got {v!r}")
            out[k] = v
        elif k == "scale_format":
            out[k] = None if v is None else _choice(v, "scale_format", SCALE_FORMATS, where)
        elif k == "scale_rounding":
            out[k] = None if v is None else _choice(v, "scale_rounding", SCALE_ROUNDINGS, where)
        elif k == "hadamard":
            if v is not None and (isinstance(v, bool) or v not in HADAMARD_SIZES):
                raise _err(where, f"hadamard must be one of {list(HADAMARD_SIZES)} (NVFP4 training: 16) or null, "
                                  f"got {v!r}")
            out[k] = v
        elif k == "sparsity":
            out[k] = _opt_float(v, "sparsity", where, lo=0.0, hi=1.0, hi_open=True)
        elif k == "threshold_rule":
            out[k] = _choice(v, "threshold_rule", THRESHOLD_RULES, where)
        elif k == "predicted":
            if v is None or isinstance(v, Prediction):
                out[k] = v
            else:
                out[k] = Prediction.from_dict(v, f"{where}: predicted" if where else "predicted")
        else:
            raise _err(where, f"unknown rule field {k!r}; expected one of {list(RULE_FIELDS)}")
    return out


def _check_combination(r: Rule, where: str) -> None:
    if r.scale == "fixed" and r.scale_value is None:
        raise _err(where, "scale 'fixed' needs a scale_value (the positive multiplier s of quantize(g*s)/s)")
    if r.scale != "fixed" and r.scale_value is not None:
        raise _err(where, f"scale_value is used by scale 'fixed' only; scale {r.scale!r} computes "
                          "its own (remove scale_value, or set scale to 'fixed')")
    if r.scale_shift != 0 and (r.scale != "amax" or r.block_size is not None):
        raise _err(where, f"scale_shift {r.scale_shift} shifts the per-tensor amax scale: set scale to "
                          "'amax' without block_size, or remove scale_shift")
    if r.block_size is not None and r.scale != "amax":
        raise _err(where, f"block_size {r.block_size} takes each block's scale from its amax: set "
                          f"scale to 'amax' (got {r.scale!r})")
    if r.scale_format is not None and r.block_size is None:
        raise _err(where, "scale_format applies to block scaling only: set block_size too, or remove it")
    if r.block_size is not None and r.scale_format is None:     # blocks have E8M0 scales unless told
        object.__setattr__(r, "scale_format", "e8m0")
    if r.hadamard is not None and r.format is not None and r.block_size is None:
        raise _err(where, f"hadamard {r.hadamard} rotates the gradient for block-scaled quantisation along the "
                          "tokens: set block_size (NVFP4 16, scale 'amax'), or remove hadamard")
    if r.scale_rounding is not None and (r.scale_format is None or scale_format_of(r.scale_format) != E8M0):
        raise _err(where, f"scale_rounding {r.scale_rounding!r} rounds MX (e8m0) block scales: set block_size "
                          "(and scale_format 'e8m0'), or remove it")



def _set_fields(obj: Any, values: Mapping[str, Any]) -> None:
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def _fields_to_json(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if v is INHERIT:
            continue
        if k == "format":
            v = None if v is None else str(v)
        elif k == "predicted":
            v = None if v is None else v.to_dict()
        out[k] = v
    return out


@dataclass(frozen=True, repr=False)
class PlanEntry:
    """One line of a plan: a layer pattern and the rule fields it sets (see :class:`Rule`).

    Args:
        layer: a module name as in ``model.named_modules()`` (exact), a glob (``*``, ``?``,
            ``[...]``, e.g. ``"layer1.*.conv*"``), or a regular expression prefixed ``"re:"``.
            Patterns match every named module except the root (containers too, as with
            :func:`gradstats.trace`); narrow them with ``types``.
        types: optional module class names; the entry matches only modules that are instances
            of one of them (any class in the module's MRO; e.g. ``"Linear"`` matches ``LazyLinear``).
        format, scale, scale_value, scale_shift, rounding, block_size, scale_format, scale_rounding,
            sparsity, threshold_rule, predicted, hadamard: the fields of :class:`Rule`; those not passed are
            :data:`INHERIT`.

    Example:
        >>> e = PlanEntry("layer*.conv*", format="e3m2fn", sparsity=None)
        >>> e, e.is_pattern, e.overrides
        (PlanEntry('layer*.conv*', format=FPFormat('e3m2fn'), sparsity=None), True, {'format': FPFormat('e3m2fn'), 'sparsity': None})
    """

    layer: str
    types: tuple[str, ...] | None = None
    format: Any = INHERIT
    scale: Any = INHERIT
    scale_value: Any = INHERIT
    scale_shift: Any = INHERIT
    rounding: Any = INHERIT
    block_size: Any = INHERIT
    scale_format: Any = INHERIT
    scale_rounding: Any = INHERIT
    sparsity: Any = INHERIT
    threshold_rule: Any = INHERIT
    predicted: Any = INHERIT
    hadamard: Any = INHERIT

    def __post_init__(self) -> None:
        where = f"layer entry {self.layer!r}" if isinstance(self.layer, str) else "layer entry"
        if not isinstance(self.layer, str) or not self.layer.strip():
            raise _err(where, f"layer must be a non-empty module name, glob or 're:' regex, got {self.layer!r}")
        if self.layer.startswith("re:"):
            try:
                re.compile(self.layer[3:])
            except re.error as exc:
                raise _err(where, f"bad regular expression: {exc}") from None
        if self.types is not None:
            types = (self.types,) if isinstance(self.types, str) else self.types
            if not isinstance(types, (list, tuple)) or not types or \
                    not all(isinstance(t, str) and t for t in types):
                raise _err(where, f"types must be a non-empty list of module class names, got {self.types!r}")
            object.__setattr__(self, "types", tuple(types))
        _set_fields(self, _check_fields(self.overrides, where))

    @property
    def overrides(self) -> dict[str, Any]:
        """The rule fields this entry sets."""
        return {k: getattr(self, k) for k in RULE_FIELDS if getattr(self, k) is not INHERIT}

    @property
    def is_pattern(self) -> bool:
        """Whether ``layer`` is a glob or ``re:`` regex (else an exact module name)."""
        return self.layer.startswith("re:") or bool(_PATTERN_CHARS.search(self.layer))

    def matches(self, name: str, type_names: Sequence[str] | None = None) -> bool:
        """Whether the entry applies to the module ``name`` whose class (and base classes) are
        ``type_names`` (needed only when the entry has ``types``).

        Example:
            >>> PlanEntry("layer1.*").matches("layer1.0.conv1"), PlanEntry("re:fc\\\\d").matches("fc2")
            (True, True)
        """
        if self.layer.startswith("re:"):
            ok = name != "" and re.fullmatch(self.layer[3:], name) is not None
        elif self.is_pattern:
            ok = name != "" and fnmatch.fnmatchcase(name, self.layer)
        else:
            ok = name == self.layer
        if ok and self.types is not None:
            if type_names is None:
                raise ValueError(f"layer entry {self.layer!r} selects module types {list(self.types)}: "
                                 "resolve the plan against a model, a run, or a mapping name -> class name")
            ok = any(t in self.types for t in type_names)
        return ok

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``layer``, ``types`` when set, and the fields the entry sets."""
        d: dict[str, Any] = {"layer": self.layer}
        if self.types is not None:
            d["types"] = list(self.types)
        d.update(_fields_to_json(self.overrides))
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "layer entry") -> "PlanEntry":
        """From a dict such as :meth:`to_dict` gives; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise _err(where, f"expected an object with a 'layer' key, got {type(d).__name__}")
        _check_keys(d, ("layer", "types", *RULE_FIELDS), where)
        if "layer" not in d:
            raise _err(where, "missing the 'layer' key (a module name, glob or 're:' regex)")
        try:
            return cls(**d)
        except ValueError as exc:
            raise _err(where, str(exc)) from None
        except TypeError as exc:  # pragma: no cover - guarded by _check_keys
            raise _err(where, str(exc)) from None

    def __repr__(self) -> str:
        parts = [repr(self.layer)]
        if self.types is not None:
            parts.append(f"types={self.types!r}")
        parts += [f"{k}={v!r}" for k, v in self.overrides.items()]
        return f"PlanEntry({', '.join(parts)})"


assert RULE_FIELDS == _RULE_NAMES
_DEFAULT_RULE = Rule()
