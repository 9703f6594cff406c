"""Runs on disk: crash safety, integrity, distributed merge, the reader's API."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gradstats
from gradstats.run import RunCorruptError


def small_run(path, steps=4, sample_every=1):
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    with gradstats.trace(model, path, sample_every=sample_every, samples=None) as tr:
        for _ in range(steps):
            model(torch.randn(6, 5)).square().mean().backward()
            tr.step()
    return gradstats.open_run(path)


def test_layout_and_reader(tmp_path):
    run = small_run(tmp_path)
    assert run.layers == ["0", "2"] and run.steps == [0, 1, 2, 3] and run.ranks == [0]
    m = run.manifest
    assert m["format_version"] == 1 and m["model_class"] == "Sequential"
    assert m["torch_version"] == torch.__version__ and m["world_size"] == 1
    assert [layer["output_shape"] for layer in m["layers"]] == [[6, 7], [6, 3]]
    df = run.stats()
    assert list(df.columns[:5]) == ["step", "rank", "layer", "kind", "call"]
    assert len(df) == 8 and df["hist"].iloc[0].shape == (277,) and df["top_abs"].iloc[0].shape == (64,)
    r = df.iloc[0]                                      # at most 42 non-zero values, then NaN
    top, k = r["top_abs"], int(r["n"] - r["n_zero"] - r["n_nonfinite"])
    assert 0 < k <= 42 and np.isfinite(top[:k]).all() and np.isnan(top[k:]).all()
    assert top[0] == r["max_abs"] and np.all(np.diff(top[:k]) <= 0)
    assert run.verify() == []
    # the statistics are a plain Parquet dataset that pandas reads without gradstats
    plain = pd.read_parquet(tmp_path / "stats")
    assert len(plain) == 8


def test_runs_without_top_magnitudes_still_read(tmp_path):
    """Runs written before rows carried top_abs: a flush without the column reads, its rows show
    NaN there, and merging ranks goes on without the field."""
    from gradstats.run import rows_to_table
    from gradstats.stats import tensor_stats

    row = {"step": 0, "rank": 0, "layer": "a", "kind": "grad", "call": 0, **tensor_stats(torch.randn(50))}
    old = rows_to_table([{k: v for k, v in row.items() if k != "top_abs"}])
    assert "top_abs" not in old.column_names and "top_abs" in rows_to_table([row]).column_names
    import pyarrow as pa

    both = pa.concat_tables([old, rows_to_table([{**row, "step": 1}])], promote_options="default")
    df = both.to_pandas()
    assert isinstance(df["top_abs"].iloc[1], np.ndarray) and df["top_abs"].iloc[0] is None
    m = gradstats.stats.merge_stats(df.to_dict("records"))
    assert "top_abs" not in m and m["n"] == 100


def test_table_from_vectors_equals_table_from_rows():
    """The writer builds its table from the stacked statistics vectors, column by column: the
    same table as from one dict per row."""
    from gradstats.run import rows_to_table, vectors_to_table
    from gradstats.stats import tensor_stats_vector, vector_to_stats

    xs = [torch.randn(300), torch.relu(torch.randn(70)), torch.zeros(5), torch.tensor([float("nan"), 2.0])]
    vecs = torch.stack([tensor_stats_vector(x) for x in xs]).numpy()
    keys = [(s, 0, f"l{s}", "grad", s % 2) for s in range(len(xs))]
    rows = [{"step": k[0], "rank": k[1], "layer": k[2], "kind": k[3], "call": k[4], **vector_to_stats(v)}
            for k, v in zip(keys, vecs)]
    a, b = vectors_to_table(keys, vecs), rows_to_table(rows)
    assert a.schema == b.schema
    for name in a.column_names:                    # NaN-aware: assert_array_equal treats NaN as equal
        ca, cb = a[name].combine_chunks(), b[name].combine_chunks()
        if name in ("hist", "top_abs"):
            ca, cb = ca.flatten(), cb.flatten()
        np.testing.assert_array_equal(ca.to_numpy(zero_copy_only=False), cb.to_numpy(zero_copy_only=False))


def test_corrupt_files_are_named_and_rest_stays_readable(tmp_path):
    run = small_run(tmp_path)
    stats_files = sorted((tmp_path / "stats").glob("*.parquet"))
    sample_files = sorted((tmp_path / "samples").glob("*.safetensors"))
    victim = stats_files[1]
    victim.write_bytes(victim.read_bytes()[:-20])          # truncated
    s_victim = sample_files[2]
    data = bytearray(s_victim.read_bytes()); data[-3] ^= 0xFF
    s_victim.write_bytes(bytes(data))                        # one flipped byte
    run = gradstats.open_run(tmp_path)
    with pytest.warns(UserWarning, match=victim.name):
        df = run.stats()
    assert sorted(df["step"].unique()) == [0, 2, 3]
    with pytest.raises(RunCorruptError, match="truncated"):
        gradstats.open_run(tmp_path).stats(on_error="raise")
    with pytest.raises(RunCorruptError, match=f"{s_victim.name}.*checksum"):
        run.samples("0", 2)
    assert run.samples("0", 3).numel() == 42                 # other steps read fine
    assert len(run.verify()) == 2


def test_bad_run_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run directory"):
        gradstats.open_run(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a gradstats run"):
        gradstats.open_run(tmp_path)
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(RunCorruptError, match="not valid JSON"):
        gradstats.open_run(tmp_path)


CRASH_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import gradstats
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    if sys.argv[2] == "samples":
        tracer = gradstats.trace(model, sys.argv[1], sample_every=2, samples=1000).attach()
    else:   # statistics only, committed in batches every 0.2 s
        tracer = gradstats.trace(model, sys.argv[1], sample_every=None, flush_secs=0.2).attach()
    print("ready", flush=True)
    step = 0
    while True:
        model(torch.randn(32, 64)).square().mean().backward()
        tracer.step()
        step += 1
""")


@pytest.mark.parametrize("delay, mode", [(0.0, "samples"), (0.4, "samples"), (1.3, "samples"),
                                         (0.0, "batched"), (0.7, "batched")])
def test_sigkill_leaves_a_readable_run(tmp_path, delay, mode):
    proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path), mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.time() + 60
    while not any((tmp_path / "commits").glob("*.json")) and time.time() < deadline:
        time.sleep(0.02)                                  # the first step is committed
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run = gradstats.open_run(tmp_path)
    assert len(run.steps) > 0
    assert run.steps == list(range(len(run.steps)))          # completed steps, no gaps
    df = run.stats(on_error="raise")
    assert set(df["step"]) == set(run.steps)
    for _, row in run.sample_index().iterrows():
        assert run.samples(row.layer, row.step).numel() == 1000
    assert run.verify() == []


DDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from torch import nn
    import gradstats

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))

    def data():
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]

    def train(m, path, shard, lr):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        with gradstats.trace(m, path, optimizer=opt, sample_every=None) as tr:
            for x, y in data():
                x, y = x[shard], y[shard]
                opt.zero_grad()
                # sum over the local shard / global batch: per-element gradients equal one process's
                nn.functional.cross_entropy(m(x), y, reduction="sum").div(16).backward()
                opt.step()

    mode, path = sys.argv[1], sys.argv[2]
    if mode == "single":
        train(model(), path, slice(None), 0.1)
    else:
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=2)
        ddp = nn.parallel.DistributedDataParallel(model())
        # DDP averages the ranks' weight gradients (half the global one here): twice the lr
        train(ddp, path, slice(rank * 8, rank * 8 + 8), 0.2)
        dist.destroy_process_group()
""")


def test_ddp_two_ranks_merge_exactly(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", DDP_SCRIPT, "ddp", str(tmp_path / "ddp")],
                              env=dict(env, RANK=str(r))) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    subprocess.run([sys.executable, "-c", DDP_SCRIPT, "single", str(tmp_path / "one")],
                   check=True, env=dict(env, OMP_NUM_THREADS="1"))
    ddp, one = gradstats.open_run(tmp_path / "ddp"), gradstats.open_run(tmp_path / "one")
    assert ddp.ranks == [0, 1] and ddp.manifest["world_size"] == 2
    assert sorted(os.listdir(tmp_path / "ddp" / "stats"))[0].startswith("part-r0-")
    merged = ddp.stats(merge_ranks=True)
    single = one.stats()
    assert len(merged) == len(single) == 6
    for (_, a), (_, b) in zip(merged.iterrows(), single.iterrows()):
        assert (a.step, a.layer, a.n, a.n_zero) == (b.step, b.layer, b.n, b.n_zero)
        for f in ("sum", "sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq", "min_abs", "max_abs"):
            # float tolerance: the two runs reduce in different orders (float32 sums, the
            # all-reduce of weight gradients), so later steps differ in the last bits;
            # relative to the magnitudes summed, since the signed sum cancels
            scale = b["sum_abs"] if f == "sum" else abs(b[f])
            assert abs(a[f] - b[f]) <= 1e-4 * scale, (f, a.step, a.layer)
        # a value within a few ulps of a power of two may change binade
        assert np.abs(a["hist"] - b["hist"]).sum() <= 2
