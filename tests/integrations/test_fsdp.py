"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2 gloo ranks on the CPU: neural gradients are
recorded per rank as with DDP; parameters and weight gradients are sharded ``DTensor``s, recorded
per rank as shards and merged by adding the shards; a plan is enforced under it. The merged run
equals a single-process run over the same global batch (float tolerance)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import gradstats

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):          # torch < 2.6
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from torch import nn
    import gradstats

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4))

    def data():
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]

    # quantise layer 0's neural gradient (a fixed scale: the same on every rank and in one process)
    PLAN = gradstats.Plan.uniform(format="e4m3fn", rounding="nearest", scale="fixed", scale_value=2.0 ** 12,
                                  layers=["0"])

    def train(m, path, shard, lr):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        with gradstats.trace(m, path, optimizer=opt, sample_every=[2], samples=None,
                             kinds=("grad", "wgrad", "weight")) as tr:
            with gradstats.apply(m, PLAN, log_to=tr):
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
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=2)
        m = model()
        mesh = init_device_mesh("cpu", (2,))
        for layer in (m[0], m[2], m[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        # FSDP2 averages the ranks' weight gradients (half the global one here): twice the lr
        train(m, path, slice(rank * 8, rank * 8 + 8), 0.2)
        dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + os.getpid() % 1000),
               WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, "fsdp", str(tmp / "fsdp")], env=dict(env, RANK=str(r)),
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    subprocess.run([sys.executable, "-c", SCRIPT, "single", str(tmp / "one")], check=True, env=env)
    return gradstats.open_run(tmp / "fsdp"), gradstats.open_run(tmp / "one")


def _close(a, b, f):
    scale = b["sum_abs"] if f == "sum" else abs(b[f])
    return abs(a[f] - b[f]) <= 1e-4 * scale + 1e-12


def test_the_layers_are_sharded_and_named_as_the_users(runs):
    fsdp, one = runs
    assert fsdp.ranks == [0, 1] and fsdp.layers == one.layers == ["0", "2", "4"]
    assert fsdp.sharded_layers == ["0", "2", "4"] and one.sharded_layers == []
    info = fsdp.layer_info().set_index("name")
    assert info.loc["0", "type"] == "FSDPLinear" and "Linear" in info.loc["0", "bases"]


@pytest.mark.parametrize("kind, factor", [("grad", 1.0), ("weight", 1.0), ("wgrad", 0.5)])
def test_merged_shards_equal_one_process(runs, kind, factor):
    fsdp, one = runs
    per_rank = fsdp.stats(kinds=[kind])
    assert sorted(per_rank["rank"].unique()) == [0, 1]
    merged, single = fsdp.stats(kinds=[kind], merge_ranks=True), one.stats(kinds=[kind])
    assert len(merged) == len(single) == 9
    for (_, a), (_, b) in zip(merged.iterrows(), single.iterrows()):
        assert (a.step, a.layer, a.n, a.n_zero) == (b.step, b.layer, b.n, b.n_zero), (kind, a.layer)
        for f in ("sum_abs", "sum_sq", "max_abs"):
            b2 = dict(b)
            b2[f] = b[f] * (factor ** 2 if f == "sum_sq" else factor)
            assert _close(a, b2, f), (kind, f, a.step, a.layer)
    if kind == "wgrad":
        # the 7 x 10 + 7 parameters of layer 0, split 4 + 3 rows: the shards' samples are the whole
        got = np.sort(np.abs(fsdp.samples("0", 2, kind="wgrad").numpy()))
        want = np.sort(np.abs(one.samples("0", 2, kind="wgrad").numpy())) * factor
        assert got.size == want.size == 77
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9)


def test_a_plan_is_enforced_on_every_rank(runs):
    fsdp, one = runs
    applied = fsdp.table("applied")
    assert sorted(applied["rank"].unique()) == [0, 1] and set(applied["layer"]) == {"0"}
    assert (applied["format"] == "e4m3fn").all()
    assert len(applied) == 2 * len(one.table("applied")) == 6
