"""FPFormat: parameters, derived constants against ml_dtypes, enumeration, names, parsing, errors."""
from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import gradstats
from gradstats.formats import REGISTRY, FPFormat, parse

# many mid-sized tensor ops: run single-threaded (see conftest.one_intraop_thread)
pytestmark = pytest.mark.usefixtures("one_intraop_thread")

# ---------------------------------------------------------------- coverage of ml_dtypes' types
# The tests below compare every ml_dtypes type that gradstats knows (its REGISTRY names written the
# ml_dtypes way) with ml_dtypes, and fail on any disagreement. A type that a later ml_dtypes release
# adds is not a failure: it is reported (MLDtypesCoverageWarning) until it is added to the REGISTRY
# (with these tests) or to OUT_OF_SCOPE below.

#: the ml_dtypes types gradstats supports: every REGISTRY name in ml_dtypes' spelling
ML_NAMES = sorted(n for n in REGISTRY if n == "bfloat16" or n.startswith(("float4_", "float6_", "float8_")))

#: ml_dtypes types that are deliberately not formats of gradstats, with the reason
OUT_OF_SCOPE = {
    **{n: "integer type: gradstats models floating-point formats only"
       for n in ("int1", "int2", "int4", "uint1", "uint2", "uint4")},
    "complex32": "complex type (a pair of float16): not a scalar floating-point format",
    "bcomplex32": "complex type (a pair of bfloat16): not a scalar floating-point format",
}


class MLDtypesCoverageWarning(UserWarning):
    """An ml_dtypes type that gradstats neither supports nor lists as out of scope."""


def ml_dtypes_types(module=ml_dtypes) -> dict[str, type]:
    """Every scalar type ``module`` exports (public names of numpy scalar type classes)."""
    out = {}
    for name in dir(module):
        t = getattr(module, name)
        if not name.startswith("_") and isinstance(t, type) and issubclass(t, np.generic):
            out[name] = t
    return out


def report_unknown(types, version: str) -> list[str]:
    """Names in ``types`` neither in ML_NAMES nor in OUT_OF_SCOPE, reported by a warning (never an error)."""
    unknown = sorted(set(types) - set(ML_NAMES) - set(OUT_OF_SCOPE))
    if unknown:
        warnings.warn(
            f"ml_dtypes {version} has types gradstats does not know: {unknown}. Add each to "
            "gradstats.formats.REGISTRY (the tests of tests/test_formats.py then compare it with "
            "ml_dtypes) or to OUT_OF_SCOPE in tests/test_formats.py with the reason.",
            MLDtypesCoverageWarning, stacklevel=2)
    return unknown


def ml_type(name: str) -> type:
    """The ml_dtypes type ``name``; the test is skipped when the installed ml_dtypes predates it."""
    t = getattr(ml_dtypes, name, None)
    if t is None:
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name} (added in a later release)")
    return t


def test_every_ml_dtypes_type_is_supported_out_of_scope_or_reported():
    types = ml_dtypes_types()
    assert len(ML_NAMES) >= 13 and "float8_e5m3fnu" in ML_NAMES and "float8_e8m0fnu" in ML_NAMES
    assert len(set(types) & set(ML_NAMES)) >= 6  # the enumeration works (ml_dtypes 0.4, the oldest allowed, has 6)
    for name in ML_NAMES:  # what the REGISTRY claims to be an ml_dtypes type is one, if ml_dtypes has it
        if name in types:
            assert ml_dtypes.finfo(types[name]).bits == REGISTRY[name].bits, name
    unknown = report_unknown(types, ml_dtypes.__version__)  # a warning, not a failure
    assert not set(unknown) & set(ML_NAMES)


def test_out_of_scope_types_are_not_formats():
    """The deliberately unsupported ml_dtypes types: each has a reason, none is a REGISTRY format."""
    assert not set(OUT_OF_SCOPE) & set(REGISTRY)
    for name, reason in OUT_OF_SCOPE.items():
        assert reason.strip()
        with pytest.raises(ValueError, match="unknown format"):
            parse(name)
    types = ml_dtypes_types()
    for name in set(OUT_OF_SCOPE) & set(types):
        t = types[name]
        if "integer" in OUT_OF_SCOPE[name]:
            assert ml_dtypes.iinfo(t).bits <= 8, name
        else:
            assert "complex" in name, name


def test_unknown_ml_dtypes_types_are_reported_not_failed():
    """A type of a future ml_dtypes that gradstats does not know gives a warning naming it."""
    class FakeModule:  # an ml_dtypes release with one more float type and one more int type
        pass

    for name, t in ml_dtypes_types().items():
        if name in ML_NAMES or name in OUT_OF_SCOPE:
            setattr(FakeModule, name, t)
    FakeModule.float8_e6m1fnu = type("float8_e6m1fnu", (np.generic,), {})
    FakeModule.int3 = type("int3", (np.generic,), {})
    types = ml_dtypes_types(FakeModule)
    with pytest.warns(MLDtypesCoverageWarning, match=r"float8_e6m1fnu.*int3"):
        assert report_unknown(types, "9.9") == ["float8_e6m1fnu", "int3"]
    known_only = {n: t for n, t in types.items() if n in ML_NAMES or n in OUT_OF_SCOPE}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert report_unknown(known_only, "9.9") == []


@pytest.mark.parametrize("name", ML_NAMES)
def test_constants_match_ml_dtypes(name):
    fmt = REGISTRY[name]
    fi = ml_dtypes.finfo(ml_type(name))
    assert fmt.bits == fi.bits
    assert fmt.man_bits == fi.nmant
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.tiny)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.epsilon == float(fi.eps)
    assert fmt.standard_name == name
    assert parse(name) == fmt and parse(str(fmt)) == fmt


@pytest.mark.parametrize("name", [n for n in ML_NAMES if n != "bfloat16"])
def test_values_enumerate_ml_dtypes_codes(name):
    """values() equals the finite values of all 2**bits codes of the ml_dtypes type."""
    t = ml_type(name)
    fmt = REGISTRY[name]
    bits = fmt.bits
    codes = np.arange(2 ** bits, dtype=np.uint8)
    vals = codes.view(t).astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals)])
    ours = fmt.values().numpy()
    np.testing.assert_array_equal(ours, vals)
    assert ours.dtype == np.float64 and np.all(np.diff(ours) > 0)
    assert fmt.max == ours[-1]
    # specials as ml_dtypes has them
    with np.errstate(invalid="ignore", over="ignore"):
        has_inf = bool(np.isinf(codes.view(t).astype(np.float32)).any())
        has_nan = bool(np.isnan(codes.view(t).astype(np.float32)).any())
    assert fmt.has_inf == has_inf and fmt.has_nan == has_nan


def test_bfloat16_against_torch():
    f = REGISTRY["bfloat16"]
    fi = torch.finfo(torch.bfloat16)
    assert (f.max, f.min_normal, f.epsilon) == (fi.max, fi.tiny, fi.eps)
    assert f.torch_dtype is torch.bfloat16
    assert REGISTRY["float16"].max == torch.finfo(torch.float16).max
    assert REGISTRY["fp32"].max == torch.finfo(torch.float32).max


def test_conventions_from_the_brief():
    assert parse("float8_e4m3").max == 240 and parse("float8_e4m3").has_inf
    assert parse("e4m3fn").max == 448 and parse("e4m3fn").has_nan and not parse("e4m3fn").has_inf
    assert parse("float6_e3m2fn").max == 28 and not parse("float6_e3m2fn").has_nan
    assert parse("float6_e2m3fn").max == 7.5
    assert parse("float4_e2m1fn").max == 6
    assert parse("e4m3fnuz").bias == 8 and parse("e4m3fnuz").max == 240
    assert parse("e5m2fnuz").bias == 16 and not parse("e5m2fnuz").has_negative_zero
    assert parse("e4m3b11fnuz").bias == 11 and parse("e4m3b11fnuz").max == 30
    assert parse("e3m4").max == 15.5 and parse("e3m4").min_normal == 0.25
    e8m0 = parse("float8_e8m0fnu")
    assert (e8m0.min_normal, e8m0.max, e8m0.bits, e8m0.signed) == (2.0 ** -127, 2.0 ** 127, 8, False)
    assert not e8m0.has_zero and not e8m0.subnormals and e8m0.min_subnormal == e8m0.min_normal
    # the 8-bit fn rule: all-ones is NaN at 8 bits, no NaN below
    assert FPFormat(4, 3, special="fn").has_nan and not FPFormat(3, 3, special="fn").has_nan
    assert FPFormat(7, 0, special="fn").max == 2.0 ** 63


def test_fnu_with_mantissa_e5m3fnu():
    """fnu with mantissa bits: unsigned, zero and subnormals in exponent code 0, all ones is NaN."""
    f = parse("float8_e5m3fnu")
    assert f == FPFormat(5, 3, special="fnu") == parse("e5m3fnu") and str(f) == "e5m3fnu"
    assert (f.bits, f.bias, f.emin, f.emax, f.signed) == (8, 15, -14, 16, False)
    assert (f.min_subnormal, f.min_normal, f.max) == (2.0 ** -17, 2.0 ** -14, 1.75 * 2.0 ** 16)
    assert f.has_zero and f.subnormals and f.has_nan and not f.has_inf and not f.has_negative_zero
    assert f.standard_name == "float8_e5m3fnu" and f.to_dict()["max"] == 114688.0
    v = f.values()
    assert v.numel() == 255 and float(v[0]) == 0.0 and bool((v >= 0).all())
    assert float(v[1]) == 2.0 ** -17 and float(v[-1]) == 114688.0
    # without subnormals, and a small one to read by eye
    ns = FPFormat(5, 3, special="fnu", subnormals=False)
    assert str(ns) == "e5m3fnu_nosub" and parse("e5m3fnu_nosub") == ns
    assert ns.min_subnormal == 2.0 ** -14 and ns.values().tolist()[:2] == [0.0, 2.0 ** -14]
    assert FPFormat(2, 1, special="fnu").values().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    # mantissa-free fnu keeps its meaning: code 0 is a normal value, no zero, no subnormals
    assert FPFormat(3, 0, special="fnu").values().tolist() == [2.0 ** k for k in range(-3, 4)]
    assert FPFormat(8, 0, special="fnu", subnormals=True).subnormals is False


def test_arbitrary_format_constants():
    f = FPFormat(3, 3)  # ieee: exponent codes 1..6, bias 3
    assert (f.bias, f.emin, f.emax, f.max) == (3, -2, 3, 15.0)
    assert f.min_subnormal == 2.0 ** -5
    g = FPFormat(3, 3, subnormals=False)
    assert g.min_subnormal == g.min_normal == 0.25
    v = g.values()
    assert v[v > 0].min() == 0.25 and (v == 0).sum() == 1
    h = FPFormat(6, 1)
    assert h.max == 1.5 * 2.0 ** 31 and h.min_subnormal == 2.0 ** -31
    shifted = FPFormat(4, 3, bias=3, special="fn")
    assert shifted.max == 448 * 2 ** 4 and str(shifted) == "e4m3b3fn"


def test_values_small_example_and_limits():
    assert FPFormat(2, 1, special="fn").values().tolist() == [
        -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert FPFormat(5, 10).values().numel() == 2 * (31 * 1024) - 1  # fp16: finite codes, one zero
    assert FPFormat(1, 0, special="fn").values().tolist() == [-2.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="up to 16 bits"):
        FPFormat(8, 23).values()


@pytest.mark.parametrize("text,expect", [
    ("e5m2", FPFormat(5, 2)),
    ("E4M3FN", FPFormat(4, 3, special="fn")),
    ("fp8_e4m3fn", FPFormat(4, 3, special="fn")),
    ("float6_e3m2fn", FPFormat(3, 2, special="fn")),
    ("fp4_e2m1fn", FPFormat(2, 1, special="fn")),
    ("1-4-3", FPFormat(4, 3)),
    ("1-5-2", FPFormat(5, 2)),
    ("bf16", FPFormat(8, 7)),
    ("bfloat16", FPFormat(8, 7)),
    ("fp16", FPFormat(5, 10)),
    ("half", FPFormat(5, 10)),
    ("fp32", FPFormat(8, 23)),
    ("tf32", FPFormat(8, 10)),
    ("e4m3b11fnuz", FPFormat(4, 3, bias=11, special="fnuz")),
    ("e3m3_nosub", FPFormat(3, 3, subnormals=False)),
    ("e8m0fnu", FPFormat(8, 0, special="fnu")),
    (" e6m1 ", FPFormat(6, 1)),
])
def test_parse(text, expect):
    assert parse(text) == expect
    assert FPFormat.parse(text) == expect
    assert parse(expect) is expect


@pytest.mark.parametrize("fmt", [FPFormat(5, 2), FPFormat(4, 3, special="fn"), FPFormat(3, 3, bias=1),
                                 FPFormat(2, 2, special="fnuz", subnormals=False), FPFormat(8, 0, special="fnu"),
                                 FPFormat(4, 3, bias=8, special="fn"), FPFormat(5, 2, bias=15, special="fnuz"),
                                 FPFormat(5, 3, special="fnu"), FPFormat(4, 2, bias=3, special="fnu"),
                                 FPFormat(3, 3, special="fnu", subnormals=False)])
def test_canonical_name_round_trips(fmt):
    assert parse(str(fmt)) == fmt
    assert repr(fmt) == f"FPFormat({str(fmt)!r})"


def test_equality_hash_and_default_bias():
    assert FPFormat(4, 3, special="fn") == FPFormat(4, 3, bias=7, special="fn")
    assert len({FPFormat(5, 2), FPFormat(5, 2, bias=15), parse("e5m2")}) == 1
    assert FPFormat(4, 3, special="fnuz") != FPFormat(4, 3, special="fn")
    with pytest.raises(Exception):
        FPFormat(5, 2).exp_bits = 4  # frozen


def test_to_dict_and_public_name():
    d = parse("e4m3fn").to_dict()
    assert d["name"] == "e4m3fn" and d["max"] == 448.0 and d["has_nan"] and not d["has_inf"]
    assert gradstats.FPFormat is FPFormat
    assert parse("e5m2").torch_dtype is torch.float8_e5m2
    assert parse("e3m3").torch_dtype is None and parse("e3m3").standard_name is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(exp_bits=0, man_bits=3), "exp_bits >= 1"),
    (dict(exp_bits=4, man_bits=-1), "man_bits >= 0"),
    (dict(exp_bits=9, man_bits=3), "wider than float32"),
    (dict(exp_bits=5, man_bits=24), "wider than float32"),
    (dict(exp_bits=8, man_bits=3, special="fn"), "wider than float32"),
    (dict(exp_bits=4, man_bits=3, bias=200), "wider than float32"),
    (dict(exp_bits=1, man_bits=3), "at least|>= 2"),
    (dict(exp_bits=4, man_bits=3, special="ocp"), "special must be one of"),
    (dict(exp_bits=8, man_bits=1, special="fnu"), "wider than float32"),
    (dict(exp_bits=5, man_bits=3, special="fnu", subnormals=1), "subnormals must be a bool"),
    (dict(exp_bits=4.0, man_bits=3), "must be an int"),
    (dict(exp_bits=4, man_bits=3, bias=1.5), "bias must be an int"),
    (dict(exp_bits=2, man_bits=1, bias=-127), "wider than float32"),
])
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FPFormat(**kwargs)


@pytest.mark.parametrize("bad", ["e4", "fp8_e3m2", "float6_e4m3fn", "int8", "", "e4m3xyz", "1-4", 3])
def test_parse_errors(bad):
    with pytest.raises(ValueError) as e:
        parse(bad)
    assert "format" in str(e.value)


def test_ldexp_consistency_of_max_for_many_formats():
    """max, min_normal and min_subnormal are the extreme entries of values() for every small format."""
    for e in range(1, 6):
        for m in range(0, 5):
            for special in ("ieee", "fn", "fnuz", "fnu"):
                for sub in (True, False):
                    try:
                        f = FPFormat(e, m, special=special, subnormals=sub)
                    except ValueError:
                        assert special == "ieee" and e == 1 or special == "fn" and e == 1 and m == 0
                        continue
                    v = f.values()
                    pos = v[v > 0]
                    assert float(pos.max()) == f.max, f
                    assert float(pos.min()) == f.min_subnormal, f
                    assert f.min_normal == math.ldexp(1.0, f.emin)
                    assert (v == 0).sum() == int(f.has_zero), f
                    if f.signed:
                        assert torch.equal(v, -v.flip(0))
                    else:
                        assert bool((v >= 0).all()) and f.bits == e + m
                        # every code but the all-ones NaN (and dropped subnormals) is one value
                        assert v.numel() == 2 ** f.bits - 1 - (0 if f.subnormals or m == 0 else 2 ** m - 1), f
