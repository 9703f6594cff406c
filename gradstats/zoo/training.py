"""A small, seeded training loop for the built-in models and data, with a per-step callback.

``train`` runs N optimizer steps on seeded minibatches and returns the losses and
(when test data is given, or for a character dataset its validation split) the test
accuracy and loss. A tracer or a plan steps along through ``optimizer=`` or the
``callback``.

Example:
    >>> from gradstats.zoo.data import load_fashion_mnist
    >>> from gradstats.zoo.models import build_model
    >>> train_set = load_fashion_mnist(split="train", source="subset", subset=512)
    >>> test_set = load_fashion_mnist(split="test", source="subset", subset=200)
    >>> model = build_model("mlp", seed=0)
    >>> result = train(model, train_set, test=test_set, steps=20, batch_size=64, lr=0.05, progress=False)
    >>> len(result.losses), result.test_accuracy > 0.5
    (20, True)
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradstats.zoo.data import CharDataset, ImageDataset, minibatches

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

Data = ImageDataset | CharDataset | tuple[Tensor, Tensor]
Callback = Callable[[int, float], "bool | None"]

DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


@dataclass
class TrainResult:
    """What :func:`train` did: per-step losses, final test metrics, evaluation history, timing.

    Attributes:
        losses: training loss after each step (float, in step order).
        test_accuracy, test_loss: on the test data at the end (``None`` without test data).
        history: ``[{"step", "test_accuracy", "test_loss"}]`` from ``eval_every``.
        steps: steps completed (fewer than asked when stopped early or diverged).
        wall_time: seconds spent in the loop, evaluation excluded.
        diverged: the loss became non-finite (training stopped there).
        config: the settings (model class, optimizer, lr, batch size, seed, ...).

    Example:
        >>> r = train(nn.Linear(4, 2), (torch.randn(32, 4), torch.randint(0, 2, (32,))), steps=3,
        ...           batch_size=8, progress=False)
        >>> r.steps, len(r.to_dataframe())
        (3, 3)
    """

    losses: list[float]
    test_accuracy: float | None = None
    test_loss: float | None = None
    history: list[dict] = field(default_factory=list)
    steps: int = 0
    wall_time: float = 0.0
    diverged: bool = False
    config: dict = field(default_factory=dict)

    @property
    def step_time(self) -> float:
        """Mean seconds per training step."""
        return self.wall_time / max(self.steps, 1)

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)

    def to_dataframe(self) -> "pd.DataFrame":
        """Losses as a pandas DataFrame (``step``, ``loss``)."""
        import pandas as pd

        return pd.DataFrame({"step": range(len(self.losses)), "loss": self.losses})

    def plot(self, ax: Any = None) -> Any:
        """Training loss against step (log-scaled y axis); returns the matplotlib Figure."""
        import matplotlib.pyplot as plt

        fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(5, 3))
        ax.plot(self.losses, lw=1)
        ax.set(xlabel="step", ylabel="training loss", yscale="log")
        if self.test_accuracy is not None:
            ax.set_title(f"test accuracy {self.test_accuracy:.3f}")
        return fig

    def __repr__(self) -> str:
        last = f"{self.losses[-1]:.4f}" if self.losses else "n/a"
        acc = f", test_accuracy={self.test_accuracy:.4f}" if self.test_accuracy is not None else ""
        return f"TrainResult(steps={self.steps}, final_loss={last}{acc}, step_time={self.step_time * 1e3:.1f} ms)"


def make_optimizer(
    model: nn.Module, name: str = "sgd", *, lr: float | None = None, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """SGD with momentum (default lr 0.05), Adam or AdamW (default lr 1e-3).

    Example:
        >>> opt = make_optimizer(nn.Linear(2, 2), "adamw")
        >>> type(opt).__name__, opt.param_groups[0]["lr"]
        ('AdamW', 0.001)
    """
    if name not in DEFAULT_LR:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(DEFAULT_LR)} or an Optimizer")
    lr = DEFAULT_LR[name] if lr is None else lr
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    params = model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy for class logits ``(B, C)`` or sequence logits ``(B, T, V)`` (computed in float32).

    Example:
        >>> round(float(loss_fn(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))), 4)
        1.3863
    """
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _batches(data: Data, batch_size: int, seed: int, seq_len: int | None, device: torch.device) -> Iterator:
    if isinstance(data, CharDataset):
        for x, y in data.batches(batch_size, seq_len=seq_len or 128, seed=seed):
            yield x.to(device), y.to(device)
        return
    if isinstance(data, ImageDataset):
        x, y = data.images, data.labels
    elif isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        x, y = data
    else:
        raise ValueError(f"data must be an ImageDataset, a CharDataset or a tuple (inputs, targets), got {type(data).__name__}")
    x, y = x.to(device), y.to(device)  # once; batches are gathered on the device
    yield from minibatches(x, y, batch_size=batch_size, seed=seed)


@torch.no_grad()
def _eval(model: nn.Module, data: Data, batch_size: int, seq_len: int | None, amp: torch.dtype | None) -> tuple[float, float]:
    """(accuracy, mean loss) over the whole image set, or over 20 fixed validation batches of a CharDataset."""
    device = _device_of(model)
    was_training = model.training
    model.eval()
    try:
        if isinstance(data, CharDataset):
            it = data.batches(min(batch_size, 64), seq_len=seq_len or 128, seed=12345, split="val", steps=20)
        else:
            x, y = (data.images, data.labels) if isinstance(data, ImageDataset) else data
            it = zip(x.split(batch_size), y.split(batch_size))
        correct = total = 0
        loss_sum = 0.0
        for xb, yb in it:
            xb, yb = xb.to(device), yb.to(device)
            with _autocast(device, amp):
                out = model(xb)
            loss_sum += float(loss_fn(out, yb)) * yb.numel()
            correct += int((out.argmax(-1) == yb).sum())
            total += yb.numel()
    finally:
        model.train(was_training)
    return correct / total, loss_sum / total


def evaluate(model: nn.Module, data: Data, *, batch_size: int = 1000, seq_len: int | None = None) -> float:
    """Accuracy of ``model`` on image data (whole set), or next-character accuracy on a CharDataset's validation split.

    The model is put in eval mode for the evaluation and restored afterwards.

    Example:
        >>> from gradstats.zoo.data import load_fashion_mnist
        >>> from gradstats.zoo.models import build_model
        >>> acc = evaluate(build_model("cnn", seed=0), load_fashion_mnist(split="test", source="subset"))
        >>> 0.0 <= acc <= 1.0
        True
    """
    return _eval(model, data, batch_size, seq_len, None)[0]


def _autocast(device: torch.device, amp: torch.dtype | None):
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp)


def train(
    model: nn.Module,
    data: Data,
    *,
    steps: int,
    batch_size: int = 128,
    lr: float | None = None,
    optimizer: str | torch.optim.Optimizer = "sgd",
    weight_decay: float = 0.0,
    schedule: str = "constant",
    warmup: int = 0,
    seed: int = 0,
    test: Data | None = None,
    eval_every: int | None = None,
    seq_len: int | None = None,
    callback: Callback | None = None,
    amp: torch.dtype | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` for ``steps`` optimizer steps on seeded minibatches of ``data``.

    Args:
        data: an :class:`~gradstats.zoo.data.ImageDataset`, a :class:`~gradstats.zoo.data.CharDataset`
            (random windows of ``seq_len``, default 128), or a tuple ``(inputs, targets)``.
        optimizer: ``"sgd"`` (momentum 0.9), ``"adam"``, ``"adamw"``, or an Optimizer you built
            (e.g. one a tracer watches); ``lr`` defaults per optimizer (:data:`DEFAULT_LR`).
        schedule: ``"constant"`` or ``"cosine"`` (to zero at the last step), after ``warmup`` linear steps.
        seed: fixes the order of the minibatches (initialise the model with ``build_model(..., seed=)``).
        test: evaluation data (defaults to the validation split of a CharDataset); evaluated at the
            end and every ``eval_every`` steps.
        callback: ``callback(step, loss)`` after each optimizer step (step counts from 0); return
            True to stop early.
        amp: an autocast dtype (``torch.bfloat16``, ``torch.float16``) or None for full precision.
        progress: show a progress bar (drawn on a terminal only; see :mod:`gradstats._progress`).

    The model is left in train mode. Batches live on the model's device.

    Example:
        >>> from gradstats.zoo.data import load_fashion_mnist
        >>> from gradstats.zoo.models import build_model
        >>> seen = []
        >>> r = train(build_model("mlp", seed=0), load_fashion_mnist(source="subset", subset=256), steps=5,
        ...           batch_size=32, callback=lambda step, loss: seen.append(step), progress=False)
        >>> seen
        [0, 1, 2, 3, 4]
    """
    from gradstats._progress import progress_bar

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    if eval_every is not None and eval_every <= 0:
        raise ValueError(f"eval_every must be a positive int or None, got {eval_every}")
    if isinstance(optimizer, torch.optim.Optimizer):
        opt, opt_name = optimizer, type(optimizer).__name__
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
    else:
        opt, opt_name = make_optimizer(model, optimizer, lr=lr, weight_decay=weight_decay), optimizer
    base_lrs = [g["lr"] for g in opt.param_groups]
    if test is None and isinstance(data, CharDataset):
        test = data
    device = _device_of(model)
    eval_bs = 1000 if not isinstance(data, CharDataset) else batch_size

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            span = max(steps - warmup, 1)
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / span))
        return 1.0

    result = TrainResult(
        losses=[],
        config={
            "model": type(model).__name__, "optimizer": opt_name, "lr": base_lrs[0], "batch_size": batch_size,
            "steps": steps, "seed": seed, "schedule": schedule, "warmup": warmup, "weight_decay": weight_decay,
            "seq_len": seq_len, "amp": str(amp) if amp else None, "device": str(device),
        },
    )  # fmt: skip
    model.train()
    batches = _batches(data, batch_size, seed, seq_len, device)
    bar = progress_bar(total=steps, desc=f"train {type(model).__name__}", unit="step", progress=progress,
                       note=f"training {type(model).__name__} for {steps} steps ({opt_name}, batch {batch_size})",
                       logger=log)
    t_loop = 0.0
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = base * lr_factor(step)
            x, y = next(batches)
            with _autocast(device, amp):
                out = model(x)
            loss = loss_fn(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = float(loss.detach())
            t_loop += time.perf_counter() - t0
            result.losses.append(value)
            result.steps = step + 1
            if not math.isfinite(value):
                result.diverged = True
                log.warning("training diverged at step %d (loss %s); stopping", step, value)
                break
            bar.update()
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{value:.4f}")
            if eval_every and test is not None and (step + 1) % eval_every == 0 and step + 1 < steps:
                acc, tl = _eval(model, test, eval_bs, seq_len, amp)
                result.history.append({"step": step + 1, "test_accuracy": acc, "test_loss": tl})
            if callback is not None and callback(step, value):
                log.info("callback stopped training after step %d", step)
                break
    finally:
        bar.close()
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base
    result.wall_time = t_loop
    if test is not None and not result.diverged:
        if not result.history or result.history[-1]["step"] != result.steps:
            acc, tl = _eval(model, test, eval_bs, seq_len, amp)
            result.history.append({"step": result.steps, "test_accuracy": acc, "test_loss": tl})
        result.test_accuracy, result.test_loss = result.history[-1]["test_accuracy"], result.history[-1]["test_loss"]
    log.info("%r", result)
    return result


# ----------------------------------------------------------------------------- model + data + settings
RECOMMENDED: dict[str, dict] = {
    "mlp": {"optimizer": "sgd", "lr": 0.05, "batch_size": 128},
    "cnn": {"optimizer": "sgd", "lr": 0.05, "batch_size": 128},
    "resnet20": {"optimizer": "sgd", "lr": 0.05, "batch_size": 128},
    "resnet18": {"optimizer": "sgd", "lr": 0.05, "batch_size": 128},
    "transformer": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 32, "seq_len": 128, "warmup": 30},
    "lstm": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 32, "seq_len": 128, "warmup": 30},
}
"""Training settings that work for each built-in model on its built-in data (see :func:`prepare`)."""


@dataclass
class Task:
    """A built-in model with its data and recommended settings; ``run(steps)`` trains it.

    Attributes:
        name: the model's registry name.
        model: the built model (on the requested device).
        train_data, test_data: the datasets (``test_data`` is None for a character dataset,
            whose validation split is used).
        hparams: keyword arguments for :func:`train` (optimizer, lr, batch size, seed, ...).

    Example:
        >>> task = prepare("mlp", source="subset", subset=128, test_subset=50)
        >>> task.run(2, batch_size=32, progress=False).steps
        2
    """

    name: str
    model: nn.Module
    train_data: Data
    test_data: Data | None
    hparams: dict

    def run(self, steps: int, **overrides) -> TrainResult:
        """``train(model, train_data, test=test_data, steps=steps, **hparams | overrides)``."""
        kw = {**self.hparams, **overrides}
        kw.setdefault("test", self.test_data)
        return train(self.model, self.train_data, steps=steps, **kw)

    def to_dict(self) -> dict:
        """Model name, data summaries and settings."""
        return {
            "model": self.name,
            "train_data": self.train_data.to_dict() if hasattr(self.train_data, "to_dict") else None,
            "test_data": self.test_data.to_dict() if hasattr(self.test_data, "to_dict") else None,
            "hparams": dict(self.hparams),
        }


def prepare(
    name: str,
    *,
    data: str | None = None,
    root: str | None = None,
    source: str = "auto",
    subset: int | None = None,
    test_subset: int | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    **model_kw: Any,
) -> Task:
    """Build a registry model, load the data it is meant for, and pick its recommended settings.

    Args:
        name: a model name from :func:`gradstats.zoo.models.list_models`.
        data: dataset name (default: the model's, :data:`gradstats.zoo.models.DEFAULT_DATA`);
            ``"digits"`` is resampled to the model's image size.
        root, source, subset: passed to the image loader (``root`` is a text file for Shakespeare);
            ``test_subset`` limits the test split likewise.
        seed: initialises the model and orders the minibatches.
        device: move the model there (batches follow it).
        model_kw: passed to the model constructor (e.g. ``d_model=256``).

    Example:
        >>> task = prepare("cnn", source="subset", subset=256, test_subset=100)
        >>> task.train_data.source, task.hparams["lr"]
        ('committed subset', 0.05)
        >>> task.run(3, progress=False).steps
        3
    """
    from gradstats.zoo.data import load_data, load_images
    from gradstats.zoo.models import DEFAULT_DATA, TEXT_MODELS, build_model, list_models

    if name not in RECOMMENDED:
        raise ValueError(f"unknown model {name!r}; expected one of {list_models()}")
    data = data or DEFAULT_DATA[name]
    hparams = {**RECOMMENDED[name], "seed": seed}
    if data == "shakespeare":
        if name not in TEXT_MODELS:
            raise ValueError(f"model {name!r} takes images; the shakespeare data needs a character model "
                             f"({' or '.join(repr(m) for m in sorted(TEXT_MODELS))})")
        train_data = load_data("shakespeare", root)
        model_kw.setdefault("vocab_size", train_data.vocab_size)
        model_kw.setdefault("seq_len", hparams["seq_len"])
        hparams["seq_len"] = model_kw["seq_len"]
        test_data = None
    else:
        if name in TEXT_MODELS:
            raise ValueError(f"model {name!r} takes characters; use data='shakespeare', not {data!r}")
        size = 32 if name == "resnet18" else 28
        kw: dict = {"size": size, "source": source}
        train_data = load_images(data, root, split="train", **kw, **({"subset": subset} if subset else {}))
        test_data = load_images(data, root, split="test", **kw, **({"subset": test_subset} if test_subset else {}))
        if name == "cnn":
            model_kw.setdefault("image_size", size)
    model = build_model(name, seed=seed, **model_kw)
    if device is not None:
        model = model.to(device)
    log.info("prepared %s on %s (%s)", name, getattr(train_data, "name", data), getattr(train_data, "source", ""))
    return Task(name, model, train_data, test_data, hparams)
