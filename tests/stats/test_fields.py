"""The statistics declared once (gradstats.stats.fields): the vector layout, the merge, a run's
columns and the C kernel's offsets all follow from the declaration."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import gradstats.stats as stats_mod
from gradstats.run.writer import rows_to_table, vectors_to_table
from gradstats.stats import fields
from gradstats.stats.reference import reduce

C_SOURCE = Path(stats_mod.__file__).resolve().parents[1] / "ops" / "native" / "stats.c"


def c_defines() -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r"^#define\s+(\w+)\s+\(?(-?\d+)\)?\s*$", C_SOURCE.read_text(), re.M)}


def test_the_c_kernel_writes_where_the_declaration_says():
    """Each scalar statistic's GS_F_ offset in stats.c is its place in the declared vector; the
    histogram's bins too: a statistic moved or added on one side only fails here."""
    d = c_defines()
    assert {k[5:].lower(): v for k, v in d.items() if k.startswith("GS_F_")} == \
        {s.name: fields.LAYOUT[s.name].start for s in fields.STATISTICS if s.scalar}
    assert d["GS_N_SCALARS"] == len(fields.SCALAR_FIELDS) == fields.LAYOUT["hist"].start
    assert (d["HIST_BINS"], d["HIST_MIN_EXP"]) == (fields.HIST_BINS, fields.HIST_MIN_EXP)
    assert fields.TOP_K <= d["MAX_TOP"]


def test_layout_follows_the_declaration():
    at = 0
    for s in fields.STATISTICS:
        assert fields.LAYOUT[s.name] == slice(at, at + s.length)
        at += s.length
    assert at == fields.VECTOR_LEN == stats_mod.VECTOR_LEN == 351
    assert stats_mod.SCALAR_FIELDS == ("n", "n_zero", "n_nonfinite", "sum", "sum_abs", "sum_sq", "sum_ln_abs",
                                       "sum_ln_abs_sq", "min_abs", "max_abs")
    assert stats_mod.COUNT_FIELDS == ("n", "n_zero", "n_nonfinite")


def test_each_statistic_is_its_declared_compute():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)).exp_() * torch.randn(5000).sign()
    x[:100] = 0
    v = reduce(x)
    p = __import__("gradstats.stats.reference", fromlist=["Pass"]).Pass(x)
    for s in fields.STATISTICS:
        want = torch.as_tensor(s.compute(p)).double().reshape(-1)
        assert torch.equal(v[fields.LAYOUT[s.name]].nan_to_num(-1.0), want.nan_to_num(-1.0)), s.name


def test_merge_follows_each_declared_rule():
    parts = [torch.tensor([0.0, 1.0, -2.0]), torch.tensor([4.0, float("inf")]), torch.zeros(3)]
    rows = [stats_mod.tensor_stats(p) for p in parts]
    m = stats_mod.merge_stats(rows)
    assert set(m) == {s.name for s in fields.STATISTICS}
    for s in fields.STATISTICS:
        want = fields.MERGES[s.merge]([r[s.name] for r in rows])
        np.testing.assert_array_equal(np.asarray(m[s.name]), np.asarray(want))
    assert (m["n"], m["n_zero"], m["n_nonfinite"], m["min_abs"], m["max_abs"]) == (8, 4, 1, 1.0, 4.0)


def test_declaration_rejects_an_unknown_merge():
    with pytest.raises(ValueError, match="merge must be one of"):
        fields.Statistic("p99", "median", lambda p: p.n)


def test_run_columns_follow_the_declaration():
    xs = [torch.randn(100), torch.relu(torch.randn(50))]
    keys = [(0, 0, "a", "grad", 0), (0, 0, "b", "grad", 0)]
    t = vectors_to_table(keys, torch.stack([stats_mod.tensor_stats_vector(x) for x in xs]).numpy())
    assert t.column_names == ["step", "rank", "layer", "kind", "call", *(s.name for s in fields.STATISTICS)]
    for s in fields.STATISTICS:
        typ = t.schema.field(s.name).type
        if s.scalar:
            assert typ == pa.from_numpy_dtype(np.dtype(s.dtype)), s.name
        else:
            assert typ == pa.list_(pa.from_numpy_dtype(np.dtype(s.dtype)), s.length), s.name
    rows = [dict(zip(("step", "rank", "layer", "kind", "call"), k)) | stats_mod.tensor_stats(x) for k, x in zip(keys, xs)]
    r = rows_to_table(rows)
    assert r.schema == t.schema
    for name in t.column_names:                                  # NaN padding of top_abs compares equal
        got, want = r[name].to_pylist(), t[name].to_pylist()
        if name in ("layer", "kind"):
            assert got == want
        else:
            np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    old = rows_to_table([{k: v for k, v in r.items() if k != "top_abs"} for r in rows])
    assert "top_abs" not in old.column_names                     # an optional statistic may be absent
    with pytest.raises(ValueError, match="'hist'"):
        rows_to_table([{k: v for k, v in r.items() if k != "hist"} for r in rows])
