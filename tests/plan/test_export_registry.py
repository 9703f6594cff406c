"""Export targets are a registry: one class per target, looked up by name or alias."""
from __future__ import annotations

import json

import pytest

from gradstats.plan import Plan, PlanEntry
from gradstats.plan.export import EXPORT_TARGETS, EXPORTERS, Exporter, exporter, register


def test_the_built_in_targets_and_their_aliases_are_registered():
    assert EXPORT_TARGETS == ("json", "torchao", "te")
    assert exporter("torchao.float8") is exporter("torchao")
    assert exporter("transformer_engine") is exporter("te")
    assert exporter("torchao").needs_types and not exporter("json").needs_types


def test_an_unknown_target_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown export target 'onnx'.*\['json', 'torchao', 'te'\]"):
        Plan([PlanEntry("fc", format="e5m2")]).export("onnx")


def test_a_new_target_is_one_class(tmp_path):
    @register
    class Formats(Exporter):
        name = "formats-only"
        target = "formats"
        help = "the format of each layer"

        def body(self, plan, model, resolved, skipped, dropped):
            for name, r, _ in resolved:
                if r.format is None:
                    skipped[name] = "no format"
            return {"formats": {name: str(r.format) for name, r, _ in resolved if r.format is not None}}

        def text(self, doc):
            return "\n".join(f"{k} {v}" for k, v in doc["formats"].items()) + "\n"

    try:
        plan = Plan([PlanEntry("fc", format="e5m2"), PlanEntry("head", sparsity=0.5)])
        with pytest.warns(UserWarning, match="head: skipped \\(no format\\)"):
            doc = plan.export("formats-only", path=tmp_path / "f.txt")
        assert doc["schema"] == "gradstats.plan.export" and doc["target"] == "formats"
        assert doc["formats"] == {"fc": "e5m2"}
        assert (tmp_path / "f.txt").read_text() == "fc e5m2\n"
        json.dumps(doc)
        with pytest.raises(ValueError, match="registered twice"):
            register(Formats)
    finally:
        EXPORTERS.pop("formats-only", None)
