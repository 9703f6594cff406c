"""Progress bars are drawn on a terminal only (gradstats._progress): a log written to a file or a
pipe holds no bar redraws, and each long stage says once what it does through logging instead."""
from __future__ import annotations

import io
import logging
import re

import pytest

import gradstats
from gradstats._progress import ENV, progress_bar, show_progress

SAMPLE = gradstats.zoo.data.data_dir() / "sample-run"

#: what tqdm writes when it draws or redraws a bar: a carriage return, or "NN%|" of the bar itself
BAR = re.compile(r"\r|\d+%\|")


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def test_a_bar_is_drawn_on_a_terminal_only():
    assert show_progress(True, _Terminal()) and not show_progress(True, io.StringIO())
    assert not show_progress(False, _Terminal())                  # progress=False: never
    out = _Terminal()
    bar = progress_bar(total=3, desc="count", unit="step", file=out)
    for _ in range(3):
        bar.update()
    bar.close()
    assert bar.shown and "count:" in out.getvalue() and "0/3" in out.getvalue()


def test_the_environment_overrides_the_stream(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert show_progress(True, io.StringIO()) and not show_progress(False, io.StringIO())
    monkeypatch.setenv(ENV, "0")
    assert not show_progress(True, _Terminal())
    monkeypatch.setenv(ENV, "auto")
    assert show_progress(True, _Terminal()) and not show_progress(True, io.StringIO())


def test_a_hidden_bar_says_once_what_it_does(caplog):
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="gradstats"):
        bar = progress_bar(total=4, desc="analyse", unit="stage", file=out, note="analysing 3 layers")
        bar.stage("fitting")
        bar.set_postfix(loss=1.0)
        bar.update(4)
        bar.close()
    assert out.getvalue() == "" and not bar.shown
    assert [r.getMessage() for r in caplog.records] == ["analysing 3 layers", "analyse: fitting"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_the_default_note_counts_the_units(caplog):
    with caplog.at_level(logging.INFO, logger="gradstats"):
        assert list(progress_bar(["a", "b"], desc="figures", unit="figure", file=io.StringIO())) == ["a", "b"]
    assert caplog.messages == ["figures: 2 figures"]


def test_training_and_analysis_write_no_bar_to_a_file(capsys, caplog, tmp_path):
    """The bars of training, fitting, the analysis and the figures, with progress asked for,
    on the non-terminal streams that pytest captures: no redraw, one INFO line each."""
    from gradstats.figures import write_figures
    from gradstats.fitting import fit_run
    from gradstats.zoo.data import load_fashion_mnist
    from gradstats.zoo.models import build_model
    from gradstats.zoo.training import train

    with caplog.at_level(logging.INFO, logger="gradstats"):
        train(build_model("mlp", seed=0), load_fashion_mnist(source="subset", subset=256), steps=3,
              batch_size=32, progress=True)
        fit_run(SAMPLE, layers=["conv1"], steps=[196], progress=True)
        write_figures(SAMPLE, tmp_path, only=["moments"], progress=True)
    cap = capsys.readouterr()
    assert not BAR.search(cap.err) and not BAR.search(cap.out), cap.err
    notes = [m for m in caplog.messages if m.startswith(("training ", "fitting ", "drawing "))]
    assert len(notes) == 3, caplog.messages
    assert "training MLP for 3 steps" in notes[0] and "fitting 1 group(s)" in notes[1] and "1 figure" in notes[2]
