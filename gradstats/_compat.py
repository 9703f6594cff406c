"""Renamed keyword arguments, kept for one release: the old name works and warns."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Accept ``old=`` for ``new=`` (``renamed_kwargs(old="new")``) with a ``DeprecationWarning``;
    passing both is a ``ValueError``.

    Example:
        >>> import warnings
        >>> @renamed_kwargs(model="family")
        ... def f(*, family="lognormal"):
        ...     return family
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     f(model="normal"), w[0].category.__name__
        ('normal', 'DeprecationWarning')
    """
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise ValueError(f"{fn.__name__}: pass {new}= only ({old}= is its old name)")
                    warnings.warn(f"{fn.__name__}: {old}= is now {new}=; the old name goes in the next release",
                                  DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap
