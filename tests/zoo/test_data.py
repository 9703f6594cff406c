"""Tests for gradstats.zoo.data: IDX reader, Fashion-MNIST sources, digits, Shakespeare characters, minibatches."""
from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradstats.zoo import data as D

REPO = Path(__file__).resolve().parents[2]
FM = REPO / "data" / "fashion-mnist"


def write_idx(path: Path, array: np.ndarray, *, compress: bool = True) -> Path:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


def fake_fashion(directory: Path, n: int = 20, *, compress: bool = True, prefix: str = "train") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    ext = ".gz" if compress else ""
    write_idx(directory / f"{prefix}-images-idx3-ubyte{ext}", images, compress=compress)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{ext}", labels, compress=compress)
    return images, labels


# ----------------------------------------------------------------------------- the committed subset
def test_committed_subset_train_and_test():
    train = D.load_fashion_mnist(split="train", source="subset")
    test = D.load_fashion_mnist(split="test", source="subset")
    assert train.source == test.source == D.SUBSET == "committed subset"
    assert train.images.shape == (6000, 1, 28, 28) and test.images.shape == (1000, 1, 28, 28)
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert train.class_counts() == [600] * 10 and test.class_counts() == [100] * 10
    # normalised with the full-set constants: roughly zero mean, unit std on the subset too
    assert abs(float(train.images.mean())) < 0.05 and abs(float(train.images.std()) - 1) < 0.05
    # the pixel range maps back exactly to [0, 255] / 255
    raw = train.images * D.FASHION_STD + D.FASHION_MEAN
    assert float(raw.min()) == pytest.approx(0.0, abs=1e-5) and float(raw.max()) == pytest.approx(1.0, abs=1e-5)
    assert train.to_dict()["source"] == "committed subset"


def test_subset_files_are_the_originals_at_the_recorded_indices():
    """The committed IDX files hold the original pixels of the listed indices (checked against the full set if installed)."""
    idx = np.loadtxt(FM / "t10k-indices.txt", dtype=np.int64, comments="#")
    labels = D.read_idx(FM / "t10k-labels-idx1-ubyte.gz")
    assert len(idx) == len(labels) == 1000 and np.all(np.diff(idx) > 0)
    full = D.DEBIAN_FASHION_MNIST / "t10k-labels-idx1-ubyte.gz"
    if full.exists():
        assert np.array_equal(D.read_idx(full)[idx], labels)
        full_img = D.read_idx(D.DEBIAN_FASHION_MNIST / "t10k-images-idx3-ubyte.gz")
        assert np.array_equal(full_img[idx], D.read_idx(FM / "t10k-images-idx3-ubyte.gz"))


def test_read_idx_headers_and_plain_files(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    for compress in (True, False):
        p = write_idx(tmp_path / f"a{compress}", arr, compress=compress)
        out = D.read_idx(p)
        assert out.dtype == np.uint8 and np.array_equal(out, arr)
    # a big-endian int32 IDX file is read in native order
    vals = np.array([1, -2, 70000], dtype=">i4")
    p = tmp_path / "i32"
    p.write_bytes(struct.pack(">HBB", 0, 0x0C, 1) + struct.pack(">I", 3) + vals.tobytes())
    assert D.read_idx(p).tolist() == [1, -2, 70000]


def test_read_idx_errors(tmp_path):
    good = write_idx(tmp_path / "good", np.zeros((4, 28, 28), np.uint8), compress=False)
    raw = good.read_bytes()
    bad_magic = tmp_path / "magic"
    bad_magic.write_bytes(b"\x01\x02" + raw[2:])
    with pytest.raises(ValueError, match="bad IDX magic number"):
        D.read_idx(bad_magic)
    truncated = tmp_path / "trunc"
    truncated.write_bytes(raw[:-10])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        D.read_idx(truncated)
    bad_gz = tmp_path / "bad.gz"
    bad_gz.write_bytes(gzip.compress(raw)[:-20])
    with pytest.raises(ValueError, match="corrupt or truncated gzip"):
        D.read_idx(bad_gz)
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"\x00")
    with pytest.raises(ValueError, match="too short"):
        D.read_idx(tiny)
    with pytest.raises(FileNotFoundError, match="IDX file not found"):
        D.read_idx(tmp_path / "nope")


def test_explicit_root_is_used_and_reported(tmp_path):
    images, labels = fake_fashion(tmp_path, 20, compress=False)
    ds = D.load_fashion_mnist(tmp_path, split="train", normalize=False)
    assert ds.source == f"directory {tmp_path}" and ds.path == tmp_path
    assert torch.equal(ds.labels, torch.from_numpy(labels.astype(np.int64)))
    assert torch.allclose(ds.images[:, 0], torch.from_numpy(images).float() / 255)


def test_missing_root_gives_instructions(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        D.load_fashion_mnist(tmp_path, split="test")


def test_corrupt_or_inconsistent_files_name_the_file(tmp_path):
    fake_fashion(tmp_path, 20)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(19, np.uint8))
    with pytest.raises(ValueError, match="19 labels for 20 images"):
        D.load_fashion_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.full(20, 12, np.uint8))
    with pytest.raises(ValueError, match="labels must be 0..9"):
        D.load_fashion_mnist(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((20, 32, 32), np.uint8))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: expected images of shape \(N, 28, 28\)"):
        D.load_fashion_mnist(tmp_path)


def test_fallback_to_the_subset_is_logged_once(tmp_path, monkeypatch, caplog):
    """source='auto' without the full set says so (once): a study must not train on the subset unaware."""
    monkeypatch.setattr(D, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    monkeypatch.setattr(D, "_SUBSET_WARNED", [])
    with caplog.at_level("WARNING", logger=D.log.name):
        assert D.load_fashion_mnist(split="test").source == "committed subset"
        D.load_fashion_mnist(split="train")
        D.load_fashion_mnist(split="test", source="subset")
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "committed subset" in r.getMessage()]
    assert len(warned) == 1 and "apt-get install dataset-fashion-mnist" in warned[0].getMessage()


def test_search_order_and_fallback(tmp_path, monkeypatch):
    """Debian path first, else the committed subset; with neither, a clear error."""
    monkeypatch.setattr(D, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    assert D.load_fashion_mnist(split="test").source == "committed subset"
    debian = tmp_path / "debian"
    debian.mkdir()
    fake_fashion(debian, 30, prefix="t10k")
    monkeypatch.setattr(D, "DEBIAN_FASHION_MNIST", debian)
    ds = D.load_fashion_mnist(split="test")
    assert ds.source == "full Debian set" and len(ds) == 30
    assert D.load_fashion_mnist(split="test", source="subset").source == "committed subset"
    # GRADSTATS_DATA replaces the repository's data/ directory
    empty = tmp_path / "emptydata"
    empty.mkdir()
    monkeypatch.setenv(D.DATA_ENV, str(empty))
    with pytest.raises(FileNotFoundError, match="not found"):
        D.load_fashion_mnist(split="test", source="subset")
    monkeypatch.setenv(D.DATA_ENV, str(REPO / "data"))
    assert D.load_fashion_mnist(split="test", source="subset").source == "committed subset"
    monkeypatch.setenv(D.DATA_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="GRADSTATS_DATA"):
        D.data_dir()


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be"):
        D.load_fashion_mnist(split="val")
    with pytest.raises(ValueError, match="source must be"):
        D.load_fashion_mnist(source="web")
    with pytest.raises(ValueError, match="subset must be a positive int"):
        D.load_fashion_mnist(source="subset", split="test", subset=0)
    with pytest.raises(ValueError, match="larger than the dataset"):
        D.load_fashion_mnist(source="subset", split="test", subset=5000)
    with pytest.raises(ValueError, match="smaller than the images"):
        D.load_fashion_mnist(source="subset", split="test", size=20)
    with pytest.raises(ValueError, match="unknown dataset"):
        D.load_data("cifar10")


def test_balanced_seeded_subset_and_padding():
    a = D.load_fashion_mnist(split="train", source="subset", subset=250, seed=3)
    b = D.load_fashion_mnist(split="train", source="subset", subset=250, seed=3)
    c = D.load_fashion_mnist(split="train", source="subset", subset=250, seed=4)
    assert torch.equal(a.images, b.images) and not torch.equal(a.images, c.images)
    assert a.class_counts() == [25] * 10
    odd = D.load_fashion_mnist(split="test", source="subset", subset=13)
    assert sorted(odd.class_counts()) == [1] * 7 + [2] * 3
    padded = D.load_fashion_mnist(split="test", source="subset", subset=20, size=32)
    plain = D.load_fashion_mnist(split="test", source="subset", subset=20)
    assert padded.images.shape == (20, 1, 32, 32)
    assert torch.equal(padded.images[..., 2:30, 2:30], plain.images)
    assert float(padded.images[..., :2, :].abs().sum()) == 0.0


def test_digits():
    train, test = D.load_digits(split="train"), D.load_digits(split="test")
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (1, 8, 8)
    assert train.labels.dtype == torch.int64 and set(train.labels.tolist()) == set(range(10))
    # stratified: every class is held out in about the same proportion
    frac = torch.tensor(test.class_counts()) / (torch.tensor(test.class_counts()) + torch.tensor(train.class_counts()))
    assert float((frac - 0.2).abs().max()) < 0.01
    up = D.load_images("digits", split="test")  # resampled to fit the image models by default
    assert up.images.shape == (len(test), 1, 28, 28)
    assert D.load_images("digits", split="test", size=32).images.shape[-2:] == (32, 32)
    small = D.load_digits(split="train", subset=100, seed=1)
    assert small.class_counts() == [10] * 10
    train_rows = {tuple(r) for r in train.images.flatten(1).tolist()}
    assert all(tuple(r) in train_rows for r in small.images.flatten(1).tolist())  # drawn from the train split


def test_auto_falls_back_to_digits(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    ddir = tmp_path / "data"
    (ddir / "digits").mkdir(parents=True)
    (ddir / "digits" / "digits.csv.gz").write_bytes((REPO / "data" / "digits" / "digits.csv.gz").read_bytes())
    monkeypatch.setenv(D.DATA_ENV, str(ddir))
    ds = D.load_images("auto", split="test")
    assert ds.name == "digits" and ds.images.shape[1:] == (1, 28, 28)


# ----------------------------------------------------------------------------- characters
def test_shakespeare_corpus():
    ds = D.load_shakespeare()
    assert ds.source == "committed subset" and len(ds.data) == 1_036_491
    assert ds.text.startswith("HAMLET, PRINCE OF DENMARK") and "Lord, what fools these mortals be!" in ds.text
    assert ds.vocab == "".join(sorted(set(ds.text))) and ds.data.dtype == torch.int64
    assert len(ds.train) + len(ds.val) == len(ds.data) and len(ds.val) == int(0.1 * len(ds.data))
    assert ds.decode(ds.data[:25]) == ds.text[:25]
    digest = hashlib.sha256((REPO / "data" / "shakespeare" / "shakespeare.txt").read_bytes()).hexdigest()
    assert digest.startswith("0f9be68bcbeb9b64")


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet="abcdefgh .,;\n'", min_size=2, max_size=200))
def test_char_round_trip(text):
    ds = D.CharDataset.from_text(text)
    assert ds.decode(ds.encode(text)) == text
    assert ds.decode(ds.data) == text
    assert ds.vocab_size == len(set(text))


def test_char_batches_are_reproducible_and_shifted():
    ds = D.CharDataset.from_text("".join(chr(97 + (i * 7) % 26) for i in range(5000)), val_fraction=0.2)
    a = list(ds.batches(8, seq_len=32, seed=1, steps=3))
    b = list(ds.batches(8, seq_len=32, seed=1, steps=3))
    c = list(ds.batches(8, seq_len=32, seed=2, steps=3))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, c))
    x, y = a[0]
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every window is a contiguous slice of the training split
    train_text = ds.decode(ds.train)
    assert all(ds.decode(torch.cat([row[:1], yrow])) in train_text for row, yrow in zip(x, y))
    xv, _ = ds.get_batch(4, 16, split="val", generator=torch.Generator().manual_seed(0))
    assert all(ds.decode(r) in ds.decode(ds.val) for r in xv)


def test_char_errors():
    ds = D.CharDataset.from_text("abcabc" * 10)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ds.encode("abz")
    with pytest.raises(ValueError, match="token ids must be in"):
        ds.decode([0, 3])
    with pytest.raises(ValueError, match="split must be"):
        ds.get_batch(2, 4, split="test")
    with pytest.raises(ValueError, match="too few for seq_len"):
        ds.get_batch(2, 100)
    with pytest.raises(ValueError, match="at least 2"):
        D.CharDataset.from_text("a")


# ----------------------------------------------------------------------------- minibatches
def test_minibatches_cover_each_epoch_once_and_are_seeded():
    x, y = torch.arange(100.0), torch.arange(100)
    batches = list(D.minibatches(x, y, batch_size=10, seed=5, epochs=2))
    assert len(batches) == 20
    first = torch.cat([b[1] for b in batches[:10]])
    assert sorted(first.tolist()) == list(range(100)) and first.tolist() != list(range(100))
    assert all(torch.equal(bx.long(), by) for bx, by in batches)
    again = list(D.minibatches(x, y, batch_size=10, seed=5, epochs=2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    ragged = list(D.minibatches(x, batch_size=30, shuffle=False, drop_last=False, epochs=1))
    assert [len(b[0]) for b in ragged] == [30, 30, 30, 10] and torch.equal(torch.cat([b[0] for b in ragged]), x)


def test_minibatches_errors():
    with pytest.raises(ValueError, match="share their first dimension"):
        next(D.minibatches(torch.zeros(3), torch.zeros(4), batch_size=1))
    with pytest.raises(ValueError, match="positive int"):
        next(D.minibatches(torch.zeros(3), batch_size=0))
    with pytest.raises(ValueError, match="larger than the dataset"):
        next(D.minibatches(torch.zeros(3), batch_size=4))
