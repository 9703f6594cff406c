"""Per-block statistics: the blocks' dynamic ranges, recorded by the tracer (opt-in), and what they
say a block-scaled format flushes, checked against quantising the stored tensors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradstats
from gradstats.ops.quantization import quantize
from gradstats.stats.blocks import RANGE_BINS, block_stats, flushed_blocks, flushed_entries, oriented_block_stats


def _reference(x: np.ndarray, b: int) -> dict:
    a = np.abs(x.reshape(-1)).astype(np.float64)
    a = np.concatenate([a, np.zeros((-a.size) % b)]).reshape(-1, b)
    hist = np.zeros(RANGE_BINS, dtype=np.int64)
    zero = 0
    for row in a:
        nz = row[row > 0]
        if not nz.size:
            zero += 1
            continue
        hist[min(int(math.floor(math.log2(nz.max())) - math.floor(math.log2(nz.min()))), RANGE_BINS - 1)] += 1
    return {"n_blocks": a.shape[0], "n_sampled": a.shape[0], "n_zero_blocks": zero, "range_hist": hist.tolist()}


@pytest.mark.parametrize("b", [1, 16, 32])
def test_block_stats_match_a_direct_count(b):
    g = torch.Generator().manual_seed(0)
    x = torch.exp(-10 + 4 * torch.randn(5000, generator=g)) * (torch.rand(5000, generator=g) < 0.7)
    x[100:164] = 0.0                                          # whole zero blocks
    assert block_stats(x, b) == _reference(x.numpy(), b)      # 5000 is no multiple of 16: a padded block


def _kernel_cases():
    g = torch.Generator().manual_seed(1)
    for n in (1, 15, 16, 17, 33, 2047, 2048, 2049, 4096 + 48, 70_001, 300_000):
        x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
        x[::7] = 0.0
        x[::13] = 1e-42                                       # subnormals count as zeros
        x[3::29] = math.inf
        x[5::31] = math.nan                                   # inf and NaN too
        if n >= 4096:
            x[: n // 32 * 32].view(-1, 16)[::3] = 0.0         # whole zero blocks of 16 beside full ones
            x[1000:1100] = 0.0
        yield n, x
    yield "ranges", torch.exp2(torch.arange(-126.0, 128.0)).repeat(4) * torch.rand(1016, generator=g)


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("threads", [1, 2])
def test_statistics_kernel_counts_every_block_exactly(build, threads, monkeypatch):
    """The statistics pass's own block counts (AVX-512 and portable builds, one and two threads)
    equal blocks_stats counting every block, on tails, zero blocks, subnormals, inf and NaN."""
    import gradstats.stats.kernel as S
    from gradstats.stats.blocks import blocks_stats, kernel_block_stats

    kernel = S._native_kernel(portable=build == "portable")
    if kernel is None:
        pytest.skip("no C compiler here: blocks_stats alone counts blocks")
    monkeypatch.setattr(S, "_native_kernel", lambda: kernel)
    rows = S.VectorRows()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, x in _kernel_cases():
            counts = np.full((2, 1 + RANGE_BINS), 7, np.int64)   # overwritten, not added to
            S.write_stats(x, rows.claim(), blocks=counts)
            assert kernel_block_stats(counts, x.numel()) == blocks_stats(x, (16, 32)), n
            assert kernel_block_stats(counts, x.numel(), (32,)) == blocks_stats(x, (32,)), n
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ValueError, match="shape"):
        S.write_stats(torch.ones(4), rows.claim(), blocks=np.zeros((2, 64), np.int64))
    with pytest.raises(ValueError, match="counts blocks of"):
        kernel_block_stats(counts, 10, (8,))


def _measured_flushed(x: torch.Tensor, fmt: str, b: int, scale_format: str) -> float:
    """The fraction of the non-zero blocks along the last dim (each row's last block partial) with a
    flushed entry, quantising ``x`` as quantize does."""
    x = x.reshape(-1, x.shape[-1])
    pad = (-x.shape[-1]) % b
    q = quantize(x, fmt, block_size=b, scale_format=scale_format)
    xv = torch.nn.functional.pad(x, (0, pad)).reshape(-1, b)
    qv = torch.nn.functional.pad(q, (0, pad)).reshape(-1, b)
    live = (xv != 0).any(1)
    flushed = ((xv != 0) & (qv == 0)).any(1)
    return float(flushed[live].double().mean())


def test_the_tracer_records_them_and_they_bound_what_formats_flush(tmp_path):
    from gradstats.zoo.training import prepare

    task = prepare("cnn", source="subset", subset=256, test_subset=100)
    with gradstats.trace(task.model, tmp_path / "run", sample_every=[1], samples=None, blocks=(16, 32),
                         block_sample=None) as tr:
        task.run(2, batch_size=64, progress=False, callback=lambda step, loss: tr.step())
    run = gradstats.open_run(tmp_path / "run")
    t = run.table("blocks")
    assert set(t["block_size"]) == {16, 32} and sorted(t["step"].unique()) == [0, 1]
    assert len(t) == 2 * 3 * len(run.stats(kinds=["grad"]))    # one row per capture, block size and orientation
    assert set(t["orientation"]) == {"rows", "columns", "2d"}
    shapes = dict(zip(run.layer_info()["name"], run.layer_info()["output_shape"]))
    checked = 0
    for layer in ("conv1", "conv2", "fc1"):
        x = run.sample_matrix(layer, 1)            # the whole gradient, as the GEMMs read it (channels last)
        assert x.numel() == math.prod(shapes[layer])
        for b, fmt, sf in ((32, "e2m1fn", "e8m0"), (32, "e4m3fn", "e8m0"), (16, "e2m1fn", "e4m3")):
            row = t[(t.layer == layer) & (t.step == 1) & (t.block_size == b) & (t.orientation == "rows")].iloc[0].to_dict()
            assert {k: row[k] if not k.endswith("hist") else list(row[k]) for k in ("n_blocks", "n_sampled",
                    "n_zero_blocks", "range_hist", "below_hist", "top_hist")} == oriented_block_stats(x, b, "rows")
            bounds = flushed_blocks(row, gradstats.Scheme.of(fmt, block_size=b, scale_format=sf))
            got = _measured_flushed(x, fmt, b, sf)
            assert bounds["low"] - 1e-3 <= got <= bounds["high"] + 1e-3, (layer, fmt, sf, bounds, got)
            if sf == "e8m0":
                assert bounds["low"] == bounds["high"]             # exact for power-of-two scales
            checked += 1
    assert checked == 9


def test_the_tracer_counts_every_block_in_the_statistics_pass_on_the_cpu(tmp_path):
    """blocks=(16, 32) with the default block_sample: where the C kernel takes the statistics, it
    counts every block along rows whose length is a multiple of the block size (n_sampled ==
    n_blocks), equal to counting them afterwards; other block sizes and orientations (and a GPU)
    take the sample."""
    from gradstats.stats import has_native_kernel

    model = torch.nn.Sequential(torch.nn.Linear(8, 3008), torch.nn.ReLU(), torch.nn.Linear(3008, 5))
    with gradstats.trace(model, tmp_path / "run", sample_every=[0], samples=None, blocks=(16, 32, 8)) as tr:
        model(torch.randn(40, 8)).square().sum().backward()
        tr.step()
    run = gradstats.open_run(tmp_path / "run")
    t = run.table("blocks")
    x = run.samples("0", 0)
    for b in (16, 32):
        row = t[(t.layer == "0") & (t.block_size == b) & (t.orientation == "rows")].iloc[0]
        full = block_stats(x, b)
        if has_native_kernel():
            assert row["n_sampled"] == row["n_blocks"] == full["n_blocks"]
            assert list(row["range_hist"]) == full["range_hist"] and row["n_zero_blocks"] == full["n_zero_blocks"]
    row8 = t[(t.layer == "0") & (t.block_size == 8) & (t.orientation == "rows")].iloc[0]
    assert row8["n_blocks"] == 15_040 and row8["n_sampled"] < row8["n_blocks"]      # a sample of them
    col = t[(t.layer == "0") & (t.block_size == 32) & (t.orientation == "columns")].iloc[0]
    assert col["n_blocks"] == 2 * 3008 and col["n_sampled"] == 512          # the default sample


def test_a_sample_of_blocks_estimates_the_fractions():
    g = torch.Generator().manual_seed(3)
    x = torch.exp(-10 + 3 * torch.randn(400_000, generator=g)) * (torch.rand(400_000, generator=g) < 0.6)
    full = block_stats(x, 32)
    part = block_stats(x, 32, sample=2048, generator=torch.Generator().manual_seed(0))
    assert part["n_blocks"] == full["n_blocks"] == 12_500 and part["n_sampled"] == 2048
    for fmt in ("e2m1fn", "e4m3fn"):
        p, f = flushed_blocks(part, fmt)["estimate"], flushed_blocks(full, fmt)["estimate"]
        se = math.sqrt(max(f * (1 - f), 1e-4) / 2048)
        assert abs(p - f) <= 4 * se, (fmt, p, f)


def test_bad_block_sizes(tmp_path):
    with pytest.raises(ValueError, match="positive block sizes"):
        gradstats.trace(torch.nn.Linear(2, 2), tmp_path / "r", blocks=(0,))
    with pytest.raises(ValueError, match="positive int"):
        block_stats(torch.ones(4), 0)
    with pytest.raises(ValueError, match="block_sample must be"):
        gradstats.trace(torch.nn.Linear(2, 2), tmp_path / "r2", blocks=(16,), block_sample=0)
    with pytest.raises(ValueError, match="scale_format"):
        flushed_blocks({"range_hist": [1] * RANGE_BINS}, gradstats.Scheme.of("e2m1fn", block_size=16, scale_format="e5m2"))


def test_several_sizes_at_once_equal_one_at_a_time():
    x = torch.exp(-8 + 3 * torch.randn(5000, generator=torch.Generator().manual_seed(5)))
    from gradstats.stats.blocks import blocks_stats

    assert blocks_stats(x, (16, 32)) == [block_stats(x, 16), block_stats(x, 32)]


def _measured_underflow(x: torch.Tensor, fmt: str, b: int, orientation: str, rounding: str = "nearest") -> float:
    """The fraction of the non-zero entries of the (M, K) tensor ``x`` that MX blocks of ``b`` flush,
    quantising as the GEMM consuming them would: along rows, down columns, or in b x b tiles."""
    if orientation == "rows":
        q = quantize(x, fmt, block_size=b, rounding=rounding, seed=1)
    elif orientation == "columns":
        q = quantize(x, fmt, block_size=b, block_dim=0, rounding=rounding, seed=1)
    else:
        M, K = x.shape
        xp = torch.nn.functional.pad(x, (0, (-K) % b, 0, (-M) % b))
        tiles = xp.reshape(xp.shape[0] // b, b, xp.shape[1] // b, b).transpose(1, 2).reshape(-1, b * b)
        q = quantize(tiles, fmt, block_size=b * b, rounding=rounding, seed=1)
        x = tiles
    nz = x != 0
    return float(((q == 0) & nz).sum()) / float(nz.sum())


def _rows_of_different_magnitudes(M=96, K=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(-10 + 1.5 * torch.randn(M, K, generator=g)) * torch.exp2(torch.randint(-12, 12, (M, 1), generator=g))
    return x * torch.sign(torch.randn(M, K, generator=g)) * (torch.rand(M, K, generator=g) < 0.8)


@pytest.mark.parametrize("orientation", ["rows", "columns", "2d"])
def test_mx_underflow_from_the_binades_below_the_block_maximum_is_exact(orientation):
    """Round-to-nearest with MX (e8m0) scales flushes an entry exactly when it sits at least
    emax - log2(smallest subnormal) + 2 binades below its block's maximum: the histogram of those
    distances gives the flushed fraction of quantize exactly (K = 200: each row's last block partial);
    under stochastic rounding within 0.005 (one draw; positions within a binade modelled)."""
    x = _rows_of_different_magnitudes()
    for b in (16, 32):
        h = oriented_block_stats(x, b, orientation)["below_hist"]
        for fmt in ("e2m1fn", "e3m2fn", "e4m3fn", "e5m2"):
            assert flushed_entries(h, fmt) == pytest.approx(_measured_underflow(x, fmt, b, orientation), abs=1e-12)
            sr = flushed_entries(h, fmt, rounding="stochastic")
            assert abs(sr - _measured_underflow(x, fmt, b, orientation, "stochastic")) <= 0.005, (b, fmt)


def test_orientations_differ_where_rows_differ_in_magnitude():
    """Rows 2**-12 to 2**12 apart: blocks along a row share one scale and flush little; blocks down a
    column mix rows and flush most small rows; each is what quantize does in that orientation."""
    x = _rows_of_different_magnitudes()
    got = {o: flushed_entries(oriented_block_stats(x, 32, o)["below_hist"], "e2m1fn") for o in ("rows", "columns")}
    assert got["columns"] > got["rows"] + 0.3, got
    for o, v in got.items():
        assert v == pytest.approx(_measured_underflow(x, "e2m1fn", 32, o), abs=1e-12)
    rows = [dict(oriented_block_stats(x, 32, o), orientation=o) for o in ("rows", "columns")]
    assert flushed_blocks(rows, "e2m1fn", orientation="columns")["low"] > flushed_blocks(rows, "e2m1fn")["low"]


def test_a_sample_of_oriented_blocks_estimates_the_underflow():
    x = _rows_of_different_magnitudes(M=512, K=512, seed=2)
    for o in ("rows", "columns", "2d"):
        full = flushed_entries(oriented_block_stats(x, 32, o)["below_hist"], "e2m1fn")
        s = oriented_block_stats(x, 32, o, sample=2048, generator=torch.Generator().manual_seed(0))
        assert s["n_sampled"] == (2048 if o != "2d" else 64)
        assert abs(flushed_entries(s["below_hist"], "e2m1fn") - full) <= 0.03, o


def test_rows_of_old_runs_count_as_rows_and_bad_orientations_are_named():
    x = _rows_of_different_magnitudes()
    old = {k: v for k, v in block_stats(x.reshape(-1)[: 96 * 192], 32).items()}       # no orientation key
    assert flushed_blocks(old, "e2m1fn")["blocks"] > 0
    assert flushed_blocks(old, "e2m1fn", orientation="columns")["blocks"] == 0
    with pytest.raises(ValueError, match="orientation must be one of"):
        flushed_blocks(old, "e2m1fn", orientation="cols")
    with pytest.raises(ValueError, match="orientation must be one of"):
        oriented_block_stats(x, 32, "diagonal")
    with pytest.raises(ValueError, match="below_hist must hold"):
        flushed_entries([1, 2], "e2m1fn")
