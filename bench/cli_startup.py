"""Start-up of the command line: ``gradstats --help`` and ``gradstats info data/sample-run`` as whole
processes, against ``python -c "import torch"`` (what every command cost before the parser stopped
importing torch) and a bare interpreter.

Each command runs once per round, in turn, the order reversed every other round; the table gives
the median wall time of each and its ratio to ``import torch``. Target: ``--help`` and ``info`` at
most 0.5 of ``import torch``. The machine is shared: compare the ratios, not the seconds.

    python bench/cli_startup.py [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the console script's own lines (``gradstats`` of pip's entry point), run on this checkout
GRADSTATS = [sys.executable, "-c", "import sys; from gradstats.cli import main; sys.exit(main())"]
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "gradstats --help": [*GRADSTATS, "--help"],
    "gradstats info data/sample-run": [*GRADSTATS, "info", str(ROOT / "data" / "sample-run")],
}
REFERENCE = 'python -c "import torch"'
TARGET = 0.5


def wall(cmd: list[str]) -> float:
    """Seconds of one run of ``cmd`` from start to exit (it must succeed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="runs of each command (default 7)")
    args = ap.parse_args()
    for cmd in COMMANDS.values():                      # warm the file cache once
        wall(cmd)
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    order = list(COMMANDS.items())
    for r in range(args.rounds):
        for label, cmd in (order if r % 2 == 0 else order[::-1]):
            times[label].append(wall(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med[REFERENCE]
    print(f"CLI start-up: whole processes, medians of {args.rounds} interleaved runs")
    print(f"| {'command':<32} | median s | ratio to import torch | target (<= {TARGET}) |")
    print(f"|{'-' * 34}|----------|-----------------------|-------------|")
    for label, s in med.items():
        verdict = ("met" if s / ref <= TARGET else "MISSED") if label.startswith("gradstats") else ""
        print(f"| {label:<32} | {s:8.3f} | {s / ref:21.2f} | {verdict:<11} |")


if __name__ == "__main__":
    main()
