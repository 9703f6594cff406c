"""GPU check: the CUDA numbers of the operators, the statistics and ``gradstats.apply``, in one run.

Sections (CUDA events around each call, medians of repeats after warm-up):

  copy          a device-to-device copy of an ``--n``-element float32 tensor: the bandwidth reference
                (GB/s, 4 bytes read + 4 written per element)
  quantize      ``gradstats.ops.quantize``, nearest and stochastic, e4m3fn, e5m2 and e3m2fn (FP6),
                nearest e2m1fn, on the same tensor (Triton path): GB/s (8 bytes per element) and
                the share of the copy's GB/s; target >= 70%
  prune_quantize  ``gradstats.ops.prune_quantize`` with a threshold > 0 and a format (and the CPU
                generator ``gradstats.apply`` passes it): same accounting, 8 bytes per element
                (the one-pass minimum, whatever the path does); target >= 70%
  blocks        the block-scaled prune + quantise kernel as the device path calls it (MX e4m3fn and e2m1fn,
                NVFP4, NVFP4 with its Hadamard transform; a linear layer's (tokens, 4096) gradient and a
                convolution's (N, 256, 32, 32) one): GB/s (8 bytes per element) and the share of the
                copy's GB/s; target >= 70%
  stats         ``gradstats.stats.tensor_stats_vector`` (what the tracer and ``gradstats.apply``
                call on CUDA tensors), full and scalars only, on an ``--n``-element gradient-like
                tensor (lognormal magnitudes, random signs, 30% zeros): GB/s read (4 bytes per
                element) and the share of the copy's GB/s; target >= 60%. Also, without a
                target, the same over the neural gradients of one ResNet-18 batch (every layer
                with parameters, one tensor after another, as the tracer does in a step)
  apply         a ResNet-18 training step (``gradstats.zoo.build_model("resnet18")``, SGD with
                momentum, batch ``--batch`` of 32x32 Fashion-MNIST images on the GPU) plain and
                with a plan applied: the reference plan of ``bench/apply_overhead.py`` (FP6
                e3m2fn, lognormal scales, 85% stochastic pruning with the lognormal threshold,
                every conv and linear layer, refreshed every gradient) and
                ``Plan.uniform(format="e3m2fn", sparsity=0.85)``; interleaved blocks, ratio the
                median over rounds of a block's time over the plain block of the same round;
                target <= 1.10x

Appendix (CUDA only, ``--no-gpu-table`` to skip): the printed table of ``bench/quantize.py``'s
``gpu_table`` (more formats, bf16, MX blocks) on the same device.

Writes ``gpu.md`` (a markdown table) and ``gpu.json`` (the same rows) under ``--out``; each row
has its value, target and pass/fail; the header the device, torch, Triton and CUDA versions.
Without a CUDA device it writes both files saying "no CUDA device: not measured" and exits 0.
``--device cpu --small`` runs the same code on tiny CPU tensors (Triton's interpreter for the
Triton kernels): a smoke test of the code paths, its timings meaningless and labelled so.

    python bench/gpu.py [--out bench/results/gpu] [--n 268435456] [--reps 20] [--rounds 7] [--block 10]
    python bench/gpu.py --device cpu --small            # smoke test, no GPU needed
    python bench/gpu.py --compile-check                 # the block kernels built for sm_90, no GPU needed
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
for _p in (str(BENCH), str(ROOT)):     # bench/ for the modules that import _common by its bare name
    if _p not in sys.path:
        sys.path.insert(0, _p)

NOT_MEASURED = "no CUDA device: not measured"
TARGET_QUANTIZE = 0.70      # share of the copy's GB/s, at least
TARGET_STATS = 0.60         # share of the copy's GB/s, at least
TARGET_APPLY = 1.10         # step time with the plan over the plain step time, at most


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(BENCH / "results" / "gpu"), help="directory of gpu.md and gpu.json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default; without a device: a 'not measured' file, exit 0) or cpu (smoke test)")
    ap.add_argument("--small", action="store_true",
                    help="tiny sizes (with --device cpu: the CPU smoke test; timings meaningless)")
    ap.add_argument("--n", type=int, default=None, help="elements of the copy, quantize and stats tensors "
                    "(default 2**28 = 1 GiB of float32; 2**16 with --small)")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per kernel (default 20; 3 with --small)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before the repeats")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the apply section "
                    "(default 7; 3 with --small)")
    ap.add_argument("--block", type=int, default=None, help="training steps per block (default 10; 2 with --small)")
    ap.add_argument("--batch", type=int, default=None, help="batch of the ResNet-18 step (default 128; 4 with --small)")
    ap.add_argument("--sections", nargs="+", default=["copy", "quantize", "blocks", "stats", "apply"],
                    choices=["copy", "quantize", "blocks", "stats", "apply"],
                    help="sections to run (copy always runs: the others are relative to it)")
    ap.add_argument("--no-gpu-table", action="store_true", help="skip the appendix (bench/quantize.py gpu_table)")
    ap.add_argument("--compile-check", action="store_true",
                    help="only compile the block-scaled kernels for sm_90 (no GPU needed) and print their registers, "
                         "stack and spills")
    a = ap.parse_args(argv)
    small = a.small
    a.n = a.n if a.n is not None else (1 << 16 if small else 1 << 28)
    a.reps = a.reps if a.reps is not None else (3 if small else 20)
    a.rounds = a.rounds if a.rounds is not None else (3 if small else 7)
    a.block = a.block if a.block is not None else (2 if small else 10)
    a.batch = a.batch if a.batch is not None else (4 if small else 128)
    return a


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
class Timer:
    """Milliseconds of a call: CUDA events on CUDA (the device timeline between the two
    records, host gaps included), ``perf_counter`` on the CPU."""

    def __init__(self, device, reps: int, warmup: int) -> None:
        import torch

        self.torch, self.device, self.reps, self.warmup = torch, device, reps, warmup
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def start(self):
        self.sync()
        if self.cuda:
            a = self.torch.cuda.Event(enable_timing=True)
            a.record()
            return a
        return time.perf_counter()

    def stop(self, start) -> float:
        """Milliseconds since ``start`` (a value :meth:`start` returned)."""
        if self.cuda:
            b = self.torch.cuda.Event(enable_timing=True)
            b.record()
            b.synchronize()
            return start.elapsed_time(b)
        return (time.perf_counter() - start) * 1e3

    def median_ms(self, fn: Callable[[], Any]) -> tuple[float, list[float]]:
        for _ in range(self.warmup):
            fn()
        self.sync()
        ts = []
        for _ in range(self.reps):
            t = self.start()
            fn()
            ts.append(self.stop(t))
        return statistics.median(ts), ts


def row(section: str, name: str, value: float | None, unit: str, *, target: float | None = None,
        at_least: bool = True, share: float | None = None, **detail: Any) -> dict[str, Any]:
    """One result: ``value`` in ``unit``; ``share`` (of the copy's bandwidth) is what the target
    is checked on when given, else ``value``."""
    checked = share if share is not None else value
    passed = None
    if target is not None and checked is not None:
        passed = bool(checked >= target) if at_least else bool(checked <= target)
    return {"section": section, "name": name, "value": value, "unit": unit, "share_of_copy": share,
            "target": target, "target_text": None if target is None else
            (f">= {target:.0%} of copy" if share is not None else f"{'>=' if at_least else '<='} {target:g}{unit}"),
            "pass": passed, **({"detail": detail} if detail else {})}


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------
def bench_copy(timer: Timer, n: int) -> tuple[dict, float]:
    import torch

    x = torch.randn(n, device=timer.device)
    y = torch.empty_like(x)
    ms, _ = timer.median_ms(lambda: y.copy_(x))
    gbs = 8 * n / ms / 1e6
    x = y = None  # noqa: F841 - free the device memory before the next section
    return row("copy", f"device-to-device copy, {n:,} float32", gbs, " GB/s", ms=ms, bytes_per_element=8), gbs


def _path_of_quantize(dev_type: str, fmt: str) -> str:
    from gradstats.formats import FPFormat
    from gradstats.ops.triton import quantize as kq
    from gradstats.ops.triton import use_triton

    if use_triton(dev_type) and kq.supports(FPFormat.parse(fmt)):
        return "triton (interpreter)" if dev_type == "cpu" else "triton"
    return "torch (not Triton)"


def _path_of_prune_quantize(x, fmt: str) -> str:
    import torch

    from gradstats.ops import fused
    from gradstats.ops.engine import active_engine

    if active_engine(x.device.type) == "native" and x.dtype == torch.float32 and fused._native() is not None:
        return "C kernel (CPU, one pass)"
    if active_engine(x.device.type) == "triton":
        return "Triton fused kernel (one pass, counts on the device)"
    q = _path_of_quantize(x.device.type, fmt)
    return f"composed: stochastic_prune ({'torch' if q.startswith('torch') else q}) + quantize ({q}) + count reductions"


def bench_quantize(timer: Timer, n: int, copy_gbs: float) -> list[dict]:
    import torch

    from gradstats import ops

    dev = timer.device
    x = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    g_dev = torch.Generator(device=dev).manual_seed(1)
    g_cpu = torch.Generator().manual_seed(2)   # what gradstats.apply passes (a CPU generator)
    cases: list[tuple[str, str, Callable[[], Any]]] = []
    for fmt in ("e4m3fn", "e5m2", "e3m2fn"):
        cases.append((f"quantize {fmt} nearest", fmt, lambda f=fmt: ops.quantize(x, f)))
        cases.append((f"quantize {fmt} stochastic ({dev.type} generator)", fmt,
                      lambda f=fmt: ops.quantize(x, f, rounding="stochastic", generator=g_dev)))
    cases.append(("quantize e2m1fn nearest", "e2m1fn", lambda: ops.quantize(x, "e2m1fn")))
    thr = 1.0      # |N(0,1)| < 1 for 68% of the entries: most are pruned to 0 or +-1
    cases.append((f"prune_quantize threshold {thr:g}, e4m3fn nearest", "e4m3fn",
                  lambda: ops.prune_quantize(x, thr, "e4m3fn", generator=g_cpu)))
    cases.append((f"prune_quantize threshold {thr:g}, e3m2fn stochastic", "e3m2fn",
                  lambda: ops.prune_quantize(x, thr, "e3m2fn", rounding="stochastic", generator=g_cpu)))
    rows = []
    for name, fmt, fn in cases:
        section = "prune_quantize" if name.startswith("prune") else "quantize"
        path = _path_of_prune_quantize(x, fmt) if section == "prune_quantize" else _path_of_quantize(dev.type, fmt)
        ms, _ = timer.median_ms(fn)
        gbs = 8 * n / ms / 1e6
        rows.append(row(section, name, gbs, " GB/s", target=TARGET_QUANTIZE, share=gbs / copy_gbs, ms=ms,
                        bytes_per_element=8, path=path))
    x = None  # noqa: F841 - free the device memory before the next section
    return rows


def bench_blocks(timer: Timer, n: int, copy_gbs: float) -> list[dict]:
    """The block-scaled prune + quantise kernel (:mod:`gradstats.ops.triton.blocks`) as the device path calls
    it (``prune_quantize_into`` with the call's statistics vector, threshold on the device): MX and NVFP4 on
    an ``n``-element (tokens, 4096) linear gradient, NVFP4 on a convolution's (N, 256, 32, 32) gradient
    (blocks along dim 1, strided; (N, 48, 4, 4) below 2**22 elements), and the NVFP4 training recipe (Hadamard: two launches, the rotated maximum
    first). 8 bytes per element (one read, one write: the one-pass minimum); target >= 70% of the copy."""
    import torch

    from gradstats.ops.fused import prune_quantize_into
    from gradstats.ops.triton import blocks as kb
    from gradstats.stats import tensor_stats_vector

    dev = timer.device
    rows = []
    chw = (256, 32, 32) if n >= 1 << 22 else (48, 4, 4)     # small runs (smoke tests): 48 channels, partial blocks
    for layout, shape, block_dim in (("linear (tokens, 4096)", (max(n // 4096, 1), 4096), -1),
                                     (f"conv (N, {', '.join(map(str, chw))})", (max(n // math.prod(chw), 1), *chw), 1)):
        x = gradient_like(n, dev).reshape(-1)[:math.prod(shape)].reshape(shape)
        m = x.numel()
        v = tensor_stats_vector(x, full=False)
        thr = torch.quantile(x.reshape(-1)[:1 << 20].abs().float(), 0.5).reshape(1)
        cases = [("nvfp4", "nvfp4")] if block_dim == 1 else [
            ("mxfp8_e4m3 nearest", "mxfp8_e4m3"), ("mxfp4 stochastic", "mxfp4:rounding=stochastic"),
            ("nvfp4 nearest", "nvfp4"), ("nvfp4_training (Hadamard: 2 launches)", "nvfp4_training")]
        for name, scheme in cases:
            from gradstats.scheme import Scheme

            resolved = Scheme.of(scheme)
            path = (f"Triton block kernel ({'two passes' if resolved.hadamard else 'one pass'}, counts on the device)"
                    if kb.covers(resolved, x, block_dim) else "composed (not the block kernel)")
            ms, _ = timer.median_ms(lambda s=scheme: prune_quantize_into(x, thr, s, seed=1, block_dim=block_dim,
                                                                          stats=v))
            gbs = 8 * m / ms / 1e6
            rows.append(row("blocks", f"prune_quantize {name}, {layout}, {m:,} float32", gbs, " GB/s",
                            target=TARGET_QUANTIZE, share=gbs / copy_gbs, ms=ms, bytes_per_element=8, path=path))
        x = v = None  # noqa: F841 - free the device memory before the next layout
    return rows


def compile_check(arch: int = 90) -> list[dict]:
    """Compile the block-scaled kernels (rows, MX and NVFP4 with the lag correction; Hadamard, both passes) for
    CUDA ``sm_<arch>`` with Triton's own ptxas, no GPU needed, and report each kernel's registers, stack and
    spills (``cuobjdump --dump-resource-usage``): a CPU-only check that the compiled path builds (the
    interpreter accepts code the compiler rejects) and stays free of spills."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gradstats.formats import FPFormat
    from gradstats.ops.consts import consts
    from gradstats.ops.triton import blocks as kb
    from gradstats.scheme import E4M3

    rows_k, had_k = kb._kernels(False)
    ptrs = {"X": "*fp32", "Y": "*fp32", "A": "*fp32", "SG": "*fp32", "ST": "*fp64", "AMX": "*i32", "CNT": "*i64",
            "SUMS": "*fp64", "CLIP": "*i64", "USED": "*fp64"}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = []
    for name, kernel, fmt_name, e4m3, extra in (
            ("rows, mxfp8_e4m3, stochastic", rows_k, "e4m3fn", False, dict(B=32, BP=32, R=64, IDX64=False, Q1=True)),
            ("rows, nvfp4, lag-corrected", rows_k, "e2m1fn", True, dict(B=16, BP=16, R=128, IDX64=False, Q1=False)),
            ("hadamard, nvfp4_training, amax pass", had_k, "e2m1fn", True,
             dict(N=16, LOGN=4, NORM=0.25, BK=128, AMAX_PASS=True)),
            ("hadamard, nvfp4_training, main pass", had_k, "e2m1fn", True,
             dict(N=16, LOGN=4, NORM=0.25, BK=128, AMAX_PASS=False))):
        fmt = FPFormat.parse(fmt_name)
        c, sc = consts(fmt), consts(E4M3)
        cst = dict(PRUNE=True, A_PTR=False, TA_MODE=2 if e4m3 else 0, I_MAX=9, E4M3=e4m3, SROUND=0, EMAX=fmt.emax,
                   MANB=fmt.man_bits, FMAX=float(fmt.max), TDIV=float(fmt.max * 448), SM=sc.M, SMSUB=sc.Msub,
                   SE0F=sc.E0F, SMAXBITS=sc.MAXBITS, SC0F=E4M3.min_normal, M=c.M, MSUB=c.Msub, E0F=c.E0F,
                   MAXBITS=c.MAXBITS, C0F=fmt.min_normal, ROUNDING=1, NEG_ZERO=True, CORR_T=True, WRITE_USED=True,
                   I_N=0, I_ZERO=1, I_NONFIN=2, I_LN=6, AMAX_PASS=False)
        cst.update(extra)
        sig = {a: ("constexpr" if a in cst else ptrs.get(a, "i32")) for a in kernel.arg_names}
        src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in cst.items()})
        t0 = time.perf_counter()
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"enable_fp_fusion": False, "num_warps": kb.NUM_WARPS})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                   text=True).stdout
        m = {key: int(v) for key, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
        out.append({"kernel": name, "sm": arch, "registers": m.get("REG"), "stack": m.get("STACK"),
                    "local (spills)": m.get("LOCAL"), "fma in ptx": k.asm["ptx"].count("fma.rn.f32"),
                    "compile s": round(time.perf_counter() - t0, 1)})
    return out


def gradient_like(n: int, device, seed: int = 0):
    """``n`` float32 values shaped like a neural gradient: magnitudes lognormal (``ln|g|`` normal,
    mean -9, sd 2), random signs, 30% exact zeros."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, device=device, generator=g).mul_(2.0).sub_(9.0).exp_()
    x.mul_(torch.rand(n, device=device, generator=g).sub_(0.5).sign_())
    x.masked_fill_(torch.rand(n, device=device, generator=g) < 0.3, 0.0)
    return x


def bench_stats(timer: Timer, n: int, copy_gbs: float, batch: int, model_name: str) -> list[dict]:
    import torch
    from stats_kernel import gradients, with_kernel

    import gradstats.stats as S

    dev = timer.device
    rows = []
    x = gradient_like(n, dev)
    on_cpu = dev.type == "cpu"
    calls: list[tuple[str, Callable[[torch.Tensor], Any], bool]] = [
        ("tensor_stats_vector full (histogram, top 64)", lambda t: S.tensor_stats_vector(t), True),
        ("tensor_stats_vector scalars (full=False, apply's refresh)",
         lambda t: S.tensor_stats_vector(t, full=False), True),
    ]
    if on_cpu:   # the torch reductions (the C kernel takes CPU float32 otherwise)
        calls.append(("torch-ops path, full", with_kernel(None, True), False))
    for name, fn, targeted in calls:
        from gradstats.ops.engine import active_engine

        path = ("C kernel (CPU)" if on_cpu and S.kernel_applies(x) and "torch-ops" not in name
                else "Triton one-pass kernel" if active_engine(dev.type) == "triton" and "torch-ops" not in name
                else "torch reductions")
        ms, _ = timer.median_ms(lambda: fn(x))
        gbs = 4 * n / ms / 1e6
        rows.append(row("stats", f"{name}, {n:,} values", gbs, " GB/s read", target=TARGET_STATS if targeted else None,
                        share=gbs / copy_gbs, ms=ms, bytes_per_element=4, path=path))
    x = None  # noqa: F841 - free the device memory before the next section
    # the neural gradients of one batch, every layer with parameters (captured on the CPU, then moved)
    grads = [g.to(dev) for g in gradients(model_name, batch)]
    total = sum(g.numel() for g in grads)

    def all_layers():
        for g in grads:
            S.tensor_stats_vector(g)

    ms, _ = timer.median_ms(all_layers)
    gbs = 4 * total / ms / 1e6
    rows.append(row("stats", f"tensor_stats_vector full over {model_name} gradients, batch {batch} "
                    f"({len(grads)} tensors, {total:,} values)", gbs, " GB/s read", share=gbs / copy_gbs,
                    ms=ms, ms_per_tensor=ms / len(grads), bytes_per_element=4))
    return rows


def bench_apply(timer: Timer, model_name: str, batch: int, rounds: int, block: int) -> list[dict]:
    import torch
    from _common import fixed_batches, interleaved_ratios, verdict
    from apply_overhead import every_conv_linear

    import gradstats
    from gradstats.plan import Plan
    from gradstats.zoo import build_model

    logging.getLogger("gradstats.apply").setLevel(logging.ERROR)   # the FP6 plan's alerts, as apply_overhead
    dev = timer.device
    model = build_model(model_name, seed=0).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if model_name == "transformer":     # the 4-layer character transformer on random tokens
        g = torch.Generator().manual_seed(0)
        batches = [(t[:, :-1].to(dev), t[:, 1:].to(dev)) for t in
                   (torch.randint(0, 128, (batch, 129), generator=g) for _ in range(block))]
        model = build_model(model_name, seed=0, vocab_size=128, seq_len=128).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        batches = [(x.to(dev), y.to(dev)) for x, y in fixed_batches(model_name, block, batch)]
    fp6 = {"format": "e3m2fn", "scale": "lognormal", "rounding": "nearest"}
    plans = {
        "fp6 + 85% sparsity (apply_overhead's reference plan)":
            every_conv_linear(**fp6, sparsity=0.85, threshold_rule="lognormal"),
        "Plan.uniform(format='e3m2fn', sparsity=0.85)": Plan.uniform(format="e3m2fn", sparsity=0.85),
    }

    def block_seconds(finish: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> float:
        t = timer.start()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            out = model(x)
            torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            if after is not None:
                after()
        if finish is not None:
            finish()
        return timer.stop(t) / 1e3 / len(batches)

    def applied(plan) -> float:
        handle = gradstats.apply(model, plan, record=False)
        return block_seconds(handle.remove)

    import tempfile

    tracer = gradstats.trace(model, tempfile.mkdtemp(prefix="gradstats-gpu-trace-"), sample_every=None, noise=False,
                             resume=True)

    def traced() -> float:             # statistics of every layer on every step, committed each block
        tracer.attach()
        sec = block_seconds(tracer.flush, tracer.step)
        tracer.detach()
        return sec

    configs: dict[str, Callable[[], float]] = {"plain": block_seconds, "trace every step": traced}
    configs.update({label: (lambda p=p: applied(p)) for label, p in plans.items()})
    for run in configs.values():          # warm-up: kernels compiled, cuDNN and the allocator settled
        run()
    res = interleaved_ratios(configs, rounds)
    rows = [row("apply", f"{model_name} step, batch {batch}, plain", res["plain"][0] * 1e3, " ms/step",
                rounds=rounds, block=block)]
    for label in ["trace every step", *plans]:
        sec, ratio, q1, q3, lo, hi = res[label]
        rows.append(row("apply", f"{model_name} step with {label}: time ratio", ratio, "x", target=TARGET_APPLY,
                        at_least=False, ms_per_step=sec * 1e3, ratio_q1=q1, ratio_q3=q3, ratio_ci90=[lo, hi],
                        verdict_ci=verdict((lo, hi), TARGET_APPLY), rounds=rounds, block=block))
    return rows


def gpu_table_appendix() -> str:
    """The printed table of bench/quantize.py's gpu_table (CUDA only)."""
    from bench.quantize import gpu_table

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        gpu_table()
    return buf.getvalue().strip()


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def environment(device_type: str) -> dict[str, Any]:
    env: dict[str, Any] = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                           "python": platform.python_version()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_runtime"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if device_type == "cuda" and torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        elif device_type == "cuda":
            env["device"] = f"none (no CUDA device; host cpu {platform.machine()}, {os.cpu_count()} cores)"
        else:
            env["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    except Exception as e:  # pragma: no cover - torch missing
        env["torch"] = f"unavailable: {e}"
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:
        env["triton"] = f"unavailable: {type(e).__name__}"
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "0")
    return env


def _fmt_value(r: dict) -> str:
    v = r["value"]
    if v is None:
        return "not measured"
    unit = r["unit"]
    if unit.strip().startswith("GB/s"):
        return f"{v:,.0f}{unit}" if v >= 10 else f"{v:.3g}{unit}"
    if unit == "x":
        return f"{v:.3f}x"
    return f"{v:.2f}{unit}"


def render_md(meta: dict, rows: list[dict], appendix: str | None, errors: list[str]) -> str:
    env = meta["environment"]
    lines = ["# GPU check: bench/gpu.py", ""]
    if meta.get("status"):
        lines += [f"**{meta['status']}**", ""]
    if meta.get("label"):
        lines += [f"**{meta['label']}**", ""]
    lines += [f"device: {env.get('device')}; torch {env.get('torch')} (CUDA {env.get('cuda_runtime')}); "
              f"triton {env.get('triton')}; python {env.get('python')}; {env.get('date')}", "",
              f"command: `{meta['command']}`", ""]
    if rows:
        lines += ["| section | measurement | value | % of copy | target | pass |", "|---|---|---|---|---|---|"]
        for r in rows:
            share = "" if r["share_of_copy"] is None else f"{r['share_of_copy']:.0%}"
            ok = "" if r["pass"] is None else ("pass" if r["pass"] else "**fail**")
            name = r["name"]
            d = r.get("detail", {})
            if d.get("path"):
                name += f" [{d['path']}]"
            if d.get("ratio_ci90"):
                lo, hi = d["ratio_ci90"]
                name += f" ({d['ms_per_step']:.2f} ms/step; 90% CI of the median ratio {lo:.3f}-{hi:.3f}: {d['verdict_ci']})"
            lines.append(f"| {r['section']} | {name} | {_fmt_value(r)} | {share} | {r['target_text'] or ''} | {ok} |")
        lines.append("")
        targeted = [r for r in rows if r["pass"] is not None]
        if targeted:
            lines += [f"targets met: {sum(r['pass'] for r in targeted)} of {len(targeted)}", ""]
        else:
            lines += ["targets: no verdicts (nothing here was measured on a GPU)", ""]
    if errors:
        lines += ["sections that failed:", ""] + [f"- {e}" for e in errors] + [""]
    if appendix:
        lines += ["## appendix: bench/quantize.py gpu_table", "", "```", appendix, "```", ""]
    return "\n".join(lines)


def write(out: Path, meta: dict, rows: list[dict], appendix: str | None, errors: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({**meta, "rows": rows, "errors": errors, "appendix": appendix},
                                             indent=1, default=str) + "\n")
    md = out / "gpu.md"
    md.write_text(render_md(meta, rows, appendix, errors))
    return md


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        for r in compile_check():
            print(r)
        return 0
    cpu = args.device == "cpu"
    if cpu:      # the Triton kernels through Triton's interpreter (must be set before they are built)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    out = Path(args.out)
    meta: dict[str, Any] = {"command": " ".join(["python bench/gpu.py", *(argv if argv is not None else sys.argv[1:])]),
                            "args": vars(args), "targets": {"quantize_share_of_copy": TARGET_QUANTIZE,
                                                            "stats_share_of_copy": TARGET_STATS,
                                                            "apply_ratio": TARGET_APPLY}}
    if not cpu and not torch.cuda.is_available():
        meta.update(status=NOT_MEASURED, environment=environment("cuda"))
        md = write(out, meta, [], None, [])
        print(f"{NOT_MEASURED}; wrote {md} and {md.with_suffix('.json')}")
        return 0
    dev = torch.device("cpu" if cpu else "cuda")
    meta["environment"] = environment(dev.type)
    if cpu:
        meta["label"] = ("CPU smoke test (--device cpu): the code paths only; timings are meaningless and no "
                         "target applies to them")
    timer = Timer(dev, args.reps, args.warmup)
    rows: list[dict] = []
    errors: list[str] = []

    def section(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:   # one failing section does not hide the others' numbers
            import traceback

            traceback.print_exc()
            errors.append(f"{name}: {type(e).__name__}: {e}")
            res = None
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        return res

    def partial() -> None:     # after each section: a run cut short by a timeout leaves what it measured
        write(out, {**meta, "status": "incomplete (the run stopped before the end)"}, rows, None, errors)

    copy_row, copy_gbs = section("copy", lambda: bench_copy(timer, args.n)) or (None, None)
    if copy_row is None:
        meta["status"] = "the copy reference failed: nothing else measured"
        write(out, meta, rows, None, errors)
        return 1
    rows.append(copy_row)
    partial()
    if "quantize" in args.sections:
        rows += section("quantize", lambda: bench_quantize(timer, args.n, copy_gbs)) or []
        partial()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if "blocks" in args.sections:
        rows += section("blocks", lambda: bench_blocks(timer, args.n, copy_gbs)) or []
        partial()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if "stats" in args.sections:
        rows += section("stats", lambda: bench_stats(timer, args.n, copy_gbs, args.batch, "resnet18")) or []
        partial()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if "apply" in args.sections:
        rows += section("apply", lambda: bench_apply(timer, "resnet18", args.batch, args.rounds, args.block)) or []
        rows += section("apply", lambda: bench_apply(timer, "transformer", 32, args.rounds, args.block)) or []
        partial()
    appendix = None
    if dev.type == "cuda" and not args.no_gpu_table and not args.small:
        appendix = section("gpu_table", gpu_table_appendix)
    if cpu:
        for r in rows:     # no verdicts on meaningless timings
            r["pass"] = None
            if "verdict_ci" in r.get("detail", {}):
                r["detail"]["verdict_ci"] = "no verdict (CPU smoke test)"
    md = write(out, meta, rows, appendix, errors)
    print(md.read_text())
    print(f"wrote {md} and {md.with_suffix('.json')}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
