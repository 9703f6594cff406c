"""Lightning: trace neural gradients (and apply a plan) with one callback.

    trainer = lightning.Trainer(max_steps=1000, callbacks=[GradstatsCallback("runs/x")])

The callback traces from ``on_train_start`` to ``on_train_end`` (and detaches on an exception);
the tracer advances once per optimizer step (``on_before_optimizer_step``: after the backward
passes of every micro-batch of ``accumulate_grad_batches``, which are calls of that step, numbered
by ``trainer.global_step``); its state is part of each checkpoint Lightning saves
(``state_dict`` / ``load_state_dict``), and a training resumed with ``trainer.fit(...,
ckpt_path=...)`` continues the run at the checkpoint's step, none recorded twice. Validation and
test loops (no gradients) record nothing. Works with ``lightning`` (``lightning.pytorch``) and,
where that is what is installed, ``pytorch_lightning``; with both installed, a
``pytorch_lightning.Trainer`` takes :class:`gradstats.integrations.pytorch_lightning.GradstatsCallback`.

Example:
    >>> import tempfile, torch
    >>> import gradstats
    >>> from gradstats.integrations.lightning import GradstatsCallback, pl
    >>> class Net(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ...     def training_step(self, batch, i):
    ...         return self.net(batch[0]).square().mean()
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=8)
    >>> run = tempfile.mkdtemp()
    >>> trainer = pl.Trainer(max_steps=3, callbacks=[GradstatsCallback(run)], logger=False, enable_progress_bar=False,
    ...                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=tempfile.mkdtemp())
    >>> trainer.fit(Net(), data)
    >>> gradstats.open_run(run).steps
    [0, 1, 2]
"""
from __future__ import annotations

import logging
import os
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:                         # pragma: no cover - depends on the environment
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError("gradstats.integrations.lightning needs lightning (pip install lightning) or "
                          "pytorch_lightning") from exc

from gradstats.integrations._session import TrainingSession

__all__ = ["GradstatsCallback", "callback_class", "pl"]

log = logging.getLogger(__name__)


class _GradstatsCallback:
    """A Lightning ``Callback`` that traces the LightningModule's neural gradients into ``run_dir``
    and, given ``plan``, enforces it (:func:`gradstats.apply`, logged into the run).

    Args:
        run_dir: the run directory (None: apply ``plan`` without tracing).
        plan: a :class:`gradstats.Plan`, the path of a saved plan, or None.
        options: :func:`gradstats.trace` options and :func:`gradstats.apply` options
            (:data:`gradstats.integrations._session.TRACE_OPTIONS` and ``APPLY_OPTIONS``;
            ``apply_seed`` for apply's seed).

    Layer names are the LightningModule's (``net.0`` for ``self.net = Sequential(...)``).
    ``callback.session`` is the :class:`gradstats.integrations.TrainingSession`. Example: see
    the module.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *, plan: Any = None, **options: Any) -> None:
        super().__init__()
        self.session = TrainingSession(run_dir, plan=plan, **options)
        self._restored: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return f"GradstatsCallback[{self.session.run_dir}]"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.session.active:
            self.session.end()
        state, self._restored = self._restored, None
        self.session.begin(pl_module, step=int(trainer.global_step), state=state)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.session.active:
            self.session.optimizer_step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.end()              # what was recorded until the exception is on disk

    def state_dict(self) -> dict[str, Any]:
        if self.session.active and self.session.tracer is not None:
            self.session.tracer.flush()     # the run holds every step the checkpoint does
        return self.session.state_dict() if self.session.active else (self._restored or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None

    def __repr__(self) -> str:
        return f"GradstatsCallback({self.session!r})"


def callback_class(base: type) -> type:
    """The gradstats callback as a subclass of ``base``, a Lightning ``Callback`` class
    (``lightning.pytorch.Callback`` or ``pytorch_lightning.Callback``: a Trainer accepts only its
    own package's callbacks).

    Example:
        >>> issubclass(callback_class(pl.Callback), pl.Callback)
        True
    """
    cls = type("GradstatsCallback", (_GradstatsCallback, base), {"__module__": __name__,
                                                                  "__doc__": _GradstatsCallback.__doc__})
    return cls


#: the callback for ``pl`` (``lightning.pytorch`` where installed, else ``pytorch_lightning``)
GradstatsCallback = callback_class(pl.Callback)
