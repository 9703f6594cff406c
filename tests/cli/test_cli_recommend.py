"""``gradstats recommend``: the library's plan and its replay table; the check table and its messages."""
from __future__ import annotations

import re

import pytest
import torch

import gradstats
from gradstats.cli import main
from gradstats.plan.checks import format_checks

LONG = "gpt_neox.layers.0.attention.query_key_value"          # a Hugging Face name, 43 characters


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = torch.nn.Linear(12, 48)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()
        self.dense = torch.nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(torch.tanh(self.attention.query_key_value(x)))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt_neox = torch.nn.Module()
        self.gpt_neox.layers = torch.nn.ModuleList([_Layer()])
        self.head = torch.nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.gpt_neox.layers[0](x)))


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("runs") / "long-names"
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstats.trace(model, path, sample_every=2) as tracer:     # samples at steps 0, 2, 4
        for _ in range(6):
            x, y = torch.randn(96, 12), torch.randint(0, 5, (96,))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tracer.step()
    return path


def _same_plan(cli: gradstats.Plan, lib: gradstats.Plan, run) -> None:
    assert cli.resolve(run) == lib.resolve(run)                       # the rules per layer, predictions too
    a, b = cli.to_dict(), lib.to_dict()
    for d in (a, b):
        d["provenance"].pop("created")
    assert a == b


def _check_lines(text: str) -> list[str]:
    return text[text.index("checked on calibration steps"):].splitlines()[1:]


@pytest.mark.parametrize("options, kwargs", [
    ([], {}),
    (["--bits", "6", "--sparsity", "0.5", "--all-layers"], {"bits": 6, "sparsity": 0.5, "output_layer": False}),
    (["--step", "last"], {"steps": "latest"}),
])
def test_recommend_command_makes_the_library_plan_and_prints_its_replay(run_path, tmp_path, capsys, options, kwargs):
    out = tmp_path / "plan.json"
    assert main(["recommend", str(run_path), *options, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    run = gradstats.open_run(run_path)
    lib = gradstats.recommend(run_path, **kwargs)
    _same_plan(gradstats.Plan.load(out), lib, run)
    assert LONG in lib.resolve(run)
    table = _check_lines(text)
    assert LONG in table                                            # the full name, on a line of its own
    if "steps" not in kwargs:                                       # calibrated where the samples are
        assert f"checked on calibration steps {lib.checks[0]['calibration_steps']}" in text
        assert lib.checks[0]["calibration_steps"] == [0, 2, 4]
        rows = [line for line in table if re.search(r"  (ok|FAILS)$", line)]
        assert len(rows) == len(lib.checks)
        replays = re.findall(r"\S+ / (\S+)", "\n".join(rows))
        assert replays and all(re.fullmatch(r"[+-]?[0-9.e+-]+", v) for v in replays), replays
        assert text.count(format_checks(lib.checks)) == 1           # the library's table, as it is


def test_recommend_command_defaults_are_the_librarys():
    import inspect

    from gradstats.cli import recommend as cli_recommend
    from gradstats.cli.recommend import recommend_kwargs

    parser = __import__("argparse").ArgumentParser()
    cli_recommend.register(parser.add_subparsers())
    args = parser.parse_args(["recommend", "RUN"])
    assert args.bits == [8] == [inspect.signature(gradstats.recommend).parameters["bits"].default]
    sig = inspect.signature(gradstats.recommend).parameters
    for name, value in recommend_kwargs(args).items():
        assert value == sig[name].default, name
    assert "steps" not in recommend_kwargs(args)                     # the library's calibration steps


def test_format_checks_never_cuts_a_layer_name():
    rec = {"predicted_sparsity": 0.5, "replayed_sparsity": 0.499, "predicted_flushed": 0.0, "replayed_flushed": 0.0,
           "predicted_overflow": 0.0, "replayed_overflow": 0.0, "predicted_gain": 1.0, "replayed_gain": 0.998,
           "predicted_bias": -0.001, "replayed_bias": 0.002, "predicted_error": 4.1e-4, "replayed_error": 4.3e-4,
           "ok": True, "problems": ""}
    names = [LONG, LONG.replace("query_key_value", "dense"), "model.embed_out.a.very.long.path." * 4 + "linear"]
    text = format_checks([{**rec, "layer": n} for n in names])
    lines = text.splitlines()
    for n in names:
        assert n in lines                                           # whole, on a line of its own
    assert all(len(line) <= 120 for line in lines if line not in names)
    short = format_checks([{**rec, "layer": "features.0"}, {**rec, "layer": "classifier"}])
    assert re.search(r"^features\.0 +0\.500 / 0\.499 .* ok$", short, re.M), short   # short names stay in their row
    failing = format_checks([{**rec, "layer": LONG, "ok": False, "problems": "step 4: replayed: magnitude bias "
                              + "-0.050 (bound 0.01); " * 12}])
    assert LONG in failing.splitlines() and all(len(line) <= 120 for line in failing.splitlines())


_QUOTED = {"overflow": (r"clips ([0-9.]+)% of the values", 100.0, 2), "gain": (r"magnitude gain ([0-9.]+)", 1.0, 3),
           "bias": (r"magnitude bias ([+-][0-9.]+)", 1.0, 3),
           "flushed": (r"flushes ([0-9.]+)% of the non-zero values", 100.0, 2)}


def _quoted(message: str) -> list[tuple[str, str, float, int]]:
    """(side, quantity, value as a fraction, decimals) of each number a problem message quotes."""
    out = []
    for part in message.split("; "):
        side = re.search(r"(predicted|replayed): ", part)
        for q, (pat, unit, digits) in _QUOTED.items():
            m = re.search(pat, part)
            if side and m:
                out.append((side.group(1), q, float(m.group(1)) / unit, digits))
    return out


def test_check_messages_quote_the_numbers_of_their_own_row(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256))
    with gradstats.trace(m, tmp_path / "run", sample_every=1) as t:
        for i in range(4):                                          # gradients that grow: the steps differ
            (m(torch.randn(32, 64)) * 3.0 ** i).pow(3).sum().backward()
            t.step()
    plan = gradstats.Plan.uniform(format="e2m3fn", rounding="nearest", sparsity=0.85, scale="amax", scale_shift=1,
                                  output_layer=False)
    v = plan.verify(t.path)
    steps = v.to_dataframe().set_index("step")
    checked = 0
    for step, row in steps.iterrows():                              # a step's row: its own numbers
        for side, q, value, digits in _quoted(row["problems"]):
            unit = _QUOTED[q][1]
            assert round(row[f"{side}_{q}"] * unit, digits) == pytest.approx(value * unit), (step, q)
            checked += 1
    per = v.per_layer()
    assert not per.loc[0, "ok"] and checked
    message = per.loc[0, "problems"]
    named = re.match(r"step (\d+): ", message)                       # a layer's row holds means over steps:
    assert named, message                                           # its message names the step it quotes
    step_row = steps.loc[int(named.group(1))]
    for side, q, value, digits in _quoted(message):
        unit = _QUOTED[q][1]
        assert round(step_row[f"{side}_{q}"] * unit, digits) == pytest.approx(value * unit), q
    # and the table shows that message below the row of means, never as if it were the row's own
    table = v.table()
    assert message.split(";")[0] in " ".join(table.split())
