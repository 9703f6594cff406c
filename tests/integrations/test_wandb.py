"""W&B: a run's statistics logged after the fact and live, with W&B in offline mode (nothing leaves
the machine); what reaches ``run.log`` is captured and compared with the run."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import struct

import pytest
import torch

wandb = pytest.importorskip("wandb")
import gradstats  # noqa: E402
from gradstats.integrations.wandb import WandbSink, log_run, step_payloads  # noqa: E402
from gradstats.stats import lognormal_moments  # noqa: E402


@pytest.fixture()
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()                    # settings are read again from the environment at the next init
    yield tmp_path
    wandb.teardown()


def _capture(wr):
    logged: list[tuple[int, dict]] = []
    real = wr.log

    def log(payload, step=None, **kw):
        assert step is None                             # W&B's own step is the run's, never gradstats'
        logged.append((payload["gradstats/step"], dict(payload)))
        return real(payload, **kw)

    wr.log = log
    return logged


def _train(path, steps=3, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    with gradstats.trace(model, path, flush_secs=0, **kw) as t:
        for i in range(steps):
            model(torch.randn(16, 8, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            t.step()
    return gradstats.open_run(path)


def test_log_run_offline(offline):
    run = _train(offline / "run")
    wr = wandb.init(project="gradstats-test", mode="offline", dir=str(offline))
    logged = _capture(wr)
    log_run(run, wandb_run=wr, formats="e4m3fn")
    wr.finish()
    assert [s for s, _ in logged] == run.steps
    step1 = dict(logged)[1]
    st = run.stats(kinds=["grad"])
    mu, _ = lognormal_moments(st[(st.layer == "0") & (st.step == 1)].iloc[0])
    assert math.isclose(step1["gradstats/0/mean_log2"], mu / math.log(2), rel_tol=1e-6)
    w = gradstats.what_if(run, "e4m3fn", steps=[1]).set_index("layer")
    assert math.isclose(step1["gradstats/2/underflow/e4m3fn"], w.loc["2", "underflow"], rel_tol=1e-6, abs_tol=1e-9)
    assert isinstance(step1["gradstats/0/log2_abs"], wandb.Histogram)
    assert list((offline / "wandb").glob("offline-run-*/run-*.wandb"))      # written to disk, offline


def test_the_live_sink_logs_every_step_into_the_active_run(offline):
    wr = wandb.init(project="gradstats-test", mode="offline", dir=str(offline))
    logged = _capture(wr)
    run = _train(offline / "run", steps=4, sinks=[WandbSink(formats=["e2m1fn"], histograms=False)])
    wr.finish()
    assert [s for s, _ in logged] == run.steps == [0, 1, 2, 3]
    assert {"gradstats/0/amax", "gradstats/2/overflow/e2m1fn"} <= set(logged[0][1])


def test_without_an_active_run_the_sink_warns_and_logs_the_steps_once_it_can(offline, caplog):
    st = _train(offline / "run", steps=3).stats()
    sink = WandbSink(histograms=False)
    with caplog.at_level(logging.WARNING, logger="gradstats.integrations.wandb"):
        sink.write(st[st.step < 2])
        sink.write(st[st.step < 2])                   # once, not per call
    assert [r.getMessage() for r in caplog.records if "no active W&B run" in r.getMessage()] and \
        sum("WandbSink cannot log" in r.getMessage() for r in caplog.records) == 1
    wr = wandb.init(project="gradstats-test")
    sink.write(st[st.step == 2])
    sink.close()
    wr.finish()
    rows, _ = _history(offline)
    assert sorted(_gradstats_rows(rows)) == [0, 1, 2]                       # nothing was dropped
    with pytest.raises(ValueError, match="max_pending"):
        WandbSink(max_pending=-1)


def test_what_is_never_logged_is_counted_when_the_sink_closes(offline, caplog):
    sink = WandbSink(histograms=False, max_pending=1)
    with caplog.at_level(logging.WARNING, logger="gradstats.integrations.wandb"):
        sink.write(_train(offline / "run", steps=3).stats())
        sink.close()
    assert any("3 step(s) of statistics were not logged to W&B" in r.getMessage() for r in caplog.records)


# -- the run's history as W&B recorded it: read back from the offline run's .wandb file ---------------

def _records(path):
    """The records of a ``.wandb`` file (wandb's protobuf ``Record``s in its LevelDB-log framing:
    a 7-byte header, then 32 KiB blocks of chunks, each ``crc32c, length, type`` then the bytes;
    types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"not a .wandb file: {data[:7]!r}"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                                    # the block's tail is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def _history(root):
    """``(rows, metrics)`` of the one offline run under ``root``: each history row as ``{key: value}``,
    and the metric definitions ``{name or glob: step_metric}``."""
    wandb.teardown()                    # finish() may return before the service has written the file out
    files = list(root.glob("**/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    rows, metrics = [], {}
    for r in _records(files[0]):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif r.WhichOneof("record_type") == "metric":
            metrics[r.metric.name or r.metric.glob_name] = r.metric.step_metric
    return rows, metrics


def _gradstats_rows(rows):
    """``{gradstats step: row}``; each step exactly once."""
    out = {}
    for row in rows:
        if "gradstats/step" in row:
            assert row["gradstats/step"] not in out, f"step {row['gradstats/step']} logged twice"
            out[row["gradstats/step"]] = row
    return out


def _check_every_row(rows, metrics, run):
    got = _gradstats_rows(rows)
    assert sorted(got) == run.steps
    expected = step_payloads(run.stats(kinds=["grad"]), histograms=False)
    for step, payload in expected.items():
        assert set(payload) <= set(got[step])
        for k, v in payload.items():
            assert math.isclose(got[step][k], v, rel_tol=1e-6, abs_tol=1e-12), (step, k)
    assert all(k.startswith("gradstats/") for k in expected[0])            # one section
    assert metrics.get("gradstats/*") == "gradstats/step"                   # its own step axis


def test_beside_the_users_own_wandb_log_no_row_is_lost(offline):
    """A plain loop that logs its loss with wandb.log each step, the sink logging from the tracer's
    writer thread: every one of the 30 gradstats steps is in the run's history, and every loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wr = wandb.init(project="gradstats-test")
    with gradstats.trace(model, offline / "run", optimizer=opt, flush_secs=0, sinks=[WandbSink()]):
        for i in range(30):
            opt.zero_grad()
            loss = model(torch.randn(16, 8, generator=torch.Generator().manual_seed(i))).square().mean()
            loss.backward()
            opt.step()
            wandb.log({"loss": loss.item()})
    wr.finish()
    run = gradstats.open_run(offline / "run")
    assert run.steps == list(range(30))
    rows, metrics = _history(offline)
    _check_every_row(rows, metrics, run)
    assert sum("loss" in r for r in rows) == 30
    assert all("_step" in r for r in rows)
    row = _gradstats_rows(rows)[7]                       # W&B stores a histogram as nested keys
    assert row["gradstats/0/log2_abs/_type"] == "histogram" and sum(row["gradstats/0/log2_abs/values"]) > 0


def test_beside_hugging_faces_own_wandb_reporting_no_row_is_lost(offline):
    """Trainer(report_to=["wandb"], logging_steps=1) logs its loss each step into the same run:
    every gradstats step is there too, under gradstats/ with its own step."""
    transformers = pytest.importorskip("transformers")
    from gradstats.integrations.huggingface import GradstatsCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0))
    data = [{"input_ids": torch.arange(i, i + 8) % 32, "labels": torch.arange(i, i + 8) % 32} for i in range(64)]
    args = transformers.TrainingArguments(str(offline / "out"), max_steps=8, per_device_train_batch_size=4,
                                          report_to=["wandb"], logging_steps=1, use_cpu=True, disable_tqdm=True,
                                          save_strategy="no", seed=0)
    cb = GradstatsCallback(offline / "run", sinks=[WandbSink(histograms=False)], flush_secs=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    wandb.finish()
    run = gradstats.open_run(offline / "run")
    assert run.steps == list(range(8))
    rows, metrics = _history(offline)
    _check_every_row(rows, metrics, run)
    assert sum("train/loss" in r for r in rows) == 8                      # and Hugging Face's rows all there
    assert metrics.get("*") == "train/global_step"
