"""What to trace: :class:`TraceConfig`, the options of :func:`gradstats.trace` as one validated,
frozen value (what the trainer callbacks of :mod:`gradstats.integrations` pass on too), and the
readers of its ``layers=`` and schedules.

Example:
    >>> cfg = TraceConfig(every=10, kinds=("grad", "act"))
    >>> cfg.sample_every, cfg.kinds
    (100, ('grad', 'act'))
    >>> TraceConfig.resolve(cfg, every=10) is cfg
    True
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from torch import nn

from gradstats._config import resolve_config
from gradstats.ops.engine import check_engine
from gradstats.run.select import layer_matcher

#: the tensors of a layer the tracer can record
KINDS = ("grad", "act", "weight", "wgrad")
Schedule = Union[int, Sequence[int], None]
LayerSelect = Union[None, str, Sequence[str], re.Pattern, Callable[[str, nn.Module], bool]]


def _owns_parameters(name: str, module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def module_selector(layers: LayerSelect) -> Callable[[str, nn.Module], bool]:
    """Turn the ``layers=`` argument into a predicate on ``(name, module)``.

    Example:
        >>> module_selector("fc*")("fc1", nn.Linear(2, 2)), module_selector(None)("act", nn.ReLU())
        (True, False)
    """
    if layers is None:
        return _owns_parameters
    if callable(layers) and not isinstance(layers, (str, re.Pattern)):
        return layers
    if isinstance(layers, (str, re.Pattern)) or (
            isinstance(layers, (list, tuple)) and layers and all(isinstance(p, (str, re.Pattern)) for p in layers)):
        match = layer_matcher(layers)
        return lambda name, _m: match(name)
    raise ValueError("layers= must be None (modules that own parameters), a glob or list of globs "
                     "on module names ('re:PATTERN' for a regex), a compiled regex, or a callable "
                     f"(name, module) -> bool; got {type(layers).__name__}")


def schedule(value: Schedule, what: str) -> Callable[[int], bool]:
    """``every=`` / ``sample_every=``: a positive period, a list of steps, or None (never).

    Example:
        >>> [schedule(2, "every")(s) for s in range(4)], schedule([3], "every")(3)
        ([True, False, True, False], True)
    """
    if value is None:
        return lambda step: False
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a positive int period or a list of steps, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{what} must be a positive int period (1 = every step) or a list of "
                             f"steps, got {value}")
        return lambda step: step % value == 0
    try:
        steps = frozenset(int(s) for s in value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a positive int period or a list of step numbers, "
                         f"got {value!r}") from None
    if any(s < 0 for s in steps):
        raise ValueError(f"{what} lists a negative step: steps count from 0")
    return lambda step: step in steps


@dataclass(frozen=True)
class TraceConfig:
    """The options of :func:`gradstats.trace` (see it for each one's meaning), validated once; the
    defaults are ``trace``'s. ``trace(model, path, config=cfg)`` takes it, and the trainer callbacks
    build one from their options. Lists become tuples, ``blocks=16`` becomes ``(16,)``.

    Example:
        >>> TraceConfig(blocks=16).blocks
        (16,)
        >>> TraceConfig(samples=0)
        Traceback (most recent call last):
        ...
        ValueError: samples must be a positive int (values kept per capture) or None (keep whole tensors), got 0
    """

    layers: LayerSelect = None
    every: Schedule = 1
    sample_every: Schedule = 100
    samples: Optional[int] = 65536
    kinds: Sequence[str] = ("grad",)
    max_bytes: Optional[int] = None
    seed: int = 0
    flush_secs: float = 1.0
    resume: bool = False
    start_step: Optional[int] = None
    sinks: Sequence[Any] = ()
    alarms: Any = True
    blocks: Union[str, Sequence[int], None] = "samples"
    block_sample: Optional[int] = 512
    noise: bool = True
    engine: Optional[str] = None            # None: GRADSTATS_ENGINE's, else each device's default

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_engine(self.engine)

        kinds = tuple(self.kinds)
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds}")
        put("kinds", kinds)
        module_selector(self.layers)
        for name in ("every", "sample_every"):
            value = getattr(self, name)
            schedule(value, name)
            if value is not None and not isinstance(value, int):
                put(name, tuple(int(s) for s in value))
        samples = self.samples
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0):
            raise ValueError(f"samples must be a positive int (values kept per capture) or None "
                             f"(keep whole tensors), got {samples!r}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive number of bytes or None, got {self.max_bytes}")
        fs = self.flush_secs
        if isinstance(fs, bool) or not isinstance(fs, (int, float)) or not fs >= 0:
            raise ValueError(f"flush_secs must be a number of seconds >= 0 (0 = commit every step), got {fs!r}")
        if not isinstance(self.resume, bool):
            raise ValueError(f"resume must be True or False, got {self.resume!r}")
        st = self.start_step
        if st is not None and (isinstance(st, bool) or not isinstance(st, int) or st < 0):
            raise ValueError(f"start_step must be a step number >= 0 or None, got {st!r}")
        blocks = self.blocks
        if isinstance(blocks, str) and blocks != "samples":
            raise ValueError(f"blocks must be 'samples' (NVFP4's and MX's blocks of 16 and 32 on the steps that "
                             f"take samples), None, or positive block sizes such as (16, 32); got {blocks!r}")
        if blocks is not None and blocks != "samples":
            blocks = (blocks,) if isinstance(blocks, int) and not isinstance(blocks, bool) else tuple(blocks)
            if not blocks or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
                raise ValueError(f"blocks must be 'samples', None or positive block sizes, e.g. (16, 32) for NVFP4 "
                                 f"and MX; got {self.blocks!r}")
            put("blocks", blocks)
        bs = self.block_sample
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
            raise ValueError(f"block_sample must be a positive number of blocks or None (every block), got {bs!r}")
        sinks = tuple(self.sinks)
        bad_sinks = [type(k).__name__ for k in sinks if not callable(getattr(k, "write", None))]
        if bad_sinks:
            raise ValueError(f"sinks must be objects with a write(stats) method (such as "
                             f"gradstats.integrations.tensorboard.TensorBoardSink); got {bad_sinks}")
        put("sinks", sinks)
        from gradstats.alarms import as_alarms

        as_alarms(self.alarms)               # True, False/None or an Alarms, else a ValueError

    def capture_record(self) -> dict[str, Any]:
        """The options a run's manifest records (``"capture"``).

        Example:
            >>> TraceConfig(every=[0, 5]).capture_record()["every"]
            [0, 5]
        """
        def plain(v: Schedule) -> Any:
            return v if isinstance(v, (int, type(None))) else list(v)

        return {"every": plain(self.every), "sample_every": plain(self.sample_every), "samples": self.samples,
                "kinds": list(self.kinds), "max_bytes": self.max_bytes, "flush_secs": self.flush_secs}

    @classmethod
    def resolve(cls, config: Optional["TraceConfig"], **keywords: Any) -> "TraceConfig":
        """The config that ``config`` and ``trace``'s keyword arguments say together: ``config`` (or
        the defaults) with every keyword that differs from its default. A keyword left at its
        default defers to ``config``; one that contradicts ``config`` is a ``ValueError``.

        Example:
            >>> TraceConfig.resolve(None, every=5).every
            5
            >>> TraceConfig.resolve(TraceConfig(every=5), every=2)
            Traceback (most recent call last):
            ...
            ValueError: trace(config=..., every=2) contradicts the config's every=5: pass the option in one place
        """
        return resolve_config(cls, config, "trace", "gradstats.tracer.TraceConfig", **keywords)
