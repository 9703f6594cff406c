"""``gradstats export PLAN --to json|torchao|te [--model RUN] [-o FILE]``: a saved plan resolved per
layer in another stack's terms (:meth:`gradstats.Plan.export`), printed or written as JSON (YAML:
``te``, Transformer Engine's debug config for nvdlfw-inspect)."""
from __future__ import annotations

import argparse


def _targets() -> list[str]:
    from gradstats.plan.export import EXPORTERS

    return list(EXPORTERS)


def register(sub: argparse._SubParsersAction) -> None:
    from gradstats.cli import LazyChoices

    p = sub.add_parser("export", help="export a saved plan per layer for another stack (json, torchao, te)")
    p.add_argument("plan", help="a plan file (gradstats recommend ... -o plan.json)")
    p.add_argument("--to", default="json", metavar="TARGET", choices=LazyChoices(_targets),
                   help="the target: %(choices)s (default json; te: Transformer Engine's nvdlfw-inspect YAML)")
    p.add_argument("--model", default=None,
                   help="a run directory whose layers resolve the plan's patterns (needed for torchao and for "
                        "plans with patterns)")
    p.add_argument("-o", "--out", default=None, help="write the export here (JSON; YAML for te); default: print it")
    p.add_argument("--strict", action="store_true", help="fail when the target cannot express part of the plan")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import warnings

    import gradstats
    from gradstats.plan.export import exporter

    target = exporter(args.to)
    plan = gradstats.Plan.load(args.plan)
    if args.model is None:                     # the plan's own check speaks Python (model=)
        pats = [e.layer for e in plan.entries if e.is_pattern]
        if target.needs_types or pats:
            why = (f"--to {args.to} needs each layer's module type" if target.needs_types else
                   f"the plan has pattern entries {pats} to resolve to layer names")
            raise ValueError(f"{why}: pass --model RUN, a run directory of the model (the one the plan was "
                             "recommended from will do)")
    model = gradstats.open_run(args.model) if args.model else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        doc = plan.export(args.to, model, path=args.out, strict=args.strict)
    for w in caught:                           # what the target cannot express, said once
        print(f"note: {w.message}")
    if args.out:
        print(f"{args.to} export of {args.plan}: {args.out}")
    else:
        print(target.text(doc), end="")
    return 0
