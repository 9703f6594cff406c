"""An installed wheel works outside the repository: it carries the committed data (the
Fashion-MNIST and Shakespeare subsets, the digits, the sample run), so the demo, the notebooks and
the Quickstart find what they need. The wheel is built from this checkout and installed into a
directory of its own, used from a working directory outside the repository."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The directory the wheel was installed into (``pip install --target``)."""
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(base / "dist"), str(ROOT)], check=True, capture_output=True)
    wheels = list((base / "dist").glob("gradstats-*.whl"))
    assert len(wheels) == 1
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(base / "site"), str(wheels[0])], check=True, capture_output=True)
    return base / "site"


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRADSTATS_DATA"}
    env["PYTHONPATH"] = str(site)          # ahead of the checkout's editable install
    return env


def _python(site: Path, code: str, cwd: Path, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(site), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_installed_package_carries_its_data(installed, tmp_path):
    out = _python(installed, """
import gradstats, gradstats.zoo.data as d
from pathlib import Path
print(Path(gradstats.__file__).parent)
print(d.data_dir())
print(len(d.load_fashion_mnist(split="train", source="subset")))
print(len(d.load_shakespeare().text))
print(gradstats.open_run(d.data_dir() / "sample-run").steps[-1])      # the committed run: 50 steps to 196
""", tmp_path).split()
    assert out[0] == str(installed / "gradstats") and out[1] == str(installed / "gradstats" / "_data")
    assert out[2:] == ["6000", "1036491", "196"]       # data/README.md: 8 plays, 1,036,491 characters


def test_the_installed_demo_runs_on_the_committed_subset(installed, tmp_path):
    out = _python(installed, "from gradstats.cli import main; import sys; sys.exit(main(['demo', '--data', 'subset', "
                  "'--steps', '12', '--subset', '512', '--test-subset', '200']))", tmp_path)
    assert "report.md" in out
    assert (tmp_path / "demo-out" / "report.md").is_file()


# about a minute for the three: the notebooks' code is run from the checkout by test_notebooks.py, and
# what the wheel changes (where the data is) is checked above; this is the end-to-end run
@pytest.mark.slow
@pytest.mark.parametrize("name", ["01_explore_a_run", "02_study_figures", "03_export_a_plan"])
def test_the_notebooks_run_against_the_installed_package(installed, tmp_path, monkeypatch, name):
    import nbformat
    from nbclient import NotebookClient

    shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", tmp_path)
    for k, v in _env(installed).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GRADSTATS_DATA", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(tmp_path / f"{name}.ipynb", as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import gradstats; print(gradstats.__file__)"))
    NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=False,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert str(installed) in nb.cells[0].outputs[0]["text"]
