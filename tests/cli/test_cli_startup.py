"""Start-up of the command line: building the parser, --help, --version and reading a run import no torch
(its import alone takes longer than the whole of these commands should)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RUN = ROOT / "data" / "sample-run"


def _heavy_after(argv: list[str]) -> tuple[int, str, dict[str, bool]]:
    """Run ``gradstats ARGV`` in a fresh interpreter; its exit status, its output and which heavy
    modules it had imported when it returned."""
    code = ("import sys\n"
            "from gradstats.cli import main\n"
            "try:\n"
            f"    rc = main({argv!r})\n"
            "except SystemExit as e:\n"
            "    rc = e.code\n"
            "print('HEAVY', {m: m in sys.modules for m in ('torch', 'scipy', 'matplotlib')})\n"
            "print('RC', rc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    heavy = eval(next(line for line in lines if line.startswith("HEAVY "))[6:])
    rc = int(next(line for line in lines if line.startswith("RC "))[3:] or 0)
    return rc, res.stdout, heavy


@pytest.mark.parametrize("argv", [["--help"], ["--version"], [], ["info", "--help"],
                                  ["figures", "--help"], ["what-if", "--help"], ["recommend", "--help"]])
def test_parser_and_help_import_no_torch(argv):
    rc, out, heavy = _heavy_after(argv)
    assert rc in (0, 2)
    assert not any(heavy.values()), f"gradstats {' '.join(argv)} imported {heavy}"
    if argv == ["--help"]:
        for cmd in ("demo", "trace", "info", "fit", "what-if", "report"):
            assert cmd in out


def test_help_of_a_command_still_lists_its_choices():
    _, out, _ = _heavy_after(["trace", "--help"])
    assert "cnn" in out and "mlp" in out and "resnet20" in out         # the built-in models, named
    _, out, _ = _heavy_after(["figures", "--help"])
    assert "qq" in out and "moments" in out                                # the figures, named


def test_bad_choice_is_refused_with_the_choices_named(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gradstats", "trace", "--model", "nope", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2
    assert "invalid choice: 'nope'" in res.stderr and "'cnn'" in res.stderr


def test_info_on_the_sample_run_imports_no_torch():
    rc, out, heavy = _heavy_after(["info", str(SAMPLE_RUN)])
    assert rc == 0
    assert "fc1" in out and "std_log2" in out and "MB on disk" in out
    assert not heavy["torch"], "gradstats info imported torch"
