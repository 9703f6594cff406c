"""trace and apply on a ``torch.compile``d model, from a fresh compile, against the same compiled model
untraced.

Each configuration runs in a fresh process with the compiler's caches off (every run compiles from
scratch, as a user's first run does): the zoo's MobileNetV2-style CNN (layers of several shapes and
``groups``: depthwise convolutions, BatchNorm, residuals), batch 64 of 28x28 images, SGD, ``--steps``
steps (12 by default). Configurations: ``compiled`` (the peer), ``compiled + trace`` (the tracer's
defaults: statistics every step, samples and block statistics on step 0 of the 12), ``compiled + apply`` (a per-tensor FP8
plan with 50% pruning on every convolution and linear layer), and the same three eager. Rounds
interleave the configurations; the ratio is the median over rounds of a run's total time over the
``compiled`` (or ``eager``) run of the same round. Target (the issue's): traced compiled at most 1.5x
the untraced compiled run, total of the 12 steps from a fresh compile.

    python bench/compiled.py [--rounds 3] [--steps 12] [--device cuda] [--configs compiled "compiled + trace"]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("compiled", "compiled + trace", "compiled + apply", "eager", "eager + trace", "eager + apply")
TARGETS = {"compiled + trace": 1.5}


def child(config: str, steps: int, device: str = "cpu") -> dict[str, float]:
    """Run one configuration in this process (on ``device``); its times."""
    import torch
    from torch import nn

    import gradstats
    from gradstats.zoo.models import build_model

    torch.manual_seed(0)
    model = build_model("mobilenet", seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 1, 28, 28, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device))
               for _ in range(4)]

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()
    run_model = torch.compile(model) if config.startswith("compiled") else model
    handle = None
    if config.endswith("trace"):
        handle = gradstats.trace(run_model, tempfile.mkdtemp(prefix="gradstats-bench-"), optimizer=opt).attach()
    elif config.endswith("apply"):
        handle = gradstats.apply(run_model, gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5), record=False)
    t0 = time.perf_counter()
    first = 0.0
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        nn.functional.cross_entropy(run_model(x), y).backward()
        opt.step()
        if i == 0:
            sync()
            first = time.perf_counter() - t0
    sync()
    total = time.perf_counter() - t0
    if handle is not None:
        handle.detach() if hasattr(handle, "detach") else handle.remove()
    recompiles = 0
    if config.startswith("compiled"):
        from torch._dynamo.utils import counters

        recompiles = int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0
    return {"total": total, "first": first, "steady_ms": 1000 * (total - first) / max(steps - 1, 1),
            "graph_breaks": int(sum(torch._dynamo.utils.counters["graph_break"].values())),
            "recompiles": recompiles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.device)))
        return
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="gradstats-inductor-"))
    configs = [c for c in CONFIGS if c in args.configs]
    for c in configs:
        peer = "compiled" if c.startswith("compiled") else "eager"
        if peer not in configs:
            raise SystemExit(f"--configs: {c!r} needs its peer {peer!r}")
    results: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs:
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", c, "--steps", str(args.steps),
                                  "--device", args.device],
                                 env=env, capture_output=True, text=True, check=True)
            results[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds}: {c}: {results[c][-1]['total']:.1f} s", file=sys.stderr)
    print(f"\n{args.steps} steps from a fresh compile, MobileNetV2-style CNN, batch 64, {args.device}; medians of "
          f"{args.rounds} interleaved rounds\n")
    print("| configuration | total s | first step s | later steps ms | ratio to its peer (min-max) | graph breaks "
          "| target |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        peer = "compiled" if c.startswith("compiled") else "eager"
        ratios = [a["total"] / b["total"] for a, b in zip(results[c], results[peer])]
        med = {k: statistics.median(row[k] for row in results[c]) for k in ("total", "first", "steady_ms", "graph_breaks")}
        target = TARGETS.get(c)
        verdict = "" if target is None else (f"<= {target}: " + ("met" if statistics.median(ratios) <= target else "NOT met"))
        print(f"| {c} | {med['total']:.1f} | {med['first']:.1f} | {med['steady_ms']:.0f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {med['graph_breaks']:.0f} | {verdict} |")


if __name__ == "__main__":
    main()
