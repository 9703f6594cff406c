"""Per-block statistics: the blocks' dynamic ranges, recorded by the tracer (opt-in), and what they
say a block-scaled format flushes, checked against quantising the stored tensors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradstats
from gradstats.ops.quantization import quantize
from gradstats.stats.blocks import RANGE_BINS, block_stats, flushed_blocks


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


def _measured_flushed(x: torch.Tensor, fmt: str, b: int, scale_format: str) -> float:
    n = (x.numel() // b) * b
    xb = x[:n]
    q = quantize(xb, fmt, block_size=b, scale_format=scale_format).view(-1, b)
    xv = xb.view(-1, b)
    live = (xv != 0).any(1)
    flushed = ((xv != 0) & (q == 0)).any(1)
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
    assert len(t) == 2 * len(run.stats(kinds=["grad"]))           # one row per capture and block size
    checked = 0
    for layer in ("conv1", "conv2", "fc1"):
        x = run.samples(layer, 1)
        for b, fmt, sf in ((32, "e2m1fn", "e8m0"), (32, "e4m3fn", "e8m0"), (16, "e2m1fn", "e4m3")):
            row = t[(t.layer == layer) & (t.step == 1) & (t.block_size == b)].iloc[0].to_dict()
            n = (x.numel() // b) * b
            if n == x.numel():
                assert {k: row[k] if k != "range_hist" else list(row[k]) for k in ("n_blocks", "n_sampled",
                        "n_zero_blocks", "range_hist")} == block_stats(x, b)
            bounds = flushed_blocks(row, fmt, scale_format=sf)
            got = _measured_flushed(x, fmt, b, sf)
            assert bounds["low"] - 1e-3 <= got <= bounds["high"] + 1e-3, (layer, fmt, sf, bounds, got)
            if sf == "e8m0":
                assert bounds["low"] == bounds["high"]             # exact for power-of-two scales
            checked += 1
    assert checked == 9


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
        flushed_blocks({"range_hist": [1] * RANGE_BINS}, "e2m1fn", scale_format="e5m2")


def test_several_sizes_at_once_equal_one_at_a_time():
    x = torch.exp(-8 + 3 * torch.randn(5000, generator=torch.Generator().manual_seed(5)))
    from gradstats.stats.blocks import blocks_stats

    assert blocks_stats(x, (16, 32)) == [block_stats(x, 16), block_stats(x, 32)]
