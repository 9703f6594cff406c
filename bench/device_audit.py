"""What trace and apply cost the device beyond the model's own backward pass, counted on the CPU.

Per model and configuration, one training step (after two warm steps, so that first calls and
caches are behind it) runs inside a :class:`gradstats.ops.audit.Audit`; the plain model's counts
for the same step are subtracted. Columns:

- ``config``: ``trace``, ``apply`` (a uniform per-tensor e4m3fn plan at 80% sparsity), ``apply:<scheme>``
  (the same with the block-scaled scheme: MX ``mxfp8_e4m3``, ``mxfp4``; ``nvfp4``; ``nvfp4_training``,
  NVFP4 with stochastic rounding and the 16-point Hadamard transform);
- ``calls``: planned or traced layer-calls in the step;
- ``big ops / call``: whole-gradient ATen operations per layer-call in the backward pass (an
  operation touching a tensor at least half the size of the model's smallest layer output, which
  is at least 2,560 elements here, so a statistics vector or a kernel's partials never count;
  views not counted); target at most 2;
- ``syncs in backward``: host synchronisations inside the backward pass; target 0;
- ``syncs / step``: in the whole step, the optimizer's and the settling included; target at most 1;
- ``launches / step``: kernel launches beyond the plain step's (Triton kernels and the non-view
  ATen operations, each at least one launch on a GPU);
- ``kernels / call``: Triton launches per layer-call in the backward pass (the statistics pass is two,
  its tiles and their combination; the fused prune-and-quantise kernel one, two with a Hadamard transform,
  whose rotated maximum needs a pass before the first block is scaled).

Then, on the device path, whether the statistics of three traced steps equal the C kernel's on the
same training (counts, extremes, binade counts, top magnitudes exactly; the sums' largest relative
difference).

Run it on the device path (the default here): ``GRADSTATS_ENGINE=triton TRITON_INTERPRET=1``, set by
this script unless ``--engine`` says otherwise. Models: a 4-layer MLP and a small
convolution-plus-GRU sequence classifier that no test uses.

    python bench/device_audit.py [--engine triton|native|torch] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from torch import nn


class ConvGRU(nn.Module):
    """A 1-d convolution, a GRU and two Linear layers tagging each step of sequences of 16-dim
    vectors (5 tags)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(16, 32, 3, padding=1)
        self.gru = nn.GRU(32, 32, batch_first=True)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        h, _ = self.gru(h)
        return self.fc2(torch.relu(self.fc1(h))).flatten(0, 1)


#: what is audited: tracing, applying a plan (``apply:<format or scheme>``; per-tensor e4m3fn by default), both
CONFIGS = ("trace", "apply", "trace+apply", "apply:mxfp8_e4m3", "apply:mxfp4", "apply:nvfp4", "apply:nvfp4_training")


def workload(name: str):
    """(model, batch, loss)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp4":
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    else:
        model = ConvGRU()
        x, y = torch.randn(32, 24, 16, generator=g), torch.randint(0, 5, (32 * 24,), generator=g)
    return model, x, y


def _outputs(model: nn.Module, layers: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """The output tensor of each of ``layers`` on ``x`` (the first of a tuple)."""
    outs: list[torch.Tensor] = []
    hs = [m.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o)) for m in layers]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return outs


def audit_step(name: str, config: str) -> dict:
    """Counts of the third step of ``name`` under ``config`` (plain, trace, apply, trace+apply)."""
    import gradstats
    from gradstats.ops.audit import Audit

    model, x, y = workload(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handles = []
    tracer = None
    if "trace" in config:
        tracer = gradstats.trace(model, tempfile.mkdtemp(prefix="gradstats-audit-"), sample_every=None,
                                 noise=False).attach()
        handles.append(tracer)
    applied = None
    if "apply" in config:
        fmt = config.split(":", 1)[1] if ":" in config else "e4m3fn"
        applied = gradstats.apply(model, gradstats.Plan.uniform(format=fmt, sparsity=0.8, output_layer=False))
        handles.append(applied)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.GRU))]
    sizes = [int(t.numel()) for t in _outputs(model, layers, x)]
    smallest = min(sizes)                        # the smallest layer output, hence gradient

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if tracer is not None:
            tracer.step()

    for _ in range(2):
        step()
    with Audit(big=smallest // 2) as a:     # (apply settles the previous step in this one's forward)
        step()
        if tracer is not None:
            tracer.flush()                # the commit of the step (on its schedule: about once a second)
    calls = 0
    if tracer is not None:
        calls += len(layers)
    if applied is not None:
        calls += len(applied.rules)
    for h in handles:
        h.__exit__(None, None, None)
    return {"model": name, "config": config, "calls": calls, **{k: dict(v) for k, v in a.to_dict().items()}}


def traced_stats(name: str, engine: str):
    """The run statistics of three traced steps of ``name`` on ``engine`` (the same training)."""
    import gradstats

    os.environ["GRADSTATS_ENGINE"] = engine
    model, x, y = workload(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tempfile.mkdtemp(prefix=f"gradstats-audit-{engine}-")
    with gradstats.trace(model, path, sample_every=None, noise=False) as t:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            t.step()
    return gradstats.open_run(path).stats().sort_values(["step", "layer", "call"]).reset_index(drop=True)


def same_statistics(name: str) -> dict:
    """Whether the device path's statistics equal the C kernel's on the same training: counts,
    extremes, binade counts and top magnitudes exactly, sums to float32 rounding."""
    import numpy as np

    dev, cpu = traced_stats(name, "triton"), traced_stats(name, "native")
    os.environ["GRADSTATS_ENGINE"] = "triton"
    exact = all((dev[c].to_numpy() == cpu[c].to_numpy()).all()
                for c in ("n", "n_zero", "n_nonfinite", "min_abs", "max_abs"))
    exact &= all((a == b).all() for a, b in zip(dev["hist"], cpu["hist"]))
    exact &= all(np.array_equal(a, b, equal_nan=True) for a, b in zip(dev["top_abs"], cpu["top_abs"]))
    worst = max(float((abs(dev[c] - cpu[c]) / cpu[c].abs().clip(lower=1e-30)).max())
                for c in ("sum_abs", "sum_sq", "sum_ln_abs_sq"))
    return {"model": name, "rows": len(dev), "exact fields equal": bool(exact and len(dev) == len(cpu)),
            "largest relative difference of a sum": worst}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="triton", choices=["triton", "native", "torch"])
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), help=f"what to audit (default: {' '.join(CONFIGS)})")
    ap.add_argument("--no-statistics", action="store_true", help="skip the statistics comparison with the C kernel")
    args = ap.parse_args(argv)
    os.environ["GRADSTATS_ENGINE"] = args.engine
    if args.engine == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    rows = []
    for name in ("mlp4", "convgru"):
        plain = audit_step(name, "plain")
        for config in args.configs:
            r = audit_step(name, config)
            d = lambda key, phase: r[key].get(phase, 0) - plain[key].get(phase, 0)  # noqa: E731
            calls = max(r["calls"], 1)
            rows.append({"model": name, "config": config, "calls": r["calls"],
                         "big ops / call": d("big_ops", "backward") / calls,
                         "syncs in backward": d("syncs", "backward"),
                         "kernels / call": d("launches", "backward") / calls,
                         "syncs / step": d("syncs", "backward") + d("syncs", "forward"),
                         "launches / step": (d("launches", "backward") + d("launches", "forward")
                                             + d("ops", "backward") + d("ops", "forward")),
                         "which syncs": {k: v for k, v in r["sync_names"].items()},
                         "which big ops": {k: v for k, v in r["big_names"].items() if k.startswith("backward")}})
    import pandas as pd

    df = pd.DataFrame(rows)
    cols = ["model", "config", "calls", "big ops / call", "kernels / call", "syncs in backward", "syncs / step",
            "launches / step"]
    print(f"engine: {args.engine}  (targets: big ops / call <= 2, syncs in backward 0, syncs / step <= 1)")
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    for r in rows:
        if r["which syncs"]:
            print(f"{r['model']} {r['config']}: syncs {r['which syncs']}")
    if args.engine == "triton" and not args.no_statistics:
        same = pd.DataFrame([same_statistics(name) for name in ("mlp4", "convgru")])
        print("statistics of three traced steps, device path against the C kernel:")
        print(same.to_string(index=False))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
