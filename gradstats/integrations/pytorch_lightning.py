"""The Lightning callback for ``pytorch_lightning`` (the package's former name), for a
``pytorch_lightning.Trainer`` where both packages are installed: a Trainer accepts only the callbacks of
its own package. Everything else: :mod:`gradstats.integrations.lightning`.

Example:
    >>> import pytorch_lightning
    >>> issubclass(GradstatsCallback, pytorch_lightning.Callback)
    True
"""
from __future__ import annotations

try:
    import pytorch_lightning as pl
except ImportError as exc:                  # pragma: no cover - depends on the environment
    raise ImportError("gradstats.integrations.pytorch_lightning needs pytorch_lightning "
                      "(pip install pytorch-lightning); for lightning use gradstats.integrations.lightning") from exc

from gradstats.integrations.lightning import callback_class

__all__ = ["GradstatsCallback", "pl"]

GradstatsCallback = callback_class(pl.Callback)
