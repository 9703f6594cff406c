"""Floating-point format analysis of lognormal gradients (see ``docs/fpanalysis.md``).

With ``ln|g| ~ N(mu, sigma**2)`` (natural log; ``p0`` exact zeros) the quantisation error of any
:class:`~gradstats.formats.FPFormat` is an exact sum of lognormal partial moments over the
format's cells. Public verbs, all vectorised over layers (``mu``, ``sigma`` arrays):

- :func:`expected_error`: the error and its parts (overflow, normal, subnormal, underflow) and the
  fractions flushed, saturated, non-finite; nearest or stochastic rounding; per-tensor or block
  (MX E8M0, NVFP4-style E4M3) scales;
- :func:`optimal_scale`: the per-tensor (power-of-two) scale that minimises it;
- :func:`best_format`: the exponent/mantissa splits of a bit width ranked, each at its best scale
  (or only the formats that exist: ``candidates="ocp"``, ``"torchao"``, ``"te"``,
  :data:`CANDIDATE_PRESETS`, :func:`preset_formats`);
- :func:`crossover_table`: the sigma (std of log2|g|) at which one more exponent bit pays;
- :func:`choose_for_training`: the format, rounding and amax-relative scale with the least noise
  whose predicted magnitude bias (:attr:`ErrorResult.bias`) is bounded: what ``recommend`` uses;
- :func:`best_format_from_stats`, :func:`expected_error_from_stats`: the same for one tensor from
  its binade histogram and maximum (what a run stores), without the lognormal assumption: the
  most accurate predictor on real gradients (:mod:`.histogram`);
- :func:`weight_gradient_alignment` (with :func:`batchnorm_inputs`): the diagnostic that
  predicts the accuracy a format costs, ``|cos(w_c, dW_c)|`` of the layers feeding a BatchNorm
  (exactly 0 without compression).

``relative=True`` errors are ``MSE / E[g**2]`` (inverse SNR); ``criterion="elementwise"`` is the
mean of ``((Q(g) - g)/g)**2``. By the identity ``MSE/E[x**2]`` under ``LN(mu, s)`` == mean relative
squared error under ``LN(mu + 2 s**2, s)``, the two criteria have the same minimum over the scale.

Example:
    >>> from gradstats import fpanalysis
    >>> b = fpanalysis.best_format(8, mu=-9.0, sigma=1.5)
    >>> str(b.format), b.scale
    ('e4m3fn', 128.0)
    >>> round(fpanalysis.expected_error(b.format, mu=-9.0, sigma=1.5, scale=b.scale).total, 6)
    0.000715
"""
from __future__ import annotations

from gradstats.fpanalysis._pieces import FRACTIONS, PARTS
from gradstats.fpanalysis.alignment import AlignmentResult, batchnorm_inputs, weight_gradient_alignment
from gradstats.fpanalysis.choice import (
                     CANDIDATE_NAMES,
                     CANDIDATE_PRESETS,
                     DEFAULT_CANDIDATES,
                     BestFormat,
                     FormatChoice,
                     best_format,
                     candidate_formats,
                     preset_formats,
)
from gradstats.fpanalysis.composed import ComposedPrediction, predict_composed
from gradstats.fpanalysis.crossover import AUTHORS_TABLE, CrossoverTable, crossover_table
from gradstats.fpanalysis.empirical import PredictionCheck, check_prediction, energy_moments, measured_error
from gradstats.fpanalysis.error import ErrorResult, expected_error
from gradstats.fpanalysis.histogram import (
                     HistogramChoice,
                     HistogramLaw,
                     best_format_from_stats,
                     expected_error_from_stats,
)
from gradstats.fpanalysis.scale import ScaleResult, optimal_scale
from gradstats.fpanalysis.training import BIAS_BOUND, FLUSH_BOUND, OBJECTIVES, TrainingChoice, choose_for_training
from gradstats.fpanalysis.what_if import predict_from_stats, what_if

__all__ = ["expected_error", "optimal_scale", "best_format", "crossover_table", "candidate_formats",
           "preset_formats", "CANDIDATE_PRESETS", "CANDIDATE_NAMES", "DEFAULT_CANDIDATES",
           "ErrorResult", "ScaleResult", "BestFormat", "FormatChoice", "CrossoverTable", "AUTHORS_TABLE",
           "measured_error", "check_prediction", "energy_moments", "PredictionCheck", "PARTS", "FRACTIONS",
           "best_format_from_stats", "expected_error_from_stats", "HistogramLaw", "HistogramChoice",
           "choose_for_training", "TrainingChoice", "BIAS_BOUND", "FLUSH_BOUND", "OBJECTIVES",
           "batchnorm_inputs", "weight_gradient_alignment", "AlignmentResult", "what_if", "predict_from_stats",
           "ComposedPrediction", "predict_composed"]
