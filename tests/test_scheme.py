"""A quantisation scheme as one frozen value (gradstats.scheme): presets, text and dict forms,
validation, and that a preset quantises bit for bit as its spelled-out keywords."""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstats
from gradstats.formats import OVERFLOWS, ROUNDINGS, FPFormat
from gradstats.scheme import E4M3, E8M0, FP32, PRESETS, SCALE_FORMATS, SCALE_ROUNDINGS, Scheme

# the OCP MX v1.0 concrete formats and NVFP4, as the spec and the libraries spell them
SPELLED = {
    "mxfp8_e4m3": dict(fmt="e4m3fn", block_size=32, scale_format="e8m0"),
    "mxfp8_e5m2": dict(fmt="e5m2", block_size=32, scale_format="e8m0"),
    "mxfp6_e2m3": dict(fmt="e2m3fn", block_size=32, scale_format="e8m0"),
    "mxfp6_e3m2": dict(fmt="e3m2fn", block_size=32, scale_format="e8m0"),
    "mxfp4": dict(fmt="e2m1fn", block_size=32, scale_format="e8m0"),
    "nvfp4": dict(fmt="e2m1fn", block_size=16, scale_format="e4m3"),
}


def test_the_presets_are_the_ocp_and_nvfp4_ones():
    assert list(PRESETS) == [*SPELLED, "nvfp4_training"]
    for name, kw in SPELLED.items():
        s = Scheme.parse(name)
        assert s.element == FPFormat.parse(kw["fmt"]) and s.block_size == kw["block_size"]
        assert s.scale_format_name == kw["scale_format"] and s.rounding == "nearest"
    nv = Scheme.parse("nvfp4")
    assert (nv.scale_format, nv.tensor_scale, nv.scale_rounding) == (E4M3, FP32, None)
    mx = Scheme.parse("mxfp4")
    assert (mx.scale_format, mx.tensor_scale, mx.scale_rounding) == (E8M0, None, "floor")
    assert E8M0.max == 2.0 ** 127 and not E8M0.has_zero and E4M3.max == 448.0


@pytest.mark.parametrize("name", list(SPELLED))
def test_each_preset_spelling_is_accepted(name):
    s = Scheme.parse(name)
    assert s.preset == name and str(s) == name
    assert Scheme.parse(name.upper()) == s
    assert s == Scheme(SPELLED[name]["fmt"], block_size=SPELLED[name]["block_size"],
                       scale_format=SPELLED[name]["scale_format"])
    assert gradstats.Scheme is Scheme


def test_scheme_is_frozen_and_hashable():
    s = Scheme.parse("nvfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 32  # type: ignore[misc]
    assert len({s, Scheme.parse("e2m1fn:block=16:scale=e4m3"), Scheme.parse("mxfp4")}) == 2


schemes = st.one_of(
    st.builds(lambda f, r: Scheme(f, rounding=r), st.sampled_from(["e4m3fn", "e5m2", "e3m2fn", "e2m1fn", "e8m7"]),
              st.sampled_from(ROUNDINGS)),
    st.builds(lambda f, b, sr, r: Scheme(f, block_size=b, scale_rounding=sr, rounding=r),
              st.sampled_from(["e4m3fn", "e5m2", "e2m3fn", "e3m2fn", "e2m1fn", "e3m4"]),
              st.integers(1, 128), st.sampled_from(SCALE_ROUNDINGS), st.sampled_from(ROUNDINGS)),
    st.builds(lambda f, b, r: Scheme(f, block_size=b, scale_format="e4m3", rounding=r),
              st.sampled_from(["e2m1fn", "e4m3fn", "e3m2fn"]), st.integers(1, 64), st.sampled_from(ROUNDINGS)),
)


@settings(max_examples=200, deadline=None)
@given(schemes)
def test_text_and_dict_forms_round_trip(s):
    assert Scheme.parse(str(s)) == s
    assert Scheme.from_dict(s.to_dict()) == s
    assert s.to_dict()["name"] == str(s)
    assert Scheme.parse(s) is s


def test_text_form_changes_a_preset():
    s = Scheme.parse("mxfp8_e4m3:scale_rounding=rceil:rounding=stochastic")
    assert (s.scale_rounding, s.rounding, s.block_size) == ("rceil", "stochastic", 32)
    assert str(s) == "mxfp8_e4m3:scale_rounding=rceil:rounding=stochastic"
    assert Scheme.parse("e4m3fn:block=32") == PRESETS["mxfp8_e4m3"]
    assert Scheme.parse("nvfp4:scale=e8m0") == Scheme("e2m1fn", block_size=16)
    assert Scheme.parse("mxfp4:block=none") == Scheme("e2m1fn")


@pytest.mark.parametrize("make, match", [
    (lambda: Scheme("e4m3fn", scale_format="e8m0"), "needs blocks: set block_size"),
    (lambda: Scheme("e4m3fn", scale_rounding="rceil"), "needs blocks: set block_size"),
    (lambda: Scheme("e4m3fn", block_size=0), "block_size must be a positive int"),
    (lambda: Scheme("e4m3fn", block_size=True), "block_size must be a positive int"),
    (lambda: Scheme("e4m3fn", block_size=32, scale_format="e5m2"), "use 'e8m0'.*or 'e4m3'"),
    (lambda: Scheme("e2m1fn", block_size=16, scale_format="e4m3", scale_rounding="floor"),
     "E4M3 scales are rounded to nearest: remove scale_rounding"),
    (lambda: Scheme("e2m1fn", block_size=32, tensor_scale="float32"), "remove tensor_scale"),
    (lambda: Scheme("e2m1fn", block_size=16, scale_format="e4m3", tensor_scale="bf16"), "float32"),
    (lambda: Scheme("e4m3fn", block_size=32, scale_rounding="up"), "scale_rounding must be one of"),
    (lambda: Scheme("e4m3fn", rounding="up"), "rounding must be one of"),
    (lambda: Scheme.parse("nvfp5"), "unknown format 'nvfp5'.*nvfp4"),
    (lambda: Scheme.parse("mxfp4:blocks=16"), "expected key=value"),
    (lambda: Scheme.parse("mxfp4:block=x"), "block must be a positive int"),
    (lambda: Scheme.parse("e4m3fn:scale=e8m0"), "add ':block=N'"),
    (lambda: Scheme.parse(3), "expected an FPFormat, a Scheme"),
    (lambda: Scheme.from_dict({"element": "e4m3fn", "bits": 8}), "unknown keys"),
])
def test_bad_combinations_name_the_problem_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_names_are_defined_once():
    from gradstats import formats, scheme
    from gradstats.fpanalysis import _params as P
    from gradstats.ops import fused
    from gradstats.ops import quantization as Q
    from gradstats.plan import _rules

    assert Q.ROUNDINGS is formats.ROUNDINGS and _rules.ROUNDINGS is formats.ROUNDINGS
    assert Q.OVERFLOWS is OVERFLOWS and P.OVERFLOWS is OVERFLOWS
    assert Q.SCALE_FORMATS is SCALE_FORMATS
    assert _rules.SCALE_FORMATS is SCALE_FORMATS and _rules.SCALE_ROUNDINGS is SCALE_ROUNDINGS
    assert Q.SCALE_ROUNDINGS is scheme.SCALE_ROUNDINGS
    assert P.PREDICTED_ROUNDINGS is formats.PREDICTED_ROUNDINGS
    assert list(fused.ROUNDING_CODES) == list(ROUNDINGS) and fused.ROUNDING_CODES["nearest"] == 0


# ----------------------------------------------------------------------------- bit for bit
def _tensor(seed: int, n: int, spread: float, zeros: float) -> torch.Tensor:
    """Lognormal magnitudes over ``spread`` binades (tails to float32 subnormals), random signs,
    a fraction of exact zeros, a partial last block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.randn(n, generator=g) * spread) * torch.sign(torch.randn(n, generator=g))
    x[torch.rand(n, generator=g) < zeros] = 0.0
    x[: min(3, n)] = torch.tensor([1e-40, -3e-39, 2.0 ** -133])[: min(3, n)]    # float32 subnormals
    return x


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(list(SPELLED)), st.integers(0, 2 ** 31), st.integers(1, 300), st.floats(0.5, 40.0),
       st.floats(0.0, 0.5))
def test_preset_quantizes_bit_for_bit_as_spelled_out(name, seed, n, spread, zeros):
    x = _tensor(seed, n, spread, zeros).reshape(1, n)
    a = gradstats.quantize(x, name)
    b = gradstats.quantize(x, **SPELLED[name])
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    sa = gradstats.block_scales(x, name)
    sb = gradstats.block_scales(x, gradstats.Scheme.of(**SPELLED[name]))
    assert torch.equal(sa.view(torch.int32), sb.view(torch.int32))


@pytest.mark.parametrize("name", list(SPELLED))
def test_preset_with_keywords_and_stochastic_rounding(name):
    x = _tensor(7, 4000, 12.0, 0.1).reshape(40, 100)
    kw = {**SPELLED[name], "rounding": "stochastic", "seed": 5, "block_dim": 0}
    a = gradstats.quantize(x, name, rounding="stochastic", seed=5, block_dim=0)
    assert torch.equal(a.view(torch.int32), gradstats.quantize(x, **kw).view(torch.int32))
    s = Scheme.parse(name)
    c = gradstats.quantize(x, s, rounding="stochastic", seed=5, block_dim=0)
    assert torch.equal(c.view(torch.int32), a.view(torch.int32))
    d = gradstats.quantize(x, s.replace(rounding="stochastic"), seed=5, block_dim=0)
    assert torch.equal(d.view(torch.int32), a.view(torch.int32))


def test_keywords_replace_the_scheme_fields():
    x = _tensor(3, 256, 6.0, 0.0)
    a = gradstats.quantize(x, "mxfp8_e4m3", scale_rounding="rceil")
    b = gradstats.quantize(x, "e4m3fn", block_size=32, scale_rounding="rceil")
    assert torch.equal(a, b)
    assert not torch.equal(a, gradstats.quantize(x, "mxfp8_e4m3"))
    a = gradstats.quantize(x, "nvfp4", block_size=32)
    assert torch.equal(a, gradstats.quantize(x, "e2m1fn", block_size=32, scale_format="e4m3"))
    with pytest.raises(ValueError, match="remove scale_rounding"):
        gradstats.quantize(x, "nvfp4", scale_rounding="rceil")
    # a plain format keeps the old defaults: per tensor, nearest
    assert torch.equal(gradstats.quantize(x, "e4m3fn"), gradstats.quantize(x, Scheme("e4m3fn")))


# ----------------------------------------------------------------------------- NVFP4 as the field trains it
def test_the_nvfp4_training_preset_is_the_recipes_gradient():
    """NVFP4 blocks, stochastic rounding and a 16-point Hadamard transform, as one scheme with a text
    form, a dict form and the quantize keywords that spell it out."""
    s = PRESETS["nvfp4_training"]
    assert s.layout.replace(hadamard=None) == PRESETS["nvfp4"]
    assert (s.rounding, s.hadamard, s.tensor_scale, s.preset) == ("stochastic", 16, FP32, "nvfp4_training")
    assert str(s) == "nvfp4_training" and Scheme.parse("NVFP4_TRAINING") == s
    assert Scheme.parse("nvfp4:rounding=stochastic:hadamard=16") == s
    assert Scheme.parse("e2m1fn:block=16:scale=e4m3:rounding=stochastic:hadamard=16") == s
    assert Scheme.from_dict(s.to_dict()) == s and s.to_dict()["hadamard"] == 16
    assert Scheme.of("e2m1fn", rounding="stochastic", block_size=16, scale_format="e4m3", hadamard=16) == s
    near = Scheme.parse("nvfp4_training:rounding=nearest")
    assert str(near) == "nvfp4:hadamard=16" and Scheme.parse(str(near)) == near and near.preset is None
    assert Scheme.parse("nvfp4_training:hadamard=none") == Scheme.parse("nvfp4:rounding=stochastic")
    assert s.replace(block_size=None).hadamard is None        # the transform goes with the blocks
    assert Scheme.from_dict({k: v for k, v in PRESETS["nvfp4"].to_dict().items() if k != "hadamard"}) == PRESETS["nvfp4"]


@pytest.mark.parametrize("make, match", [
    (lambda: Scheme("e2m1fn", hadamard=16), "set block_size"),
    (lambda: Scheme("e2m1fn", block_size=16, scale_format="e4m3", hadamard=12), "hadamard must be one of"),
    (lambda: Scheme("e2m1fn", block_size=16, scale_format="e4m3", hadamard=True), "hadamard must be one of"),
    (lambda: Scheme.parse("nvfp4:hadamard=x"), "hadamard must be a positive int"),
    (lambda: Scheme.parse("e2m1fn:hadamard=16"), "set block_size"),
])
def test_a_bad_hadamard_names_the_problem(make, match):
    with pytest.raises(ValueError, match=match):
        make()


hadamard_schemes = st.builds(
    lambda f, b, sf, r, h: Scheme(f, block_size=b, scale_format=sf, rounding=r, hadamard=h),
    st.sampled_from(["e2m1fn", "e4m3fn", "e3m2fn"]), st.integers(1, 64), st.sampled_from(["e8m0", "e4m3"]),
    st.sampled_from(ROUNDINGS), st.sampled_from([2, 4, 16, 64, 256]))


@settings(max_examples=100, deadline=None)
@given(hadamard_schemes)
def test_hadamard_schemes_round_trip_as_text_and_dict(s):
    assert Scheme.parse(str(s)) == s and Scheme.from_dict(s.to_dict()) == s
    assert s.to_dict()["name"] == str(s) and Scheme.of(str(s)) == s


def test_the_preset_quantizes_as_its_spelled_out_keywords():
    x = _tensor(11, 40 * 48, 8.0, 0.05).reshape(40, 48)
    a = gradstats.quantize(x, "nvfp4_training", seed=9)
    b = gradstats.quantize(x, "e2m1fn", block_size=16, scale_format="e4m3", rounding="stochastic", hadamard=16,
                           seed=9)
    c = gradstats.quantize(x, "nvfp4", rounding="stochastic", hadamard=16, seed=9, orientation="columns")
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(a, c)
    assert not torch.equal(a, gradstats.quantize(x, "nvfp4:rounding=stochastic", seed=9, orientation="columns"))
    with pytest.raises(ValueError, match="use orientation 'columns'"):
        gradstats.quantize(x, "nvfp4_training", orientation="rows")
    with pytest.raises(ValueError, match="set\\s+block_size|set block_size"):
        gradstats.quantize(x, "e2m1fn", hadamard=16)


def test_scheme_of_is_the_operators_one_door():
    """Scheme.of reads what quantize and prune_quantize are given: a scheme's fields replaced by the keywords
    given, a plain format with the defaults (keywords that do not apply checked, then dropped), the errors
    naming the caller; the same arguments give the same scheme (resolved once)."""
    assert Scheme.of("nvfp4", rounding="stochastic", hadamard=16) == PRESETS["nvfp4_training"]
    assert Scheme.of("e2m1fn", block_size=32) == PRESETS["mxfp4"] and Scheme.of(PRESETS["mxfp4"]) is PRESETS["mxfp4"]
    assert Scheme.of(FPFormat.parse("e4m3fn"), scale_format="e4m3", scale_rounding="rceil") == Scheme("e4m3fn")
    assert Scheme.of("e2m1fn", block_size=16, scale_format="e4m3", scale_rounding="ceil") == PRESETS["nvfp4"]
    assert Scheme.of("mxfp4", scale_rounding="rceil").scale_rounding == "rceil"
    assert Scheme.of("e5m2", rounding="stochastic") is Scheme.of("e5m2", rounding="stochastic")
    for kw, match in ((dict(rounding="up"), "quantize: rounding must be one of"),
                      (dict(block_size=0), "quantize: block_size must be a positive int"),
                      (dict(block_size=True), "quantize: block_size must be a positive int"),
                      (dict(scale_format="e5m2"), "quantize: scale_format must be one of"),
                      (dict(block_size=32, scale_rounding="up"), "quantize: scale_rounding must be one of"),
                      (dict(hadamard=16), "quantize: a Hadamard transform .* set block_size"),
                      (dict(block_size=16, hadamard=12), "quantize: hadamard must be one of")):
        with pytest.raises(ValueError, match=match):
            Scheme.of("e2m1fn", what="quantize", **kw)
    with pytest.raises(ValueError, match="rounds E8M0"):
        Scheme.of("nvfp4", scale_rounding="rceil")
    with pytest.raises(ValueError, match="expected an FPFormat"):
        Scheme.of(["e4m3fn"])


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8_e4m3", "mxfp6_e3m2", "nvfp4"])
def test_the_block_scale_rule_puts_a_blocks_maximum_where_the_estimators_say(name):
    """block_decode_scales (the rule on tensors) and Scheme.block_top_log2 (the rule as the flush estimators
    read it) agree: E8M0 puts a block's maximum in the element's top binade, E4M3 at its maximum up to the
    scale's e4m3 rounding; NVFP4 flushes a block whole below block_scale_floor_log2."""
    from gradstats.ops.block_scales import block_decode_scales

    s = Scheme.parse(name)
    amax = torch.exp2(torch.rand(20_000, generator=torch.Generator().manual_seed(1)) * 40 - 20)
    scaled = torch.log2(amax / block_decode_scales(amax, s, tensor_amax=2.0 ** 21))
    top = s.block_top_log2
    if s.tensor_scale is None:
        assert bool(((scaled >= top) & (scaled < top + 1)).all())
    else:
        ratio = torch.log2(amax / 2.0 ** 21)          # the block's maximum relative to the tensor's
        normal = ratio > math.log2(E4M3.min_normal / E4M3.max)                 # the e4m3 scale a normal number
        assert bool((scaled[normal] - top).abs().max() < 0.1)                   # e4m3 steps of at most 2**-3
        floor = s.block_scale_floor_log2
        assert bool(torch.isinf(scaled[ratio < floor - 0.1]).all()) and bool(torch.isfinite(scaled[ratio > floor + 0.1]).all())
