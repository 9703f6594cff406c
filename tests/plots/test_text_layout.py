"""The figures that name layers stay legible on a model with many, long layer names: traced from a
small model whose modules are named as GPT-2's (49 Linear layers), every visible text of each
figure lies inside the figure and no two texts overlap."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import gradstats
from gradstats import figures

#: GPT-2's linear layers: 12 blocks of four, and the head
GPT2_NAMES = [f"transformer.h.{i}.{p}" for i in range(12)
              for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + ["lm_head"]


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(d, 3 * d), "c_proj": nn.Linear(3 * d, d)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn["c_proj"](torch.tanh(self.attn["c_attn"](x)))
        return x + self.mlp["c_proj"](torch.relu(self.mlp["c_fc"](x)))


class _GPT2Shaped(nn.Module):
    """Module names as GPT-2's (``transformer.h.{i}.attn.c_attn`` ... ``lm_head``), tiny sizes."""

    def __init__(self, d: int = 8, vocab: int = 16, n_layer: int = 12) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"h": nn.ModuleList(_Block(d) for _ in range(n_layer))})
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(x)


def gpt2_shaped_run(path) -> gradstats.Run:
    """Two training steps of the GPT-2-shaped model traced into ``path`` (gradients, activations
    and weights, with raw samples on both steps)."""
    torch.manual_seed(0)
    model = _GPT2Shaped()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradstats.trace(model, path, sample_every=1, samples=4096, kinds=("grad", "act", "weight")) as t:
        for _ in range(2):
            x, y = torch.randn(64, 8), torch.randint(0, 16, (64,))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            t.step()
    return gradstats.open_run(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = gpt2_shaped_run(tmp_path_factory.mktemp("gpt2-shaped") / "run")
    assert r.layers == GPT2_NAMES
    return r


@pytest.fixture(scope="module")
def ctx(run):
    """The context write_figures computes its figures from, shared by the figures."""
    return {"run": run, "plans": None, "errors": None}


def _overlaps(fig) -> tuple[list[str], list[tuple[str, str]]]:
    """(texts outside the figure, pairs of overlapping texts) of the figure drawn with Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = _undrawn_tick_labels(fig)
    page = fig.bbox
    boxes = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip() or id(t) in hidden:
            continue
        bb = t.get_window_extent(renderer)
        if bb.width > 0 and bb.height > 0:
            boxes.append((t.get_text(), bb))
    outside = [s for s, bb in boxes if bb.x0 < page.x0 - 1 or bb.y0 < page.y0 - 1
               or bb.x1 > page.x1 + 1 or bb.y1 > page.y1 + 1]
    pairs = []
    for (s, a), (u, b) in itertools.combinations(boxes, 2):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        if w > 1 and h > 1:
            pairs.append((s, u))
    return outside, pairs


def _undrawn_tick_labels(fig) -> set[int]:
    """ids of the tick labels an axis keeps but does not draw: spare ticks beyond its locator's,
    and ticks outside its view."""
    drawn, every = set(), set()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            lo, hi = lo - 1e-9 * abs(lo), hi + 1e-9 * abs(hi)
            for ticks, locs in ((axis.majorTicks, axis.get_majorticklocs()),
                                (axis.minorTicks, axis.get_minorticklocs())):
                for k, tick in enumerate(ticks):
                    every |= {id(tick.label1), id(tick.label2)}
                    if k < len(locs) and lo <= locs[k] <= hi:
                        drawn |= {id(tick.label1), id(tick.label2)}
    return every - drawn


#: the figures of write_figures that name layers
NAMED = ["distributions", "qq", "goodness_of_fit", "moments", "cosine", "format_map", "format_ranges",
         "error_vs_exponent_bits"]


@pytest.mark.parametrize("name", NAMED)
def test_no_text_overlaps_or_leaves_the_figure_with_gpt2_layer_names(ctx, name):
    import matplotlib.pyplot as plt

    fig = figures.FIGURES[name][0](ctx)
    try:
        outside, pairs = _overlaps(fig)
    finally:
        plt.close(fig)
    assert not outside, f"{name}: {len(outside)} texts leave the figure, e.g. {outside[:3]}"
    assert not pairs, f"{name}: {len(pairs)} pairs of texts overlap, e.g. {pairs[:3]}"


def test_the_figures_name_every_planned_layer(ctx):
    """The map and the ranges show every layer (none thinned away to make room)."""
    import matplotlib.pyplot as plt

    fmap = figures.FIGURES["format_map"][0](ctx)
    labels = [t.get_text().split("  ")[0] for t in fmap.axes[0].get_yticklabels()]
    planned = [e.layer for e in next(iter(ctx["plans"].values())).entries]
    assert labels == planned and len(planned) >= 48
    ranges = figures.FIGURES["format_ranges"][0](ctx)
    assert [t.get_text() for t in ranges.axes[0].get_yticklabels()] == planned
    plt.close("all")
    assert np.isfinite([e.predicted.sigma for e in next(iter(ctx["plans"].values())).entries]).all()
