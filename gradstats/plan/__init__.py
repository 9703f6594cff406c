"""Per-layer plans: which format, scale, rounding and pruning each layer's neural gradient gets.

A :class:`Plan` is a list of :class:`PlanEntry` (a layer pattern plus the rule fields it sets),
the plan's default :class:`Rule`, and its :class:`Provenance`. It is plain data: saved as JSON
with a versioned schema (``docs/plan-format.md``), readable and editable by hand, exported to
other stacks (:meth:`Plan.export`), and resolved against a model to one complete :class:`Rule`
per planned module (:meth:`Plan.resolve`), which is what :func:`gradstats.apply` enforces.

Precedence (:meth:`Plan.resolve`): a module is planned when at least one entry matches it.
Its rule starts from the plan's ``defaults``; then every matching *pattern* entry (glob or
``re:`` regex) sets its fields, in the order of the plan; then every matching *exact-name*
entry sets its fields, in order. So exact names win over patterns, and among entries of the
same kind the later one wins. An entry sets only the fields it names (in JSON: the keys it
has; in Python: the arguments passed); ``null``/``None`` is a value ("no format", "no pruning").

Example:
    >>> import torch
    >>> from gradstats.plan import Plan, PlanEntry
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> plan = Plan.uniform(format="e4m3", sparsity=0.8)
    >>> plan = plan.with_entries(PlanEntry("2", format="e5m2", sparsity=None))
    >>> {name: (str(r.format), r.sparsity) for name, r in plan.resolve(model).items()}
    {'0': ('e4m3', 0.8), '2': ('e5m2', None)}
"""
from gradstats.plan._plan import CONV_LINEAR_TYPES, SCHEMA, SCHEMA_VERSION, Plan
from gradstats.plan._rules import (
                     INHERIT,
                     ROUNDINGS,
                     RULE_FIELDS,
                     SCALE_FORMATS,
                     SCALE_RULES,
                     THRESHOLD_RULES,
                     PlanEntry,
                     Rule,
                     amax_scale,
)
from gradstats.plan._values import Prediction, Provenance
from gradstats.plan.checks import OVERFLOW_BOUND, Verification, verify
from gradstats.plan.export import EXPORT_TARGETS

__all__ = ["Plan", "PlanEntry", "Rule", "Prediction", "Provenance", "INHERIT", "SCHEMA",
           "SCHEMA_VERSION", "SCALE_RULES", "ROUNDINGS", "THRESHOLD_RULES", "SCALE_FORMATS",
           "RULE_FIELDS", "CONV_LINEAR_TYPES", "EXPORT_TARGETS", "amax_scale", "verify", "Verification",
           "OVERFLOW_BOUND"]
