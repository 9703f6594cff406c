"""How a tensor is quantised, as one frozen value: :class:`Scheme`, with the named :data:`PRESETS`.

A scheme is an element format (:class:`~gradstats.formats.FPFormat`), a block size (None: one scale
per tensor), the block scale's format (:data:`E8M0`, the OCP MX power of two, or :data:`E4M3`, NVFP4's
``e4m3fn``) and how an E8M0 scale is rounded (:data:`SCALE_ROUNDINGS`), the second-level per-tensor
scale of NVFP4 (:data:`FP32`), the element rounding (:data:`gradstats.formats.ROUNDINGS`), and an optional
random Hadamard transform of the tokens before quantisation (:data:`HADAMARD_SIZES`; see
:mod:`gradstats.ops.hadamard`).

The presets are named as the OCP Microscaling spec (v1.0) and Transformer Engine / torchao name them:

==============  ========  =====  ============  ============  ==========  ========
name            elements  block  block scale   tensor scale  rounding    Hadamard
==============  ========  =====  ============  ============  ==========  ========
mxfp8_e4m3      e4m3fn    32     e8m0          --            nearest     --
mxfp8_e5m2      e5m2      32     e8m0          --            nearest     --
mxfp6_e2m3      e2m3fn    32     e8m0          --            nearest     --
mxfp6_e3m2      e3m2fn    32     e8m0          --            nearest     --
mxfp4           e2m1fn    32     e8m0          --            nearest     --
nvfp4           e2m1fn    16     e4m3fn        float32       nearest     --
nvfp4_training  e2m1fn    16     e4m3fn        float32       stochastic  16
==============  ========  =====  ============  ============  ==========  ========

``nvfp4_training`` is the gradient's treatment in NVIDIA's NVFP4 pretraining recipe ("Pretraining
Large Language Models with NVFP4", 2025; Transformer Engine's ``NVFP4BlockScaling``, torchao's
``NVFP4TrainingConfig``): NVFP4 blocks, stochastic rounding, and a 16-point random Hadamard transform
of the weight-gradient GEMM's operand along the tokens, quantised in blocks along the tokens
(:func:`gradstats.quantize` documents what one emulated gradient means for the two GEMMs).

A scheme's text form is a preset or format name followed by ``:key=value`` changes (``block``,
``scale``, ``scale_rounding``, ``rounding``, ``hadamard``); ``str()`` gives it and :meth:`Scheme.parse`
reads it back.

Example:
    >>> from gradstats.scheme import Scheme
    >>> s = Scheme.parse("nvfp4")
    >>> str(s.element), s.block_size, str(s.scale_format), str(s.tensor_scale)
    ('e2m1fn', 16, 'e4m3fn', 'e8m23')
    >>> str(Scheme.parse("mxfp8_e4m3:scale_rounding=rceil")), str(Scheme("e4m3fn", block_size=64))
    ('mxfp8_e4m3:scale_rounding=rceil', 'e4m3fn:block=64:scale=e8m0')
    >>> Scheme.parse(str(s)) == s, Scheme.parse("e5m2") == Scheme("e5m2")
    (True, True)
    >>> str(Scheme.parse("nvfp4:rounding=stochastic:hadamard=16")), str(Scheme.parse("nvfp4_training:rounding=nearest"))
    ('nvfp4_training', 'nvfp4:hadamard=16')
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Union

from gradstats.formats import REGISTRY, ROUNDINGS, FPFormat, parse

__all__ = ["Scheme", "PRESETS", "SCALE_FORMATS", "SCALE_ROUNDINGS", "HADAMARD_SIZES", "E8M0", "E4M3", "FP32",
           "scale_format_of", "names_scheme"]

#: the OCP MX block scale type: unsigned powers of two ``2**-127 .. 2**127`` (``float8_e8m0fnu``)
E8M0: FPFormat = REGISTRY["float8_e8m0fnu"]
#: NVFP4's block scale type (``float8_e4m3fn``, max 448)
E4M3: FPFormat = REGISTRY["float8_e4m3fn"]
#: NVFP4's second-level per-tensor scale (float32)
FP32: FPFormat = REGISTRY["float32"]
#: the block scale formats by their short names (the ``scale_format=`` values of :func:`gradstats.quantize`)
_SCALE_FORMAT_OF: Mapping[str, FPFormat] = MappingProxyType({"e8m0": E8M0, "e4m3": E4M3})
#: the names of the block scale formats: MX ``"e8m0"``, NVFP4 ``"e4m3"``
SCALE_FORMATS: tuple[str, ...] = tuple(_SCALE_FORMAT_OF)
#: how an E8M0 block scale is rounded from the block's largest magnitude ``amax`` (OCP MX and
#: torchao's ``ScaleCalculationMode``): ``"floor"`` ``2**(floor(log2 amax) - emax)`` (the OCP
#: rule; large values of a block may saturate), ``"ceil"`` ``2**(ceil(log2 amax) - emax)``,
#: ``"even"`` ``amax`` first rounded to the element's mantissa width (half up), then floor, and
#: ``"rceil"`` ``2**ceil(log2(amax / fmt.max))`` (no element saturates; torchao's MX training
#: default, NVIDIA's cuBLAS rule). An E4M3 scale is rounded to nearest (no choice).
SCALE_ROUNDINGS: tuple[str, ...] = ("floor", "ceil", "even", "rceil")
#: the sizes of a random Hadamard transform (:mod:`gradstats.ops.hadamard`): powers of two; the recipe uses 16
HADAMARD_SIZES: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)


def check_hadamard(hadamard: int | None, block_size: int | None, what: str = "quantize") -> None:
    """Raise a ValueError unless ``hadamard`` is None or a size of :data:`HADAMARD_SIZES` with blocks.

    Example:
        >>> check_hadamard(16, 16)
    """
    if hadamard is None:
        return
    if isinstance(hadamard, bool) or hadamard not in HADAMARD_SIZES:
        raise ValueError(f"{what}: hadamard must be one of {HADAMARD_SIZES} (NVFP4 training uses 16) or None, "
                         f"got {hadamard!r}")
    if block_size is None:
        raise ValueError(f"{what}: a Hadamard transform feeds block-scaled quantisation along the tokens: set "
                         "block_size (NVFP4 uses 16), or remove hadamard")


_KEYS = ("block", "scale", "scale_rounding", "rounding", "hadamard")


def scale_format_of(v: Union[str, FPFormat]) -> FPFormat:
    """The block scale format a name or format stands for: :data:`E8M0` or :data:`E4M3`.

    Accepts the short names of :data:`SCALE_FORMATS` and any spelling :func:`gradstats.formats.parse`
    reads as one of the two (``"e8m0fnu"``, ``"float8_e4m3fn"``).

    Example:
        >>> scale_format_of("e8m0") == E8M0, scale_format_of("float8_e4m3fn") == E4M3
        (True, True)
    """
    if isinstance(v, str) and v.strip().lower() in _SCALE_FORMAT_OF:
        return _SCALE_FORMAT_OF[v.strip().lower()]
    try:
        f = parse(v)
    except ValueError:
        f = None
    if f not in (E8M0, E4M3):
        raise ValueError(f"scale format {v!r} is not one the quantiser computes: use 'e8m0' (MX power-of-two "
                         "scales) or 'e4m3' (NVFP4: e4m3fn scales times a float32 tensor scale)")
    return f


def _scale_name(f: FPFormat | None) -> str | None:
    return None if f is None else ("e8m0" if f == E8M0 else "e4m3")


@dataclass(frozen=True)
class Scheme:
    """How a tensor is quantised (see the module doc); validated and normalised on construction.

    Args:
        element: the element format (an :class:`FPFormat` or a name).
        block_size: elements per shared-scale block (MX 32, NVFP4 16), or None: one scale per tensor.
        scale_format: the block scale's format, :data:`E8M0` (default with blocks) or :data:`E4M3`
            (a name of :data:`SCALE_FORMATS` is accepted); None without blocks.
        scale_rounding: how an E8M0 scale is rounded (:data:`SCALE_ROUNDINGS`, default ``"floor"``,
            the OCP rule); None for E4M3 scales (rounded to nearest) and without blocks.
        tensor_scale: the second-level per-tensor scale's format: :data:`FP32` with E4M3 block
            scales (set by default, as NVFP4 has it), None otherwise.
        rounding: element rounding (:data:`gradstats.formats.ROUNDINGS`).
        hadamard: None, or the size ``n`` of a random Hadamard transform (:data:`HADAMARD_SIZES`; NVFP4
            training uses 16) applied along the tokens, in groups of ``n``, before block-scaled
            quantisation along the tokens (the weight-gradient GEMM's operand), and undone after it
            (:mod:`gradstats.ops.hadamard`). Needs blocks.

    Example:
        >>> s = Scheme("e2m1fn", block_size=16, scale_format="e4m3")
        >>> s == Scheme.parse("nvfp4"), s.preset, s.scale_format_name
        (True, 'nvfp4', 'e4m3')
        >>> Scheme("e4m3fn", scale_format="e8m0")
        Traceback (most recent call last):
        ...
        ValueError: Scheme: a block scale format needs blocks: set block_size (MX uses 32, NVFP4 16), or remove scale_format
    """

    element: FPFormat
    block_size: int | None = None
    scale_format: FPFormat | None = None
    scale_rounding: str | None = None
    tensor_scale: FPFormat | None = None
    rounding: str = "nearest"
    hadamard: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("element", parse(self.element))
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"Scheme: block_size must be a positive int (MX uses 32, NVFP4 16) or None, got {b!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"Scheme: rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        h = self.hadamard
        if h is not None and (isinstance(h, bool) or h not in HADAMARD_SIZES):
            raise ValueError(f"Scheme: hadamard must be one of {HADAMARD_SIZES} (the recipe's 16) or None, got {h!r}")
        if b is None and h is not None:
            raise ValueError("Scheme: a Hadamard transform feeds block-scaled quantisation: set block_size (NVFP4 "
                             "uses 16), or remove hadamard")
        if b is None:
            for k in ("scale_format", "scale_rounding", "tensor_scale"):
                if getattr(self, k) is not None:
                    raise ValueError(f"Scheme: a block {k.replace('_format', ' format')} needs blocks: set block_size "
                                     f"(MX uses 32, NVFP4 16), or remove {k}")
            return
        sf = E8M0 if self.scale_format is None else scale_format_of(self.scale_format)
        set_("scale_format", sf)
        if sf == E8M0:
            sr = "floor" if self.scale_rounding is None else self.scale_rounding
            if sr not in SCALE_ROUNDINGS:
                raise ValueError(f"Scheme: scale_rounding must be one of {SCALE_ROUNDINGS}, got {sr!r}")
            set_("scale_rounding", sr)
            if self.tensor_scale is not None:
                raise ValueError("Scheme: E8M0 (MX) block scales have no second-level tensor scale: remove "
                                 "tensor_scale, or use scale_format='e4m3' (NVFP4)")
        else:
            if self.scale_rounding is not None:
                raise ValueError(f"Scheme: scale_rounding {self.scale_rounding!r} rounds E8M0 (MX) scales; E4M3 "
                                 "scales are rounded to nearest: remove scale_rounding, or use scale_format='e8m0'")
            ts = FP32 if self.tensor_scale is None else parse(self.tensor_scale)
            if ts != FP32:
                raise ValueError(f"Scheme: the tensor scale of E4M3 block scales is float32 (as NVFP4's), got "
                                 f"{ts}: remove tensor_scale or set it to 'float32'")
            set_("tensor_scale", ts)

    # ------------------------------------------------------------------ views
    @property
    def scale_format_name(self) -> str | None:
        """The short name of the block scale format (``"e8m0"``, ``"e4m3"``), None without blocks."""
        return _scale_name(self.scale_format)

    @property
    def bits_per_value(self) -> float:
        """The storage a value takes, in bits: the element's width plus its share of the block
        scale (the per-tensor FP32 scale of NVFP4 is not counted: one per tensor).

        Example:
            >>> Scheme.parse("nvfp4").bits_per_value, Scheme.parse("mxfp4").bits_per_value, Scheme("e4m3fn").bits_per_value
            (4.5, 4.25, 8.0)
        """
        extra = self.scale_format.bits / self.block_size if self.block_size is not None else 0.0
        return float(self.element.bits + extra)

    @property
    def preset(self) -> str | None:
        """The name of the preset this scheme is (:data:`PRESETS`), or None.

        Example:
            >>> Scheme("e4m3fn", block_size=32).preset, Scheme("e4m3fn").preset
            ('mxfp8_e4m3', None)
        """
        for name, p in PRESETS.items():
            if p == self:
                return name
        return None

    @property
    def layout(self) -> "Scheme":
        """The scheme without its rounding choices (the elements' rounding, an E8M0 scale's
        rounding): what another stack that rounds its own way can be asked for.

        Example:
            >>> Scheme.parse("mxfp8_e4m3:scale_rounding=rceil:rounding=stochastic").layout.preset
            'mxfp8_e4m3'
            >>> str(Scheme.parse("nvfp4_training").layout)      # the transform stays
            'nvfp4:hadamard=16'
        """
        return Scheme(self.element, block_size=self.block_size, scale_format=self.scale_format,
                      tensor_scale=self.tensor_scale, hadamard=self.hadamard)

    @classmethod
    def of(cls, fmt: "str | FPFormat | Scheme", *, rounding: str | None = None, block_size: int | None = None,
           scale_format: "str | FPFormat | None" = None, scale_rounding: str | None = None,
           hadamard: int | None = None, what: str = "Scheme.of") -> "Scheme":
        """The scheme of an operator's arguments, resolved once: the one door of :func:`gradstats.quantize`,
        :func:`gradstats.prune_quantize` and :func:`gradstats.ops.block_scales`.

        ``fmt`` is an :class:`FPFormat` or a format name (one scale per tensor unless ``block_size`` is
        given; then E8M0 scales rounded by the OCP rule unless told otherwise), or a scheme or a scheme's
        name (:meth:`parse`), whose fields the keywords given replace. With a plain format, keywords that
        do not apply are checked and dropped: a scale format or scale rounding without blocks, an E8M0
        scale rounding with E4M3 scales. ``what`` names the caller in the errors.

        Example:
            >>> Scheme.of("e2m1fn", block_size=16, scale_format="e4m3") == PRESETS["nvfp4"]
            True
            >>> str(Scheme.of("mxfp4", scale_rounding="rceil")), str(Scheme.of("e4m3fn", scale_format="e4m3"))
            ('mxfp4:scale_rounding=rceil', 'e4m3fn')
            >>> Scheme.of("e4m3fn", rounding="up", what="quantize")
            Traceback (most recent call last):
            ...
            ValueError: quantize: rounding must be one of ('nearest', 'stochastic', 'toward_zero'), got 'up'
        """
        try:
            return _of(fmt, rounding, block_size, scale_format, scale_rounding, hadamard, what)
        except TypeError:   # an unhashable argument: resolved without the cache (and refused there)
            return _of.__wrapped__(fmt, rounding, block_size, scale_format, scale_rounding, hadamard, what)

    @property
    def block_top_log2(self) -> float:
        """The block-scale rule as the estimators read it: ``log2`` of where a block's largest magnitude
        lands once divided by its decode scale. E8M0 scales (MX, the OCP floor rule
        ``2**(floor(log2 amax) - emax)``) put it in the element's top binade ``[2**emax, 2**(emax + 1))``,
        its mantissa kept (``emax`` is returned); E4M3 scales (NVFP4) map it onto the element's maximum
        (``log2 fmt.max``, up to the scale's own e4m3 rounding). The exact rule on tensors, every E8M0
        rounding included, is :func:`gradstats.ops.block_scales.block_decode_scales`.

        Example:
            >>> Scheme.parse("mxfp4").block_top_log2, round(Scheme.parse("nvfp4").block_top_log2, 4)
            (2.0, 2.585)
        """
        if self.block_size is None:
            raise ValueError(f"scheme {self}: one scale per tensor has no block scale: set block_size")
        return float(self.element.emax) if self.tensor_scale is None else math.log2(self.element.max)

    @property
    def block_scale_floor_log2(self) -> float | None:
        """``log2`` of the ratio of a block's maximum to the tensor's below which NVFP4's E4M3 block scale
        ``e4m3(448 * m / max|x|)`` rounds to zero (half the smallest e4m3 subnormal, relative to 448) and
        flushes the block whole; None for E8M0 scales (they reach ``2**-127``) and without blocks.

        Example:
            >>> Scheme.parse("nvfp4").block_scale_floor_log2, Scheme.parse("mxfp4").block_scale_floor_log2
            (-18.807354922057606, None)
        """
        if self.block_size is None or self.tensor_scale is None:
            return None
        sf = self.scale_format
        return math.log2(sf.min_subnormal) - 1 - math.log2(sf.max)

    @property
    def block_layout(self) -> "Scheme":
        """Where the scheme's scales live and nothing else: its block size and scale formats on float32
        elements, rounded to nearest, without a transform (what a granularity names:
        :func:`gradstats.fpanalysis.granularity.granularity_layout`); ``.replace(element=f)`` puts a
        format in it.

        Example:
            >>> Scheme.parse("mxfp4").block_layout == Scheme.parse("mxfp8_e4m3:rounding=stochastic").block_layout
            True
            >>> str(Scheme.parse("nvfp4_training").block_layout.replace(element="e2m1fn"))
            'nvfp4'
        """
        return Scheme(FP32, block_size=self.block_size, scale_format=self.scale_format, tensor_scale=self.tensor_scale)

    def replace(self, **changes: Any) -> "Scheme":
        """A copy with ``changes``; fields derived from a changed block layout are derived anew.

        Example:
            >>> str(Scheme.parse("nvfp4").replace(scale_format="e8m0"))
            'e2m1fn:block=16:scale=e8m0'
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "block_size" in changes and changes["block_size"] is None:
            d.update(scale_format=None, scale_rounding=None, tensor_scale=None, hadamard=None)
        if "scale_format" in changes:
            d.update(scale_rounding=None, tensor_scale=None)
        d.update(changes)
        return Scheme(**d)

    # ------------------------------------------------------------------ names
    def __str__(self) -> str:
        exact = self.preset
        if exact is not None:
            return exact
        layout = (self.element, self.block_size, self.scale_format, self.tensor_scale)
        base = next((n for n, p in PRESETS.items()
                     if (p.element, p.block_size, p.scale_format, p.tensor_scale) == layout), None)
        parts = [base or str(self.element)]
        if base is None and self.block_size is not None:
            parts += [f"block={self.block_size}", f"scale={self.scale_format_name}"]
        if self.scale_rounding not in (None, "floor"):
            parts.append(f"scale_rounding={self.scale_rounding}")
        if self.rounding != "nearest":
            parts.append(f"rounding={self.rounding}")
        if self.hadamard is not None:
            parts.append(f"hadamard={self.hadamard}")
        return ":".join(parts)

    def __repr__(self) -> str:
        return f"Scheme({str(self)!r})"

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (names, not format objects); :meth:`from_dict` reads it back.

        Example:
            >>> Scheme.parse("nvfp4").to_dict()
            {'name': 'nvfp4', 'element': 'e2m1fn', 'block_size': 16, 'scale_format': 'e4m3', 'scale_rounding': None, 'tensor_scale': 'float32', 'rounding': 'nearest', 'hadamard': None}
        """
        return {"name": str(self), "element": str(self.element), "block_size": self.block_size,
                "scale_format": self.scale_format_name, "scale_rounding": self.scale_rounding,
                "tensor_scale": None if self.tensor_scale is None else "float32", "rounding": self.rounding,
                "hadamard": self.hadamard}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Scheme":
        """The scheme of a :meth:`to_dict` view (``name`` is ignored: the fields say it all).

        Example:
            >>> s = Scheme.parse("mxfp6_e3m2:rounding=stochastic")
            >>> Scheme.from_dict(s.to_dict()) == s
            True
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"Scheme.from_dict: expected a mapping, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields - {"name"}
        if unknown:
            raise ValueError(f"Scheme.from_dict: unknown keys {sorted(unknown)}; expected {sorted(fields)}")
        return cls(**{k: v for k, v in d.items() if k != "name"})

    @classmethod
    def parse(cls, value: "str | FPFormat | Scheme") -> "Scheme":
        """A scheme from a preset name, a format name (one scale per tensor), either followed by
        ``:key=value`` changes (``block=N``, ``scale=e8m0|e4m3``, ``scale_rounding=...``,
        ``rounding=...``, ``hadamard=N|none``), an :class:`FPFormat`, or a scheme (returned unchanged).

        Example:
            >>> Scheme.parse("MXFP4") == Scheme("e2m1fn", block_size=32)
            True
            >>> Scheme.parse("e2m1fn:block=16:scale=e4m3").preset
            'nvfp4'
        """
        if isinstance(value, Scheme):
            return value
        if isinstance(value, FPFormat):
            return cls(value)
        if not isinstance(value, str):
            raise ValueError(f"format: expected an FPFormat, a Scheme or a name such as 'e4m3fn' or 'nvfp4', "
                             f"got {type(value).__name__}")
        head, *mods = [p.strip() for p in value.split(":")]
        key = head.lower()
        if key in PRESETS:
            s = PRESETS[key]
        else:
            try:
                s = cls(parse(head))
            except ValueError as exc:
                raise ValueError(f"{exc}; or a scheme preset ({', '.join(PRESETS)}), either optionally followed "
                                 "by ':block=N', ':scale=e8m0|e4m3', ':scale_rounding=...', ':rounding=...', "
                                 "':hadamard=N'") from None
        changes: dict[str, Any] = {}
        for m in mods:
            k, sep, v = m.partition("=")
            k, v = k.strip(), v.strip()
            if not sep or k not in _KEYS:
                raise ValueError(f"scheme {value!r}: cannot read {m!r}; expected key=value with a key of {_KEYS}")
            if k in ("block", "hadamard"):
                try:
                    changes["block_size" if k == "block" else k] = None if v.lower() == "none" else int(v)
                except ValueError:
                    raise ValueError(f"scheme {value!r}: {k} must be a positive int, got {v!r}") from None
            else:
                changes["scale_format" if k == "scale" else k] = v
        if "scale_format" in changes and changes.get("block_size", s.block_size) is None:
            raise ValueError(f"scheme {value!r}: a scale format needs blocks: add ':block=N' (MX uses 32, NVFP4 16)")
        if changes.get("block_size") is not None and s.block_size is None and "scale_format" not in changes:
            changes["scale_format"] = "e8m0"
        return s.replace(**changes) if changes else s


@functools.lru_cache(maxsize=512, typed=True)
def _of(fmt: Any, rounding: Any, block_size: Any, scale_format: Any, scale_rounding: Any, hadamard: Any,
        what: str) -> Scheme:
    """:meth:`Scheme.of`, cached on its (hashable) arguments: an operator called once per layer and step
    resolves its scheme once."""
    if isinstance(fmt, Scheme) and rounding is None and block_size is None and scale_format is None \
            and scale_rounding is None and hadamard is None:
        return fmt
    if names_scheme(fmt):
        s = Scheme.parse(fmt)
        given = {k: v for k, v in (("rounding", rounding), ("block_size", block_size), ("scale_format", scale_format),
                                   ("scale_rounding", scale_rounding), ("hadamard", hadamard)) if v is not None}
        return s.replace(**given) if given else s
    element = parse(fmt)
    rounding = "nearest" if rounding is None else rounding
    if rounding not in ROUNDINGS:
        raise ValueError(f"{what}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    check_hadamard(hadamard, block_size, what)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"{what}: block_size must be a positive int, got {block_size!r}")
    try:
        sf = E8M0 if scale_format is None else scale_format_of(scale_format)
    except ValueError:
        raise ValueError(f"{what}: scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}") from None
    sr = "floor" if scale_rounding is None else scale_rounding
    if sr not in SCALE_ROUNDINGS:
        raise ValueError(f"{what}: scale_rounding must be one of {SCALE_ROUNDINGS}, got {scale_rounding!r}")
    if block_size is None:
        return Scheme(element, rounding=rounding)
    return Scheme(element, block_size=block_size, scale_format=sf, scale_rounding=sr if sf == E8M0 else None,
                  rounding=rounding, hadamard=hadamard)


def names_scheme(value: Any) -> bool:
    """Whether ``value`` is a scheme beyond a bare format: a :class:`Scheme`, a preset name, or a
    text with ``:`` changes (a format name, an :class:`FPFormat`, anything else: False).

    Example:
        >>> names_scheme("nvfp4"), names_scheme("e4m3fn:block=32"), names_scheme("e4m3fn"), names_scheme(3)
        (True, True, False, False)
    """
    if isinstance(value, Scheme):
        return True
    return isinstance(value, str) and (":" in value or value.strip().lower() in PRESETS)


#: the named schemes (OCP MX v1.0 concrete formats, NVIDIA's NVFP4, and NVFP4 as its pretraining
#: recipe treats gradients), by their library names
PRESETS: Mapping[str, Scheme] = MappingProxyType({
    "mxfp8_e4m3": Scheme(REGISTRY["float8_e4m3fn"], block_size=32),
    "mxfp8_e5m2": Scheme(REGISTRY["float8_e5m2"], block_size=32),
    "mxfp6_e2m3": Scheme(REGISTRY["float6_e2m3fn"], block_size=32),
    "mxfp6_e3m2": Scheme(REGISTRY["float6_e3m2fn"], block_size=32),
    "mxfp4": Scheme(REGISTRY["float4_e2m1fn"], block_size=32),
    "nvfp4": Scheme(REGISTRY["float4_e2m1fn"], block_size=16, scale_format=E4M3),
    "nvfp4_training": Scheme(REGISTRY["float4_e2m1fn"], block_size=16, scale_format=E4M3, rounding="stochastic",
                             hadamard=16),
})
