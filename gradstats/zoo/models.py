"""Built-in models, plain ``torch.nn`` (no torchvision), and a registry by name.

=============  =======================================================  ===================
name           model                                                    input
=============  =======================================================  ===================
``mlp``        MLP 784-256-10 (widths configurable)                     ``(B, 1, 28, 28)``
``cnn``        2 x (conv-BN-ReLU-maxpool) + 2 fully connected layers    ``(B, 1, 28, 28)``
``resnet20``   CIFAR-style ResNet-20 (3 stages x 3 basic blocks)        ``(B, 1, 28, 28)``
``resnet18``   CIFAR-style ResNet-18 (4 stages x 2 basic blocks)        ``(B, 1, 32, 32)``
``transformer`` character-level GPT-style decoder                       ``(B, T)`` int64
``lstm``       character-level LSTM language model (one LSTM layer)     ``(B, T)`` int64
``mobilenet``  MobileNetV2-style: 3 inverted residuals (depthwise 3x3)  ``(B, 1, 28, 28)``
=============  =======================================================  ===================

Every layer is its own submodule (attention projections, LayerNorms, MLP linears,
activations), so forward and backward hooks on submodules see every activation and
neural gradient; no functional shortcuts hide a layer.

Example:
    >>> import torch
    >>> model = build_model("cnn", seed=0)
    >>> model(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MLP(nn.Module):
    """Fully connected ReLU network, 784-256-10 by default.

    Args:
        in_features: flattened input size (784 for 28x28 images).
        hidden: widths of the hidden layers (``(256,)``; ``(512, 256)`` for deeper).
        num_classes: output size.

    Example:
        >>> MLP(hidden=(64, 32))(torch.zeros(3, 1, 28, 28)).shape
        torch.Size([3, 10])
    """

    input_shape = (1, 28, 28)

    def __init__(self, in_features: int = 784, hidden: Sequence[int] = (256,), num_classes: int = 10) -> None:
        super().__init__()
        widths = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)
        self.input_shape = (1, 28, 28) if in_features == 784 else (in_features,)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks (conv3x3-BatchNorm-ReLU-maxpool2) and two fully connected layers.

    32 and 64 channels, then ``64*7*7 -> 128 -> 10`` for 28x28 input (``image_size``
    sets the flattened size for other sizes).

    Example:
        >>> SmallCNN()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        channels: tuple[int, int] = (32, 64),
        hidden: int = 128,
        image_size: int = 28,
    ) -> None:
        super().__init__()
        c1, c2 = channels
        self.conv1 = nn.Conv2d(in_channels, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c2)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        side = image_size // 4
        self.fc1 = nn.Linear(c2 * side * side, hidden)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_classes)
        self.input_shape = (in_channels, image_size, image_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        x = self.pool2(self.relu2(self.bn2(self.conv2(x))))
        return self.fc2(self.relu3(self.fc1(self.flatten(x))))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, depthwise 3x3 (``groups`` = channels), 1x1 projection,
    each with BatchNorm (ReLU6 after the first two), and the residual where the shape allows.

    Example:
        >>> InvertedResidual(16, 24, 2)(torch.zeros(2, 16, 14, 14)).shape
        torch.Size([2, 24, 7, 7])
    """

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 6) -> None:
        super().__init__()
        h = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(h, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        y = self.project(self.dw(self.expand(x)))
        return x + y if self.residual else y


class MobileNetV2Tiny(nn.Module):
    """A MobileNetV2-style CNN for 28x28 input: a strided 3x3 stem (16 channels, 14 wide), three
    inverted residuals (16, 24 and 32 channels; 14, 7 and 4 wide), global average pooling and
    one Linear layer. Layers of many shapes and ``groups``: depthwise convolutions, BatchNorm,
    ReLU6, residual sums.

    Example:
        >>> MobileNetV2Tiny()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.blocks = nn.Sequential(InvertedResidual(16, 16, 1), InvertedResidual(16, 24, 2),
                                    InvertedResidual(24, 32, 2))
        self.head = nn.Linear(32, num_classes)
        self.input_shape = (in_channels, 28, 28)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class BasicBlock(nn.Module):
    """ResNet basic block: two conv3x3-BN, identity or 1x1-conv-BN shortcut, ReLU after the sum.

    Example:
        >>> BasicBlock(16, 32, stride=2)(torch.zeros(1, 16, 8, 8)).shape
        torch.Size([1, 32, 4, 4])
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet of basic blocks: conv3x3 stem (no max-pool), stages, global average pool, fc.

    Works on any input size (global average pooling). Use :func:`resnet20` or
    :func:`resnet18`.

    Example:
        >>> ResNet((1, 1), (8, 16))(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        blocks: Sequence[int],
        widths: Sequence[int],
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
    ) -> None:
        super().__init__()
        if len(blocks) != len(widths):
            raise ValueError(f"blocks and widths must have the same length, got {blocks} and {widths}")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        stages = []
        in_planes = widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            layer = []
            for j in range(n):
                layer.append(BasicBlock(in_planes, w, stride=2 if (i > 0 and j == 0) else 1))
                in_planes = w
            stages.append(nn.Sequential(*layer))
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_planes, num_classes)
        self.input_shape = (in_channels, image_size, image_size)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(self.flatten(self.pool(x)))


def resnet20(in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> ResNet:
    """ResNet-20: 3 stages of 3 basic blocks with 16/32/64 channels (~0.27 M parameters).

    Example:
        >>> resnet20()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    return ResNet((3, 3, 3), (16, 32, 64), in_channels, num_classes, image_size)


def resnet18(in_channels: int = 1, num_classes: int = 10, image_size: int = 32) -> ResNet:
    """CIFAR-style ResNet-18: 4 stages of 2 basic blocks, 64-512 channels (~11 M parameters), 32x32 input.

    Example:
        >>> sum(p.numel() for p in resnet18().parameters()) > 11_000_000
        True
    """
    return ResNet((2, 2, 2, 2), (64, 128, 256, 512), in_channels, num_classes, image_size)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections (``nn.Linear``).

    Example:
        >>> CausalSelfAttention(32, 4)(torch.zeros(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n_heads

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + fc2(GELU(fc1(ln2(x))))``.

    Example:
        >>> TransformerBlock(32, 4)(torch.zeros(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class CharTransformer(nn.Module):
    """Character-level GPT-style decoder: token + learned positional embeddings, pre-norm blocks, LM head.

    Input int64 token ids ``(B, T)`` with ``T <= seq_len``; output logits ``(B, T, vocab_size)``.

    Example:
        >>> m = CharTransformer(vocab_size=65, d_model=32, n_layers=2, n_heads=4, seq_len=16)
        >>> m(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 65])
    """

    def __init__(
        self,
        vocab_size: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.input_shape = (seq_len,)
        self.vocab_size = vocab_size
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 scaling of residual projections
            if name.endswith(("out_proj.weight", "fc2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expected int64 token ids of shape (B, T), got {tuple(idx.shape)} {idx.dtype}")
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class CharLSTM(nn.Module):
    """Character-level LSTM language model: embedding, a Linear input projection (tanh), one LSTM
    layer, a Linear projection (ReLU) and the LM head.

    Input int64 token ids ``(B, T)`` with ``T <= seq_len``; output logits ``(B, T, vocab_size)``.
    The recurrent model of the study (its gradients flow back through time, where the
    transformer's and the CNNs' do not).

    Example:
        >>> m = CharLSTM(vocab_size=65, d_model=32, seq_len=16)
        >>> m(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 65])
    """

    def __init__(self, vocab_size: int = 128, d_model: int = 128, seq_len: int = 128) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.inp = nn.Linear(d_model, d_model)
        self.lstm = nn.LSTM(d_model, d_model, batch_first=True)
        self.proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.input_shape = (seq_len,)
        self.vocab_size = vocab_size

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expected int64 token ids of shape (B, T), got {tuple(idx.shape)} {idx.dtype}")
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the model's seq_len={self.seq_len}")
        h, _ = self.lstm(torch.tanh(self.inp(self.embed(idx))))
        return self.head(torch.relu(self.proj(h)))


# ----------------------------------------------------------------------------- registry
MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "cnn": SmallCNN,
    "resnet20": resnet20,
    "resnet18": resnet18,
    "transformer": CharTransformer,
    "lstm": CharLSTM,
    "mobilenet": MobileNetV2Tiny,
}
"""Model constructors by name (see :func:`build_model`)."""

DEFAULT_DATA = {"mlp": "fashion-mnist", "cnn": "fashion-mnist", "resnet20": "fashion-mnist",
                "resnet18": "fashion-mnist", "transformer": "shakespeare", "lstm": "shakespeare",
                "mobilenet": "fashion-mnist"}  # fmt: skip
"""The built-in dataset each model is meant for (``resnet18`` wants it padded to 32x32)."""

TEXT_MODELS = frozenset(name for name, data in DEFAULT_DATA.items() if data == "shakespeare")
"""The models that take character ids (the others take images)."""


def list_models() -> list[str]:
    """Names accepted by :func:`build_model`.

    Example:
        >>> list_models()
        ['cnn', 'lstm', 'mlp', 'mobilenet', 'resnet18', 'resnet20', 'transformer']
    """
    return sorted(MODELS)


def build_model(name: str, *, seed: int | None = None, **kw: Any) -> nn.Module:
    """Build a built-in model by name; ``kw`` go to its constructor.

    With ``seed``, the initial weights depend only on the seed (the global RNG is
    left untouched).

    Example:
        >>> a, b = build_model("mlp", seed=1), build_model("mlp", seed=1)
        >>> torch.equal(a.net[1].weight, b.net[1].weight)
        True
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {list_models()}")
    try:
        if seed is None:
            return MODELS[name](**kw)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MODELS[name](**kw)
    except TypeError as exc:
        raise ValueError(f"bad arguments for model {name!r}: {exc}") from None


def example_input(model: nn.Module, batch_size: int = 2, *, generator: torch.Generator | None = None) -> Tensor:
    """A random input batch of the right shape and dtype for a built-in model.

    Example:
        >>> example_input(build_model("resnet18")).shape
        torch.Size([2, 1, 32, 32])
    """
    shape = getattr(model, "input_shape", None)
    if shape is None:
        raise ValueError(f"{type(model).__name__} has no input_shape; not a built-in model")
    if isinstance(model, (CharTransformer, CharLSTM)):
        return torch.randint(0, model.vocab_size, (batch_size, *shape), generator=generator)
    return torch.randn(batch_size, *shape, generator=generator)
