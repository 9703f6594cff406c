"""What the noise model reads from a run (:mod:`gradstats.noise.terms`): per layer, the terms that
turn a relative error of its output gradient into a noise ratio of its weight gradient, which
layers feed which and how much noise travels back between them. Each other part of the noise model
lives with its stage:

- :mod:`gradstats.tracer.noise`: what the trace records for it (the ``"noise"`` and
  ``"noise_graph"`` tables);
- :func:`gradstats.predicted_noise` (:mod:`gradstats.plan.noise_prediction`): the ratio a plan is
  predicted to cost, from a run (:func:`gradstats.recommend` bounds it by default, ``noise_bound=``);
- :func:`gradstats.noise_probe` (:mod:`gradstats.apply.noise_probe`): the same ratio measured by
  running the plan on a model.

Example:
    >>> from gradstats.noise import NOISE_BOUND
    >>> NOISE_BOUND
    0.02
"""
from gradstats.noise.terms import NOISE_BOUND, downstream, gain_of, gains, noise_terms, noise_weights

__all__ = ["NOISE_BOUND", "noise_terms", "downstream", "gains", "gain_of", "noise_weights"]
