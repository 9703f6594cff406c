"""Exports of a plan, resolved per layer, for other code and other stacks (:meth:`Plan.export`).

Each target is an :class:`~gradstats.plan.export.base.Exporter` in its own module, registered by
name in :data:`EXPORTERS`:

- ``"json"`` (:mod:`.plain`): per layer the format, the scale rule and a scale any code can use,
  rounding, blocks and pruning: plain data with no gradstats types;
- ``"torchao"`` (:mod:`.torchao`): torchao.float8 casts, or its MXFP8 training recipe, per
  ``nn.Linear`` layer;
- ``"te"`` (:mod:`.transformer_engine`): a Transformer Engine debug config for nvdlfw-inspect,
  written as YAML with ``path=``.

What a target cannot express is reported once, as a ``UserWarning`` (``warnings.warn``): a
lossy export the caller asked for, which they may have to make up for in their own code
(``strict=True`` makes it a ``ValueError``). It is not logged as well, so it shows once with
logging configured too (``logging.captureWarnings(True)`` routes it into logging).

Example:
    >>> from gradstats.plan.export import EXPORT_TARGETS
    >>> EXPORT_TARGETS
    ('json', 'torchao', 'te')
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

# the built-in targets register themselves on import (a new target: one module, imported here)
from gradstats.plan.export import plain as plain
from gradstats.plan.export import torchao as torchao
from gradstats.plan.export import transformer_engine as transformer_engine
from gradstats.plan.export.base import (
    EXPORT_SCHEMA,
    EXPORT_VERSION,
    EXPORTERS,
    Exporter,
    Resolved,
    exporter,
    register,
    target_names,
)
from gradstats.plan.export.torchao import TORCHAO_DTYPES, TORCHAO_MX_SCALE_ROUNDINGS
from gradstats.plan.export.transformer_engine import te_yaml

#: targets of :meth:`gradstats.plan.Plan.export` (their names; aliases are in :data:`EXPORTERS`)
EXPORT_TARGETS = tuple(target_names())

__all__ = ["export", "te_yaml", "Exporter", "EXPORTERS", "EXPORT_TARGETS", "EXPORT_SCHEMA", "EXPORT_VERSION",
           "TORCHAO_DTYPES", "TORCHAO_MX_SCALE_ROUNDINGS", "exporter", "register", "target_names"]


def _resolved(plan: Any, model: Any, need_types: bool) -> list[Resolved]:
    from gradstats.layers import module_candidates

    if model is None:
        pats = [e.layer for e in plan.entries if e.is_pattern]
        if pats:
            raise ValueError(f"the plan has pattern entries {pats}: pass model= (an nn.Module, a Run, or a "
                             "mapping name -> class name) to resolve them to layer names")
        if need_types:
            raise ValueError("this export needs each layer's module type: pass model= (an nn.Module, a Run, "
                             "or a mapping name -> class name)")
        model = list(dict.fromkeys(e.layer for e in plan.entries))
    types = dict(module_candidates(model))
    return [(name, rule, types.get(name)) for name, rule, _ in plan.resolve_entries(model, strict=True)]


def export(plan: Any, target: str, model: Any = None, *, path: str | os.PathLike[str] | None = None,
           strict: bool = False) -> dict[str, Any]:
    """See :meth:`gradstats.plan.Plan.export`."""
    one = exporter(target)
    resolved = _resolved(plan, model, need_types=one.needs_types)
    prov = None if plan.provenance is None else plan.provenance.to_dict()
    skipped: dict[str, str] = {}
    dropped: dict[str, list[str]] = {}
    doc: dict[str, Any] = {"schema": EXPORT_SCHEMA, "version": EXPORT_VERSION, "target": one.target,
                           "provenance": prov, **one.body(plan, model, resolved, skipped, dropped)}
    if skipped or dropped:
        lines = [f"{n}: skipped ({why})" for n, why in skipped.items()]
        lines += [f"{n}: {note}" for n, notes in dropped.items() for note in notes]
        msg = f"export to {doc['target']}: not expressible there:\n  " + "\n  ".join(lines)
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)        # once: not also through logging
    if path is not None:
        from gradstats.run import atomic_write_bytes

        atomic_write_bytes(Path(path), one.text(doc).encode())
    return doc
