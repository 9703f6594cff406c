"""Low-precision floating-point formats as values: :class:`FPFormat`, :func:`parse`, :data:`REGISTRY`.

A format has a sign bit (all but ``fnu``), ``exp_bits`` exponent bits and ``man_bits`` mantissa
bits, an exponent ``bias`` (default ``2**(exp_bits-1) - 1``; one larger for ``fnuz``), and a
convention for its special values (``special``):

``"ieee"``
    the all-ones exponent is reserved for inf and NaN (``e5m2``; ml_dtypes ``float8_e4m3``, max 240).
``"fn"``
    finite, no inf.  Formats of 8 bits or more keep one NaN code (all ones, ``e4m3fn``, max 448);
    narrower ones have no NaN either (``float6_e3m2fn`` max 28, ``float6_e2m3fn`` 7.5, ``float4_e2m1fn`` 6).
``"fnuz"``
    finite, no negative zero: the code of -0 is the only NaN; bias one larger by default.
``"fnu"``
    finite and unsigned (no sign bit, so ``exp_bits + man_bits`` bits); the all-ones code is the only
    NaN. With ``man_bits == 0`` exponent code 0 is a normal value and there is no zero: the E8M0
    scale type of the OCP MX formats (``float8_e8m0fnu``: the powers of two ``2**-127 .. 2**127``).
    With ``man_bits > 0`` exponent code 0 holds zero and the subnormals, as in the signed formats
    (``float8_e5m3fnu``: bias 15, smallest subnormal ``2**-17``, max ``1.75 * 2**16 = 114688``).

Every format must fit in float32 (the quantiser works on float32 bit patterns): at most 8 exponent
and 23 mantissa bits, smallest normal ``>= 2**-126``, largest value ``< 2**128``.

Example:
    >>> from gradstats.formats import FPFormat
    >>> f = FPFormat.parse("fp8_e4m3fn")
    >>> f, f.max, f.min_subnormal
    (FPFormat('e4m3fn'), 448.0, 0.001953125)
    >>> str(FPFormat(3, 2, special="fn")), FPFormat.parse("1-5-2") == FPFormat(5, 2)
    ('e3m2fn', True)
    >>> u = FPFormat.parse("float8_e5m3fnu")
    >>> u.bits, u.max, u.min_subnormal == 2.0 ** -17, u.has_zero, u.signed
    (8, 114688.0, True, True, False)
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

__all__ = ["FPFormat", "parse", "parse_list", "REGISTRY", "SPECIALS", "amax_scale", "ROUNDINGS", "ROUNDING_CODES",
           "PREDICTED_ROUNDINGS", "OVERFLOWS"]

SPECIALS = ("ieee", "fn", "fnuz", "fnu")
#: the rounding modes of quantisation (:func:`gradstats.quantize`), the one list every stage uses
ROUNDINGS = ("nearest", "stochastic", "toward_zero")
#: the integer code of each rounding mode that the kernels (C, Triton) take: its index in :data:`ROUNDINGS`
ROUNDING_CODES = {name: code for code, name in enumerate(ROUNDINGS)}
#: the rounding modes whose error, bias and underflow the analysis predicts (fpanalysis, recommend, what-if)
PREDICTED_ROUNDINGS = ("nearest", "stochastic")
#: what quantisation does with values beyond the format's largest (:func:`gradstats.quantize`)
OVERFLOWS = ("saturate", "nonfinite")
_SUFFIX = {"ieee": "", "fn": "fn", "fnuz": "fnuz", "fnu": "fnu"}


@dataclass(frozen=True)
class FPFormat:
    """A binary floating-point format ``1 + exp_bits + man_bits`` bits wide (see the module doc).

    Args:
        exp_bits: exponent bits ``E >= 1`` (``>= 2`` for ``"ieee"``), at most 8.
        man_bits: mantissa (fraction) bits ``M >= 0``, at most 23.
        bias: exponent bias; ``None`` gives ``2**(E-1) - 1`` (``2**(E-1)`` for ``"fnuz"``).
        special: ``"ieee"``, ``"fn"``, ``"fnuz"`` or ``"fnu"`` (see the module doc).
        subnormals: whether the zero exponent code holds subnormals (``False``: only zero,
            values below the smallest normal round to 0 or to it). Always ``False`` for a
            mantissa-free ``"fnu"`` format, whose exponent code 0 is a normal value.

    Attributes are plain values, so formats compare, hash and print canonically.

    Example:
        >>> f = FPFormat(5, 2)
        >>> f.bits, f.max, f.min_normal, f.epsilon, f.has_inf, str(f)
        (8, 57344.0, 6.103515625e-05, 0.25, True, 'e5m2')
        >>> FPFormat(4, 3, special="fnuz").bias, FPFormat(2, 1, special="fn").values().tolist()[-3:]
        (8, [3.0, 4.0, 6.0])
    """

    exp_bits: int
    man_bits: int
    bias: int | None = field(default=None, kw_only=True)
    special: str = field(default="ieee", kw_only=True)
    subnormals: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        e, m = self.exp_bits, self.man_bits
        for name, v in (("exp_bits", e), ("man_bits", m)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"FPFormat: {name} must be an int, got {v!r}")
        if self.special not in SPECIALS:
            raise ValueError(f"FPFormat: special must be one of {SPECIALS}, got {self.special!r}")
        if e < 1 or m < 0:
            raise ValueError(f"FPFormat: need exp_bits >= 1 and man_bits >= 0, got E={e}, M={m}")
        if e > 8 or m > 23:
            raise ValueError(f"FPFormat: e{e}m{m} is wider than float32 can hold (allowed: exp_bits <= 8, man_bits <= 23)")
        if self.special == "ieee" and e < 2:
            raise ValueError("FPFormat: an 'ieee' format needs exp_bits >= 2 (the all-ones exponent is reserved)")
        if not isinstance(self.subnormals, bool):
            raise ValueError(f"FPFormat: subnormals must be a bool, got {self.subnormals!r}")
        if self._code0_normal:
            object.__setattr__(self, "subnormals", False)  # exponent code 0 is a normal value
        if self.bias is None:
            object.__setattr__(self, "bias", self.default_bias)
        elif isinstance(self.bias, bool) or not isinstance(self.bias, int):
            raise ValueError(f"FPFormat: bias must be an int or None, got {self.bias!r}")
        if self._max_code_value() is None:
            raise ValueError(f"FPFormat: {self} has no positive finite value")
        lo = -127 if self._code0_normal else -126
        if self.emin < lo or self.emax > 127:
            raise ValueError(
                f"FPFormat: {self} has exponents {self.emin}..{self.emax}, wider than float32 can hold "
                f"(allowed: smallest normal exponent >= {lo}, largest <= 127; adjust bias={self.bias})")

    # ------------------------------------------------------------------ derived constants
    @property
    def _code0_normal(self) -> bool:
        """Whether exponent code 0 holds a normal value (mantissa-free ``fnu``: no zero, no subnormals)."""
        return self.special == "fnu" and self.man_bits == 0

    @property
    def default_bias(self) -> int:
        """The bias used when ``bias=None``: ``2**(E-1) - 1``, or ``2**(E-1)`` for ``fnuz``."""
        return 2 ** (self.exp_bits - 1) - (0 if self.special == "fnuz" else 1)

    @property
    def bits(self) -> int:
        """Total width in bits (sign included; ``fnu`` has no sign bit)."""
        return self.exp_bits + self.man_bits + (0 if self.special == "fnu" else 1)

    @property
    def signed(self) -> bool:
        """Whether the format has a sign bit (all but ``fnu``)."""
        return self.special != "fnu"

    @property
    def has_inf(self) -> bool:
        """Whether +-inf are representable (``ieee`` only)."""
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether a NaN code exists (``ieee``, ``fnuz``, ``fnu``; ``fn`` when 8 bits or wider)."""
        return self.special != "fn" or self.bits >= 8

    @property
    def has_negative_zero(self) -> bool:
        """Whether -0 is a value (``ieee`` and ``fn``)."""
        return self.special in ("ieee", "fn")

    @property
    def has_zero(self) -> bool:
        """Whether 0 is a value (all but the mantissa-free ``fnu`` formats such as ``e8m0fnu``)."""
        return not self._code0_normal

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (``1 - bias``; ``-bias`` for mantissa-free ``fnu``)."""
        return -self.bias if self._code0_normal else 1 - self.bias

    def _max_code_value(self) -> tuple[int, int] | None:
        """(exponent code, mantissa code) of the largest finite value, or None if none is finite."""
        top = 2 ** self.exp_bits - 1
        mtop = 2 ** self.man_bits - 1
        if self.special == "ieee":
            code = (top - 1, mtop)
        elif self._nan_is_all_ones:
            code = (top, mtop - 1) if self.man_bits > 0 else (top - 1, 0)
        else:
            code = (top, mtop)
        return code if code[0] >= (0 if self._code0_normal else 1) else None

    @property
    def _nan_is_all_ones(self) -> bool:
        """Whether the all-ones code is the (only) NaN: ``fnu``, and ``fn`` of 8 bits or more."""
        return self.special == "fnu" or (self.special == "fn" and self.has_nan)

    @functools.cached_property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        code = self._max_code_value()
        assert code is not None
        return code[0] - self.bias

    @functools.cached_property
    def max(self) -> float:
        """Largest finite value (computed once per format: the hooks of ``apply`` read it on every call)."""
        ec, mc = self._max_code_value()  # type: ignore[misc]
        return math.ldexp(1.0 + mc / 2 ** self.man_bits, ec - self.bias)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2**emin``."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (``min_normal`` when there are no subnormals)."""
        if self.subnormals and self.man_bits > 0:
            return math.ldexp(1.0, self.emin - self.man_bits)
        return self.min_normal

    @property
    def epsilon(self) -> float:
        """Distance from 1 to the next larger value in the binade of 1, ``2**-man_bits``."""
        return math.ldexp(1.0, -self.man_bits)

    @property
    def standard_name(self) -> str | None:
        """The ml_dtypes-style name (``'float8_e4m3fn'``, ``'bfloat16'``) when the format has one."""
        for name, fmt in REGISTRY.items():
            if fmt == self and ("_" in name or name in ("bfloat16", "float16", "float32")):
                return name
        return None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype holding exactly these values, if torch has one (``e5m2`` -> ``torch.float8_e5m2``)."""
        import torch

        name = self.standard_name
        return getattr(torch, name, None) if name else None

    # ------------------------------------------------------------------ enumeration
    def values(self) -> torch.Tensor:
        """All finite representable values, sorted ascending, as a float64 tensor (formats up to 16 bits).

        Zero appears once (``-0 == 0``); unsigned (``fnu``) formats have no negative values.

        Example:
            >>> FPFormat(2, 1, special="fn").values().tolist()
            [-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
            >>> FPFormat(2, 1, special="fnu").values().tolist()  # unsigned; all ones (6.0 in e2m1fn) is NaN
            [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
        """
        if self.bits > 16:
            raise ValueError(f"values(): {self} has {self.bits} bits; enumeration is for formats up to 16 bits")
        import torch

        e_codes = torch.arange(2 ** self.exp_bits, dtype=torch.float64).repeat_interleave(2 ** self.man_bits)
        m_codes = torch.arange(2 ** self.man_bits, dtype=torch.float64).repeat(2 ** self.exp_bits)
        frac = m_codes / 2 ** self.man_bits
        top, mtop = 2 ** self.exp_bits - 1, 2 ** self.man_bits - 1
        if self._code0_normal:
            pos = torch.ldexp(torch.ones_like(e_codes), (e_codes - self.bias).to(torch.int64))
            keep = e_codes < top
            return pos[keep].sort().values
        normal = torch.ldexp(1.0 + frac, (e_codes - self.bias).to(torch.int64))
        sub = torch.ldexp(frac, torch.full_like(e_codes, self.emin, dtype=torch.int64))
        pos = torch.where(e_codes == 0, sub, normal)
        keep = torch.ones_like(pos, dtype=torch.bool)
        if not self.subnormals:
            keep &= ~((e_codes == 0) & (m_codes > 0))
        if self.special == "ieee":
            keep &= e_codes < top
        elif self._nan_is_all_ones:
            keep &= ~((e_codes == top) & (m_codes == mtop))
        pos = pos[keep]
        if not self.signed:
            return pos.sort().values
        return torch.cat([-pos[pos > 0], pos]).sort().values

    # ------------------------------------------------------------------ names
    def __str__(self) -> str:
        s = f"e{self.exp_bits}m{self.man_bits}"
        if self.bias != self.default_bias:
            s += f"b{self.bias}"
        s += _SUFFIX[self.special]
        if not self.subnormals and self.man_bits > 0:
            s += "_nosub"
        return s

    def __repr__(self) -> str:
        return f"FPFormat({str(self)!r})"

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view: the defining fields plus the derived constants.

        Example:
            >>> FPFormat.parse("e4m3fn").to_dict()["max"]
            448.0
        """
        return {
            "name": str(self), "exp_bits": self.exp_bits, "man_bits": self.man_bits, "bias": self.bias,
            "special": self.special, "subnormals": self.subnormals, "bits": self.bits, "emin": self.emin,
            "emax": self.emax, "max": self.max, "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal, "epsilon": self.epsilon, "has_inf": self.has_inf,
            "has_nan": self.has_nan,
        }

    @classmethod
    def parse(cls, name: "str | FPFormat") -> "FPFormat":
        """Parse a format name; see :func:`parse`.

        Example:
            >>> FPFormat.parse("float6_e3m2fn").max
            28.0
        """
        return parse(name)


def amax_scale(fmt: "FPFormat | str", amax: float) -> float:
    """The largest power of two ``s`` with ``amax * s <= fmt.max`` (1 when ``amax`` is 0 or not
    finite): the scale that maps a tensor's largest magnitude into the format's top binade.

    Example:
        >>> amax_scale("e4m3fn", 3.0)
        128.0
    """
    fmt = parse(fmt)
    a = float(amax)
    if not (math.isfinite(a) and a > 0):
        return 1.0
    k = math.floor(math.log2(fmt.max / a))
    if math.ldexp(a, k) > fmt.max:  # guard the rounding of log2
        k -= 1
    return math.ldexp(1.0, max(min(k, 127), -126))


_CORE = re.compile(r"^e(\d+)m(\d+)(?:b(\d+))?(fnuz|fnu|fn)?(_nosub)?$")
_WIDTH = re.compile(r"^(?:fp|float)(\d+)_(.+)$")
_SEM = re.compile(r"^1-(\d+)-(\d+)$")


def parse(name: "str | FPFormat") -> FPFormat:
    """A format from its name.

    Accepted: canonical names (``"e5m2"``, ``"e4m3fn"``, ``"e4m3b11fnuz"``, ``"e3m3_nosub"``), the same
    with a width prefix (``"fp8_e4m3fn"``, ``"float6_e3m2fn"``; the width must match), sign-exponent-mantissa
    triples (``"1-4-3"``, an ``ieee`` format), every ml_dtypes float type (``"float8_e8m0fnu"``), and the
    aliases ``bf16``/``bfloat16``, ``fp16``/``float16``/``half``, ``fp32``/``float32``, ``tf32``.
    An :class:`FPFormat` is returned unchanged.

    Example:
        >>> parse("1-4-3"), parse("bf16"), parse("float8_e4m3b11fnuz").bias
        (FPFormat('e4m3'), FPFormat('e8m7'), 11)
    """
    if isinstance(name, FPFormat):
        return name
    if not isinstance(name, str):
        raise ValueError(f"format: expected an FPFormat or a name such as 'e4m3fn', got {type(name).__name__}")
    return _parse_str(name)


def parse_list(formats: Any) -> list[FPFormat]:
    """Formats from a comma-separated string (``"e4m3fn,e5m2"``), an iterable of names or formats,
    one format, or None (no formats).

    Example:
        >>> [str(f) for f in parse_list("e4m3fn, e5m2")], parse_list(None)
        (['e4m3fn', 'e5m2'], [])
    """
    if formats is None:
        return []
    if isinstance(formats, (str, FPFormat)):
        formats = [p.strip() for p in formats.split(",") if p.strip()] if isinstance(formats, str) else [formats]
    return [parse(f) for f in formats]


@functools.lru_cache(maxsize=256)
def _parse_str(name: str) -> FPFormat:
    key = name.strip().lower()
    if key in REGISTRY:
        return REGISTRY[key]
    mt = _SEM.match(key)
    if mt:
        return FPFormat(int(mt.group(1)), int(mt.group(2)))
    width = None
    mw = _WIDTH.match(key)
    if mw:
        width, key = int(mw.group(1)), mw.group(2)
    mc = _CORE.match(key)
    if mc:
        e, m = int(mc.group(1)), int(mc.group(2))
        special = mc.group(4) or "ieee"
        bias = int(mc.group(3)) if mc.group(3) is not None else None
        fmt = FPFormat(e, m, bias=bias, special=special, subnormals=mc.group(5) is None)
        if width is not None and width != fmt.bits:
            raise ValueError(f"format {name!r}: the prefix says {width} bits but {fmt} has {fmt.bits}")
        return fmt
    raise ValueError(
        f"unknown format {name!r}: expected 'eXmY' with optional 'bNN' bias and 'fn'/'fnuz'/'fnu' suffix "
        f"(e.g. 'e4m3fn', 'fp8_e5m2', 'float6_e3m2fn'), a triple like '1-4-3', or one of {sorted(REGISTRY)}")


def _build_registry() -> Mapping[str, FPFormat]:
    reg: dict[str, FPFormat] = {
        # every float type of ml_dtypes, under its own name (parameters hard-coded here)
        "bfloat16": FPFormat(8, 7),
        "float8_e3m4": FPFormat(3, 4),
        "float8_e4m3": FPFormat(4, 3),
        "float8_e4m3fn": FPFormat(4, 3, special="fn"),
        "float8_e4m3fnuz": FPFormat(4, 3, special="fnuz"),
        "float8_e4m3b11fnuz": FPFormat(4, 3, bias=11, special="fnuz"),
        "float8_e5m2": FPFormat(5, 2),
        "float8_e5m2fnuz": FPFormat(5, 2, special="fnuz"),
        "float8_e5m3fnu": FPFormat(5, 3, special="fnu"),
        "float8_e8m0fnu": FPFormat(8, 0, special="fnu"),
        "float6_e2m3fn": FPFormat(2, 3, special="fn"),
        "float6_e3m2fn": FPFormat(3, 2, special="fn"),
        "float4_e2m1fn": FPFormat(2, 1, special="fn"),
        # IEEE and friends
        "float16": FPFormat(5, 10),
        "float32": FPFormat(8, 23),
    }
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "single": "float32"}
    for a, t in aliases.items():
        reg[a] = reg[t]
    reg["tf32"] = FPFormat(8, 10)
    return MappingProxyType(reg)


#: Named formats: every ml_dtypes float type by its ml_dtypes name, plus bf16/fp16/fp32/tf32 aliases.
REGISTRY: Mapping[str, FPFormat] = _build_registry()
