"""what_if: what a format would do to each traced tensor, from the run's statistics alone, checked
against quantising the stored tensors (runs traced with whole tensors kept, samples=None)."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import gradstats
from gradstats.formats import amax_scale, parse
from gradstats.fpanalysis import predict_from_stats, what_if
from gradstats.ops.quantization import block_scales, quantize
from gradstats.scheme import Scheme

FORMATS = ("e4m3fn", "e5m2", "e2m1fn", "e3m2fn")


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    from gradstats.zoo.training import prepare

    path = tmp_path_factory.mktemp("whatif") / "cnn"
    task = prepare("cnn", source="subset", subset=256, test_subset=100)
    with gradstats.trace(task.model, path, sample_every=[0, 3], samples=None, blocks=None) as tr:   # no blocks
        task.run(4, batch_size=64, progress=False, callback=lambda step, loss: tr.step())
    return gradstats.open_run(path)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=96,
                                                                 n_positions=32, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path_factory.mktemp("whatif") / "gpt2"
    with gradstats.trace(model, path, sample_every=[0, 2], samples=None, optimizer=opt, blocks=None):
        for i in range(3):
            ids = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    return gradstats.open_run(path)


def _measure(x: torch.Tensor, fmt: str, rounding: str, block: int | None, max_abs: float,
             scale_format: str = "e8m0", scale: float | None = None) -> dict[str, float]:
    """Quantise the whole tensor ``x`` as what_if assumes; fractions per non-zero entry (stochastic
    rounding: the mean over 4 draws, whose single-draw bias has a standard deviation of up to ~0.008
    on these tensors)."""
    f = parse(fmt)
    gen = torch.Generator().manual_seed(0)
    draws = 4 if rounding == "stochastic" else 1
    if block is not None:
        n = (x.numel() // block) * block
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))[:n]]   # exchangeable
        X = block_scales(x, Scheme.of(f, block_size=block, scale_format=scale_format)).double()
        over = (x.view(-1, block).abs().double() / torch.where(X > 0, X, 1.0)[:, None] > f.max).reshape(-1)
    else:
        s = amax_scale(f, max_abs) if scale is None else scale
        over = (x.abs().double() * s > f.max)
    xd, nz = x.double(), x != 0
    out = {"underflow": 0.0, "overflow": float(over[nz].double().mean()), "rel_mse": 0.0, "bias": 0.0}
    for _ in range(draws):
        if block is None:
            q = quantize(x * s, f, rounding=rounding, overflow="saturate", generator=gen).double() / s
        else:
            q = quantize(x, f, rounding=rounding, block_size=block, scale_format=scale_format, generator=gen).double()
        out["underflow"] += float((q[nz] == 0).double().mean()) / draws
        out["rel_mse"] += float(((q - xd) ** 2).sum() / (xd ** 2).sum()) / draws
        out["bias"] += float((q.abs().sum() - xd.abs().sum()) / xd.abs().sum()) / draws
    return out


def _pairs(run, rounding, block, scale_format="e8m0", formats=FORMATS):
    st = run.stats(kinds=["grad"])
    idx = run.sample_index()
    for _, r in idx[idx.kind == "grad"].iterrows():
        row = st[(st.step == r.step) & (st.layer == r.layer) & (st.call == r.call)].iloc[0].to_dict()
        x = run.samples(r.layer, int(r.step), call=int(r.call))
        assert x.numel() == row["n"]                      # the whole tensor, in order
        for fmt in formats:
            s = fmt if block is None else Scheme.of(fmt, block_size=block, scale_format=scale_format)
            yield (r.layer, int(r.step), fmt), predict_from_stats(row, s, rounding=rounding), \
                _measure(x, fmt, rounding, block, float(row["max_abs"]), scale_format)


# the bounds of docs/fpanalysis.md ("What if"), measured on these runs: (fractions, relative MSE as a
# ratio, bias) for the hidden layers and for the output layer, whose gradient (softmax minus one-hot)
# has a spike of one entry per row that a binade histogram cannot place within its binade.
# Per tensor with round-to-nearest, underflow and overflow are exact (values exactly on a power of
# two aside); stochastic rounding is measured on the mean of 4 draws
BOUNDS = {
    ("nearest", None, "e8m0"): ((1e-5, 0.15, 0.015), (1e-5, 0.40, 0.015)),
    ("stochastic", None, "e8m0"): ((0.015, 0.15, 0.015), (0.015, 0.40, 0.02)),
    ("nearest", 32, "e8m0"): ((0.015, 0.15, 0.015), (0.05, 0.40, 0.015)),
    ("stochastic", 32, "e8m0"): ((0.015, 0.15, 0.015), (0.05, 0.40, 0.015)),
    # NVFP4: the block scale follows the block's largest entry continuously, so where the logits'
    # spike sits within its binade moves the predicted error of the output layer by up to 3.2x
    ("nearest", 16, "e4m3"): ((0.015, 0.15, 0.015), (0.05, 3.5, 0.02)),
    ("stochastic", 16, "e4m3"): ((0.015, 0.15, 0.015), (0.05, 3.5, 0.02)),
}


@pytest.mark.parametrize("rounding, block, scale_format", list(BOUNDS))
@pytest.mark.parametrize("which", ["cnn_run", "gpt2_run"])
def test_predictions_hold_on_the_stored_tensors(request, which, rounding, block, scale_format):
    from gradstats.layers import output_layer

    run = request.getfixturevalue(which)
    logits = output_layer(run)
    checked = 0
    formats = FORMATS if scale_format == "e8m0" else ("e2m1fn", "e3m2fn")     # NVFP4: 4- and 6-bit elements
    for key, p, m in _pairs(run, rounding, block, scale_format, formats):
        d_frac, r_mse, d_bias = BOUNDS[rounding, block, scale_format][key[0] == logits]
        assert abs(p["underflow"] - m["underflow"]) <= d_frac, (key, p, m)
        assert abs(p["overflow"] - m["overflow"]) <= d_frac, (key, p, m)
        if m["rel_mse"] > 1e-12:
            assert abs(p["rel_mse"] / m["rel_mse"] - 1) <= r_mse, (key, p, m)
        assert abs(p["bias"] - m["bias"]) <= d_bias, (key, p, m)
        checked += 1
    assert checked >= 8 * len(formats)


def test_blocks_help_where_the_tensor_is_wide(cnn_run):
    per_tensor = what_if(cnn_run, "e2m1fn", steps=[0])
    blocks = what_if(cnn_run, "e2m1fn", steps=[0], granularity=32)
    assert (blocks["underflow"].to_numpy() <= per_tensor["underflow"].to_numpy() + 1e-9).all()
    assert blocks["log2_scale"].isna().all() and per_tensor["log2_scale"].notna().all()


def test_the_table(cnn_run):
    df = what_if(cnn_run, "e4m3fn,e5m2", layers="conv*", rounding="stochastic")
    assert list(df.columns) == ["step", "layer", "format", "block_size", "scale_format", "rounding", "n", "underflow",
                                "overflow", "rel_mse", "bias", "log2_scale", "orientation", "estimate"]
    assert sorted(df["step"].unique()) == cnn_run.steps and set(df["layer"]) == {"conv1", "conv2"}
    assert len(df) == len(cnn_run.steps) * 2 * 2
    # e5m2 has the wider range: it flushes less and costs more error at 8 bits on these tensors
    w = df.pivot_table(index=["step", "layer"], columns="format", values=["underflow", "rel_mse"])
    assert (w["underflow"]["e5m2"] <= w["underflow"]["e4m3fn"]).all()
    assert gradstats.what_if is what_if


@pytest.mark.parametrize("kw, match", [
    ({"formats": []}, "at least one format"),
    ({"formats": "e4m3fn", "rounding": "down"}, "rounding must be one of"),
    ({"formats": "e4m3fn", "steps": [999]}, "no 'grad' statistics"),
    ({"formats": "e4m3fn", "scale": "lognormal"}, "scale must be 'amax' or a positive number"),
    ({"formats": "e4m3fn", "granularity": 0}, "granularity must be one of"),
])
def test_bad_arguments_are_named(cnn_run, kw, match):
    with pytest.raises(ValueError, match=match):
        what_if(cnn_run, **kw)


def test_the_command_line_and_the_figure(cnn_run, tmp_path, capsys):
    from gradstats.cli import main
    from gradstats.plots.fpanalysis import plot_what_if

    assert main(["what-if", str(cnn_run.path), "--formats", "e4m3fn,e5m2,e2m1fn", "--block", "32",
                 "-o", str(tmp_path / "w.csv")]) == 0
    out = capsys.readouterr().out
    assert "underflow" in out and "e2m1fn" in out
    df = pd.read_csv(tmp_path / "w.csv")
    assert set(df["format"]) == {"e4m3fn", "e5m2", "e2m1fn"} and (df["block_size"] == 32).all()
    fig = plot_what_if(what_if(cnn_run, ["e4m3fn", "e2m1fn"]), value="underflow")
    assert len([a for a in fig.axes if a.get_title()]) == 2
    fig.savefig(tmp_path / "what_if.png")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("which", ["cnn_run", "gpt2_run"])
def test_any_multiplier_holds_on_the_stored_tensors(request, which, rounding):
    """A per-tensor multiplier that is not a power of two (the format's cells then cut the binades at
    other places than at "amax"), against quantising the stored tensors at it: within the bounds of
    stochastic rounding at "amax" (the cell boundaries no longer fall on binade edges)."""
    from gradstats.layers import output_layer

    run = request.getfixturevalue(which)
    logits = output_layer(run)
    st = run.stats(kinds=["grad"])
    idx = run.sample_index()
    checked = 0
    for _, r in idx[idx.kind == "grad"].iterrows():
        row = st[(st.step == r.step) & (st.layer == r.layer) & (st.call == r.call)].iloc[0].to_dict()
        x = run.samples(r.layer, int(r.step), call=int(r.call))
        for fmt in FORMATS:
            s = amax_scale(parse(fmt), float(row["max_abs"])) * 0.7        # not a power of two
            p = predict_from_stats(row, fmt, rounding=rounding, scale=s)
            m = _measure(x, fmt, rounding, None, float(row["max_abs"]), scale=s)
            d_frac, r_mse, d_bias = BOUNDS["stochastic", None, "e8m0"][r.layer == logits]
            assert p["log2_scale"] == pytest.approx(math.log2(s))
            assert abs(p["underflow"] - m["underflow"]) <= d_frac, (r.layer, fmt, p, m)
            assert abs(p["overflow"] - m["overflow"]) <= d_frac, (r.layer, fmt, p, m)
            if m["rel_mse"] > 1e-12:
                assert abs(p["rel_mse"] / m["rel_mse"] - 1) <= r_mse, (r.layer, fmt, p, m)
            assert abs(p["bias"] - m["bias"]) <= d_bias, (r.layer, fmt, p, m)
            checked += 1
    assert checked >= 8 * len(FORMATS)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("block", [None, 32])
@pytest.mark.parametrize("which", ["cnn_run", "gpt2_run"])
def test_a_row_alone_equals_the_row_in_the_table(request, which, rounding, block):
    """what_if predicts every (step, layer) row at once, rows of other binade spans padded into the
    same arrays; predict_from_stats predicts one row as a table of one: the padding changes nothing."""
    run = request.getfixturevalue(which)
    st = run.stats(kinds=["grad"])
    df = what_if(run, FORMATS, rounding=rounding, granularity=block)
    assert len(df) == len(st.groupby(["step", "layer"])) * len(FORMATS)
    checked = 0
    for _, x in st[st.call == 0].iterrows():
        if len(st[(st.step == x.step) & (st.layer == x.layer)]) != 1:
            continue
        for fmt in FORMATS:
            ref = predict_from_stats(x.to_dict(), fmt, rounding=rounding, granularity=block)
            got = df[(df.step == x.step) & (df.layer == x.layer) & (df.format == fmt)].iloc[0]
            for col in ("underflow", "overflow", "rel_mse", "bias", "log2_scale"):
                assert got[col] == pytest.approx(ref[col], rel=1e-9, abs=1e-12, nan_ok=True), (x.layer, fmt, col)
            checked += 1
    assert checked >= 8 * len(FORMATS)


class _EmbeddingGRU(torch.nn.Module):
    """An embedding, a Conv1d over the sequence, a GRU read at its last step: the Conv1d's gradient
    (batch, channels, 40 steps) decays along the sequence, so rows differ in magnitude."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.conv = torch.nn.Conv1d(32, 32, 3, padding=1)
        self.gru = torch.nn.GRU(32, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        h = self.conv(self.emb(x).transpose(1, 2)).transpose(1, 2)
        return self.head(self.gru(h)[0][:, -1])


@pytest.fixture(scope="module")
def gru_run(tmp_path_factory):
    torch.manual_seed(0)
    net = _EmbeddingGRU()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (64, 40), generator=g), torch.randint(0, 10, (64,), generator=g)
    path = tmp_path_factory.mktemp("whatif") / "gru"
    with gradstats.trace(net, path, layers="conv", samples=None, sample_every=1, blocks=(16, 32)) as t:
        for _ in range(2):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step(), opt.zero_grad()
            t.step()
    return gradstats.open_run(path)


def test_blocks_recorded_by_orientation_give_the_underflow_of_the_whole_tensors(gru_run):
    """MX e2m1fn blocks of 32 on the GRU model's Conv1d, laid out as the GEMMs read its gradient
    (channels last: along the channels, or along the tokens): the underflow read from the recorded
    blocks (2048 sampled per tensor) is within 0.02 of quantising the whole tensors in each orientation;
    the exchangeable model, blind to the rows' magnitudes, was 0.16 off along rows."""
    shape = gru_run.layer_info()["output_shape"][0]
    for o in ("rows", "columns"):
        df = what_if(gru_run, ["e2m1fn"], granularity=32, orientation=o)
        assert (df["estimate"] == "blocks").all() and (df["orientation"] == o).all()
        for step in gru_run.steps:
            g = gru_run.sample_matrix("conv", step)               # the whole gradient, (N*L, C)
            assert g.shape == (shape[0] * shape[2], shape[1])
            nz = g != 0
            measured = float(((quantize(g, "e2m1fn", block_size=32, orientation=o) == 0) & nz).sum() / nz.sum())
            got = float(df.loc[df.step == step, "underflow"].iloc[0])
            assert abs(got - measured) <= 0.02, (o, step, got, measured)
    rows = what_if(gru_run, ["e2m1fn"], granularity=32)["underflow"].to_numpy()
    cols = what_if(gru_run, ["e2m1fn"], granularity=32, orientation="columns")["underflow"].to_numpy()
    assert (abs(rows - cols) > 0.05).all()              # the orientations differ on this layer


def test_runs_without_oriented_blocks_keep_the_exchangeable_estimate(gru_run, cnn_run):
    """A run traced without blocks, and one recorded before blocks had an orientation (no
    ``orientation``, no ``below_hist``), are predicted for exchangeable entries, as before."""
    from gradstats.fpanalysis.what_if import what_if_stats
    from gradstats.run.select import layer_stats

    df = what_if(cnn_run, ["e2m1fn"], granularity=32, steps=[0], orientation="columns")
    assert (df["estimate"] == "exchangeable").all()
    st = layer_stats(gru_run, ["grad"], None)
    old = gru_run.table("blocks")
    old = old[old["orientation"] == "rows"].drop(columns=["orientation", "below_hist"])
    a = what_if_stats(st, ["e2m1fn"], granularity=32, blocks=old)
    b = what_if_stats(st, ["e2m1fn"], granularity=32)
    assert (a["estimate"] == "exchangeable").all()
    assert a["underflow"].tolist() == b["underflow"].tolist()
    nv = what_if(cnn_run, ["e2m1fn"], granularity="nvfp4", steps=[0])   # NVFP4 without blocks
    assert (nv["estimate"] == "exchangeable").all()
    with pytest.raises(ValueError, match="orientation must be one of"):
        what_if(gru_run, ["e2m1fn"], granularity=32, orientation="cols")


@pytest.mark.parametrize("name, fmt, kw", [
    ("nvfp4", "e2m1fn", {"granularity": "nvfp4"}),
    ("mxfp4", "e2m1fn", {"granularity": 32}),
    ("mxfp8_e4m3", "e4m3fn", {"granularity": "mx"}),
    ("mxfp6_e3m2:rounding=stochastic", "e3m2fn", {"granularity": 32, "rounding": "stochastic"}),
])
def test_a_scheme_predicts_as_its_spelled_out_form(cnn_run, name, fmt, kw):
    a = what_if(cnn_run, name, layers="conv*")
    b = what_if(cnn_run, fmt, layers="conv*", **kw)
    assert (a["format"] == name).all() and (b["format"] == fmt).all()
    pd.testing.assert_frame_equal(a.drop(columns="format"), b.drop(columns="format"))
    st = cnn_run.stats()
    row = st[st["layer"] == "conv1"].iloc[0].to_dict()
    assert predict_from_stats(row, name) == predict_from_stats(row, fmt, **kw)


def test_schemes_and_plain_formats_mix(cnn_run, tmp_path, capsys):
    df = what_if(cnn_run, ["e4m3fn", "nvfp4"], layers="conv1", granularity=32)
    e4, nv = df[df.format == "e4m3fn"], df[df.format == "nvfp4"]
    assert (e4["block_size"] == 32).all() and (e4["scale_format"] == "e8m0").all()
    assert (nv["block_size"] == 16).all() and (nv["scale_format"] == "e4m3").all()
    with pytest.raises(ValueError, match="drop ':scale_rounding=rceil'"):
        what_if(cnn_run, "mxfp4:scale_rounding=rceil")
    from gradstats.cli import main

    assert main(["what-if", str(cnn_run.path), "--formats", "e4m3fn,nvfp4", "--layers", "conv1"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4: NVFP4 blocks of 16" in out and "e4m3fn: per-tensor amax scale" in out


def test_nvfp4_underflow_from_the_recorded_blocks(tmp_path):
    """NVFP4 (e4m3 block scales under a float32 tensor scale) on the GRU model's Conv1d, whose
    gradient decays along the sequence so that a third of its blocks' scales underflow e4m3: the
    underflow read from the recorded blocks (every block counted) is within 0.02 of quantising the
    whole tensors, blocks along the channels; the exchangeable model was 0.29 off."""
    from gradstats.fpanalysis.what_if import what_if_stats
    from gradstats.run.select import layer_stats

    torch.manual_seed(0)
    net = _EmbeddingGRU()
    x = torch.randint(0, 64, (32, 40), generator=torch.Generator().manual_seed(0))
    with gradstats.trace(net, tmp_path, layers="conv", samples=None, sample_every=1, block_sample=None) as t:
        for _ in range(2):
            net(x).square().sum().backward()
            t.step()
    run = gradstats.open_run(tmp_path)
    nv = what_if(run, ["e2m1fn"], granularity="nvfp4")
    assert (nv["estimate"] == "blocks").all()
    exch = what_if_stats(layer_stats(run, ["grad"], None), ["e2m1fn"], granularity="nvfp4")
    for step in run.steps:
        g = run.sample_matrix("conv", step)
        nz = g != 0
        measured = float(((gradstats.quantize(g, "nvfp4") == 0) & nz).sum() / nz.sum())
        assert (gradstats.block_scales(g, "nvfp4") == 0).float().mean() > 0.25      # whole blocks flushed
        got = float(nv.loc[nv.step == step, "underflow"].iloc[0])
        assert abs(got - measured) <= 0.02, (step, got, measured)
        assert abs(float(exch.loc[exch.step == step, "underflow"].iloc[0]) - measured) > 0.2
