"""The analysis and report of a run: what ``gradstats report RUN -o DIR`` and ``make demo`` do.

:func:`analyse` fits every traced layer (:func:`gradstats.fit_run` on the steps with raw
samples, else on the streamed statistics), derives the pruning thresholds for the target
sparsities (85% and 90% by default) and the recommended FP8, FP6 and FP4 formats per layer
(:func:`gradstats.recommend`, one plan per width and sparsity), and checks the predicted
quantisation error against the error measured on the run's raw samples
(:func:`gradstats.fpanalysis.measured_error`). It works on the run of any model: a layer without
neural-gradient statistics (a module whose weights are used functionally, such as the
``out_proj`` of ``nn.MultiheadAttention``) is skipped with a note, and a group that cannot be
fitted (an identically zero gradient, a damaged sample file) is reported with the reason in the
table, the text and ``report.md``, never fatal. :meth:`Analysis.write` (or :func:`report`) writes
``plan.json``, the per-width plans, ``report.md`` with the figures embedded, the figures
(:func:`gradstats.figures.write_figures`) and the tables.

Example:
    >>> import tempfile, gradstats
    >>> from gradstats.report import analyse
    >>> a = analyse(gradstats.zoo.data.data_dir() / "sample-run")
    >>> a.table.loc[a.table["layer"] == "conv2", "fp8"].item()
    'e4m3fn'
    >>> rep = a.write(tempfile.mkdtemp(), figures=False)
    >>> sorted(rep.files)[:4]
    ['errors', 'fits', 'layers', 'plan']
"""
from gradstats.report.analysis import BITS, SPARSITIES, Analysis, analyse, report
from gradstats.report.write import Report

__all__ = ["analyse", "report", "Analysis", "Report", "SPARSITIES", "BITS"]
