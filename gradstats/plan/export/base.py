"""What every export target of a plan is: an :class:`Exporter` registered by name.

A target is one class in one module of this package: its name (and aliases), whether it needs
each layer's module type, how it turns the plan's resolved rules into a document, and how that
document is written to a file. :func:`gradstats.plan.export.export` looks the target up in
:data:`EXPORTERS` and does the rest (the document's header, reporting what a target cannot
express, writing the file), so adding a target is one module plus its tests (and the import
that registers it in ``__init__``).

Example:
    >>> from gradstats.plan.export.base import EXPORTERS
    >>> sorted(EXPORTERS)            # names and aliases
    ['json', 'te', 'torchao', 'torchao.float8', 'transformer_engine']
"""
from __future__ import annotations

import json
from typing import Any, ClassVar

from gradstats.plan._rules import Rule

#: schema name and version of an export document
EXPORT_SCHEMA = "gradstats.plan.export"
EXPORT_VERSION = 1

#: one resolved layer: its name, its rule, and its module's class names (None where not known)
Resolved = tuple[str, Rule, "tuple[str, ...] | None"]

#: the registered targets by name (aliases included)
EXPORTERS: dict[str, "Exporter"] = {}


class Exporter:
    """One export target. Subclasses set the class attributes and implement :meth:`body`.

    ``name`` is what ``Plan.export(name)`` and ``gradstats export --to NAME`` take; ``aliases``
    other names for it; ``target`` the document's ``"target"`` field; ``needs_types`` whether it
    needs each layer's module class (then ``model=`` is required); ``help`` one line for the CLI.
    """

    name: ClassVar[str]
    target: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    needs_types: ClassVar[bool] = False
    help: ClassVar[str] = ""

    def body(self, plan: Any, model: Any, resolved: list[Resolved], skipped: dict[str, str],
             dropped: dict[str, list[str]]) -> dict[str, Any]:
        """The document's keys after its header. Layers the target skips go into ``skipped``
        (name -> why), what it drops of a layer's rule into ``dropped`` (name -> notes)."""
        raise NotImplementedError

    def text(self, doc: dict[str, Any]) -> str:
        """The document as the file ``path=`` writes (JSON unless the target says otherwise)."""
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def register(cls: type[Exporter]) -> type[Exporter]:
    """Class decorator: add a target to :data:`EXPORTERS` under its name and aliases."""
    one = cls()
    for key in (cls.name, *cls.aliases):
        if key in EXPORTERS:
            raise ValueError(f"export target {key!r} is registered twice ({type(EXPORTERS[key]).__name__}, "
                             f"{cls.__name__})")
        EXPORTERS[key] = one
    return cls


def exporter(name: str) -> Exporter:
    """The registered target ``name`` (or one of its aliases); a ValueError lists the targets."""
    try:
        return EXPORTERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown export target {name!r}; expected one of {target_names()}") from None


def target_names() -> list[str]:
    """The registered targets' names (no aliases), in registration order."""
    return list(dict.fromkeys(e.name for e in EXPORTERS.values()))
