"""The text table of a plan's checks (:func:`format_checks`): per layer, what the model predicted
against what the replay on the run's samples measured, with what failed or was replaced below.

Example:
    >>> table = format_checks([{"layer": "fc", "ok": True, "predicted_gain": 1.0, "replayed_gain": 0.999}])
    >>> table.splitlines()[2].split()
    ['fc', '-', '/', '-', '-', '/', '-', '-', '/', '-', '1.000', '/', '0.999', '-', '/', '-', '-', '/', '-', 'ok']
"""
from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["format_checks", "TABLE_WIDTH", "plan_label", "repair_line", "repair_summary"]


#: the width the check tables aim to stay within: a layer name that does not fit beside the numbers
#: gets a line of its own, and what failed or was replaced is wrapped below its row
TABLE_WIDTH = 120
#: the check table's columns: quantity (``predicted_<q>`` / ``replayed_<q>``) and its format
_COLUMNS = (("sparsity", ".3f"), ("flushed", ".4f"), ("overflow", ".4f"), ("gain", ".3f"), ("bias", "+.3f"),
            ("error", ".3g"))


def format_checks(records: Sequence[dict[str, Any]], width: int = TABLE_WIDTH) -> str:
    """Text table of per-layer check records (:meth:`Verification.per_layer` rows, or a plan's ``checks``):
    per quantity predicted / replayed, the predicted noise ratio where a record has one, and the verdict.
    Layer names are never cut: a name too long to sit beside the numbers within ``width`` columns
    gets a line of its own, the numbers on the next. What failed (``problems``: the values of the
    step named) and why the first choice was replaced (``note``: the values of that rule, at that
    step) follow the row, wrapped to ``width``.

    Example:
        >>> rec = {"layer": "encoder.layers.0.attention.query_key_value", "ok": True,
        ...        "predicted_gain": 1.0, "replayed_gain": 0.999}
        >>> print(format_checks([rec]).splitlines()[3])
        encoder.layers.0.attention.query_key_value
    """
    import textwrap

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) else format(v, fmt)

    noise = any(num(r.get("predicted_noise"), "g") != "-" for r in records)
    heads = [q for q, _ in _COLUMNS] + (["noise R"] if noise else [])
    subs = ["pred / replay"] * len(_COLUMNS) + (["predicted"] if noise else [])
    cells = [[f"{num(r.get(f'predicted_{q}'), f)} / {num(r.get(f'replayed_{q}'), f)}" for q, f in _COLUMNS]
             + ([num(r.get("predicted_noise"), ".3g")] if noise else []) for r in records]
    widths = [max([len(h), len(s)] + [len(c[i]) for c in cells]) for i, (h, s) in enumerate(zip(heads, subs))]

    def join(cols: Sequence[str]) -> str:
        return " ".join(f"{c:>{w}}" for c, w in zip(cols, widths))

    verdicts = ["ok" if r.get("ok") else "FAILS" for r in records]
    names = [str(r["layer"]) for r in records]
    numbers = len(join(heads)) + 2 + max([len("verdict")] + [len(v) for v in verdicts])
    name_w = max([len("layer")] + [len(n) for n in names])
    inline = name_w + 1 + numbers <= width
    pad = name_w + 1 if inline else 2
    lines = [f"{'layer':<{name_w}} {join(heads)}  verdict" if inline else "layer",
             f"{'':<{pad - 1}} {join(subs)}".rstrip() if inline else f"  {join(heads)}  verdict"]
    if not inline:
        lines.append(f"  {join(subs)}")
    for r, name, c, verdict in zip(records, names, cells, verdicts):
        if inline:
            lines.append(f"{name:<{name_w}} {join(c)}  {verdict}")
        else:
            lines += [name, f"  {join(c)}  {verdict}"]
        notes = []
        if not r.get("ok") and r.get("problems"):
            notes.append(str(r["problems"]))
        if r.get("note"):
            notes.append(f"first choice {r['note']}")
        for text in notes:
            lines += textwrap.wrap(text, width=width, initial_indent="    ", subsequent_indent="      ",
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def rule_words(rule: Any) -> str:
    """:meth:`~gradstats.plan.Rule.describe` with the per-tensor scale's shift, which it leaves out.

    Example:
        >>> from gradstats.plan import Rule
        >>> rule_words(Rule(format="e2m1fn", scale="amax", scale_shift=2, rounding="stochastic"))
        'e2m1fn stochastic amax scale x2^+2; no pruning'
    """
    words = rule.describe()
    if rule.quantizes and rule.scale_shift:
        fmt, _, prune = words.partition("; ")
        words = f"{fmt} scale x2^{rule.scale_shift:+d}; {prune}"
    return words


def repair_line(layer: str, rule: Any, failed: dict[str, Any], now: Any, *, passed: str | None,
                most: int = 2) -> str:
    """One layer of :func:`repair_summary`: the rule that failed its check, at which step and why (the
    first ``most`` problems of the ``failed`` row), and what was done: changed to the choice ``passed``
    names, or (None) left in the last choice tried, ``now``, which fails too.

    Example:
        >>> from gradstats.plan import Rule
        >>> was = Rule(format="e2m1fn", scale="amax", scale_shift=2, rounding="stochastic")
        >>> print(repair_line("conv1", was, {"step": 196, "problems": ["predicted: magnitude gain 0.98"]},
        ...                   was.replace(scale_shift=0), passed="scale shift 0"))
          conv1: e2m1fn stochastic amax scale x2^+2; no pruning failed at step 196 (predicted: magnitude gain 0.98) -> changed to scale shift 0: e2m1fn stochastic amax; no pruning
    """
    probs = list(failed["problems"])
    why = "; ".join(probs[:most]) + (f"; {len(probs) - most} more" if len(probs) > most else "")
    done = f"changed to {passed}" if passed else "no choice passed: left in the last tried, which fails too"
    return f"  {layer}: {rule_words(rule)} failed at step {failed['step']} ({why}) -> {done}: {rule_words(now)}"


def repair_summary(plan_name: str, lines: Sequence[str], planned: int, steps: Sequence[int]) -> str:
    """The one warning of a plan's repairs: which plan, how many of its planned layers failed their
    check, what is done about it, then the :func:`repair_line` of each.

    Example:
        >>> print(repair_summary("recommend(bits=4, sparsity=0.85)", ["  conv1: ..."], 3, [196]))
        recommend(bits=4, sparsity=0.85): 1 of 3 planned layer(s) failed the check on the run's samples (step 196); each is changed to the first choice that passes, not kept as planned (plan.checks has the numbers):
          conv1: ...
    """
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(str(s) for s in steps)}"
    return (f"{plan_name}: {len(lines)} of {planned} planned layer(s) failed the check on the run's samples ({at}); "
            "each is changed to the first choice that passes, not kept as planned (plan.checks has the numbers):\n"
            + "\n".join(lines))


def plan_label(plan: Any) -> str:
    """A short name of ``plan`` for logs: its generator's name with the ``bits``, ``sparsity`` and
    (other than per tensor) ``granularity`` it was made for (``"recommend(bits=6, sparsity=0.85)"``),
    or ``"the plan"``.

    Example:
        >>> from gradstats.plan import Plan, Provenance
        >>> gen = "recommend(bits=6, sparsity=0.85, granularity='tensor', rounding=None)"
        >>> plan_label(Plan([], provenance=Provenance(generator=gen)))
        'recommend(bits=6, sparsity=0.85)'
    """
    gen = plan.provenance.generator if plan.provenance is not None else None
    if not gen:
        return "the plan"
    head, _, args = gen.partition("(")
    keep = [a for a in args.rstrip(")").split(", ")
            if a.startswith(("bits=", "sparsity=")) or (a.startswith("granularity=") and a != "granularity='tensor'")]
    return f"{head}({', '.join(keep)})" if keep else head
