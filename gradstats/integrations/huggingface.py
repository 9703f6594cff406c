"""Hugging Face ``transformers.Trainer``: trace neural gradients (and apply a plan) with one callback.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GradstatsCallback("runs/gpt2")])

The callback traces from ``on_train_begin`` to ``on_train_end``; the tracer advances once per
optimizer step (``on_pre_optimizer_step``: after the backward passes of every micro-batch of
gradient accumulation, which are calls of that step); its state goes into each checkpoint
directory the trainer saves (``gradstats_state_rank{R}.pt``), and a training resumed from a
checkpoint (``trainer.train(resume_from_checkpoint=...)``) continues the run at the checkpoint's
``global_step``: the steps recorded after that checkpoint by the interrupted training are
superseded, none is recorded twice. Evaluation (no gradients) records nothing.

Example (a tiny GPT-2 from a config, random weights):
    >>> import contextlib, io, tempfile, torch
    >>> from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    >>> import gradstats
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16,
    ...                                    bos_token_id=0, eos_token_id=0))
    >>> data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 8
    >>> run = tempfile.mkdtemp()
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4,
    ...                          report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GradstatsCallback(run)])
    >>> with contextlib.redirect_stdout(io.StringIO()):        # the Trainer prints its summary
    ...     _ = trainer.train()
    >>> gradstats.open_run(run).steps, "transformer.h.0.attn.c_attn" in gradstats.open_run(run).layers
    ([0, 1], True)
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:          # pragma: no cover - depends on the environment
    raise ImportError("gradstats.integrations.huggingface needs the transformers package "
                      "(pip install 'transformers[torch]')") from exc

from gradstats.integrations._session import TrainingSession

__all__ = ["GradstatsCallback", "STATE_FILE"]

log = logging.getLogger(__name__)

#: the file in each checkpoint directory that holds a rank's callback state
STATE_FILE = "gradstats_state_rank{rank}.pt"


class GradstatsCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that traces the model's neural gradients into ``run_dir``
    and, given ``plan``, enforces it (:func:`gradstats.apply`, logged into the run).

    Args:
        run_dir: the run directory (None: apply ``plan`` without tracing).
        plan: a :class:`gradstats.Plan`, the path of a saved plan, or None.
        options: :func:`gradstats.trace` options and :func:`gradstats.apply` options
            (:data:`gradstats.integrations._session.TRACE_OPTIONS` and ``APPLY_OPTIONS``;
            ``apply_seed`` for apply's seed).

    ``callback.session`` is the :class:`gradstats.integrations.TrainingSession` (its ``tracer``
    and ``applied`` handles while training runs). Example: see the module.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *, plan: Any = None, **options: Any) -> None:
        self.session = TrainingSession(run_dir, plan=plan, **options)

    @staticmethod
    def _rank(args: Any) -> int:
        return int(getattr(args, "process_index", 0) or 0)

    def _state_path(self, args: Any, step: int) -> Path:
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}" / STATE_FILE.format(rank=self._rank(args))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        import torch

        if model is None:
            raise ValueError("GradstatsCallback: the Trainer passed no model to on_train_begin")
        step = int(state.global_step)
        saved = None
        if step > 0:
            path = self._state_path(args, step)
            if path.is_file():
                saved = torch.load(path, weights_only=True)
            else:
                log.info("gradstats: resuming at step %d without a saved callback state (%s not found): the run "
                         "continues at step %d, its sampling is not the uninterrupted one's", step, path, step)
        if self.session.active:        # a second train() on the same trainer
            self.session.end()
        self.session.begin(model, step=step, state=saved)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session.active:
            self.session.optimizer_step()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch

        if not self.session.active:
            return
        if self.session.tracer is not None:
            self.session.tracer.flush()     # the run holds every step the checkpoint does
        path = self._state_path(args, int(state.global_step))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.session.state_dict(), tmp)
        os.replace(tmp, path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.end()

    def __repr__(self) -> str:
        return f"GradstatsCallback({self.session!r})"
