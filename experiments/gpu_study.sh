#!/usr/bin/env bash
# The study's CNN and ResNet-18 tables at larger scale on one GPU (scale_study.py --gpu: the CNN
# 8 epochs x 6 seeds, ResNet-18 at 32x32 4 epochs x 3 seeds; tier A), within a device budget:
# the trainings stop at $LIMIT seconds (finished jobs are kept and a rerun resumes), then what is
# left is printed. The full Fashion-MNIST must be on the machine: the Debian package, or the four
# IDX files in $FASHION_MNIST_ROOT.
#
#   FASHION_MNIST_ROOT=.cache/fashion-mnist LIMIT=480 bash experiments/gpu_study.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-experiments/results}
LIMIT=${LIMIT:-480}
WORKERS=${WORKERS:-4}
ROOT_ARG=()
if [ -n "${FASHION_MNIST_ROOT:-}" ]; then ROOT_ARG=(--data-root "$FASHION_MNIST_ROOT"); fi
$PY -c "import torch, sys; sys.exit(None if torch.cuda.is_available() else 'no CUDA device: the GPU study needs one')"
$PY - "${FASHION_MNIST_ROOT:-}" <<'PYEOF'
import sys
from gradstats.zoo.data import load_fashion_mnist
d = load_fashion_mnist(root=sys.argv[1] or None)
if d.to_dict()["n"] != 60000:
    sys.exit(f"the GPU study needs the full Fashion-MNIST (60k): found {d.source}; set FASHION_MNIST_ROOT")
PYEOF
timeout "$LIMIT" $PY experiments/scale_study.py --gpu --tiers A --workers "$WORKERS" --out "$OUT" "${ROOT_ARG[@]}" || echo "stopped at ${LIMIT} s (finished jobs kept)"
$PY experiments/scale_study.py --gpu --tiers A --out "$OUT" --remaining "${ROOT_ARG[@]}"
