"""Tests for gradstats.zoo.models: shapes, backward, registry, seeding, hooks on submodules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradstats.zoo import models as M

CASES = {
    "mlp": ({}, (3, 1, 28, 28), (3, 10)),
    "cnn": ({}, (3, 1, 28, 28), (3, 10)),
    "resnet20": ({}, (3, 1, 28, 28), (3, 10)),
    "resnet18": ({}, (2, 1, 32, 32), (2, 10)),
    "transformer": ({"vocab_size": 40, "seq_len": 32}, (3, 32), (3, 32, 40)),
    "lstm": ({"vocab_size": 40, "d_model": 16, "seq_len": 32}, (3, 32), (3, 32, 40)),
    "mobilenet": ({}, (3, 1, 28, 28), (3, 10)),
}


def test_registry_lists_every_model():
    assert M.list_models() == sorted(CASES)
    assert set(M.DEFAULT_DATA) == set(CASES)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        M.build_model("vgg")
    with pytest.raises(ValueError, match="bad arguments for model 'mlp'"):
        M.build_model("mlp", widths=3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_backward(name):
    kw, in_shape, out_shape = CASES[name]
    model = M.build_model(name, seed=0, **kw)
    x = M.example_input(model, in_shape[0], generator=torch.Generator().manual_seed(0))
    assert tuple(x.shape) == in_shape
    out = model(x)
    assert tuple(out.shape) == out_shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    target = torch.randint(0, out_shape[-1], out_shape[:-1])
    F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    # every parameter receives some gradient (no dead branch in the definitions)
    assert all(float(p.grad.abs().sum()) > 0 for p in model.parameters())


def test_parameter_counts_match_the_architectures():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(M.build_model("mlp")) == 784 * 256 + 256 + 256 * 10 + 10
    assert count(M.build_model("mlp", hidden=(128, 64))) == 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    cnn = M.build_model("cnn")
    assert cnn.fc1.in_features == 64 * 7 * 7 and count(cnn) == 421_738
    r20 = M.build_model("resnet20")
    assert sum(isinstance(m, M.BasicBlock) for m in r20.modules()) == 9
    convs_fc = [m for m in r20.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    shortcut_convs = [m for m in r20.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)]
    assert len(convs_fc) - len(shortcut_convs) == 20  # the "20" of ResNet-20
    r18 = M.build_model("resnet18")
    assert sum(isinstance(m, M.BasicBlock) for m in r18.modules()) == 8 and 11.0e6 < count(r18) < 11.3e6
    assert M.build_model("cnn", image_size=32)(torch.zeros(1, 1, 32, 32)).shape == (1, 10)
    assert M.build_model("resnet20")(torch.zeros(1, 1, 32, 32)).shape == (1, 10)


def test_seed_fixes_init_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = M.build_model("resnet20", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = M.build_model("resnet20", seed=7)
    c = M.build_model("resnet20", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["conv1.weight"], sc["conv1.weight"])


def test_transformer_is_causal():
    model = M.build_model("transformer", seed=0, vocab_size=20, d_model=32, n_layers=2, seq_len=16).eval()
    x = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 20
    out_x, out_y = model(x), model(y)
    assert torch.allclose(out_x[:, :10], out_y[:, :10], atol=1e-6)
    assert not torch.allclose(out_x[:, 10:], out_y[:, 10:])
    assert model(x[:, :5]).shape == (2, 5, 20)  # shorter sequences are fine
    with pytest.raises(ValueError, match="exceeds the model's seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="int64 token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="divisible"):
        M.build_model("transformer", d_model=30, n_heads=4)


def test_hooks_on_submodules_see_the_neural_gradients():
    """Backward hooks on attention projections, LayerNorm and MLP linears get dL/d(output) equal to autograd's."""
    model = M.build_model("transformer", seed=0, vocab_size=30, d_model=32, n_layers=2, seq_len=16)
    block = model.blocks[1]
    watched = {"q_proj": block.attn.q_proj, "v_proj": block.attn.v_proj, "out_proj": block.attn.out_proj,
               "ln1": block.ln1, "fc1": block.fc1, "fc2": block.fc2, "ln_f": model.ln_f}  # fmt: skip
    grads, outs = {}, {}

    def keep(name):
        def hook(module, inputs, output):  # returns None: the output is not replaced
            output.retain_grad()
            outs[name] = output

        return hook

    for name, mod in watched.items():
        mod.register_forward_hook(keep(name))
        mod.register_full_backward_hook(lambda m, gi, go, name=name: grads.__setitem__(name, go[0]))
    x = torch.randint(0, 30, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(x)
    F.cross_entropy(out.reshape(-1, 30), x.reshape(-1)).backward()
    assert set(grads) == set(watched)
    for name in watched:
        assert grads[name].shape == outs[name].shape
        assert torch.equal(grads[name], outs[name].grad), name


def test_example_input_rejects_foreign_models():
    with pytest.raises(ValueError, match="no input_shape"):
        M.example_input(nn.Linear(3, 3))
    x = M.example_input(M.build_model("transformer", vocab_size=7, seq_len=8), 4)
    assert x.dtype == torch.int64 and x.shape == (4, 8) and int(x.max()) < 7
