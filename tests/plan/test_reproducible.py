"""A plan is a function of the run and the options: the same in every process (no dependence on the
order in which Python happens to iterate a set of layer names, which PYTHONHASHSEED changes)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

import gradstats

PLAN_OF = textwrap.dedent("""
    import json, logging, sys
    import torch
    import gradstats
    logging.getLogger("gradstats").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    d = gradstats.recommend(gradstats.open_run(sys.argv[1]), bits=6, sparsity=0.85, check=False).to_dict()
    d["provenance"].pop("created", None)
    print(json.dumps(d, sort_keys=True, default=str))
""")


def test_a_noise_bounded_plan_is_the_same_under_every_hash_seed(tmp_path):
    """Twelve layers of one size, noise records on every other step: the noise bound's greedy pass visits
    layers of equal size in the plan's order. It had visited them in a set's order, and two hash seeds
    gave two plans (different granted sparsities) from one run."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(16, 16), nn.Tanh())])
    with gradstats.trace(model, tmp_path / "run", sample_every=2) as t:
        for _ in range(8):
            model(torch.randn(32, 16)).square().mean().backward()
            t.step()
    assert not gradstats.open_run(tmp_path / "run").table("noise").empty
    plans = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", PLAN_OF, str(tmp_path / "run")], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        plans.add(out.stdout)
    assert len(plans) == 1
