"""The lifecycle both trainer callbacks share: trace (and apply a plan) from the start of training
to its end, one step per optimizer step, and a state that travels with the trainer's checkpoints."""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Optional

from torch import nn

from gradstats.apply.settings import ApplyConfig
from gradstats.tracer import TraceConfig

log = logging.getLogger(__name__)

#: version of :meth:`TrainingSession.state_dict`
STATE_VERSION = 1
#: keyword arguments of :func:`gradstats.apply` a callback takes: the fields of
#: :class:`gradstats.apply.ApplyConfig` (its ``seed`` as ``apply_seed``, beside the tracer's options)
APPLY_OPTIONS = tuple(f.name for f in dataclasses.fields(ApplyConfig) if f.name != "seed")
#: keyword arguments of :func:`gradstats.trace` a callback passes on: the fields of
#: :class:`gradstats.tracer.TraceConfig` but those the session sets (where the run resumes)
TRACE_OPTIONS = tuple(f.name for f in dataclasses.fields(TraceConfig) if f.name not in ("resume", "start_step"))


class TrainingSession:
    """Trace ``model`` into ``run_dir`` and (given ``plan``) apply the plan, for one training.

    Args:
        run_dir: the run directory (:func:`gradstats.trace`); None to apply ``plan`` without
            tracing (then ``plan`` is needed).
        plan: a :class:`gradstats.Plan`, the path of a saved plan, or None (trace only).
        options: keyword arguments of :func:`gradstats.trace` (:data:`TRACE_OPTIONS`, validated here
            into a :class:`gradstats.tracer.TraceConfig`, :attr:`trace_config`) and of
            :func:`gradstats.apply` (:data:`APPLY_OPTIONS`; ``apply_seed`` for apply's seed).

    :meth:`begin` at the start of training (with the trainer's step: 0, or the step of the
    checkpoint it resumed from, and that checkpoint's :meth:`state_dict`), :meth:`optimizer_step`
    once per optimizer step after the backward passes of its micro-batches, :meth:`end` at the
    end (or on an exception). Example: see :mod:`gradstats.integrations`.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None, *, plan: Any = None, **options: Any) -> None:
        if run_dir is None and plan is None:
            raise ValueError("a gradstats callback needs a run directory to trace into, a plan to apply, "
                             "or both; got neither")
        unknown = sorted(set(options) - set(TRACE_OPTIONS) - set(APPLY_OPTIONS) - {"apply_seed"})
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}: a gradstats callback takes the options of "
                             f"gradstats.trace {list(TRACE_OPTIONS)} and of gradstats.apply "
                             f"{list(APPLY_OPTIONS)} (and apply_seed)")
        if plan is not None:
            from gradstats.plan import Plan

            if isinstance(plan, (str, os.PathLike)):
                plan = Plan.load(plan)
            if not isinstance(plan, Plan):
                raise ValueError(f"plan must be a gradstats.Plan, the path of a saved plan, or None; got "
                                 f"{type(plan).__name__}")
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.plan = plan
        #: the tracer's options, checked when the callback is made rather than when training starts
        self.trace_config = TraceConfig(**{k: v for k, v in options.items() if k in TRACE_OPTIONS})
        apply_options = {k: v for k, v in options.items() if k in APPLY_OPTIONS}
        if "apply_seed" in options:
            apply_options["seed"] = options["apply_seed"]
        #: apply's options, likewise checked at once
        self.apply_config = ApplyConfig(**apply_options)
        self.tracer: Any = None
        self.applied: Any = None
        self.step = 0

    @property
    def active(self) -> bool:
        """Whether :meth:`begin` was called and :meth:`end` not yet."""
        return self.tracer is not None or self.applied is not None

    def begin(self, model: nn.Module, *, step: int = 0, state: Optional[dict[str, Any]] = None) -> None:
        """Attach to ``model`` at the trainer's ``step`` (its count of optimizer steps done: 0 for a
        new training, the checkpoint's for a resumed one); ``state``: the :meth:`state_dict` saved
        with that checkpoint, if there is one (the sampling and the plan's statistics then continue
        exactly; without it the run still continues at ``step``, superseding what it held from there)."""
        from gradstats.apply import apply
        from gradstats.tracer import Tracer

        if self.active:
            raise ValueError("this gradstats session is already attached to a training; end() it first")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be the trainer's number of optimizer steps done (an int >= 0), got {step!r}")
        if state is not None:
            _check_state(state)
            if state["step"] != step:
                log.warning("gradstats: the saved callback state is of step %d, the trainer resumes at step %d; "
                            "the run continues at %d", state["step"], step, step)
        self.step = step
        if self.run_dir is not None:
            start = step if step > 0 else None
            config = dataclasses.replace(self.trace_config, start_step=start)
            self.tracer = Tracer(model, self.run_dir, config=config).attach()
            if state is not None and state.get("tracer") is not None:
                self.tracer.load_state_dict({**state["tracer"], "step": step})
        if self.plan is not None:
            self.applied = apply(model, self.plan, log_to=self.tracer, config=self.apply_config)
            if state is not None and state.get("applied") is not None:
                self.applied.load_state_dict(state["applied"])

    def optimizer_step(self) -> None:
        """Close the current step (call it once per optimizer step, before or after the update:
        every gradient of the step has been computed)."""
        if not self.active:
            raise ValueError("the gradstats session is not attached: call begin(model, step=...) first")
        if self.tracer is not None:
            self.tracer.step()
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume exactly: the step, the tracer's and the applied
        plan's states (plain data and uint8 tensors: ``torch.load(weights_only=True)`` reads it)."""
        return {"version": STATE_VERSION, "step": int(self.step),
                "tracer": None if self.tracer is None else self.tracer.state_dict(),
                "applied": None if self.applied is None else self.applied.state_dict()}

    def end(self) -> None:
        """Remove the plan's hooks and detach the tracer (what is pending is written). Idempotent."""
        if self.applied is not None:
            self.applied.remove()
            self.applied = None
        if self.tracer is not None:
            self.tracer.detach()
            self.tracer = None

    def __repr__(self) -> str:
        return (f"TrainingSession(run_dir={None if self.run_dir is None else str(self.run_dir)!r}, "
                f"plan={'yes' if self.plan is not None else 'no'}, step={self.step}, active={self.active})")


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or "step" not in state or state.get("version") != STATE_VERSION:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a gradstats callback state (TrainingSession.state_dict(), version "
                         f"{STATE_VERSION}): got {got}")
