"""The capture side of the tracer: the hooks on each selected module (a forward hook that registers a
tensor hook on the module's output), what a hook records (a statistics row written in place, per-block
statistics, a sample), the parameters taken when a step closes, and the glue to the noise records
(:mod:`gradstats.tracer.noise`). :class:`gradstats.tracer.Tracer` is made of it and of
:class:`gradstats.tracer.commit.Commit`.

Example:
    >>> import torch
    >>> first_grad_tensor((torch.ones(2), torch.ones(2, requires_grad=True))).shape
    torch.Size([2])
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn

from gradstats.layers import module_types
from gradstats.ops.engine import using
from gradstats.ops.host import Outbox
from gradstats.ops.layout import channel_dim, gemm_matrix
from gradstats.run import sample_key
from gradstats.stats import VectorRows, kernel_applies, tensor_stats_vector, write_stats
from gradstats.stats.blocks import BLOCK_SIZES, RANGE_BINS
from gradstats.stats.kernel import write_stats_raw
from gradstats.tracer.noise import (
    Propagation,
    flat_grad,
    has_closed_form,
    noise_params,
    records_noise,
    sample_layout,
    sending_back,
    vjp_terms,
    weight_grad_terms,
)
from gradstats.tracer.taps import grad_tap, observe, replace_first_grad_tensor

if TYPE_CHECKING:
    from gradstats.tracer.config import TraceConfig

log = logging.getLogger(__name__)


def first_grad_tensor(out: Any) -> torch.Tensor | None:
    """The first floating tensor requiring grad in a (nested) module output."""
    if isinstance(out, torch.Tensor):
        return out if (out.requires_grad and out.is_floating_point()) else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            t = first_grad_tensor(item)
            if t is not None:
                return t
    return None


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: the local shard of a ``DTensor`` (FSDP2's
    ``fully_shard``, tensor parallelism), the tensor itself otherwise."""
    return t.to_local() if _is_dtensor(t) else t


def sharded_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are split across ranks (``DTensor``s with a ``Shard``
    placement, as ``fully_shard`` makes them): its weights and weight gradients are then recorded
    per rank as shards, which ``Run.stats(merge_ranks=True)`` adds up instead of taking one
    rank's replica.

    Example:
        >>> sharded_parameters(torch.nn.Linear(2, 2))          # plain parameters: not sharded
        False
    """
    for p in module.parameters(recurse=False):
        if _is_dtensor(p) and any(type(pl).__name__ in ("Shard", "_StridedShard") for pl in p.placements):
            return True
    return False


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1



#: tokens per group of a gradient's sample (:func:`token_groups`): a multiple of the block sizes of
#: the formats users target (NVFP4 16, MX 32), so that blocks along the tokens and tiles are whole
TOKEN_GROUP = 32


def token_groups(m: torch.Tensor, k: int | None, generator: torch.Generator) -> torch.Tensor:
    """A sample of about ``k`` values of the gradient matrix ``m`` ``(M tokens, K channels)``
    (:func:`gradstats.ops.layout.gemm_matrix`) that keeps its block layout: whole groups of
    :data:`TOKEN_GROUP` consecutive tokens, aligned, drawn uniformly without replacement and kept in
    token order, each with all its channels. Every block a GEMM reads (along the channels, along the
    tokens, ``16 x 16`` and ``32 x 32`` tiles) lies wholly inside the sample or outside it, so a
    replay quantises the sampled blocks exactly as the whole tensor's. At least ``k`` values (whole
    groups: fewer than one group more), ``m`` itself when it holds at most that many (or ``k`` is
    None); fewer tokens per group when one group of 32 holds more than ``4 k`` values.

    Example:
        >>> m = torch.arange(128 * 4, dtype=torch.float32).reshape(128, 4)
        >>> s = token_groups(m, 256, torch.Generator().manual_seed(0))
        >>> s.shape, bool((s[1:, 0] - s[:-1, 0] >= 4).all()), int(s[0, 0]) % (32 * 4)
        (torch.Size([64, 4]), True, 0)
        >>> token_groups(m, 300, torch.Generator().manual_seed(0)).numel()     # 3 groups of 32 x 4
        384
        >>> token_groups(torch.zeros(16, 8192), 65536, torch.Generator()).shape  # under one group: whole
        torch.Size([16, 8192])
    """
    M, K = m.shape
    if k is None or M * K <= k:
        return m
    g = TOKEN_GROUP
    while g > 1 and g * K > 4 * k:                # very wide layers (a vocabulary's logits): fewer tokens
        g //= 2
    groups = M // g
    if groups == 0:                                # fewer tokens than one group: all of them
        return m
    take = max(1, min(groups, -(-k // (g * K))))
    idx = sample_indices(groups, take, generator, m.device).sort().values.to(torch.int64)
    rows = (idx[:, None] * g + torch.arange(g, device=m.device)[None, :]).reshape(-1)
    return m[rows]


def sample_indices(n: int, k: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)`` drawn uniformly at random, in random order: the same
    law as ``torch.randperm(n)[:k]``, without its O(n) cost when ``k`` is small against ``n``.

    Draws slightly more than ``k`` indices with replacement and keeps the distinct ones: given
    their number, by symmetry they are a uniform subset of that size, so a uniform random ``k`` of
    them, in random order, is a uniform ordered sample without replacement.

    Example:
        >>> idx = sample_indices(10**6, 1000, torch.Generator().manual_seed(0), torch.device("cpu"))
        >>> idx.shape, idx.unique().numel()
        (torch.Size([1000]), 1000)
    """
    # 32-bit indices where they suffice: the sort inside unique() and the permutation take half
    # the time of 64-bit ones (a capture's sample of 65536 from 1.6M values: 2.95 -> 1.3 ms)
    dtype = torch.int32 if n < 2**31 else torch.int64
    if 4 * k >= n:
        return torch.randperm(n, generator=generator, device=device, dtype=dtype)[:k]
    m = k + (k * k) // n + 64            # about k distinct among m draws, with room to spare
    drawn = torch.randint(0, n, (m,), generator=generator, device=device, dtype=dtype).unique()
    while drawn.numel() < k:
        more = torch.randint(0, n, (m,), generator=generator, device=device, dtype=dtype)
        drawn = torch.cat([drawn, more]).unique()
    return drawn[torch.randperm(drawn.numel(), generator=generator, device=device, dtype=dtype)[:k]]


class Capture:
    """The hooks and records of a :class:`gradstats.tracer.Tracer` (its state is set up by the
    tracer's constructor; declared here for the reader)."""

    config: "TraceConfig"
    kinds: tuple[str, ...]
    blocks: tuple[int, ...] | None
    blocks_on_samples: bool
    block_sample: int | None
    samples_per_capture: int | None
    seed: int
    rank: int
    noise: bool
    current_step: int
    modules: dict[str, nn.Module]
    _lock: threading.Lock
    _rows: VectorRows
    _row_keys: list[tuple[int, str, str, int]]
    _pending: list[tuple[int, str, str, int, torch.Tensor]]
    _pending_samples: dict[str, tuple[torch.Tensor, int]]
    _pending_tables: dict[str, list[dict[str, Any]]]
    _outbox: Outbox
    _calls: dict[Any, int]
    _slots: dict[str, tuple[int | None, int | None]]
    _compiled: bool
    _shapes: dict[str, list[int]]
    _sampling_stopped: bool
    _active_step: int | None
    _active_now: tuple[bool, bool]
    _take_stats: Callable[[int], bool]
    _take_samples: Callable[[int], bool]
    _generators: dict[torch.device, torch.Generator]
    _noise_generators: dict[torch.device, torch.Generator]
    _graph_step: int | None
    _propagation: Propagation | None
    _noise_prev: tuple[int, dict[str, torch.Tensor]] | None
    #: the autograd edges of the outputs of the sampled step's calls whose noise terms are
    #: vector-Jacobian products (:func:`gradstats.tracer.noise.vjp_terms`), by (step, layer, call):
    #: held here, not in the tensor hook (a hook that held its own tensor's graph would keep it
    #: alive), released when the step closes
    _noise_edges: dict[tuple[int, str, int], Any]
    #: the traced modules whose parameters got gradients although they were never called, with
    #: their class names (the manifest's ``"uncalled"``)
    _uncalled: dict[str, str]
    world_size: int
    model: nn.Module
    log_rows: Callable[[str, Any], None]       # Commit's

    def _before_update(self) -> None:
        """The step's gradients are complete: the parameters and weight gradients it records, and
        the traced modules that got gradients without being called."""
        if "weight" in self.kinds or "wgrad" in self.kinds:
            self._capture_parameters()
        if self.noise:
            self._finish_propagation()
            self._capture_noise_pair()
            self.__dict__.pop("_noise_edges", None)
        self._find_uncalled()

    def _find_uncalled(self) -> None:
        """Name once, in a warning and in the manifest (``"uncalled"``), the traced modules whose own
        trainable parameters got a gradient although the module was never called: its weights are
        used functionally (``F.linear(x, self.proj.weight)``), so no hook sees its output gradient and
        no plan reaches it. A module is not named when a called traced ancestor stands for it: a
        matmul layer (:data:`gradstats.layers.MATMUL_TYPES`) that applies its children's weights
        itself, as ``nn.MultiheadAttention`` its ``out_proj``."""
        known = self.__dict__.setdefault("_uncalled", {})
        todo = self.__dict__.get("_uncalled_todo")
        if todo is None:        # the candidates: modules that own trainable parameters
            todo = self.__dict__.setdefault("_uncalled_todo", {
                name: ps for name, m in self.modules.items()
                if (ps := [p for p in m.parameters(recurse=False) if p.requires_grad])})
        if not todo:
            return
        for name in [n for n in todo if n in self._shapes]:
            del todo[name]                       # called: seen
        if not self._shapes:                     # nothing traced was called: not a step of this model yet
            return
        new = {}
        for name, params in list(todo.items()):
            if self._stands_for(name):           # for good: a called ancestor stays called
                del todo[name]
                continue
            grads = [p.grad for p in params if p.grad is not None]
            if grads and any(bool(_local(gr).detach().ne(0).any()) for gr in grads):
                new[name] = type(self.modules[name]).__name__
                del todo[name]
        if not new:
            return
        known.update(new)
        log.warning("gradstats.trace: %d traced module(s) got weight gradients in step %d but were never called: "
                    "%s. Their weights are used functionally (e.g. F.linear(x, module.weight)), so their gradients "
                    "cannot be traced or planned because the module is never called; call the module instead, or "
                    "trace and plan the module that uses its weights",
                    len(new), self.current_step, ", ".join(f"{n} ({t})" for n, t in new.items()))
        self._write_manifest()

    def _stands_for(self, name: str) -> bool:
        """Whether a called traced ancestor of module ``name`` stands for it (:meth:`_find_uncalled`)."""
        from gradstats.layers import layer_records

        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            anc = ".".join(parts[:k])
            mod = self.modules.get(anc)
            if mod is not None and anc in self._shapes and layer_records({anc: mod})[0].matmul:
                return True
        return False

    def _finish_propagation(self) -> None:
        """After the step whose noise propagation was measured: its rows, once per run."""
        prop = self._propagation
        if prop is not None and self.current_step == self._graph_step:
            graph, gains = prop.finish(self.current_step)
            self._propagation = None
            if graph:
                self.log_rows("noise_graph", graph)
            if gains:
                self.log_rows("noise_gain", gains)

    def _capture_noise_pair(self) -> None:
        """SGD's own noise of each recorded layer's gradient (of its :func:`gradstats.tracer.noise.noise_params`),
        from two batches: the gradients of a sampled step ``s`` and of the next, ``|G_s - G_(s+1)|^2 / 2``
        (into the ``"noise"`` table as ``pair``, at step ``s + 1`` with ``of_step = s``; one update apart,
        the model's drift is small next to the minibatch noise)."""
        step = self.current_step
        prev = self._noise_prev
        if prev is not None and prev[0] == step - 1:
            rows = []
            for name, g0 in prev[1].items():
                g1 = flat_grad(noise_params(self.modules[name]), local=_local)
                if g1 is not None and g1.shape == g0.shape:
                    d2 = float((g1 - g0).square().sum())
                    rows.append({"step": step, "of_step": prev[0], "layer": name, "call": -1, "rank": self.rank,
                                 "pair": d2 / 2.0})
            if rows:
                self.log_rows("noise", rows)
            self._noise_prev = None
        if self._active(step)[1] and "grad" in self.kinds:
            grads = {}
            for name, module in self.modules.items():
                if name in self._shapes and records_noise(module):
                    g = flat_grad(noise_params(module), local=_local)
                    if g is not None:
                        grads[name] = g
            self._noise_prev = (step, grads) if grads else None


    # -- hooks
    def _active(self, step: int) -> tuple[bool, bool]:
        """(statistics, samples) taken on ``step``: worked out once per step (every module's
        forward hook asks)."""
        if step != self._active_step:
            self._active_now = (self._take_stats(step),
                                self._take_samples(step) and not self._sampling_stopped)
            self._active_step = step
        return self._active_now

    def _make_forward_hook(self, name: str) -> Callable[..., None]:
        def forward_hook(module: nn.Module, inputs: Any, output: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            if torch.compiler.is_compiling():       # a graph dynamo traces: taps, decided when they run
                return self._tap_compiled(name, output)
            step = self.current_step
            do_stats, do_samples = self._active(step)
            if not (do_stats or do_samples) and name in self._shapes:
                return              # nothing taken on this step (calls are counted on taken steps)
            out = first_grad_tensor(output)
            if out is None:
                return
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            if name not in self._shapes:
                self._shapes[name] = list(out.shape)
            if not (do_stats or do_samples):
                return
            if "act" in self.kinds:
                self._record(step, name, "act", call, out.detach(), do_stats, do_samples)
            if "grad" in self.kinds:
                noise = self._noise_input(step, name, call, module, inputs, output, out) if do_samples else None

                def tensor_hook(grad: torch.Tensor) -> None:
                    if sending_back():                   # noise sent back by a propagation measurement
                        return
                    prop = self._propagation
                    if torch.compiler.is_compiling():    # traced (compiled autograd): kept out
                        self._record(step, name, "grad", call, grad, do_stats, do_samples)
                    else:                                # eager, the common case: no wrapper
                        self._record_now(step, name, "grad", call, grad, do_stats, do_samples)
                        if noise is not None:
                            noise(grad)
                        if prop is not None and step == self._graph_step and call == 0:
                            prop.on_gradient(name, grad, self._noise_generator(grad.device))
                out.register_hook(tensor_hook)
        return forward_hook

    def _tap_compiled(self, name: str, output: Any) -> Any:
        """Under ``torch.compile``: taps on the module's output (:mod:`gradstats.tracer.taps`) whose
        callbacks (:meth:`_on_compiled`) decide at run time what to record. Only constants are
        read here, so the compiled graph neither breaks nor recompiles per module or step."""
        act, grad = self._slots[name]
        out = first_grad_tensor(output)
        if out is None:
            return None
        if act is not None:
            observe(out, act)
        if grad is None:
            return None
        return replace_first_grad_tensor(output, lambda t: grad_tap(t, grad))

    def _on_compiled(self, name: str, kind: str, t: torch.Tensor) -> None:
        """A tap of a compiled model's module ran: record ``t`` as the forward hook and the tensor
        hook record it in eager mode. Calls are counted per kind in the order the taps run (the
        gradients' in backward order); the noise terms, which need the layer's input, are not
        recorded (the run's manifest says so)."""
        if kind == "grad" and sending_back():
            return
        step = self.current_step
        do_stats, do_samples = self._active(step)
        self._compiled = True
        if not (do_stats or do_samples) and name in self._shapes:
            return
        key = (name, kind)
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        if name not in self._shapes:
            self._shapes[name] = list(t.shape)
        if do_stats or do_samples:
            self._record_now(step, name, kind, call, t, do_stats, do_samples)

    def _noise_input(self, step: int, name: str, call: int, module: nn.Module, inputs: Any, output: Any,
                     out: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
        """On a sampled step: what the noise terms of the call's gradient need
        (:mod:`gradstats.tracer.noise`), as the function that records them from the output gradient:
        the layer's input for a closed form (autograd holds it already), else the autograd edge of its
        output, kept until the step closes; and the autograd nodes of the step's first calls, from
        which the layers downstream of each are worked out once."""
        if not self.noise or torch.compiler.is_compiling():
            return None
        x = next((t for t in (inputs if isinstance(inputs, tuple) else (inputs,)) if isinstance(t, torch.Tensor)),
                 None)
        if self._propagation is not None and call == 0:
            if self._graph_step is None:
                self._graph_step = step
            if step == self._graph_step:
                self._propagation.keep(name, out, x, noise_params(module))
        if has_closed_form(module):
            if x is None:
                return None
            xd = x.detach()
            return lambda grad: self._record_noise(step, name, call, module, xd, grad)
        params = noise_params(module)
        if not params or out.grad_fn is None or not self._vjp_allowed(params):
            return None
        batch, where = sample_layout(module, output, out)
        key = (step, name, call)
        self.__dict__.setdefault("_noise_edges", {})[key] = torch.autograd.graph.get_gradient_edge(out)
        return lambda grad: self._record_noise_vjp(key, params, batch, where, grad)

    def _vjp_allowed(self, params: list[torch.Tensor]) -> bool:
        """Whether a backward pass may be sent through a module's graph to its parameters: not for
        parameters sharded across ranks (FSDP: a backward pass to them would gather and reduce
        them, on this rank alone)."""
        if self.world_size == 1:
            return True
        if any(_is_dtensor(p) or type(p).__name__ == "FlatParameter" for p in params):
            return False
        fsdp = self.__dict__.get("_under_fsdp")
        if fsdp is None:
            fsdp = self.__dict__["_under_fsdp"] = any(type(m).__name__ == "FullyShardedDataParallel"
                                                      for m in self.model.modules())
        return not fsdp

    def _record_noise(self, step: int, layer: str, call: int, module: nn.Module, x: torch.Tensor,
                      grad: torch.Tensor) -> None:
        try:
            terms = weight_grad_terms(module, x, grad, self._noise_generator(grad.device))
        except RuntimeError as exc:   # a layer whose input is not what its type says: no noise terms
            log.debug("no noise terms for %s: %s", layer, exc)
            return
        self.log_rows("noise", [{"step": step, "layer": layer, "call": call, "rank": self.rank, **terms}])

    def _record_noise_vjp(self, key: tuple[int, str, int], params: list[torch.Tensor], batch: int,
                          where: int | torch.Tensor | None, grad: torch.Tensor) -> None:
        """The noise terms of a call without a closed form, by vector-Jacobian products through the
        module's graph (:func:`gradstats.tracer.noise.vjp_terms`), from the edge its forward kept."""
        step, layer, call = key
        edge = self.__dict__.get("_noise_edges", {}).pop(key, None)
        if edge is None:
            return
        try:
            terms = vjp_terms(edge, grad, params, self._noise_generator(grad.device), batch=batch, where=where)
        except RuntimeError as exc:   # a graph that cannot be walked again: no noise terms
            log.debug("no noise terms for %s: %s", layer, exc)
            return
        if terms is not None:
            self.log_rows("noise", [{"step": step, "layer": layer, "call": call, "rank": self.rank, **terms}])

    def _noise_generator(self, device: torch.device) -> torch.Generator:
        """The noise records' own random stream (the samples' stream is not touched by them)."""
        gen = self._noise_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 7919 * self.rank + 104729)
            self._noise_generators[device] = gen
        return gen

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 7919 * self.rank)
            self._generators[device] = gen
        return gen

    @torch.compiler.disable
    def _record(self, step: int, layer: str, kind: str, call: int, t: torch.Tensor,
                do_stats: bool, do_samples: bool) -> None:
        """:meth:`_record_now`, never traced by the compiler (a hook inside a compiled region
        runs it eagerly)."""
        self._record_now(step, layer, kind, call, t, do_stats, do_samples)

    def _record_now(self, step: int, layer: str, kind: str, call: int, t: torch.Tensor,
                    do_stats: bool, do_samples: bool) -> None:
        """Record one captured tensor, under the trace's engine (``TraceConfig.engine``) when it names one."""
        engine = self.config.engine
        if engine is None:
            return self._record_on(step, layer, kind, call, t, do_stats, do_samples)
        with using(engine):
            return self._record_on(step, layer, kind, call, t, do_stats, do_samples)

    def _record_on(self, step: int, layer: str, kind: str, call: int, t: torch.Tensor,
                   do_stats: bool, do_samples: bool) -> None:
        # every tensor read here is detached first (or only its memory is): no graph is recorded,
        # with or without grad mode
        vec = None
        if do_stats:
            want_blocks = self.blocks is not None and kind == "grad" and (do_samples or not self.blocks_on_samples)
            counts = None
            if kernel_applies(t):     # the common case on the CPU: the kernel writes a row in place
                if want_blocks and set(self.blocks) & set(BLOCK_SIZES):   # and counts every block of those
                    counts = np.empty((len(BLOCK_SIZES), 1 + RANGE_BINS), np.int64)   # write_stats zeroes it
                with self._lock:      # (held while it writes: a flush never takes a half-written row)
                    if counts is None:          # checked just above: the kernel on the tensor's memory
                        write_stats_raw(t.data_ptr(), t.numel(), self._rows.claim())
                    else:
                        write_stats(t, self._rows.claim(), blocks=counts)
                    self._row_keys.append((step, layer, kind, call))
            else:
                vec = tensor_stats_vector(t)
            if want_blocks:
                from gradstats.stats.blocks import ORIENTATIONS, finite_max, kernel_block_stats, oriented_block_stats

                cd = self._channel_dim(layer, t)
                done = [b for b in self.blocks if b in BLOCK_SIZES] if counts is not None else []
                exact = dict(zip(done, kernel_block_stats(counts, t.numel(), done))) if done else {}
                m = gemm_matrix(t.detach(), cd)              # blocks as the GEMMs read them (ops.layout)
                last = int(m.shape[-1])
                tmax = finite_max(m)
                gen = self._generator(t.device)
                rows = []
                for b in self.blocks:
                    for o in ORIENTATIONS:
                        st = oriented_block_stats(m, b, o, sample=self.block_sample, generator=gen, tensor_max=tmax)
                        if o == "rows" and b in exact and last % b == 0 and cd in (-1, t.dim() - 1):
                            # memory order is row order: every block counted
                            st = {**exact[b], "below_hist": st["below_hist"], "top_hist": st["top_hist"]}
                        rows.append({"step": step, "layer": layer, "kind": kind, "call": call, "block_size": b,
                                     "orientation": o, **st})
                with self._lock:
                    self._pending_tables.setdefault("blocks", []).extend(dict(r, rank=self.rank) for r in rows)
        sample = None
        if do_samples:
            k = self.samples_per_capture
            if kind == "grad":            # whole token groups of the GEMM matrix: blocks replay as applied
                m = token_groups(gemm_matrix(t.detach(), self._channel_dim(layer, t)), k, self._generator(t.device))
                sample = (m.to(torch.float32).clone(), t.numel())
            else:
                flat = t.detach().reshape(-1)
                if k is not None and flat.numel() > k:
                    flat = flat[sample_indices(flat.numel(), k, self._generator(flat.device), flat.device)]
                sample = (flat.to(torch.float32).clone(), t.numel())
        if vec is None and sample is None:
            return
        with self._lock:      # device tensors start their copies to the host now, read at the commit
            if vec is not None:
                self._pending.append((step, layer, kind, call, self._outbox.put(vec)))
            if sample is not None:
                self._pending_samples[sample_key(step, layer, kind, call)] = (self._outbox.put(sample[0]), sample[1])

    def _channel_dim(self, layer: str, t: torch.Tensor) -> int:
        """The dim of ``layer``'s gradient ``t`` that holds its channels (:func:`gradstats.ops.layout.channel_dim`)."""
        return channel_dim(module_types(self.modules[layer]), t.dim())

    def _capture_parameters(self) -> None:
        step = self.current_step
        do_stats, do_samples = self._active(step)
        if not (do_stats or do_samples):
            return
        for name, module in self.modules.items():
            params = list(module.parameters(recurse=False))
            if not params or name not in self._shapes:      # a module not called has no gradient
                continue
            if "weight" in self.kinds:
                w = torch.cat([_local(p.detach()).reshape(-1).float() for p in params])
                self._record(step, name, "weight", 0, w, do_stats, do_samples)
            if "wgrad" in self.kinds:
                grads = [_local(p.grad).reshape(-1).float() for p in params if p.grad is not None]
                if grads:
                    self._record(step, name, "wgrad", 0, torch.cat(grads), do_stats, do_samples)
