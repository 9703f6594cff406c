"""Two checkouts of the package timed in one process, interleaved: ``prune`` of a 1e7-entry tensor and
``what_if`` on one traced run, milliseconds (medians of ``--repeats`` rounds).

    git worktree add /tmp/before <commit>
    python bench/two_trees.py --against /tmp/before [--repeats 9] [--steps 150]

The whole-tensor companion of ``bench/one_layer.py`` (one layer's floats), with its loader: each
round times the other tree's call, then this tree's, so that load on the machine falls on both
alike. Rows: ``gradstats.pruning.prune(x, 0.85)`` with the default rule, ``stochastic=False`` and
``threshold_rule="histogram"`` (``x``: lognormal magnitudes, sigma 2.2, 30% zeros, float32), and
``gradstats.what_if(run, ["e4m3fn", "e5m2", "e2m1fn"])`` per tensor and with MX blocks of 32 on
``bench/what_if.py``'s run (24 layers, ``--steps`` steps), per (step, layer, format). A tree from
before the analysis took ``granularity=`` is called with ``block_size=32``.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from one_layer import HERE, load


def prune_calls(mods: dict[str, Any], x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    pr = mods["gradstats.pruning"]
    g = torch.Generator().manual_seed(0)
    return {"prune 1e7, default rule (ms)": lambda: pr.prune(x, 0.85, generator=g),
            "prune 1e7, hard (ms)": lambda: pr.prune(x, 0.85, stochastic=False),
            "prune 1e7, histogram (ms)": lambda: pr.prune(x, 0.85, threshold_rule="histogram", generator=g)}


def what_if_calls(mods: dict[str, Any], path: Path, formats: tuple[str, ...]) -> dict[str, Callable[[], Any]]:
    run = mods["gradstats"].open_run(path)
    wi = mods["gradstats.fpanalysis"].what_if
    blocks = {"granularity": 32} if "granularity" in inspect.signature(wi).parameters else {"block_size": 32}
    return {"what_if per tensor (ms per row)": lambda: wi(run, formats),
            "what_if MX blocks of 32 (ms per row)": lambda: wi(run, formats, **blocks)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="DIR", required=True, help="another checkout, timed in the same rounds")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=150, help="steps of the what_if run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trees = {"against": load(str(Path(args.against).resolve())), "this": load(HERE)}
    gen = torch.Generator().manual_seed(0)
    n = 10 ** 7
    x = torch.exp(torch.randn(n, generator=gen) * 2.2 - 8) * torch.randn(n, generator=gen).sign()
    x[torch.rand(n, generator=gen) < 0.3] = 0
    sys.modules.update(trees["this"])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import what_if as bench_what_if

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run"
        bench_what_if.build_run(path, args.steps, 24)
        calls, per = {}, {}
        for name, mods in trees.items():
            sys.modules.update(mods)
            calls[name] = {**prune_calls(mods, x), **what_if_calls(mods, path, bench_what_if.FORMATS)}
            for row, f in calls[name].items():
                out = f()
                per[row] = len(out) if row.startswith("what_if") else 1
        times: dict[tuple[str, str], list[float]] = {(t, r): [] for t in trees for r in calls["this"]}
        for _ in range(args.repeats):
            for row in calls["this"]:
                for t in trees:
                    sys.modules.update(trees[t])
                    t0 = time.perf_counter()
                    calls[t][row]()
                    times[(t, row)].append((time.perf_counter() - t0) * 1e3 / per[row])
    print("| call | against | this | this / against |\n|---|---|---|---|")
    for row in calls["this"]:
        a, b = (statistics.median(times[(t, row)]) for t in ("against", "this"))
        print(f"| {row} | {a:.4g} | {b:.4g} | {b / a:.2f} |", flush=True)
    print(f"\nmedians of {args.repeats} rounds, the two trees interleaved in each, one torch thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
