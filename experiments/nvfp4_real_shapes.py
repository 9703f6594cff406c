"""NVFP4's (or MX's) predicted error beside the measured one on real layers' output gradients.

For a MobileNetV2-style CNN's convolutions (Fashion-MNIST, batch 64), a ``transformers`` GPT-NeoX's fused
q/k/v projection and MLP (tiny config, 16 windows of 64 Shakespeare characters) and the character
LSTM's recurrent layer (its output gradient, batch 32): one backward pass after 20 training steps,
each layer's output gradient captured. Per layer, the relative MSE and the fraction of the non-zero
entries flushed to zero: predicted by the lognormal fit of its non-zero magnitudes (mu, sigma of
``ln|g|``, the zero fraction: ``expected_error(scheme, ..., numel=, tensor_amax=)`` at the tensor's own
maximum) and by ``what_if``'s histogram law (``predict_from_stats`` of its statistics row); measured by
``gradstats.prune_quantize`` on the gradient as apply quantises it (blocks along the channels,
:func:`gradstats.ops.layout.channel_dim`), and on the same entries shuffled (exchangeable blocks, which
both predictions assume).

    python experiments/nvfp4_real_shapes.py [--scheme nvfp4|mxfp4] [--tree DIR]

``--tree DIR``: the package of another checkout (``git worktree add``) predicts and quantises instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()))
else:
    sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import gradstats  # noqa: E402
import gradstats.fpanalysis as fa  # noqa: E402
from gradstats.ops.layout import channel_dim  # noqa: E402
from gradstats.stats import tensor_stats  # noqa: E402


def captured(model: nn.Module, names: list[str], batches: list, loss_fn) -> dict[str, tuple[torch.Tensor, str]]:
    """20 SGD steps, then each named module's output gradient of one more backward pass."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches[:20]:
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    grads: dict[str, tuple[torch.Tensor, str]] = {}
    mods = dict(model.named_modules())
    hooks = []
    for n in names:
        def hook(m, gi, go, n=n):
            g = go[0]
            grads[n] = (g.detach().clone(), type(m).__name__)
        hooks.append(mods[n].register_full_backward_hook(hook))
    x, y = batches[20]
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    for h in hooks:
        h.remove()
    return grads


def workloads() -> dict[str, dict[str, tuple[torch.Tensor, str]]]:
    from _common import fixed_batches, gpt_neox_tiny, lm_loss, text_batches

    from gradstats.zoo.models import build_model

    torch.manual_seed(0)
    out = {}
    cnn = build_model("mobilenet", seed=0)
    convs = [n for n, m in cnn.named_modules() if isinstance(m, nn.Conv2d)]
    ce = lambda m, x, y: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    out["mobilenet"] = captured(cnn, convs[::3], fixed_batches("mobilenet", 21, 64), ce)
    batches, vocab = text_batches(21, 16)
    neox = gpt_neox_tiny(vocab)
    names = [n for n, _ in neox.named_modules() if n.endswith(("query_key_value", "dense_h_to_4h", "dense_4h_to_h"))]
    out["gpt_neox"] = captured(neox, names, batches, lm_loss)
    lstm = build_model("lstm", seed=0)
    lb, _ = text_batches(21, 32, seq_len=lstm.seq_len if hasattr(lstm, "seq_len") else 64)
    lm = lambda m, x, y: nn.functional.cross_entropy(m(x).reshape(-1, m(x).shape[-1]), y.reshape(-1))  # noqa: E731
    out["lstm"] = captured(lstm, ["inp", "proj"], lb, lm)
    return out


def predicted(fa, g: torch.Tensor, scheme: str) -> tuple[float, float]:
    """``(relative MSE, flushed fraction of the non-zero entries)`` the lognormal fit predicts."""
    a = g.double().abs().reshape(-1)
    nz = a[a > 0]
    ln = nz.log()
    p0 = 1 - nz.numel() / a.numel()
    r = fa.expected_error(scheme, mu=float(ln.mean()), sigma=float(ln.std()), p0=p0, numel=a.numel(),
                          tensor_amax=float(a.max()))
    return float(r.total), float(r.flushed) / max(1 - p0, 1e-12)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose package predicts and quantises")
    ap.add_argument("--scheme", default="nvfp4", choices=["nvfp4", "mxfp4"])
    args = ap.parse_args(argv)
    print(f"gradstats from {Path(gradstats.__file__).parent}")
    data = workloads()
    print("| model | layer | shape | blocks along | rel. MSE: lognormal | what-if | measured | shuffled "
          "| flushed: lognormal | what-if | measured | shuffled |")
    print("|---" * 12 + "|")
    ratios = []
    gen = torch.Generator().manual_seed(0)
    for model, grads in data.items():
        for name, (g, typ) in grads.items():
            dim = channel_dim(typ, g.dim())
            amax = float(g.abs().max())
            kw = {"tensor_amax": amax} if args.scheme == "nvfp4" else {}
            nz = g != 0
            cells = []
            for x, d in ((g.float(), dim), (g.float().reshape(-1)[torch.randperm(g.numel(), generator=gen)], -1)):
                q, _ = gradstats.ops.prune_quantize(x, 0.0, args.scheme, block_dim=d, **kw)
                err = float(((q.double() - x.double()) ** 2).sum() / (x.double() ** 2).sum())
                cells.append((err, float(((q == 0) & (x != 0)).sum() / nz.sum())))
            (err, fl), (err_s, fl_s) = cells
            pe, pf = predicted(fa, g, args.scheme)
            w = fa.predict_from_stats(dict(tensor_stats(g.float())), args.scheme)
            we, wf = w["rel_mse"], w["underflow"] * g.numel() / float(nz.sum())
            ratios.append(pe / err)
            print(f"| {model} | {name} | {tuple(g.shape)} | {dim} | {pe:.4f} | {we:.4f} | {err:.4f} | {err_s:.4f} "
                  f"| {pf:.3f} | {wf:.3f} | {fl:.3f} | {fl_s:.3f} |", flush=True)
    ratios.sort()
    print(f"\nlognormal rel. MSE predicted / measured ({len(ratios)} layers): median {ratios[len(ratios) // 2]:.2f}, "
          f"range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
