"""The Lightning callback: a small LightningModule trains a few steps with only
``callbacks=[GradstatsCallback(...)]`` added; gradient accumulation and checkpoint resume."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")
import gradstats  # noqa: E402
from gradstats.integrations.lightning import GradstatsCallback, pl  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                       torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(n: int = 8) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)     # 2 steps an epoch


def fit(tmp_path, callback, *, steps, accumulate=1, ckpt_dir=None, ckpt_path=None, model=None):
    callbacks = [callback]
    if ckpt_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1,
                                                      filename="{step}"))
    trainer = pl.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=ckpt_dir is not None, default_root_dir=str(tmp_path),
                         accelerator="cpu", devices=1, deterministic=True)
    trainer.fit(model or Net(), data(), ckpt_path=ckpt_path)
    return trainer


def test_one_step_per_optimizer_step_with_accumulation(tmp_path):
    fit(tmp_path, GradstatsCallback(tmp_path / "run"), steps=2, accumulate=2)
    run = gradstats.open_run(tmp_path / "run")
    assert run.steps == [0, 1]
    assert {"net.0", "net.2", "net.4"} <= set(run.layers)
    st = run.stats(kinds=["grad"])
    assert st[st["layer"] == "net.0"].groupby("step")["call"].nunique().tolist() == [2, 2]


def test_resuming_from_a_checkpoint_continues_the_run_without_duplicates(tmp_path):
    opts = dict(sample_every=1, samples=32)
    fit(tmp_path / "a", GradstatsCallback(tmp_path / "run_a", **opts), steps=4)
    fit(tmp_path / "b", GradstatsCallback(tmp_path / "run_b", **opts), steps=4, ckpt_dir=tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt" / "step=2.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert any(k.startswith("GradstatsCallback") and v["step"] == 2 for k, v in saved.items())
    fit(tmp_path / "c", GradstatsCallback(tmp_path / "run_b", **opts), steps=4, ckpt_path=str(ckpt))
    a = gradstats.open_run(tmp_path / "run_a").stats(kinds=["grad"]).sort_values(["step", "layer", "call"])
    b = gradstats.open_run(tmp_path / "run_b").stats(kinds=["grad"]).sort_values(["step", "layer", "call"])
    assert gradstats.open_run(tmp_path / "run_b").steps == [0, 1, 2, 3]
    assert not b.duplicated(["step", "layer", "call", "rank"]).any() and len(a) == len(b)
    cols = ["n", "n_zero", "sum", "sum_abs", "sum_sq", "max_abs"]
    np.testing.assert_allclose(b[cols].to_numpy(float), a[cols].to_numpy(float), rtol=1e-5, atol=1e-12)
    np.testing.assert_array_equal(gradstats.open_run(tmp_path / "run_b").samples("net.2", step=3),
                                  gradstats.open_run(tmp_path / "run_a").samples("net.2", step=3))


def test_a_plan_is_applied_with_its_state_in_the_checkpoint(tmp_path):
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5, prune_at=False)
    cb = GradstatsCallback(tmp_path / "run", plan=plan)
    fit(tmp_path, cb, steps=2, ckpt_dir=tmp_path / "ckpt")
    applied = gradstats.open_run(tmp_path / "run").table("applied")
    assert set(applied["layer"]) == {"net.0", "net.2"}       # net.4 is the output layer
    saved = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("GradstatsCallback"))
    assert set(state["applied"]["layers"]) == {"net.0", "net.2"}
    assert not cb.session.active


def _hf_model(name: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=48, n_positions=16, bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, vocab_size=48, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


HF_PROJECTIONS = {
    "gpt2": [f"model.transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                        "mlp.c_proj")],
    "llama": [f"model.model.layers.{i}.{p}" for i in range(2) for p in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")],
}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_transformers_model_inside_a_lightning_module(tmp_path, name):
    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _hf_model(name)

        def training_step(self, batch, i):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 48, (16, 12), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    trainer = pl.Trainer(max_steps=2, callbacks=[GradstatsCallback(tmp_path / "run")], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path), accelerator="cpu", devices=1)
    trainer.fit(LM(), loader)
    run = gradstats.open_run(tmp_path / "run")
    projections = HF_PROJECTIONS[name]
    assert run.steps == [0, 1] and set(projections) <= set(run.layers)
    assert sorted(gradstats.Plan.uniform(format="e4m3fn").resolve(run)) == sorted(projections)


def test_pytorch_lightning_trainer_takes_its_own_callback(tmp_path):
    ptl = pytest.importorskip("pytorch_lightning")
    from gradstats.integrations.pytorch_lightning import GradstatsCallback as PTLCallback

    class Small(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def training_step(self, batch, i):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    assert issubclass(PTLCallback, ptl.Callback) and not issubclass(PTLCallback, pl.Callback)
    trainer = ptl.Trainer(max_steps=2, callbacks=[PTLCallback(tmp_path / "run")], logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                          default_root_dir=str(tmp_path), accelerator="cpu", devices=1)
    trainer.fit(Small(), data())
    assert gradstats.open_run(tmp_path / "run").steps == [0, 1]
