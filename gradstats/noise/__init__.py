"""What a plan costs: the noise it adds to each layer's weight gradient, against SGD's own.

- :mod:`gradstats.noise.record`: what the trace records for it (the ``"noise"`` and
  ``"noise_graph"`` tables);
- :func:`predicted_noise`: the ratio predicted from a run, for any plan
  (:func:`gradstats.recommend` bounds it by default, ``noise_bound=``);
- :func:`noise_probe`: the same ratio measured by running the plan on a model.
"""
from typing import Any

from gradstats.noise.predict import NOISE_BOUND, NoisePrediction, predicted_noise

__all__ = ["predicted_noise", "NoisePrediction", "noise_probe", "NoiseProbe", "NOISE_BOUND"]


def __getattr__(name: str) -> Any:
    if name in ("noise_probe", "NoiseProbe"):     # the probe runs a model: torch only when used
        from gradstats.noise import probe

        return getattr(probe, name)
    raise AttributeError(f"module 'gradstats.noise' has no attribute {name!r}")
