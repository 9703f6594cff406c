"""A granularity (``"tensor"``, ``"mx"``, ``"nvfp4"``, an int block size) is read in one place, as a
scheme's block layout, by best_format, preset_formats, recommend and both commands."""
from __future__ import annotations

import numpy as np
import pytest

import gradstats
from gradstats import fpanalysis as fa
from gradstats.cli import main
from gradstats.fpanalysis.granularity import GRANULARITIES, granularity_layout, granularity_of
from gradstats.scheme import E4M3, E8M0, PRESETS, Scheme

SAMPLE_RUN = gradstats.zoo.data.data_dir() / "sample-run"


def test_the_names_are_the_layouts_of_the_presets_and_an_int_has_e8m0_scales():
    assert granularity_layout("tensor") == Scheme("float32") and granularity_of(granularity_layout("tensor")) == "tensor"
    for name, preset in (("mx", "mxfp4"), ("mx", "mxfp8_e4m3"), ("nvfp4", "nvfp4")):
        lay = granularity_layout(name)
        assert (lay.block_size, lay.scale_format) == (PRESETS[preset].block_size, PRESETS[preset].scale_format)
        assert lay.replace(element=PRESETS[preset].element) == PRESETS[preset]
        assert granularity_of(preset) == name and granularity_layout(PRESETS[preset]) == lay
    for n in (32, np.int64(32), 16, 64):
        lay = granularity_layout(n)
        assert (lay.block_size, lay.scale_format, lay.scale_format_name) == (int(n), E8M0, "e8m0")
    assert granularity_of(granularity_layout(32)) == "mx"
    assert granularity_of(granularity_layout(16)) is None   # E8M0 blocks of 16 are not NVFP4's layout
    nv = Scheme("float32", block_size=16, scale_format="e4m3")
    assert granularity_of(nv) == "nvfp4" and Scheme("float32", block_size=16, scale_format=E4M3) == granularity_layout("nvfp4")
    assert set(GRANULARITIES) == {"tensor", "mx", "nvfp4"}
    for bad in ("channel", 0, -32, True, 2.5, None):
        with pytest.raises(ValueError, match=r"granularity must be one of \['tensor', 'mx', 'nvfp4'\] or a block "
                                             r"size \(an int N: blocks of N with E8M0 scales\)"):
            granularity_layout(bad)
    with pytest.raises(ValueError, match="needs blocks"):
        Scheme("float32", scale_format="e8m0")


def test_best_format_and_preset_formats_take_the_granularity_of_the_layout():
    # blocks of 32 with E8M0 scales are MX: torchao's MX FP6; E8M0 blocks of 16 are no preset
    # granularity (every granularity's formats), and E4M3 blocks of 16 are NVFP4 (FP4 only)
    assert [str(f) for f in fa.preset_formats("torchao", 6, granularity=32)] == ["e2m3fn", "e3m2fn"]
    assert [str(f) for f in fa.preset_formats("te", 8, granularity=16)] == ["e4m3fn", "e5m2"]
    with pytest.raises(ValueError, match="granularity must be one of"):
        fa.preset_formats("ocp", 8, granularity="channel")
    nv = fa.best_format(4, mu=-9.0, sigma=1.5, candidates="te", granularity="nvfp4")
    assert [str(c) for c in nv.candidates] == ["e2m1fn"]
    mx = fa.best_format(6, mu=-9.0, sigma=1.5, candidates="torchao", granularity=32)
    assert [str(c) for c in mx.candidates] == ["e2m3fn", "e3m2fn"]


def test_the_commands_read_the_granularity_through_the_one_resolver(tmp_path, capsys):
    # a bad granularity is refused while the arguments are read, naming what is accepted
    with pytest.raises(SystemExit):
        main(["recommend", str(SAMPLE_RUN), "--granularity", "channel"])
    err = capsys.readouterr().err
    assert "argument --granularity" in err and "['tensor', 'mx', 'nvfp4']" in err
    # what-if's --granularity nvfp4 gives NVFP4 blocks; --block 32 is --granularity mx
    a, b, c = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.csv"
    args = ["what-if", str(SAMPLE_RUN), "--formats", "e2m1fn", "--steps", "0", "--layers", "conv1"]
    assert main([*args, "--granularity", "nvfp4", "-o", str(a)]) == 0
    assert ",16,e4m3," in a.read_text()
    assert main([*args, "--granularity", "mx", "-o", str(b)]) == 0
    assert main([*args, "--block", "32", "-o", str(c)]) == 0
    assert b.read_text() == c.read_text() and ",32,e8m0," in b.read_text()
    assert main([*args, "--granularity", "mx", "--block", "32"]) == 2
    assert "--granularity or --block" in capsys.readouterr().err


def test_the_commands_choices_come_from_the_vocabulary(capsys):
    from gradstats.fpanalysis import OBJECTIVES
    from gradstats.plan import THRESHOLD_RULES
    from gradstats.plan.recommend import FORMAT_RULES

    for flag, names in (("--threshold-rule", THRESHOLD_RULES), ("--objective", OBJECTIVES),
                        ("--format-rule", FORMAT_RULES)):
        with pytest.raises(SystemExit):
            main(["recommend", str(SAMPLE_RUN), flag, "nonsense"])
        err = capsys.readouterr().err
        assert all(repr(n) in err for n in names), (flag, err)
    with pytest.raises(SystemExit):
        main(["what-if", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS) and all(g in out for g in GRANULARITIES)
