"""Use gradstats inside the trainers people already use: one callback each, nothing else to write.

* :class:`gradstats.integrations.huggingface.GradstatsCallback`: a ``transformers.TrainerCallback``;
* :class:`gradstats.integrations.lightning.GradstatsCallback`: a ``lightning.pytorch.Callback``
  (``pytorch_lightning`` where that is what is installed).

Both trace the neural gradients into a run (:func:`gradstats.trace`) and, given a plan, enforce it
(:func:`gradstats.apply`, logging into the run) from the start of training to its end; advance one
step per optimizer step (the micro-batches of gradient accumulation are calls of that step); and
save their state with the trainer's checkpoints, so that a training resumed from a checkpoint
continues the run at the checkpoint's step, with no step recorded twice. Both are thin: the
lifecycle lives in :class:`TrainingSession`, which a custom training loop can drive too. See
``docs/integrations.md``.

Example:
    >>> import tempfile, torch
    >>> from gradstats.integrations import TrainingSession
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> session = TrainingSession(tempfile.mkdtemp())
    >>> session.begin(model, step=0)
    >>> for _ in range(2):
    ...     model(torch.randn(8, 4)).square().mean().backward()
    ...     session.optimizer_step()
    >>> session.end(); session.state_dict()["step"]
    2
"""
from __future__ import annotations

from gradstats.integrations._session import TrainingSession

__all__ = ["TrainingSession"]
