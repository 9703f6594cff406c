"""The character-level corpus of the testbed: :class:`CharDataset` (vocabulary, encode/decode,
train/validation split, batches) and :func:`load_shakespeare`, the committed plays. Nothing is
downloaded; :func:`gradstats.zoo.data.load_data` loads it by name (``"shakespeare"``) beside the images.

Example:
    >>> from gradstats.zoo.text import load_shakespeare
    >>> ds = load_shakespeare()
    >>> x, y = ds.get_batch(2, 16)
    >>> x.shape, ds.source
    (torch.Size([2, 16]), 'committed subset')
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gradstats.zoo.files import DATA_ENV, SUBSET, data_dir

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- characters
@dataclass
class CharDataset:
    """A character-level corpus: vocabulary, encode/decode, train/validation split, batches.

    Attributes:
        text: the whole corpus.
        vocab: the sorted characters of the corpus (index = token id).
        data: the corpus encoded as an int64 tensor.
        train, val: contiguous parts of ``data`` (the last ``val_fraction`` is validation).
        source: where the text came from.

    Example:
        >>> ds = CharDataset.from_text("to be or not to be, that is the question. " * 20)
        >>> ds.decode(ds.encode("to be"))
        'to be'
        >>> x, y = ds.get_batch(4, 8, generator=torch.Generator().manual_seed(0))
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([4, 8]), True)
    """

    text: str
    vocab: str
    data: Tensor
    train: Tensor
    val: Tensor
    source: str = "text"
    name: str = "chars"

    @classmethod
    def from_text(cls, text: str, *, val_fraction: float = 0.1, source: str = "text", name: str = "chars") -> "CharDataset":
        """Build the vocabulary and the split from a string."""
        if not isinstance(text, str) or len(text) < 2:
            raise ValueError("text must be a string of at least 2 characters")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        vocab = "".join(sorted(set(text)))
        lut = np.full(max(map(ord, vocab)) + 1, -1, dtype=np.int64)
        lut[[ord(c) for c in vocab]] = np.arange(len(vocab))
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        data = torch.from_numpy(lut[codes])
        n_val = int(len(data) * val_fraction)
        return cls(text, vocab, data, data[: len(data) - n_val], data[len(data) - n_val :], source, name)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    def encode(self, s: str) -> Tensor:
        """Token ids (int64) of a string; characters outside the vocabulary are a ValueError."""
        stoi = self._stoi
        try:
            return torch.tensor([stoi[c] for c in s], dtype=torch.int64)
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """The string of a sequence of token ids."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if any(not 0 <= i < len(self.vocab) for i in ids):
            raise ValueError(f"token ids must be in [0, {len(self.vocab)})")
        return "".join(self.vocab[i] for i in ids)

    @functools.cached_property
    def _stoi(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.vocab)}

    def _split(self, split: str) -> Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val

    def get_batch(
        self, batch_size: int, seq_len: int, *, split: str = "train", generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """One batch of random windows: inputs ``(B, T)`` and targets shifted by one, int64."""
        data = self._split(split)
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        if len(data) <= seq_len:
            raise ValueError(f"the {split} split has {len(data)} tokens, too few for seq_len={seq_len}")
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        window = starts[:, None] + torch.arange(seq_len + 1)
        chunk = data[window]
        return chunk[:, :-1], chunk[:, 1:]

    def batches(
        self, batch_size: int, *, seq_len: int = 128, seed: int = 0, split: str = "train", steps: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Seeded endless (or ``steps``-long) stream of :meth:`get_batch` batches."""
        g = torch.Generator().manual_seed(seed)
        i = 0
        while steps is None or i < steps:
            yield self.get_batch(batch_size, seq_len, split=split, generator=g)
            i += 1

    def to_dict(self) -> dict:
        """Summary: name, source, sizes."""
        return {
            "name": self.name,
            "source": self.source,
            "n_chars": len(self.data),
            "vocab_size": self.vocab_size,
            "n_train": len(self.train),
            "n_val": len(self.val),
        }

    def __repr__(self) -> str:
        return f"CharDataset({self.name!r}, chars={len(self.data)}, vocab={self.vocab_size}, source={self.source!r})"


def load_shakespeare(path: str | os.PathLike | None = None, *, val_fraction: float = 0.1) -> CharDataset:
    """Shakespeare's plays as a character dataset (the committed ~1 MB, 8 whole plays, by default).

    ``path`` may name any plain-text file (e.g. the complete works) instead.

    Example:
        >>> ds = load_shakespeare()
        >>> ds.vocab_size, len(ds.data) > 1_000_000
        (76, True)
    """
    if path is None:
        ddir = data_dir()
        if ddir is None:
            raise FileNotFoundError(f"no committed data directory found; set {DATA_ENV}=<repository>/data")
        path, source = ddir / "shakespeare" / "shakespeare.txt", SUBSET
    else:
        source = f"file {path}"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    log.info("Shakespeare: %d characters from the %s (%s)", len(text), source, path)
    return CharDataset.from_text(text, val_fraction=val_fraction, source=source, name="shakespeare")
