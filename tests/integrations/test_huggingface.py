"""The Hugging Face Trainer callback: tiny GPT-2 and Llama models from configs (random weights, no
download) train a few steps with only ``callbacks=[GradstatsCallback(...)]`` added."""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import gradstats  # noqa: E402
from gradstats.integrations.huggingface import STATE_FILE, GradstatsCallback  # noqa: E402

VOCAB = 48


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                        max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def train(model, out, callback, *, steps=3, accumulation=1, save_steps=None, resume=None) -> Trainer:
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulation, report_to=[], use_cpu=True,
                             disable_tqdm=True, logging_strategy="no", seed=0, data_seed=0,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(resume_from_checkpoint=resume)
    return trainer


PROJECTIONS = {
    "gpt2": [f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")],
    "llama": [f"model.layers.{i}.{p}" for i in range(2) for p in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")],
}


@pytest.mark.parametrize("name, build", [("gpt2", gpt2), ("llama", llama)])
def test_the_callback_alone_traces_every_projection(tmp_path, name, build):
    run_dir = tmp_path / "run"
    train(build(), tmp_path / "out", GradstatsCallback(run_dir), steps=3, accumulation=2)
    run = gradstats.open_run(run_dir)
    assert run.steps == [0, 1, 2]                        # one step per optimizer step
    assert set(PROJECTIONS[name]) <= set(run.layers)
    st = run.stats(kinds=["grad"])
    calls = st[st["layer"] == PROJECTIONS[name][0]].groupby("step")["call"].nunique()
    assert calls.tolist() == [2, 2, 2]                   # the two micro-batches are calls of the step
    # and the default plan covers the same projections, not the embeddings or the LM head
    planned = gradstats.Plan.uniform(format="e4m3fn").resolve(build())
    assert sorted(planned) == sorted(PROJECTIONS[name])


def _stats(run_dir) -> pd.DataFrame:
    st = gradstats.open_run(run_dir).stats(kinds=["grad"])
    return st.sort_values(["step", "layer", "call"]).reset_index(drop=True)


def test_resuming_from_a_checkpoint_continues_the_run_without_duplicates(tmp_path):
    # the uninterrupted training
    train(gpt2(), tmp_path / "a", GradstatsCallback(tmp_path / "run_a", sample_every=1, samples=64),
          steps=4, save_steps=2)
    # a training that saved at step 2 and 4, then is resumed from step 2 (as after a crash at step 3)
    train(gpt2(), tmp_path / "b", GradstatsCallback(tmp_path / "run_b", sample_every=1, samples=64),
          steps=4, save_steps=2)
    assert (tmp_path / "b" / "checkpoint-2" / STATE_FILE.format(rank=0)).is_file()
    train(gpt2(), tmp_path / "b", GradstatsCallback(tmp_path / "run_b", sample_every=1, samples=64),
          steps=4, save_steps=2, resume=str(tmp_path / "b" / "checkpoint-2"))
    run_b = gradstats.open_run(tmp_path / "run_b")
    assert run_b.steps == [0, 1, 2, 3]
    a, b = _stats(tmp_path / "run_a"), _stats(tmp_path / "run_b")
    assert not b.duplicated(["step", "layer", "call", "rank"]).any()
    assert len(a) == len(b)
    cols = ["n", "n_zero", "sum", "sum_abs", "sum_sq", "sum_ln_abs", "max_abs"]
    np.testing.assert_allclose(b[cols].to_numpy(float), a[cols].to_numpy(float), rtol=1e-5)
    # the sampling continued from the saved generator state: the same samples as uninterrupted
    layer = PROJECTIONS["gpt2"][0]
    np.testing.assert_array_equal(gradstats.open_run(tmp_path / "run_b").samples(layer, step=3),
                                  gradstats.open_run(tmp_path / "run_a").samples(layer, step=3))


def test_a_plan_is_applied_and_logged_into_the_run(tmp_path):
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5)
    cb = GradstatsCallback(tmp_path / "run", plan=plan, warmup=1)
    train(gpt2(), tmp_path / "out", cb, steps=3)
    applied = gradstats.open_run(tmp_path / "run").table("applied")
    assert set(applied["layer"]) == set(PROJECTIONS["gpt2"])
    assert sorted(applied["step"].unique()) == [1, 2]       # the warm-up call passed unchanged
    assert (applied["format"] == "e4m3fn").all()
    assert not cb.session.active                             # detached at the end of training


def test_apply_only_and_bad_options(tmp_path):
    plan = gradstats.Plan.uniform(format="e5m2")
    cb = GradstatsCallback(plan=plan)
    train(gpt2(), tmp_path / "out", cb, steps=1)
    with pytest.raises(ValueError, match="run directory to trace into, a plan to apply"):
        GradstatsCallback()
    with pytest.raises(ValueError, match="unknown option.*'evry'"):
        GradstatsCallback(tmp_path / "r", evry=2)


def test_bert_and_vit_have_every_projection_planned_and_the_rest_explained():
    from transformers import BertConfig, BertForMaskedLM, ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16))
    vit = ViTForImageClassification(ViTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                              intermediate_size=64, image_size=16, patch_size=4, num_labels=3))
    for model, head in ((bert, "cls.predictions.decoder"), (vit, "classifier")):
        plan = gradstats.Plan.uniform(format="e4m3fn")
        linear = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        assert sorted(plan.resolve(model)) == sorted(n for n in linear if n != head)
        why = plan.unplanned(model)
        assert why[head].startswith("the output layer")
        assert all(w.startswith(("an embedding", "a normalisation", "the output layer", "not a matmul layer type"))
                   for w in why.values())
