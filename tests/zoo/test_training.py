"""Tests for gradstats.zoo.training: the loop learns, is reproducible, and its hooks behave."""
from __future__ import annotations

import json

import pytest
import torch

from gradstats.zoo.data import CharDataset, load_fashion_mnist
from gradstats.zoo.models import build_model
from gradstats.zoo.training import evaluate, make_optimizer, train


@pytest.fixture(scope="module")
def fm():
    return (
        load_fashion_mnist(split="train", source="subset", subset=1024),
        load_fashion_mnist(split="test", source="subset", subset=300),
    )


def test_cnn_learns_on_the_committed_subset(fm):
    train_set, test_set = fm
    model = build_model("cnn", seed=0)
    before = evaluate(model, test_set)
    r = train(model, train_set, test=test_set, steps=30, batch_size=64, lr=0.05, seed=0, progress=False)
    assert r.steps == 30 and len(r.losses) == 30 and not r.diverged
    first, last = sum(r.losses[:5]) / 5, sum(r.losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert r.test_accuracy > max(0.6, before + 0.3), (before, r.test_accuracy)
    assert model.training  # left in train mode
    assert json.loads(json.dumps(r.to_dict()))["config"]["model"] == "SmallCNN"
    assert list(r.to_dataframe().columns) == ["step", "loss"]


def test_training_is_reproducible(fm):
    train_set, _ = fm
    runs = []
    for _ in range(2):
        model = build_model("mlp", seed=3)
        r = train(model, train_set, steps=8, batch_size=32, seed=5, progress=False)
        runs.append((r.losses, model.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    other = train(build_model("mlp", seed=3), train_set, steps=8, batch_size=32, seed=6, progress=False)
    assert other.losses != runs[0][0]


def test_callback_optimizer_instance_and_schedule(fm):
    train_set, test_set = fm
    model = build_model("mlp", seed=0)
    opt = make_optimizer(model, "sgd", lr=0.1)
    lrs, stepped = [], []
    opt.register_step_post_hook(lambda o, a, k: stepped.append(1))

    def cb(step, loss):
        lrs.append(opt.param_groups[0]["lr"])
        return step == 9  # stop after the 10th step

    r = train(model, train_set, optimizer=opt, steps=20, batch_size=32, schedule="cosine", warmup=2,
              callback=cb, test=test_set, eval_every=5, progress=False)  # fmt: skip
    assert r.steps == 10 and len(stepped) == 10
    assert lrs[0] == pytest.approx(0.05) and lrs[1] == pytest.approx(0.1)  # linear warm-up
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # cosine decay
    assert opt.param_groups[0]["lr"] == 0.1  # restored afterwards
    assert [h["step"] for h in r.history] == [5, 10]


def test_char_transformer_and_tuple_data():
    text = "the quick brown fox jumps over the lazy dog. " * 200
    ds = CharDataset.from_text(text)
    model = build_model("transformer", seed=0, vocab_size=ds.vocab_size, d_model=32, n_layers=1, seq_len=32)
    r = train(model, ds, steps=40, batch_size=16, seq_len=32, optimizer="adamw", lr=3e-3, progress=False)
    assert r.losses[-1] < 0.6 * r.losses[0] and r.test_loss is not None and 0 <= r.test_accuracy <= 1
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    r2 = train(torch.nn.Linear(5, 3), (x, y), steps=3, batch_size=16, progress=False, test=(x, y))
    assert r2.steps == 3 and r2.test_accuracy is not None


def test_divergence_stops_training(fm):
    train_set, _ = fm
    model = build_model("mlp", seed=0)
    with torch.no_grad():
        model.net[1].weight.fill_(float("inf"))
    r = train(model, train_set, steps=5, batch_size=32, progress=False)
    assert r.diverged and r.steps == 1 and r.test_accuracy is None


def test_bad_inputs(fm):
    train_set, _ = fm
    model = build_model("mlp")
    with pytest.raises(ValueError, match="torch.nn.Module"):
        train("mlp", train_set, steps=1)
    with pytest.raises(ValueError, match="steps must be"):
        train(model, train_set, steps=-1)
    with pytest.raises(ValueError, match="unknown optimizer"):
        train(model, train_set, steps=1, optimizer="lbfgs")
    with pytest.raises(ValueError, match="schedule must be"):
        train(model, train_set, steps=1, schedule="step")
    with pytest.raises(ValueError, match="data must be"):
        train(model, [1, 2, 3], steps=1, progress=False)
    with pytest.raises(ValueError, match="lr must be positive"):
        make_optimizer(model, "sgd", lr=0.0)


def test_prepare_picks_data_and_settings_per_model():
    from gradstats.zoo.training import RECOMMENDED, prepare

    cnn = prepare("cnn", source="subset", subset=200, test_subset=50, seed=1)
    assert cnn.train_data.source == "committed subset" and len(cnn.train_data) == 200 and len(cnn.test_data) == 50
    assert cnn.hparams == {**RECOMMENDED["cnn"], "seed": 1}
    r18 = prepare("resnet18", source="subset", subset=20, test_subset=20)
    assert r18.train_data.input_shape == (1, 32, 32) == r18.model.input_shape
    digits = prepare("cnn", data="digits")
    assert digits.train_data.input_shape == (1, 28, 28)
    r = digits.run(2, batch_size=16, progress=False)
    assert r.steps == 2 and r.test_accuracy is not None
    tf = prepare("transformer", d_model=32, n_layers=1, seq_len=16)
    assert tf.model.vocab_size == tf.train_data.vocab_size == 76 and tf.hparams["seq_len"] == 16
    assert tf.run(2, batch_size=4, progress=False).steps == 2
    assert tf.to_dict()["train_data"]["name"] == "shakespeare"
    with pytest.raises(ValueError, match="unknown model"):
        prepare("vgg")
    with pytest.raises(ValueError, match="takes images"):
        prepare("cnn", data="shakespeare")
    with pytest.raises(ValueError, match="takes characters"):
        prepare("transformer", data="fashion-mnist")
    lstm = prepare("lstm", d_model=16, seq_len=16)
    assert lstm.model.vocab_size == 76 and lstm.run(2, batch_size=4, progress=False).steps == 2
    with pytest.raises(ValueError, match="'lstm' takes characters"):
        prepare("lstm", data="digits")
    with pytest.raises(ValueError, match="only as the committed subset"):
        prepare("mlp", data="digits", source="full")
    assert prepare("mlp", data="digits", subset=50).train_data.class_counts() == [5] * 10
