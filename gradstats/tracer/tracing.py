"""Capture neural gradients (dL/d layer output) of any PyTorch model into a run on disk.

A forward hook on each selected module registers a tensor hook on the module's output; the
tensor hook sees the gradient with respect to that output in the backward pass, computes the
streamed statistics of :mod:`gradstats.stats` on the tensor's own device and, on sampled
steps, keeps an unbiased uniform random sample. Nothing is modified: training with the tracer
is bit-identical to training without it.

Example:
    >>> import tempfile, torch
    >>> import gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with gradstats.trace(model, tempfile.mkdtemp(), optimizer=opt) as tracer:
    ...     for _ in range(3):
    ...         opt.zero_grad()
    ...         model(torch.randn(16, 4)).square().mean().backward()
    ...         opt.step()          # the tracer advances with the optimizer
    >>> gradstats.open_run(tracer.path).steps
    [0, 1, 2]
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from gradstats.ops.host import Outbox
from gradstats.run import RunWriter, last_committed_step
from gradstats.stats import VectorRows
from gradstats.stats.blocks import BLOCK_SIZES
from gradstats.tracer import taps
from gradstats.tracer.capture import Capture, _dist_info
from gradstats.tracer.commit import Commit
from gradstats.tracer.config import LayerSelect, Schedule, TraceConfig, module_selector, schedule
from gradstats.tracer.noise import Propagation
from gradstats.wrappers import named_layers, unwrap

log = logging.getLogger(__name__)


class Tracer(Capture, Commit):
    """Captures neural gradients (and optionally activations, weights and weight gradients)
    of selected modules into a run directory. See :func:`trace` for the arguments.

    Use as a context manager, or call :meth:`attach` / :meth:`detach`. Advance the step
    with :meth:`step` (or pass ``optimizer=`` to advance on each ``optimizer.step()``).

    Example:
        >>> import tempfile, torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3))
        >>> tracer = gradstats.Tracer(model, tempfile.mkdtemp()).attach()
        >>> model(torch.randn(2, 3)).sum().backward(); tracer.step()
        >>> tracer.detach(); gradstats.open_run(tracer.path).layers
        ['0']
    """

    def __init__(self, model: nn.Module, path: str | os.PathLike[str], *, config: TraceConfig | None = None,
                 layers: LayerSelect = None, every: Schedule = 1, sample_every: Schedule = 100,
                 samples: int | None = 65536, kinds: Iterable[str] = ("grad",),
                 optimizer: torch.optim.Optimizer | None = None,
                 max_bytes: int | None = None, seed: int = 0, flush_secs: float = 1.0,
                 resume: bool = False, start_step: int | None = None, sinks: Iterable[Any] = (),
                 alarms: Any = True, blocks: str | Sequence[int] | None = "samples",
                 block_sample: int | None = 512, noise: bool = True, engine: str | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"trace() needs a torch.nn.Module as model, got {type(model).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"trace() needs the path of a run directory (a str or pathlib.Path) as path, "
                             f"got {type(path).__name__}: trace(model, 'runs/my-run')")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        #: the options traced with (:class:`gradstats.tracer.TraceConfig`)
        self.config = cfg = TraceConfig.resolve(
            config, layers=layers, every=every, sample_every=sample_every, samples=samples, kinds=kinds,
            max_bytes=max_bytes, seed=seed, flush_secs=flush_secs, resume=resume, start_step=start_step,
            sinks=sinks, alarms=alarms, blocks=blocks, block_sample=block_sample, noise=noise, engine=engine)
        layers, samples, max_bytes, seed = cfg.layers, cfg.samples, cfg.max_bytes, cfg.seed
        resume, start_step, noise = cfg.resume, cfg.start_step, cfg.noise
        self.kinds = tuple(cfg.kinds)
        #: block sizes of the per-block statistics (:mod:`gradstats.stats.blocks`), or None; taken on
        #: the sampled steps only with ``blocks="samples"`` (the default)
        self.blocks_on_samples = cfg.blocks == "samples"
        self.blocks = (BLOCK_SIZES if self.blocks_on_samples else
                       None if cfg.blocks is None else tuple(cfg.blocks))
        self.block_sample = cfg.block_sample
        sinks = list(cfg.sinks)
        from gradstats.alarms import as_alarms

        #: the :class:`gradstats.alarms.Alarms` checked on each commit (None: off)
        self.alarms = as_alarms(cfg.alarms)
        if self.alarms is not None:
            self.alarms.bind(lambda rows: self.log_rows("alarms", rows))
            sinks = [*sinks, self.alarms]
        self.sinks = sinks
        self.model = model
        self.path = Path(path)
        self._take_stats = schedule(cfg.every, "every")
        self._take_samples = schedule(cfg.sample_every, "sample_every")
        self.samples_per_capture = samples
        self.max_bytes = max_bytes
        self.optimizer = optimizer
        self.seed = seed
        self.flush_secs = float(cfg.flush_secs)
        self._last_commit = time.monotonic()
        select = module_selector(layers)
        root = unwrap(model)
        self._default_layers = layers is None
        self.modules: dict[str, nn.Module] = {n: m for n, m in named_layers(model) if select(n, m)}
        if not self.modules:
            names = [n for n, _ in named_layers(model)][:12]
            raise ValueError(f"layers={layers!r} matches no module of {type(root).__name__}; "
                             f"module names look like {names}")
        self.rank, self.world_size = _dist_info()
        self.resume = resume
        self.start_step = start_step
        self.current_step = 0 if start_step is None else start_step
        #: this tracing session (commit records carry it: a later session that starts at an
        #: earlier step supersedes what an earlier one wrote from there on)
        self._session = f"{time.time_ns():x}-{os.getpid()}-{self.rank}"
        self._reported_uncalled = False
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        # statistics of the step(s) not yet committed: CPU float32 tensors are written by the C
        # kernel straight into rows (no allocation per capture), others kept as device vectors
        self._rows = VectorRows()
        self._row_keys: list[tuple[int, str, str, int]] = []
        self._pending: list[tuple[int, str, str, int, torch.Tensor]] = []
        self._active_step: int | None = None
        self._active_now = (False, False)
        self._pending_samples: dict[str, tuple[torch.Tensor, int]] = {}
        self._outbox = Outbox()         # device statistics and samples on their way to the host
        self._pending_tables: dict[str, list[dict[str, Any]]] = {}
        self._calls: dict[Any, int] = {}
        # the taps of a compiled model (gradstats.tracer.taps): per module, the act and grad slots
        self._slots: dict[str, tuple[int | None, int | None]] = {}
        self._compiled = False              # a tap ran: the model (or a part of it) is compiled
        self._shapes: dict[str, list[int]] = {}
        self._sampling_stopped = False
        self._generators: dict[torch.device, torch.Generator] = {}
        self._writer: RunWriter | None = None
        self._written_shapes: dict[str, list[int]] = {}
        self._created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._attached = False
        #: record the noise terms of :mod:`gradstats.tracer.noise` on sampled steps
        self.noise = bool(noise)
        # the step whose noise propagation is measured (the first sampled one), and the measurement
        self._graph_step: int | None = None
        # not under torch.distributed: FSDP frees the parameters a backward pass sent back from one layer
        # would need, and every rank would have to take part (the prediction then assumes gain 1)
        self._propagation: Propagation | None = Propagation() if self.noise and self.world_size == 1 else None
        self._noise_prev: tuple[int, dict[str, torch.Tensor]] | None = None
        self._noise_generators: dict[torch.device, torch.Generator] = {}

    # -- lifecycle
    def attach(self) -> "Tracer":
        """Create the run directory and register the hooks. Returns ``self``."""
        if self._attached:
            return self
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"cannot write a run to {self.path}: {exc.strerror or exc}; "
                             "pass a writable directory") from None
        last = last_committed_step(self.path)
        if last is not None and self.start_step is None:
            if not self.resume:
                raise ValueError(
                    f"{self.path} already holds a run (steps up to {last}); pass resume=True to "
                    f"continue it after step {last} (CLI: --resume), start_step=N to continue from "
                    "a checkpoint taken at step N (what was written from step N on is superseded), "
                    "or a new directory")
            self.current_step = last + 1
        self._previous = self._read_previous_manifest() if last is not None else None
        self._writer = RunWriter(self.path, self.rank, max_bytes=self.max_bytes,
                                 session=self._session, start_step=self.current_step, sinks=self.sinks)
        self._write_manifest()
        for name, module in self.modules.items():
            self._slots[name] = tuple(taps.register(functools.partial(self._on_compiled, name, kind))
                                      if kind in self.kinds else None for kind in ("act", "grad"))
            self._handles.append(module.register_forward_hook(self._make_forward_hook(name)))
        if self.optimizer is not None:     # the step closes: its gradients are complete
            self._handles.append(self.optimizer.register_step_pre_hook(lambda *_: self._before_update()))
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._advance()))
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove the hooks, flush what is pending and wait until it is on disk."""
        if not self._attached:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for slots in self._slots.values():
            for slot in slots:
                if slot is not None:
                    taps.release(slot)
        self._slots.clear()
        self._flush(self.current_step, force=True)
        assert self._writer is not None
        if self.sinks:                  # what the sinks (the alarms) log while the last tables commit
            self._writer.wait()
            if self._pending_tables:
                self._flush(self.current_step, force=True)
        self._writer.close()
        self._write_manifest()
        self._attached = False

    def __enter__(self) -> "Tracer":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # -- steps
    def step(self) -> None:
        """Close the current step: write its statistics and samples, advance the counter.

        Call it once per optimizer step (not needed when the tracer was given ``optimizer=``).
        """
        if self.optimizer is not None:
            raise ValueError("this tracer advances on optimizer.step() (optimizer= was given); "
                             "do not call tracer.step() as well")
        self._before_update()
        self._advance()


    def _advance(self) -> None:
        self._flush(self.current_step)
        if not self._reported_uncalled and self._shapes:
            self._report_uncalled()
        self.current_step += 1
        self._calls.clear()

    def _report_uncalled(self) -> None:
        """Say once which selected modules the first traced step never called (an attention
        block's ``out_proj`` used functionally, a branch not taken): they are left out of the
        run's layers until they are called."""
        self._reported_uncalled = True
        missing = [n for n in self.modules if n not in self._shapes]
        if missing:
            level = logging.INFO if self._default_layers else logging.WARNING
            log.log(level, "gradstats: %d selected module(s) produced no gradient in step %d and are "
                    "not traced until they do (not called, or their output needs no grad): %s",
                    len(missing), self.current_step, ", ".join(missing))
            self._write_manifest()

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume this tracer exactly: the step, the sampling
        generators' states and whether the byte budget stopped sampling.

        Save it beside the model and optimizer; restore with :meth:`load_state_dict` on a tracer
        of the same run. Example:
            >>> import tempfile, torch, gradstats
            >>> m, path = torch.nn.Linear(2, 2), tempfile.mkdtemp()
            >>> with gradstats.trace(m, path) as t:
            ...     m(torch.randn(3, 2)).sum().backward(); t.step()
            ...     ckpt = t.state_dict()
            >>> with gradstats.trace(m, path, resume=True) as t2:
            ...     t2.load_state_dict(ckpt)
            ...     m(torch.randn(3, 2)).sum().backward(); t2.step()
            >>> ckpt["step"], gradstats.open_run(path).steps
            (1, [0, 1])
        """
        return {"step": int(self.current_step), "seed": int(self.seed),
                "sampling_stopped": bool(self._sampling_stopped),
                "generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next step recorded is ``state["step"]``, and
        sampling draws what the checkpointed tracer would have drawn. Whatever this run holds
        from that step on (written after the checkpoint, by a training that then crashed) is
        superseded by what is recorded now. Call it before the first step of the resumed
        training (on an attached tracer, or before attaching: then no ``resume=`` is needed)."""
        need = {"step", "seed", "sampling_stopped", "generators"}
        if not isinstance(state, dict) or not need <= set(state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"load_state_dict expects a dict from Tracer.state_dict() with keys "
                             f"{sorted(need)}, got {got}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"the state's step must be an int >= 0, got {step!r}")
        if int(state["seed"]) != self.seed:
            log.warning("gradstats: the tracer state was saved with seed=%s, this tracer has seed=%s; "
                        "the saved generator states are used", state["seed"], self.seed)
        if self._attached:
            self._flush(self.current_step, force=True)   # what was recorded so far, under the old count
        self.current_step = self.start_step = step
        self._session = f"{time.time_ns():x}-{os.getpid()}-{self.rank}"
        if self._writer is not None:
            self._writer.session, self._writer.start_step = self._session, step
        self._calls.clear()
        self._active_step = None
        self._sampling_stopped = bool(state["sampling_stopped"])
        for dev, gstate in state["generators"].items():
            self._generator(torch.device(dev)).set_state(torch.as_tensor(gstate, dtype=torch.uint8))


    def __repr__(self) -> str:
        return (f"Tracer({str(self.path)!r}, layers={len(self.modules)}, kinds={self.kinds}, "
                f"step={self.current_step})")


def trace(model: nn.Module, path: str | os.PathLike[str], *, config: TraceConfig | None = None,
          layers: LayerSelect = None,
          every: Schedule = 1, sample_every: Schedule = 100, samples: int | None = 65536,
          kinds: Iterable[str] = ("grad",), optimizer: torch.optim.Optimizer | None = None,
          max_bytes: int | None = None, seed: int = 0, flush_secs: float = 1.0,
          resume: bool = False, start_step: int | None = None, sinks: Iterable[Any] = (),
          alarms: Any = True, blocks: str | Sequence[int] | None = "samples", block_sample: int | None = 512,
          noise: bool = True, engine: str | None = None) -> Tracer:
    """Trace the neural gradients of ``model`` into the run directory ``path``.

    Args:
        model: any ``nn.Module``; DDP, DataParallel, FSDP and ``torch.compile`` wrappers are
            seen through (:func:`gradstats.wrappers.unwrap`): layer names are the user's.
        path: run directory (created). A directory that already holds a run is an error unless
            ``resume=True`` or ``start_step=`` says how to continue it.
        config: the options below as one value (:class:`gradstats.tracer.TraceConfig`, what the
            trainer callbacks build); a keyword given beside it must agree with it (a keyword left
            at its default defers to it), else ``ValueError``.
        layers: which modules: ``None`` for those that own parameters (Linear, Conv, norms,
            Embedding, ...; modules that are never called, such as an attention block's
            ``out_proj`` used functionally, are left out with one log line), a glob or list of
            globs on module names (``"re:..."`` for a regex), a compiled regex, or a callable
            ``(name, module) -> bool``. The model itself, when it owns parameters, is ``"(root)"``.
        every: steps on which statistics are taken: a period (1 = every step) or a list.
        sample_every: steps on which raw samples are kept: a period, a list, or ``None``.
        samples: values kept per capture (an unbiased uniform sample without replacement),
            or ``None`` to keep whole flattened tensors in order.
        kinds: any of ``"grad"`` (dL/d output), ``"act"`` (outputs), ``"weight"`` and
            ``"wgrad"`` (the module's own parameters and their gradients, taken when the step
            closes; with ``optimizer=`` just before the optimizer updates them).
        optimizer: advance the step on each ``optimizer.step()`` instead of ``tracer.step()``.
        max_bytes: byte budget of the run's files; sampling stops with a warning beyond it.
        seed: seed of the tracer's own random generator (the global RNG is never touched).
        flush_secs: closed steps are committed to disk together once this many seconds have
            passed since the last commit (and at once on sampled steps, on :meth:`Tracer.flush`
            and when the tracer detaches); 0 commits every step. A run read while training goes
            on, or after the process is killed, shows every step committed until then: at most
            ``flush_secs`` of training behind. Fewer, larger files and less work per step.
        resume: continue a run at ``path`` after its last committed step.
        start_step: number the first step recorded (a trainer restored from a checkpoint taken
            at step N passes N; whatever the run holds from step N on is superseded). For an
            exact resume of the sampling too, restore :meth:`Tracer.load_state_dict`.
        sinks: objects with a ``write(stats)`` method (and optionally ``close()``) that receive
            each committed statistics table (a DataFrame as ``Run.stats()`` has it), on the
            writer thread after the commit: live views such as
            :class:`gradstats.integrations.tensorboard.TensorBoardSink`. A sink that raises is
            reported once and left out; the run on disk is complete whatever a sink does.
        alarms: ``True`` (default): warn once per layer, and record in the run's ``"alarms"``
            table, when a layer's gradient is all zero for 3 steps in a row or has non-finite
            values; ``False``: off; or a :class:`gradstats.alarms.Alarms` (other bounds, formats to
            watch: ``Alarms(watch="e4m3fn,e2m1fn", flush_bound=0.5)``). Checked on the writer thread.
        blocks: block sizes (``(16, 32)``: NVFP4 and MX) of per-block statistics of each neural
            gradient on the steps statistics are taken, in each orientation a GEMM consumes it
            (rows of channels, columns of tokens, ``B x B`` tiles; :mod:`gradstats.ops.layout`): the
            blocks' dynamic ranges and the entries' binades below their block's maximum, into the run's
            ``"blocks"`` table (:mod:`gradstats.stats.blocks`; :func:`gradstats.what_if` reads the MX and
            NVFP4 underflow from them, :func:`gradstats.stats.blocks.flushed_blocks` the fraction of
            blocks flushed). ``"samples"`` (the default): blocks of 16 and 32 on the steps that take
            samples, where a block plan calibrates; None: none. On the CPU the dynamic ranges of row blocks of 16 and 32 are counted, every one,
            in the statistics kernel's own pass where the last dim is a multiple of the size.
        block_sample: blocks counted per tensor, block size and orientation, a uniform random
            sample (default 512, ``512 / B`` tiles: a cost that does not grow with the tensor,
            fractions of blocks within about 2.2 points, of entries closer); None: every block (a few passes over the tensor).
        noise: on sampled steps, record per call of each traced module with trainable parameters
            the terms from which :func:`gradstats.predicted_noise` predicts the noise a plan
            adds to the layer's weight gradient against SGD's own minibatch noise (for a Linear or a
            1-d/2-d convolution one extra weight-gradient product per layer on those steps; for
            other modules, a GRU, an Embedding, two backward passes through the module; the
            ``"noise"`` and ``"noise_graph"`` tables, :mod:`gradstats.tracer.noise`). Default on.
        engine: the engine of the trace's passes (:data:`gradstats.ops.engine.ENGINES`: ``"native"``,
            ``"torch"``, ``"triton"``); None (default): ``GRADSTATS_ENGINE``'s, else each device's default.

    Returns a :class:`Tracer`; use it as a context manager (or ``.attach()``/``.detach()``).

    Example:
        >>> import tempfile, torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
        >>> _ = model(torch.randn(1, 1, 8, 8))
        >>> with gradstats.trace(model, tempfile.mkdtemp(), layers="0") as t:
        ...     model(torch.randn(2, 1, 8, 8)).sum().backward(); t.step()
        >>> list(gradstats.open_run(t.path).stats()["layer"])
        ['0']
    """
    return Tracer(model, path, config=config, layers=layers, every=every, sample_every=sample_every,
                  samples=samples, kinds=kinds, optimizer=optimizer, max_bytes=max_bytes, seed=seed,
                  flush_secs=flush_secs, resume=resume, start_step=start_step, sinks=sinks, alarms=alarms,
                  blocks=blocks, block_sample=block_sample, noise=noise, engine=engine)
