"""``RecommendConfig``: the options of :func:`gradstats.recommend` and :func:`gradstats.recommend_each`
as one frozen value, beside :class:`gradstats.TraceConfig` and :class:`gradstats.ApplyConfig`.

A call may pass a config, keywords, or both (:func:`gradstats._config.resolve_config`): a keyword at
its default defers to the config, one that contradicts it is a ``ValueError``. What each option does
is documented once, in :func:`gradstats.recommend`.

Example:
    >>> from gradstats.plan.config import RecommendConfig
    >>> cfg = RecommendConfig(sparsity=0.85, noise_bound=0.1)
    >>> cfg.sparsity, cfg.granularity, cfg.noise_bound
    (0.85, 'tensor', 0.1)
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable, Sequence

from gradstats._config import resolve_config
from gradstats.fpanalysis.training import FLUSH_BOUND
from gradstats.noise import NOISE_BOUND
from gradstats.plan._statistics import Steps

__all__ = ["RecommendConfig"]


@dataclass(frozen=True)
class RecommendConfig:
    """The options of :func:`gradstats.recommend` (all but ``bits``, the width or widths asked for),
    each with the meaning and default documented there.

    Example:
        >>> RecommendConfig(granularity="nvfp4").rounding is None
        True
    """

    sparsity: float | str | None = None
    granularity: str | int = "tensor"
    rounding: str | None = None
    steps: Steps = "auto"
    threshold_rule: str | None = None
    candidates: str | Iterable[Any] | None = "ocp"
    layers: str | Sequence[str] | None = None
    format_rule: str = "lognormal"
    objective: str = "training"
    bias_bound: float | None = None
    flush_bound: float | None = FLUSH_BOUND
    output_layer: str | bool | None = None
    prune_at: str | bool | None = None
    check: bool = True
    noise_bound: float | None = NOISE_BOUND

    @classmethod
    def resolve(cls, config: RecommendConfig | None, verb: str, **options: Any) -> RecommendConfig:
        """The config that ``config`` and a call's keyword ``options`` say together (a keyword at its
        default defers to the config; one that contradicts it is a ``ValueError``).

        Example:
            >>> RecommendConfig.resolve(RecommendConfig(sparsity=0.5), "recommend", sparsity=None).sparsity
            0.5
        """
        return resolve_config(cls, config, verb, "gradstats.RecommendConfig", **options)

    def options(self) -> dict[str, Any]:
        """The options as keywords (values as they are, not copied).

        Example:
            >>> RecommendConfig().options()["noise_bound"]
            0.02
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}
