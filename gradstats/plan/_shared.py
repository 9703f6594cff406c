"""Work that checking a plan repeats, done once: one scope (:func:`shared_work`) in which the
per-step pieces of :mod:`gradstats.plan.checks` remember what they computed.

:func:`gradstats.recommend` checks each layer's rule on each calibration step, tries the next
choice where a layer fails, bounds the plan's noise (which predicts the same operators again at
nearby sparsities), and repairs and bounds again. The same statistics rows, samples, thresholds,
scales, predictions and replays come back many times; within the scope each is computed once and
then looked up. Keys are the *content* of what a result depends on (a statistics row by its
numbers, a rule by its fields); a run and the samples read from it are keyed by the object, which the
scope keeps alive (a run opened again is read again). So a stale result cannot be returned for
different inputs; outside the scope nothing is remembered.

Example:
    >>> with shared_work() as memo:
    ...     remember(("answer",), lambda: 42), remember(("answer",), lambda: 0)
    (42, 42)
    >>> remember(("answer",), lambda: 0)        # outside the scope: computed every time
    0
"""
from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional, TypeVar

import numpy as np

__all__ = ["shared_work", "remember", "row_key", "rule_key"]

T = TypeVar("T")

_MEMO: ContextVar[Optional[dict[Any, Any]]] = ContextVar("gradstats_plan_shared_work", default=None)

#: the scalar fields of a statistics row that what is predicted from it may read
_ROW_SCALARS = ("n", "n_zero", "n_nonfinite", "sum", "sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq",
                "min_abs", "max_abs")


@contextlib.contextmanager
def shared_work() -> Iterator[dict[Any, Any]]:
    """A scope in which :func:`remember` keeps what it computes (nested scopes share the outer one).

    Example:
        >>> with shared_work() as outer, shared_work() as inner:
        ...     outer is inner
        True
    """
    memo = _MEMO.get()
    if memo is not None:
        yield memo
        return
    memo: dict[Any, Any] = {}
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)


def remember(key: Any, compute: Callable[[], T]) -> T:
    """``compute()``, once per ``key`` within a :func:`shared_work` scope (every time outside one).

    Example:
        >>> with shared_work():
        ...     calls = []
        ...     [remember(("x", 1), lambda: calls.append(1) or len(calls)) for _ in range(3)]
        [1, 1, 1]
    """
    memo = _MEMO.get()
    if memo is None:
        return compute()
    try:
        return memo[key]
    except KeyError:
        out = memo[key] = compute()
        return out


def row_key(row: Any) -> Any:
    """A statistics row's content as a hashable key: its layer and step, its scalar sums and
    extremes, its histogram and top magnitudes (as bytes, so that NaN equals NaN). Within a scope the
    key of one row object is computed once (the row is kept alive with it).

    Example:
        >>> row_key({"n": 4, "hist": [1, 3]}) == row_key({"n": 4.0, "hist": [1, 3]})
        True
    """
    memo = _MEMO.get()
    if memo is not None:
        hit = memo.get(("row_key", id(row)))
        if hit is not None and hit[0] is row:
            return hit[1]
    get = row.get
    scal = np.array([_num(get(k)) for k in _ROW_SCALARS], dtype=np.float64).tobytes()
    hist = get("hist")
    top = get("top_abs")
    key = (str(get("layer")), str(get("step")), scal,
           None if hist is None else np.asarray(hist, dtype=np.float64).tobytes(),
           None if top is None else np.asarray(top, dtype=np.float64).tobytes())
    if memo is not None:
        memo[("row_key", id(row))] = (row, key)
    return key


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def rule_key(rule: Any) -> tuple[Any, ...]:
    """A rule's fields but its (informational) prediction, as a hashable key.

    Example:
        >>> from gradstats.plan import Rule
        >>> rule_key(Rule(sparsity=0.5)) == rule_key(Rule(sparsity=0.5, predicted=None))
        True
    """
    from gradstats.plan._rules import RULE_FIELDS

    memo = _MEMO.get()
    if memo is not None:
        hit = memo.get(("rule_key", id(rule)))
        if hit is not None and hit[0] is rule:
            return hit[1]
    key = tuple((k, getattr(rule, k)) for k in RULE_FIELDS if k != "predicted")
    if memo is not None:
        memo[("rule_key", id(rule))] = (rule, key)
    return key
