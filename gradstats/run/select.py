"""Selecting layers and steps: the one pattern language and the one step grammar of gradstats.

Layers are named by the module names of the traced model. ``layers=`` everywhere (tracing, fitting,
recommending, reporting, exporting) takes None (the stage's default), a glob (``"features.*"``),
``"re:PATTERN"`` (a regex matched in full), a compiled regex, or a list of those; an exact name always
matches itself. ``steps=`` takes None (all), an int, a ``slice`` or ``range``, or a list of steps.

Example:
    >>> from gradstats.run.select import select_layers, select_steps
    >>> select_layers(["conv1", "conv2", "fc1"], "conv*")
    ['conv1', 'conv2']
    >>> select_layers(["conv1", "conv2", "fc1"], "re:(conv2|fc1)")
    ['conv2', 'fc1']
    >>> select_steps([0, 10, 20, 30], range(10, 30))
    [10, 20]
"""
from __future__ import annotations

import fnmatch
import logging
import math
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

__all__ = ["layer_matcher", "select_layers", "select_steps", "layer_stats", "calibration_steps"]

#: what ``layers=`` takes on names (the tracer also takes a callable on modules)
LayerPatterns = "str | re.Pattern | Iterable[str | re.Pattern] | None"


def layer_matcher(layers: str | re.Pattern | Iterable[str] | None) -> Callable[[str], bool]:
    """A predicate ``name -> bool`` for the layer patterns of the tracer's ``layers=``
    (:func:`gradstats.trace`): None (every name), a glob, ``"re:PATTERN"`` (a regex matched in
    full), a compiled regex, or a list of those; an exact name always matches itself. A
    callable on modules selects what the tracer records and has no meaning on a run's names."""
    if layers is None:
        return lambda name: True
    if callable(layers) and not isinstance(layers, (str, re.Pattern)):
        raise ValueError("layers= of a run takes names, globs ('re:PATTERN' for a regex) or a compiled "
                         "regex; a callable (name, module) -> bool only selects modules when tracing")
    if isinstance(layers, (str, re.Pattern)):
        pats: list[Any] = [layers]
    else:
        try:
            pats = list(layers)
        except TypeError:
            raise ValueError(f"layers= must be None, a glob, 're:PATTERN', a compiled regex or a list of "
                             f"names/globs; got {type(layers).__name__}") from None
    if not pats or not all(isinstance(p, (str, re.Pattern)) for p in pats):
        raise ValueError(f"layers= must be None, a glob, 're:PATTERN', a compiled regex or a non-empty list "
                         f"of names/globs; got {layers!r}")
    exact = {p for p in pats if isinstance(p, str)}
    globs = [p for p in exact if not p.startswith("re:")]
    regexes = [re.compile(p[3:]) for p in exact if p.startswith("re:")] + [p for p in pats if isinstance(p, re.Pattern)]

    def match(name: str) -> bool:
        return (name in exact or any(fnmatch.fnmatchcase(name, g) for g in globs)
                or any(r.fullmatch(name) for r in regexes))
    return match


def select_layers(names: Sequence[str], layers: str | re.Pattern | Iterable[str] | None) -> list[str]:
    """Layers of ``names`` matching ``layers`` (see :func:`layer_matcher`: None for all, globs,
    ``"re:PATTERN"``, a compiled regex, or a list of them), in the order of ``names``."""
    if layers is None:
        return list(names)
    match = layer_matcher(layers)
    out = [n for n in names if match(n)]
    if not out:
        shown = [layers] if isinstance(layers, (str, re.Pattern)) else list(layers)
        raise ValueError(f"no layer matches {shown}; the run's layers are {list(names)} (globs, "
                         "'re:PATTERN' for a regex)")
    return out


def layer_stats(run: Any, kinds: Iterable[str],
                layers: str | re.Pattern | Iterable[str] | None = None) -> "pd.DataFrame":
    """``run.stats(kinds=...)`` of the layers ``layers`` selects (:func:`select_layers`: None for
    all, globs, ``"re:PATTERN"``, a compiled regex or a list; a ``ValueError`` when none matches)."""
    st = run.stats(kinds=list(kinds))
    if layers is None:
        return st
    return st[st["layer"].isin(set(select_layers(run.layers, layers)))].reset_index(drop=True)


def select_steps(all_steps: Sequence[int], steps: int | slice | Iterable[int] | None) -> list[int]:
    """Steps of ``all_steps`` selected by None (all), an int, a slice/range or a list."""
    if steps is None:
        return list(all_steps)
    if isinstance(steps, int):
        steps = [steps]
    if isinstance(steps, slice):
        lo = -math.inf if steps.start is None else steps.start
        hi = math.inf if steps.stop is None else steps.stop
        st = steps.step or 1
        base = 0 if steps.start is None else steps.start
        out = [s for s in all_steps if lo <= s < hi and (s - base) % st == 0]
    else:
        want = {int(s) for s in steps}
        out = [s for s in all_steps if s in want]
    if not out:
        raise ValueError(f"no step of the run is selected by {steps!r}; the run has steps "
                         f"{list(all_steps)[:10]}{'...' if len(all_steps) > 10 else ''}")
    return out


#: how many calibration steps ``steps="auto"`` takes, spread over the run, the later ones denser
AUTO_STEPS = 4


def calibration_steps(run: Any, layers: Sequence[str], *, kind: str = "grad", steps: Any = "auto") -> list[int]:
    """The steps a plan is calibrated and checked on. ``"auto"``: up to :data:`AUTO_STEPS` steps spread
    over the run, at 1/4, 1/2, 3/4 and the end of the steps that hold samples of every layer (of the
    steps with statistics where none do), so that drift over training is seen; ``"latest"``: each
    layer's latest step; otherwise :mod:`gradstats.run.select`'s step grammar.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=2) as t:
        ...     for _ in range(9):
        ...         m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> calibration_steps(gradstats.open_run(t.path), ["0"])
        [2, 4, 6, 8]
    """
    df = run.stats(kinds=[kind])
    df = df[df["layer"].isin(list(layers))]
    have = sorted(int(s) for s in df["step"].unique())
    if not have:
        raise ValueError(f"the run at {run.path} has no {kind!r} statistics for layers {list(layers)[:5]}")
    if steps is None or (isinstance(steps, str) and steps == "latest"):
        return [have[-1]]
    if isinstance(steps, str) and steps == "auto":
        # steps whose gradients held NaN/inf (a diverged loss) calibrate nothing: left out, and said so
        bad = sorted(int(s) for s in df.loc[df.get("n_nonfinite", 0) > 0, "step"].unique()) \
            if "n_nonfinite" in df.columns else []
        if bad and len(bad) < len(have):
            log.warning("calibration leaves out steps %s: gradients were NaN/inf there (a diverged loss?)",
                        bad if len(bad) <= 10 else f"{bad[:10]} ... ({len(bad)})")
            have = [s for s in have if s not in set(bad)]
        idx = run.sample_index()
        if len(idx):
            idx = idx[(idx["kind"] == kind) & idx["layer"].isin(list(layers))]
            counts = idx.groupby("step")["layer"].nunique()
            full = sorted(int(s) for s, c in counts.items() if c == len(set(layers)) and int(s) in set(have))
        else:
            full = []
        pool = full or have
        picks = sorted({pool[max(0, math.ceil(q * len(pool)) - 1)] for q in (0.25, 0.5, 0.75, 1.0)})
        return picks[-AUTO_STEPS:]
    return select_steps(have, steps)
