"""Noise terms of any module with trainable parameters: the vector-Jacobian products of
gradstats.tracer.noise against the closed form and brute force, a GRU tagger traced end to end,
and the step's own gradients left as they are."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradstats
from gradstats.apply.noise_probe import _weight_grads
from gradstats.noise.terms import noise_terms
from gradstats.tracer.noise import (
    centred_signs,
    noise_params,
    records_noise,
    sample_layout,
    vjp_terms,
    weight_grad_terms,
)


class Tagger(nn.Module):
    """Embedding -> GRU(batch_first=True) -> Linear: a tag per token."""

    def __init__(self, vocab: int = 40, dim: int = 12, hidden: int = 16, tags: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(self.emb(x))[0])


def _batch(seed: int, b: int = 8, t: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (b, t), generator=gen), torch.randint(0, 5, (b, t), generator=gen)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1))


def _train(model: nn.Module, path, steps: int = 3, **trace_kw) -> list[dict[str, torch.Tensor]]:
    """``steps`` SGD steps of ``model`` (traced when ``path`` is given); each step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []

    def one(step: int) -> None:
        opt.zero_grad()
        _loss(model, _batch(step)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()

    if path is None:
        for s in range(steps):
            one(s)
    else:
        with gradstats.trace(model, path, optimizer=opt, **trace_kw):
            for s in range(steps):
                one(s)
    return grads


def test_records_noise_means_any_trainable_parameters():
    assert records_noise(nn.GRU(2, 3)) and records_noise(nn.Embedding(4, 2)) and records_noise(nn.LayerNorm(3))
    assert not records_noise(nn.ReLU())
    frozen = nn.LayerNorm(3).requires_grad_(False)
    assert not records_noise(frozen) and noise_params(frozen) == []
    gru = nn.GRU(2, 3, num_layers=2)
    assert [id(p) for p in noise_params(gru)] == [id(p) for p in gru.parameters()]
    lin = nn.Linear(3, 2)
    assert [id(p) for p in noise_params(lin)] == [id(lin.weight)]      # the closed form's: the weight


def test_vjp_q2_matches_the_linear_closed_form():
    """Averaged over draws of z, |d<out, g*z>/dW|^2 is sum_r |g_r|^2 |x_r|^2."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    x = torch.randn(5, 3, 6) * torch.linspace(0.2, 3.0, 5)[:, None, None]   # rows of unequal size
    g = torch.randn(5, 3, 4)
    closed = weight_grad_terms(lin, x, g, torch.Generator().manual_seed(0))
    out = lin(x)
    gen = torch.Generator().manual_seed(1)
    draws = [vjp_terms(out, g, [lin.weight], gen, batch=5, where=0) for _ in range(1500)]
    assert np.mean([d["q2"] for d in draws]) == pytest.approx(closed["q2"], rel=0.04)
    assert draws[0]["batch"] == closed["batch"] and draws[0]["rows"] == closed["rows"]
    # s2 is the same product in both: |sum_i c_i G_i|^2 for the signs drawn (after the draw of z)
    gen = torch.Generator().manual_seed(2)
    probe = torch.Generator().manual_seed(2)
    torch.randn(g.shape, generator=probe)
    c = centred_signs(5, probe, torch.device("cpu")).double()
    per = torch.einsum("brk,brj->bkj", g.double(), x.double())                # each sample's G_i
    expected = float((c[:, None, None] * per).sum(0).square().sum())
    assert vjp_terms(out, g, [lin.weight], gen, batch=5, where=0)["s2"] == pytest.approx(expected, rel=1e-5)


def _per_sample_grads(module: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> torch.Tensor:
    """Brute force: each sample's gradient of all the module's parameters, flat."""
    out = []
    for x, g in zip(xs, gs):
        module.zero_grad()
        torch.autograd.backward(module(x)[0], g)
        out.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]).double())
    return torch.stack(out)


@pytest.mark.parametrize("batch_first", [True, False])
def test_vjp_s2_of_a_gru_is_the_centred_sign_product_of_its_samples(batch_first):
    torch.manual_seed(0)
    gru = nn.GRU(3, 4, batch_first=batch_first)
    b, t = 6, 5
    x = torch.randn(b, t, 3) if batch_first else torch.randn(t, b, 3)
    y = gru(x)
    out = y[0]
    g = torch.randn(out.shape)
    batch, where = sample_layout(gru, y, out)
    assert (batch, where) == (b, 0 if batch_first else 1)
    gen = torch.Generator().manual_seed(3)
    terms = vjp_terms(out, g, noise_params(gru), gen, batch=batch, where=where)
    probe = torch.Generator().manual_seed(3)
    torch.randn(g.shape, generator=probe)
    c = centred_signs(b, probe, torch.device("cpu")).double()
    pick = (lambda t_, i: t_[i:i + 1]) if batch_first else (lambda t_, i: t_[:, i:i + 1])
    per = _per_sample_grads(gru, [pick(x, i) for i in range(b)], [pick(g, i) for i in range(b)])
    assert terms["s2"] == pytest.approx(float((c[:, None] * per).sum(0).square().sum()), rel=1e-4)
    assert terms["batch"] == b and terms["rows"] == b * t and terms["q2"] > 0


def test_vjp_s2_of_a_packed_sequence_signs_each_sample():
    torch.manual_seed(0)
    gru = nn.GRU(3, 4, batch_first=True)
    lengths = [5, 3, 2, 2]
    seqs = [torch.randn(n, 3) for n in lengths]
    packed = nn.utils.rnn.pack_sequence(seqs)
    y = gru(packed)
    out = y[0].data
    g = torch.randn(out.shape)
    batch, where = sample_layout(gru, y, out)
    assert batch == 4 and isinstance(where, torch.Tensor) and where.tolist()[:6] == [0, 1, 2, 3, 0, 1]
    terms = vjp_terms(out, g, noise_params(gru), torch.Generator().manual_seed(4), batch=batch, where=where)
    probe = torch.Generator().manual_seed(4)
    torch.randn(g.shape, generator=probe)
    c = centred_signs(4, probe, torch.device("cpu")).double()
    # the packed rows of sample i: time step s holds the first batch_sizes[s] samples
    rows = [[int(sum(y[0].batch_sizes[:s])) + i for s in range(lengths[i])] for i in range(4)]
    per = _per_sample_grads(gru, [s[None] for s in seqs], [g[r][None] for r in rows])
    assert terms["s2"] == pytest.approx(float((c[:, None] * per).sum(0).square().sum()), rel=1e-4)


def test_vjp_terms_of_a_sparse_embedding():
    emb = nn.Embedding(10, 3, sparse=True)
    idx = torch.tensor([[1, 1, 2], [1, 4, 4]])          # repeated rows: the sparse gradient is coalesced
    out = emb(idx)
    g = torch.randn(out.shape)
    dense = nn.Embedding(10, 3)
    dense.weight.data.copy_(emb.weight.data)
    a = vjp_terms(out, g, [emb.weight], torch.Generator().manual_seed(0), batch=2, where=0)
    b = vjp_terms(dense(idx), g, [dense.weight], torch.Generator().manual_seed(0), batch=2, where=0)
    assert a["q2"] == pytest.approx(b["q2"], rel=1e-6) and a["s2"] == pytest.approx(b["s2"], rel=1e-6)


def test_a_gru_tagger_gets_noise_terms_and_a_finite_prediction(tmp_path):
    torch.manual_seed(0)
    _train(Tagger(), tmp_path, steps=3, sample_every=1)
    run = gradstats.open_run(tmp_path)
    terms = noise_terms(run, ["emb", "gru", "out"])
    assert set(terms.index) == {"emb", "gru", "out"}
    for layer in ("emb", "gru"):
        for col in ("q2", "minibatch", "pair", "signs"):
            v = float(terms.loc[layer, col])
            assert math.isfinite(v) and v > 0, (layer, col, v)
    pred = gradstats.predicted_noise(run, gradstats.Plan.uniform(sparsity=0.85, output_layer=False))
    assert math.isfinite(pred["gru"]) and pred["gru"] > 0
    # the pair estimate is over all the GRU's parameters: of the order of the centred-sign one
    assert 0.2 < terms.loc["gru", "pair"] / terms.loc["gru", "signs"] < 5


def test_the_step_gradients_are_the_same_with_and_without_noise_records(tmp_path):
    torch.manual_seed(0)
    model = Tagger()
    plain = _train(copy.deepcopy(model), None)
    off = _train(copy.deepcopy(model), tmp_path / "off", sample_every=1, noise=False)
    on = _train(copy.deepcopy(model), tmp_path / "on", sample_every=1, noise=True)
    run = gradstats.open_run(tmp_path / "on")
    assert len(run.table("noise").query("layer == 'gru' and call >= 0")) == 3
    # the backward passes sent for the noise terms are not recorded as gradients (one row per layer and step)
    stats = run.stats()
    assert len(stats) == len(gradstats.open_run(tmp_path / "off").stats()) == 3 * 3
    for a, b, c in zip(plain, off, on):
        for name in a:
            assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name


def test_the_probe_measures_all_of_a_grus_parameters():
    torch.manual_seed(0)
    model = Tagger()
    _loss(model, _batch(0)).backward()
    got = _weight_grads({"gru": model.gru, "out": model.out})
    assert got["gru"].numel() == sum(p.numel() for p in model.gru.parameters())
    assert got["out"].numel() == model.out.weight.numel() and got["gru"].dtype == torch.float64
    probe = gradstats.noise_probe(model, [_batch(s) for s in range(3)],
                                        gradstats.Plan.uniform(sparsity=0.85, output_layer=False), _loss, draws=1)
    assert math.isfinite(probe["gru"]) and probe["gru"] > 0


def test_a_failed_vjp_leaves_no_record(tmp_path, caplog, monkeypatch):
    import gradstats.tracer.capture as capture

    def broken(*args, **kwargs):
        raise RuntimeError("Trying to backward through the graph a second time")

    monkeypatch.setattr(capture, "vjp_terms", broken)
    with caplog.at_level("DEBUG", logger="gradstats.tracer.capture"):
        _train(Tagger(), tmp_path, steps=1, sample_every=1)
    noise = gradstats.open_run(tmp_path).table("noise")
    assert set(noise["layer"]) == {"out"}                    # the closed form's alone
    assert any("no noise terms for gru" in r.getMessage() for r in caplog.records)
