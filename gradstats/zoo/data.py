"""Built-in data: Fashion-MNIST (IDX), scikit-learn digits, Shakespeare characters.

Nothing is downloaded. Fashion-MNIST is looked up, in order, in an explicit
``root`` directory, the Debian package ``dataset-fashion-mnist``
(``/usr/share/datasets/fashion-mnist``), then the balanced subset committed
under ``data/fashion-mnist`` (6,000 train + 1,000 test images). The committed
``data/`` directory is found beside the source tree, or through the
environment variable ``GRADSTATS_DATA``. Every loader reports which source it
used (``.source`` and a log line).

This module holds the image datasets, seeded minibatches and :func:`load_data` (any built-in
dataset by name); it is the one place to import the data from, so it also serves the names of
:mod:`gradstats.zoo.files` (``data_dir``, ``read_idx``: where the data lives, how IDX files are
read) and :mod:`gradstats.zoo.text` (``CharDataset``, ``load_shakespeare``: the characters).

Example:
    >>> from gradstats.zoo.data import load_fashion_mnist
    >>> test = load_fashion_mnist(split="test", source="subset")
    >>> test.images.shape, test.labels.dtype, test.source
    (torch.Size([1000, 1, 28, 28]), torch.int64, 'committed subset')
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gradstats.zoo.files import DATA_ENV, FULL_SET, SUBSET, _find, _read, data_dir, read_idx
from gradstats.zoo.text import CharDataset, load_shakespeare

__all__ = ["ImageDataset", "load_fashion_mnist", "load_digits", "load_images", "fashion_mnist_sources", "minibatches",
           "load_data", "DATASETS", "IMAGE_DATASETS", "FASHION_CLASSES", "DEBIAN_FASHION_MNIST", "data_dir",
           "read_idx", "DATA_ENV", "FULL_SET", "SUBSET", "CharDataset", "load_shakespeare"]

log = logging.getLogger(__name__)

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs the full set."""

FASHION_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
# Mean and standard deviation of the full 60,000-image training set (pixels in [0, 1]);
# the same constants for every source, so subset and full set are normalised alike.
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
DIGITS_MEAN, DIGITS_STD = 0.3053, 0.3760  # 1,797 scikit-learn digits, pixels / 16

HOW_TO_GET_FASHION = (
    "Install the full set with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu; files in "
    f"{DEBIAN_FASHION_MNIST}), or pass root=DIR (CLI: --data DIR) holding train-images-idx3-ubyte[.gz], "
    "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] from "
    "https://github.com/zalandoresearch/fashion-mnist; the committed subset lives in the repository's "
    f"data/fashion-mnist, and an installed wheel carries it (or set {DATA_ENV}=<repository>/data)."
)


# ----------------------------------------------------------------------------- image datasets
@dataclass
class ImageDataset:
    """Images ``(N, C, H, W)`` float32 (normalised) with int64 labels, and where they came from.

    Attributes:
        images: float32 tensor ``(N, C, H, W)``.
        labels: int64 tensor ``(N,)``.
        name: dataset name (``"fashion-mnist"``, ``"digits"``).
        split: ``"train"`` or ``"test"``.
        source: ``"full Debian set"``, ``"committed subset"`` or ``"directory DIR"``.
        path: directory the files were read from.
        classes: class names, indexed by label.

    Example:
        >>> ds = load_fashion_mnist(split="test", source="subset")
        >>> xb, yb = next(ds.batches(32, seed=0))
        >>> xb.shape, yb.shape
        (torch.Size([32, 1, 28, 28]), torch.Size([32]))
    """

    images: Tensor
    labels: Tensor
    name: str
    split: str
    source: str
    path: Path | None = None
    classes: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes) if self.classes else int(self.labels.max()) + 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one image, ``(C, H, W)``."""
        return tuple(self.images.shape[1:])

    def batches(
        self, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = True, epochs: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Seeded minibatches ``(images, labels)``; endless unless ``epochs`` is given. See :func:`minibatches`."""
        return minibatches(
            self.images, self.labels, batch_size=batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, epochs=epochs
        )

    def class_counts(self) -> list[int]:
        """Number of images of each class."""
        return torch.bincount(self.labels, minlength=self.num_classes).tolist()

    def to_dict(self) -> dict:
        """Summary (not the tensors): name, split, source, path, size, shape, class counts."""
        return {
            "name": self.name,
            "split": self.split,
            "source": self.source,
            "path": str(self.path) if self.path else None,
            "n": len(self),
            "input_shape": list(self.input_shape),
            "class_counts": self.class_counts(),
            **self.meta,
        }

    def __repr__(self) -> str:
        return f"ImageDataset({self.name!r}, split={self.split!r}, n={len(self)}, shape={self.input_shape}, source={self.source!r})"


def _check_split(split: str) -> str:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split


def _balanced_subset(labels: Tensor, n: int, seed: int) -> Tensor:
    """Indices of ``n`` examples, as balanced over classes as possible, drawn with ``seed``, in original order."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"subset must be a positive int, got {n!r}")
    if n > len(labels):
        raise ValueError(f"subset={n} is larger than the dataset ({len(labels)} examples)")
    g = torch.Generator().manual_seed(seed)
    classes = torch.unique(labels)
    per_class = [torch.nonzero(labels == c).flatten() for c in classes]
    per_class = [idx[torch.randperm(len(idx), generator=g)] for idx in per_class]
    # round-robin over classes: the first n of this order is balanced
    rank = torch.cat([torch.arange(len(idx)) for idx in per_class])
    order = torch.cat(per_class)
    key = rank * len(classes) + torch.cat([torch.full((len(idx),), i) for i, idx in enumerate(per_class)])
    chosen = order[torch.argsort(key)[:n]]
    return torch.sort(chosen).values


def _pad(images: Tensor, size: int | None) -> Tensor:
    if size is None or size == images.shape[-1]:
        return images
    h, w = images.shape[-2:]
    if size < max(h, w):
        raise ValueError(f"size={size} is smaller than the images ({h}x{w}); expected >= {max(h, w)}")
    top, left = (size - h) // 2, (size - w) // 2
    return F.pad(images, (left, size - w - left, top, size - h - top))


def fashion_mnist_sources(root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """The candidate Fashion-MNIST directories, in search order, as ``(source, path)`` pairs.

    Example:
        >>> [s for s, _ in fashion_mnist_sources()][-1]
        'committed subset'
    """
    if root is not None:
        return [(f"directory {Path(root)}", Path(root).expanduser())]
    out = [(FULL_SET, DEBIAN_FASHION_MNIST)]
    ddir = data_dir()
    if ddir is not None:
        out.append((SUBSET, ddir / "fashion-mnist"))
    return out


_SUBSET_WARNED: list[bool] = []


def load_fashion_mnist(
    root: str | os.PathLike | None = None,
    *,
    split: Literal["train", "test"] = "train",
    subset: int | None = None,
    seed: int = 0,
    source: Literal["auto", "full", "subset"] = "auto",
    normalize: bool = True,
    size: int | None = None,
) -> ImageDataset:
    """Load Fashion-MNIST as float32 ``(N, 1, 28, 28)`` images and int64 labels.

    Args:
        root: a directory holding the four IDX files (``.gz`` or not); when given,
            only it is searched. Otherwise the full Debian set, then the committed subset.
        split: ``"train"`` (60,000 full / 6,000 subset) or ``"test"`` (10,000 / 1,000).
        subset: keep this many examples, balanced over classes, chosen with ``seed``.
        source: ``"auto"`` (search order above), ``"full"`` (the Debian set only) or
            ``"subset"`` (the committed subset only).
        normalize: subtract the training-set mean and divide by its std (else pixels in [0, 1]).
        size: zero-pad the images to ``size x size`` (e.g. 32 for the CIFAR-style ResNet-18).

    The source used is logged and recorded in ``.source``.

    Example:
        >>> ds = load_fashion_mnist(split="train", source="subset", subset=100, size=32)
        >>> ds.images.shape, ds.class_counts()
        (torch.Size([100, 1, 32, 32]), [10, 10, 10, 10, 10, 10, 10, 10, 10, 10])
    """
    _check_split(split)
    if source not in ("auto", "full", "subset"):
        raise ValueError(f"source must be 'auto', 'full' or 'subset', got {source!r}")
    if root is not None and source != "auto":
        raise ValueError("give either root=DIR or source='full'/'subset', not both")
    candidates = fashion_mnist_sources(root)
    if source == "full":
        candidates = [c for c in candidates if c[0] == FULL_SET]
    elif source == "subset":
        candidates = [c for c in candidates if c[0] == SUBSET]
    prefix = "train" if split == "train" else "t10k"
    for name, directory in candidates:
        img_path = _find(directory, f"{prefix}-images-idx3-ubyte")
        lbl_path = _find(directory, f"{prefix}-labels-idx1-ubyte")
        if img_path is None or lbl_path is None:
            if root is not None:
                raise FileNotFoundError(
                    f"Fashion-MNIST {split} files not found in {directory} (looked for "
                    f"{prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-idx1-ubyte[.gz]). {HOW_TO_GET_FASHION}"
                )
            continue
        images, labels = _read(img_path), _read(lbl_path)
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(f"{img_path}: expected images of shape (N, 28, 28), got {images.shape}")
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError(f"{lbl_path}: {labels.shape[0]} labels for {images.shape[0]} images in {img_path}")
        if labels.size and labels.max() > 9:
            raise ValueError(f"{lbl_path}: labels must be 0..9, found {int(labels.max())}")
        x = torch.from_numpy(images.astype(np.float32)).div_(255.0).unsqueeze(1)
        y = torch.from_numpy(labels.astype(np.int64))
        if subset is not None:
            idx = _balanced_subset(y, subset, seed)
            x, y = x[idx], y[idx]
        if normalize:
            x = x.sub_(FASHION_MEAN).div_(FASHION_STD)
        x = _pad(x, size)
        log.info("Fashion-MNIST %s: %d images from the %s (%s)", split, len(y), name, directory)
        if name == SUBSET and source == "auto" and root is None and not _SUBSET_WARNED:
            _SUBSET_WARNED.append(True)          # once per process: a fallback a study must not miss
            log.warning("the full Fashion-MNIST set is not installed: using the committed subset (6,000 train, "
                        "1,000 test images). For the full set: apt-get install dataset-fashion-mnist, or "
                        "root=DIR with the IDX files; source='subset' silences this")
        return ImageDataset(x, y, "fashion-mnist", split, name, directory, FASHION_CLASSES)
    looked = ", ".join(str(d) for _, d in candidates) or "nowhere (no committed data directory found)"
    raise FileNotFoundError(f"Fashion-MNIST {split} split not found (looked in {looked}). {HOW_TO_GET_FASHION}")


def load_digits(
    path: str | os.PathLike | None = None,
    *,
    split: Literal["train", "test"] = "train",
    subset: int | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    normalize: bool = True,
    size: int | None = None,
) -> ImageDataset:
    """The 1,797 scikit-learn 8x8 digits (committed under ``data/digits``), as ``(N, 1, 8, 8)`` images.

    The train/test split is a fixed, class-stratified split (``test_fraction`` of each
    class is held out, the same for every ``seed``). ``subset`` keeps that many examples
    of the split, balanced over classes and drawn with ``seed``. ``size=28`` resamples the images
    (bilinear) to 28x28 so the Fashion-MNIST models accept them.

    Example:
        >>> tr, te = load_digits(split="train"), load_digits(split="test")
        >>> len(tr) + len(te), tr.images.shape[1:]
        (1797, torch.Size([1, 8, 8]))
    """
    _check_split(split)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if path is None:
        ddir = data_dir()
        if ddir is None:
            raise FileNotFoundError(f"no committed data directory found; set {DATA_ENV}=<repository>/data")
        path = ddir / "digits" / "digits.csv.gz"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"scikit-learn digits file not found: {path}")
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a valid digits CSV ({exc})") from None
    if table.ndim != 2 or table.shape[1] != 65:
        raise ValueError(f"{path}: expected rows of 64 pixels and a label, got shape {table.shape}")
    x = torch.from_numpy(table[:, :64].copy()).div_(16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    g = torch.Generator().manual_seed(0)  # one fixed split, whatever the subset seed
    test_mask = torch.zeros(len(y), dtype=torch.bool)
    for c in torch.unique(y):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        test_mask[idx[: round(test_fraction * len(idx))]] = True
    keep = test_mask if split == "test" else ~test_mask
    x, y = x[keep], y[keep]
    if subset is not None:
        idx = _balanced_subset(y, subset, seed)
        x, y = x[idx], y[idx]
    if normalize:
        x = (x - DIGITS_MEAN) / DIGITS_STD
    if size is not None and size != 8:
        if size < 8:
            raise ValueError(f"size must be >= 8, got {size}")
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    log.info("digits %s: %d images from the %s (%s)", split, len(y), SUBSET, path)
    return ImageDataset(x, y, "digits", split, SUBSET, path.parent, tuple(str(i) for i in range(10)))


IMAGE_DATASETS = ("fashion-mnist", "digits")


def load_images(
    name: str = "fashion-mnist", root: str | os.PathLike | None = None, *, split: str = "train", **kw: Any
) -> ImageDataset:
    """Load an image dataset by name: ``"fashion-mnist"``, ``"digits"``, or ``"auto"``.

    The digits are resampled to 28x28 unless ``size`` says otherwise, so that every
    image set from here fits the built-in image models. ``"auto"`` gives Fashion-MNIST
    from the first source found, and falls back to the committed digits (with a warning)
    only when no Fashion-MNIST is available at all.

    Example:
        >>> load_images("digits", split="test", size=28).images.shape
        torch.Size([359, 1, 28, 28])
    """
    if name == "fashion-mnist":
        return load_fashion_mnist(root, split=split, **kw)
    def digits(path, kw):
        if kw.pop("source", "auto") not in ("auto", "subset"):
            raise ValueError("the digits exist only as the committed subset; source must be 'auto' or 'subset'")
        kw["size"] = kw.get("size") or 28
        return load_digits(path, split=split, **kw)

    if name == "digits":
        return digits(root, kw)
    if name == "auto":
        try:
            return load_fashion_mnist(root, split=split, **kw)
        except FileNotFoundError as exc:
            log.warning("%s Falling back to the scikit-learn digits.", exc)
            return digits(None, kw)
    raise ValueError(f"unknown image dataset {name!r}; expected one of {IMAGE_DATASETS} or 'auto'")


# ----------------------------------------------------------------------------- minibatches
def minibatches(
    *tensors: Tensor,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    epochs: int | None = None,
) -> Iterator[tuple[Tensor, ...]]:
    """Seeded shuffled minibatches over tensors sharing their first dimension.

    Each epoch draws a fresh permutation from a ``torch.Generator`` seeded with ``seed``,
    so the sequence of batches depends on ``seed`` only. Endless when ``epochs`` is None.

    Example:
        >>> x, y = torch.arange(10.0), torch.arange(10)
        >>> it = minibatches(x, y, batch_size=4, seed=1)
        >>> [len(b[0]) for b, _ in zip(it, range(3))]
        [4, 4, 4]
    """
    if not tensors:
        raise ValueError("minibatches needs at least one tensor")
    n = tensors[0].shape[0]
    if any(t.shape[0] != n for t in tensors):
        raise ValueError(f"tensors must share their first dimension, got {[tuple(t.shape) for t in tensors]}")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if drop_last and batch_size > n:
        raise ValueError(f"batch_size={batch_size} is larger than the dataset ({n} examples) with drop_last=True")
    if epochs is not None and epochs < 0:
        raise ValueError(f"epochs must be >= 0 or None, got {epochs}")
    g = torch.Generator().manual_seed(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = torch.randperm(n, generator=g) if shuffle else torch.arange(n)
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            idx = order[start : start + batch_size]
            yield tuple(t[idx] for t in tensors)
        epoch += 1


DATASETS = ("fashion-mnist", "digits", "shakespeare")


def load_data(name: str, root: str | os.PathLike | None = None, **kw: Any) -> ImageDataset | CharDataset:
    """Load a built-in dataset by name (``fashion-mnist``, ``digits``, ``shakespeare``).

    Example:
        >>> load_data("shakespeare").name
        'shakespeare'
    """
    if name == "shakespeare":
        return load_shakespeare(root, **kw)
    if name in IMAGE_DATASETS or name == "auto":
        return load_images(name, root, **kw)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
