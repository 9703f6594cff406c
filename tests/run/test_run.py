"""Runs on disk: crash safety, integrity, distributed merge, the reader's API."""
from __future__ import annotations

import copy
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
    with pytest.raises(ValueError, match=r"open_run\(\) needs the path of a run directory.*got Sequential"):
        gradstats.open_run(nn.Sequential(nn.Linear(2, 2)))     # the model passed for the run


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
        n = run.samples(row.layer, row.step).numel()
        assert n == row.n_samples and 1000 <= n <= row.n_total        # whole groups of tokens
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
        with gradstats.trace(m, path, optimizer=opt, sample_every=None,
                             kinds=("grad", "wgrad", "weight")) as tr:
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
    merged = ddp.stats(merge_ranks=True, kinds=["grad"])
    single = one.stats(kinds=["grad"])
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
    # weights and weight gradients are replicas (the same tensor on every rank after the
    # all-reduce): merged, they count once, not world_size times
    for kind, factor in (("weight", 1.0), ("wgrad", 0.5)):   # DDP averages: half the global wgrad
        rows = ddp.stats(kinds=[kind])
        assert sorted(rows["rank"].unique()) == [0, 1]
        m, s1 = ddp.stats(merge_ranks=True, kinds=[kind]), one.stats(kinds=[kind])
        assert len(m) == len(s1) == 6 and (m["rank"] == -1).all()
        assert (m["n"].to_numpy() == s1["n"].to_numpy()).all(), kind
        np.testing.assert_allclose(m["sum_abs"].to_numpy(), factor * s1["sum_abs"].to_numpy(), rtol=1e-4)


# ----------------------------------------------------------------------------- resuming a run

def _train_lin(model, path, steps, scale=1.0, **kw):
    with gradstats.trace(model, path, sample_every=1, samples=None, **kw) as tr:
        for _ in range(steps):
            (scale * model(torch.randn(6, 5))).square().mean().backward()
            tr.step()
    return tr


def _lin():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def test_existing_run_needs_resume_or_start_step(tmp_path):
    model = _lin()
    _train_lin(model, tmp_path, 3)
    with pytest.raises(ValueError, match=r"already holds a run \(steps up to 2\).*resume=True.*start_step="):
        _train_lin(model, tmp_path, 1)
    assert gradstats.open_run(tmp_path).steps == [0, 1, 2]          # nothing was written
    tr = _train_lin(model, tmp_path, 2, resume=True)
    run = gradstats.open_run(tmp_path)
    assert tr.current_step == 5 and run.steps == [0, 1, 2, 3, 4]
    stats = run.stats()
    assert not stats.duplicated(["step", "rank", "layer", "kind", "call"]).any()
    assert len(stats) == 5 * 2 and run.layers == ["0", "2"]
    # an empty directory, or one with no commits yet, needs neither
    _train_lin(_lin(), tmp_path / "fresh", 1)
    assert gradstats.open_run(tmp_path / "fresh").steps == [0]


def test_start_step_supersedes_what_followed_the_checkpoint(tmp_path):
    model = _lin()
    _train_lin(model, tmp_path, 5)                                    # steps 0..4
    before = gradstats.open_run(tmp_path).stats()
    _train_lin(model, tmp_path, 2, scale=1000.0, start_step=2)        # restored at step 2
    run = gradstats.open_run(tmp_path)
    assert run.steps == [0, 1, 2, 3]                                 # step 4 was superseded
    stats = run.stats()
    assert not stats.duplicated(["step", "rank", "layer", "kind", "call"]).any()
    old = before[before.step < 2].reset_index(drop=True)
    pd.testing.assert_frame_equal(stats[stats.step < 2].reset_index(drop=True)[["n", "sum_abs"]],
                                  old[["n", "sum_abs"]])
    new = stats[stats.step >= 2]
    assert (new["max_abs"].to_numpy() > 100 * before[before.step >= 2]["max_abs"].max()).all()
    idx = run.sample_index()
    assert sorted(idx.step.unique()) == [0, 1, 2, 3] and not idx.duplicated(
        ["step", "rank", "layer", "kind", "call"]).any()
    assert run.samples("0", 3).abs().max() > 100 * before["max_abs"].max()


def test_tracer_state_dict_resumes_sampling_exactly(tmp_path):
    """Checkpoint after 2 steps, crash, restore: the run equals an uninterrupted one."""
    def batches():
        g = torch.Generator().manual_seed(5)
        return [torch.randn(64, 5, generator=g) for _ in range(4)]

    def step(model, opt, x):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    model = _lin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstats.trace(model, tmp_path / "whole", optimizer=opt, sample_every=1, samples=50, seed=3):
        for x in batches():
            step(model, opt, x)

    model = _lin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = gradstats.trace(model, tmp_path / "resumed", optimizer=opt, sample_every=1, samples=50, seed=3)
    with tr:
        for x in batches()[:2]:
            step(model, opt, x)
        ckpt = copy.deepcopy({"tracer": tr.state_dict(), "model": model.state_dict(),
                              "opt": opt.state_dict()})
        step(model, opt, batches()[2])            # trained on after the checkpoint, then crashed
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model = _lin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["opt"])
    tr = gradstats.trace(model, tmp_path / "resumed", optimizer=opt, sample_every=1, samples=50, seed=3)
    tr.load_state_dict(ckpt["tracer"])            # before attaching: no resume= needed
    with tr:
        for x in batches()[2:]:
            step(model, opt, x)
    whole, resumed = gradstats.open_run(tmp_path / "whole"), gradstats.open_run(tmp_path / "resumed")
    assert whole.steps == resumed.steps == [0, 1, 2, 3]
    a, b = whole.stats(), resumed.stats()
    pd.testing.assert_frame_equal(a.drop(columns=["hist", "top_abs"]), b.drop(columns=["hist", "top_abs"]))
    for s in whole.steps:
        for layer in whole.layers:
            assert torch.equal(whole.samples(layer, s), resumed.samples(layer, s)), (s, layer)
    with pytest.raises(ValueError, match="Tracer.state_dict"):
        tr.load_state_dict({"step": 1})


def test_stats_raise_after_a_warned_read(tmp_path):
    small_run(tmp_path)
    victim = sorted((tmp_path / "stats").glob("*.parquet"))[1]
    victim.write_bytes(victim.read_bytes()[:-20])
    run = gradstats.open_run(tmp_path)
    with pytest.warns(gradstats.RunDamageWarning, match=victim.name):
        run.stats()
    with pytest.raises(RunCorruptError, match="truncated"):
        run.stats(on_error="raise")                          # the cached read still raises
    # the lost step is gone from steps too, and each problem is listed once
    assert run.steps == [0, 2, 3]
    run.stats(); run.verify()
    assert len([p for p in run.problems if victim.name in p]) == 1


def test_manifest_that_is_not_an_object(tmp_path):
    small_run(tmp_path)
    (tmp_path / "manifest.json").write_text("[1, 2, 3]")
    with pytest.raises(RunCorruptError, match="JSON list, not an object"):
        gradstats.open_run(tmp_path)


def test_samples_of_every_call_and_a_message_that_agrees(tmp_path):
    shared = nn.Linear(4, 4)
    with gradstats.trace(shared, tmp_path, sample_every=[0, 3], samples=None) as tr:
        for _ in range(4):
            shared(torch.tanh(shared(torch.randn(3, 4)))).sum().backward()
            tr.step()
    run = gradstats.open_run(tmp_path)
    assert run.layers == ["(root)"]
    both = run.samples("(root)", 3, call=None)
    assert torch.equal(both, torch.cat([run.samples("(root)", 3, call=0), run.samples("(root)", 3, call=1)]))
    with pytest.raises(ValueError, match=r"at step 1 \(any call\).*exist at steps \[0, 3\] with calls"):
        run.samples("(root)", 1, call=None)
    with pytest.raises(ValueError, match="call must be"):
        run.samples("(root)", 3, call=-1)


def test_damaged_stats_and_info_agree(tmp_path, capsys):
    from gradstats.cli import main

    small_run(tmp_path)
    victim = sorted((tmp_path / "stats").glob("*.parquet"))[2]
    victim.write_bytes(b"not parquet" + victim.read_bytes()[11:])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["info", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "steps 0..3 (3 captured)" in out
    assert (out + err).count(victim.name) == 1               # named once, not three times
    assert gradstats.open_run(tmp_path).summary()["steps"].tolist() == [3, 3]


# ----------------------------------------------------------------------------- a run as a dataset
def test_every_parquet_file_says_what_it_holds(tmp_path):
    import pyarrow.parquet as pq

    model = _lin()
    with gradstats.trace(model, tmp_path / "r", flush_secs=0) as tr:
        h = gradstats.apply(model, gradstats.Plan.uniform(format="e4m3fn", layers=["0"]), log_to=tr)
        for _ in range(2):
            model(torch.randn(6, 5)).square().mean().backward()
            tr.step()
        h.remove()
    run = gradstats.open_run(tmp_path / "r")
    for table in ("stats", "applied"):
        files = run.files(table)
        assert files
        for f in files:
            meta = {k.decode(): v.decode() for k, v in pq.read_schema(f).metadata.items()}
            assert meta["gradstats.format_version"] == "1" and meta["gradstats.table"] == table
            assert meta["gradstats.version"] == gradstats.__version__
    stats_meta = pq.read_schema(run.files("stats")[0]).metadata
    assert stats_meta[b"gradstats.hist_min_exp"] == b"-149" and stats_meta[b"gradstats.hist_log_base"] == b"2"
    # the further tables have the statistics' key types
    assert str(run.table("applied")["rank"].dtype) == str(run.stats()["rank"].dtype) == "int32"
    assert str(run.table("applied")["step"].dtype) == "int64"


def test_files_and_dataset_hold_committed_rows_only(tmp_path):
    import shutil

    _train_lin(_lin(), tmp_path / "r", 4)
    run = gradstats.open_run(tmp_path / "r")
    stray = tmp_path / "r" / "stats" / "part-r0-999999.parquet"       # written, its commit record never was
    shutil.copy(run.files("stats")[0], stray)
    run = gradstats.open_run(tmp_path / "r")
    assert stray not in run.files("stats") and stray in set((tmp_path / "r" / "stats").glob("*.parquet"))
    assert run.dataset().count_rows() == len(run.stats())
    # a session that resumed at step 2 supersedes what the first one wrote from there on
    _train_lin(_lin(), tmp_path / "r", 1, start_step=2)
    run = gradstats.open_run(tmp_path / "r")
    got = run.dataset().to_table().to_pandas()
    assert sorted(got["step"].unique()) == run.steps == [0, 1, 2]
    assert len(got) == len(run.stats())
    with pytest.raises(ValueError, match="not a Parquet table"):
        run.files("samples")
