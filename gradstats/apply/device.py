"""The device path of :func:`gradstats.apply`: no host synchronisation in the backward pass.

Where the gradient's engine is Triton (CUDA tensors, or CPU tensors under ``GRADSTATS_ENGINE=triton``
and ``TRITON_INTERPRET=1``, :func:`gradstats.ops.engine.active_engine`), a planned layer's call in the
backward pass only launches work:

1. its statistics, one pass of the Triton statistics kernel, into a vector that stays on the device;
2. the fused prune-and-quantise kernel at the layer's current threshold and scale (host numbers,
   passed as kernel arguments), whose counts and sums accumulate on the device in the same pass
   (per-tensor scales: :mod:`gradstats.ops.triton.fused`; MX and NVFP4 block scales:
   :mod:`gradstats.ops.triton.blocks`, NVFP4's tensor scale from the statistics' maximum; the NVFP4
   training recipe's Hadamard transform needs the rotated tensor's maximum first: two launches); both
   correct the settings for the lag themselves, from the statistics vector;
3. non-blocking copies of the vector and the counts towards the host (:class:`gradstats.ops.host.Outbox`).

Nothing is read back there. The handle *settles* outside the backward pass, at the next forward of
a planned layer (or when a result is asked for: ``to_dataframe()``, ``summary()``, ``alerts``,
``state_dict()``, ``remove()``): one wait for every copy of the step, then, per call in order, the
statistics are folded into the layer's running state and its threshold, scale and predictions
solved (the same host code as the CPU path: :class:`gradstats.apply.refresh.Refresher`), and the
counts checked and recorded (:class:`gradstats.apply.alerts.Alerts`).

**The lag.** The threshold and scale a call uses are solved from the statistics of the calls
before the last settling: with ``refresh_every=1``, the previous step's gradient instead of the
current one, which the CPU path reads in the backward pass. A layer's first call therefore has no
statistics to work from and passes its gradient unchanged (it seeds them, like one warm-up call);
a fallback triggered by a call changes the rule from the next step; an alert is raised at the
settling after the call. The effect on achieved sparsity is measured in ``bench/RESULTS.md``
(``bench/device_lag.py``). The ``"exact"`` threshold rule selects from the gradient itself and
reads its threshold back on each refresh (one synchronisation per refreshed call); the other rules
read nothing.

The random draws of each call come from a seed made of the handle's ``seed`` and the call's index
(host integers: drawing from a generator would read a tensor), so a run on a GPU and the same run
on the CPU through the interpreter make the same draws, and a checkpoint resumes them exactly
(``state_dict()`` holds the index).

Example:
    >>> import torch, gradstats
    >>> h = gradstats.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)),
    ...                     gradstats.Plan.uniform(format="e4m3fn", output_layer=False))
    >>> h.device_path.calls, h.device_path.inflight, h.device_path.refresher is h.refresher   # none on the CPU
    (0, [], True)
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from gradstats.apply.refresh import LayerState, Refresher, snapshot
from gradstats.ops import random as _rng
from gradstats.ops.fused import CompressCounts, prune_quantize_into
from gradstats.ops.host import Outbox
from gradstats.pruning.rules import THRESHOLD_RULES

#: a call's record on the device: counts (int64[5], as float64 bits), sums (float64[6]), the threshold
#: and scale the kernel used (float64[2])
RECORD_LEN = 13


def _one_kernel(g: torch.Tensor, fmt: Any, scale: float) -> bool:
    """Whether the fused Triton kernel takes the call whole (its lag correction included); ``fmt`` the element
    format of the rule's scheme, or None."""
    from gradstats.ops.engine import use_triton
    from gradstats.ops.fused import fused_covers
    from gradstats.ops.triton import fused as kfused

    return (use_triton(g.device.type) and g.numel() > 0 and g.is_contiguous() and kfused.supports(fmt)
            and fused_covers(fmt, scale) and math.isfinite(scale))


def _block_kernel(g: torch.Tensor, fmt: Any, q: dict[str, Any], st: LayerState, rule: Any) -> dict[str, Any] | None:
    """The block kernel's arguments for the call (the rule's scheme ``fmt`` and the block dim), or None where
    it does not take it whole (:func:`gradstats.ops.triton.blocks.covers`, a finite threshold, a contiguous
    gradient)."""
    from gradstats.ops.engine import use_triton
    from gradstats.ops.triton import blocks as kblocks

    if not (use_triton(g.device.type) and g.numel() > 0 and g.is_contiguous()):
        return None
    if rule.prunes and not (math.isfinite(st.threshold) and st.threshold >= 0):
        return None
    block_dim = q.get("block_dim", -1)
    if not kblocks.covers(fmt, g, block_dim):
        return None
    return {"s": fmt, "block_dim": block_dim}


_F = {"n": 0, "n_zero": 1, "n_nonfinite": 2, "sum_ln_abs": 6, "max_abs": 9}


def current_settings(v: torch.Tensor, st: LayerState, rule: Any, fmt: Any) -> tuple[Any, Any]:
    """The threshold and scale a call uses, corrected on the device for the lag: the solved
    threshold (and a per-tensor scale) moved by the drift of the gradient's location since they
    were solved, ``exp(mu_now - solved_mu)`` (``mu_now``: the mean ``ln|g|`` of this call's
    statistics vector ``v``, still on the device); the scale, a power of two, then lowered where
    this call's largest magnitude (or the threshold, which pruning rounds up to) would saturate.
    Small tensor operations on ``v``, nothing read back. Host numbers where nothing is corrected."""
    from gradstats.stats import LAYOUT, SCALAR_FIELDS

    threshold: Any = st.threshold if rule.prunes else 0.0
    scale: Any = st.scale
    if math.isnan(st.solved_mu):
        return threshold, scale
    i = {name: SCALAR_FIELDS.index(name) for name in _F}
    assert LAYOUT["max_abs"].start == i["max_abs"]
    n_nz = v[i["n"]] - v[i["n_zero"]] - v[i["n_nonfinite"]]
    drift = torch.where(n_nz > 0, v[i["sum_ln_abs"]] / n_nz.clamp_min(1) - st.solved_mu, 0.0)
    if rule.prunes and st.threshold > 0 and math.isfinite(st.threshold):
        threshold = (st.threshold * torch.exp(drift)).to(torch.float32)
    if rule.quantizes and rule.block_size is None and fmt is not None and rule.scale != "fixed":
        s = torch.exp2(torch.round(math.log2(st.scale) - drift / math.log(2)))
        top = torch.maximum(v[i["max_abs"]].nan_to_num(0.0), torch.as_tensor(threshold, dtype=torch.float64,
                                                                               device=v.device))
        cap = torch.where(top > 0, torch.exp2(torch.floor(torch.log2(fmt.max / top.clamp_min(1e-300)))), s)
        scale = torch.minimum(s, cap).to(torch.float32)
    return threshold, scale


class DevicePath:
    """The device path of :class:`~gradstats.apply.Applied` (see the module's docstring): it shares
    the handle's ``rules`` and ``state``, solves with its :class:`~gradstats.apply.refresh.Refresher`,
    and hands each settled call to ``account`` (the handle's checks and records)."""

    def __init__(self, refresher: Refresher, config: Any, quantize_args: Callable[[str, Any, torch.Tensor], dict],
                 account: Callable[..., None]) -> None:
        self.refresher, self.rules, self.state = refresher, refresher.rules, refresher.state
        self.config, self.quantize_args, self.account = config, quantize_args, account
        self.outbox = Outbox()
        self.inflight: list[tuple[Any, ...]] = []
        #: enforced calls on the device path so far (their seeds follow from it; checkpointed)
        self.calls = 0

    def _next_seed(self) -> int:
        """The seed of the next call, from the handle's seed and the call's index: host integers,
        no draw from a generator (which reads a tensor)."""
        self.calls += 1
        return _rng.mix64(_rng.mix64(self.config.seed) + self.calls) >> 2

    def compress(self, name: str, g: torch.Tensor) -> torch.Tensor:
        from gradstats.apply.refresh import all_reduce_stats, stats_vector

        rule, st = self.rules[name], self.state[name]
        k = st.seq - self.config.warmup
        refresh = k < 0 or self.refresher.refreshes(k)
        threshold_rule = THRESHOLD_RULES[rule.threshold_rule] if rule.prunes else None
        hist = threshold_rule is not None and threshold_rule.needs_histogram
        v = stats_vector(g, full=refresh and hist)   # every call: its location corrects the lag below
        if self.config.sync_stats and torch.distributed.is_available() and torch.distributed.is_initialized():
            v = all_reduce_stats(v)
        if self.refresher.needs_stats(rule, refresh):
            self.outbox.put(v)
            self.inflight.append(("stats", name, refresh, refresh and hist, g.numel()))
        if k < 0 or math.isnan(st.mu):       # warm-up, or the layer's first call: no statistics back yet
            st.seq += 1
            return g
        if refresh and threshold_rule is not None and not threshold_rule.from_statistics:
            self.refresher.solve(name, True, g.numel(), g)    # (reads its threshold back)
        q = self.quantize_args(name, rule, g)
        fmt = q.pop("fmt")                           # the rule's scheme (None: no quantisation)
        el = None if fmt is None else fmt.element
        if (el is None or fmt.block_size is None) and _one_kernel(g, el, st.scale):
            # one launch: the fused kernel corrects the settings for the lag from v itself and
            # writes its counts, sums and the settings it used into one zeroed buffer
            from gradstats.ops.triton import fused as kfused

            buf = torch.zeros(RECORD_LEN, dtype=torch.float64, device=g.device)
            out, _, _ = kfused.prune_quantize_triton(
                g, st.threshold if rule.prunes else 0.0, el, scale=st.scale, rounding=rule.rounding,
                seed=self._next_seed(), counts=buf[:5].view(torch.int64), sums=buf[5:11], used=buf[11:13],
                stats=v, solved_mu=st.solved_mu, correct_threshold=rule.prunes,
                correct_scale=rule.quantizes and rule.scale != "fixed")
        elif el is not None and fmt.block_size is not None and (b := _block_kernel(g, fmt, q, st, rule)) is not None:
            # block scales, one launch (two with a Hadamard transform): the kernel corrects the threshold for
            # the lag from v, takes NVFP4's tensor scale from v's maximum, and writes its counts, sums and the
            # settings it used into one zeroed buffer
            from gradstats.ops.triton import blocks as kblocks

            buf = torch.zeros(RECORD_LEN, dtype=torch.float64, device=g.device)
            out, _, _ = kblocks.prune_quantize_blocks_triton(
                g, st.threshold if rule.prunes else 0.0, b.pop("s"), seed=self._next_seed(),
                counts=buf[:5].view(torch.int64), sums=buf[5:11], used=buf[11:13], stats=v,
                solved_mu=st.solved_mu, correct_threshold=rule.prunes, scale=float(st.scale), **b)
        else:    # other block rules: the operators one after the other
            threshold, scale = current_settings(v, st, rule, el)
            out, counts, sums = prune_quantize_into(g, threshold, fmt, scale=scale, seed=self._next_seed(), stats=v,
                                                    **q)
            used = torch.stack([torch.as_tensor(threshold, dtype=torch.float64, device=g.device).reshape(()),
                                torch.as_tensor(scale, dtype=torch.float64, device=g.device).reshape(())])
            buf = torch.cat([counts.view(torch.float64), sums, used])
        self.outbox.put(buf)
        self.inflight.append(("counts", name, st.seq, g.numel(), rule, snapshot(st)))
        st.seq += 1
        return out

    def settle(self) -> None:
        """Bring the device's statistics and counts of every call so far to the host (one wait),
        then update each layer's state, solve its settings, check and record its calls, in order.
        Called by the handle itself (next forward, results, checkpoints); harmless to call again."""
        if not self.inflight:
            return
        items = iter(self.outbox.collect())
        inflight, self.inflight = self.inflight, []
        for entry in inflight:
            if entry[0] == "stats":
                _, name, refresh, hist, numel = entry
                self.refresher.fold(name, next(items), hist)
                self.refresher.solve(name, refresh, numel)
                continue
            _, name, seq, numel, rule, snap = entry
            buf = next(items)
            thr, scale = buf[11:13].tolist()
            snap = {**snap, "threshold": thr, "scale": scale}      # as the kernel used them
            counts = CompressCounts(numel, *buf[:5].view(torch.int64).tolist(), *buf[5:11].tolist())
            self.account(name, rule, seq, counts, math.nan, snap)


__all__ = ["DevicePath"]
