"""One rule for the option values of the verbs (:class:`gradstats.tracer.TraceConfig`,
:class:`gradstats.apply.ApplyConfig`): a frozen dataclass holds the options, and a call may pass
a config, keywords, or both. A keyword left at its default defers to the config; one that
differs from the config is a ``ValueError`` (the option said in two places, two ways).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Opts:
    ...     every: int = 1
    >>> resolve_config(Opts, None, "verb", every=5).every
    5
    >>> resolve_config(Opts, Opts(every=5), "verb", every=1).every     # the default defers
    5
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, TypeVar

C = TypeVar("C")


def resolve_config(cls: type[C], config: Optional[C], verb: str, home: str = "", **keywords: Any) -> C:
    """The config that ``config`` and ``verb``'s keyword arguments say together: ``config`` (or
    the defaults) with every keyword that differs from its default. ``home``: where users import
    ``cls`` from (for the error message; default its module)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(keywords) - set(defaults))
    if unknown:
        raise ValueError(f"unknown {verb} option(s) {unknown}; {cls.__name__} takes {list(defaults)}")
    if config is not None and not isinstance(config, cls):
        raise ValueError(f"config must be a {home or cls.__module__ + '.' + cls.__name__} or None, got "
                         f"{type(config).__name__}")
    given = {k: v for k, v in keywords.items() if not _same(v, defaults[k])}
    if config is None:
        return cls(**given)
    for k, v in given.items():
        if not _same(v, getattr(config, k)) and not _same(getattr(cls(**{k: v}), k), getattr(config, k)):
            raise ValueError(f"{verb}(config=..., {k}={v!r}) contradicts the config's {k}={getattr(config, k)!r}: "
                             "pass the option in one place")
    return config


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:      # values without a plain truth of ==, such as arrays
        return False
