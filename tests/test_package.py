"""The public names resolve, and importing gradstats stays light."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradstats


def test_every_public_name_resolves():
    for name in gradstats.__all__:
        assert getattr(gradstats, name) is not None, name


def test_stable_names_from_the_brief():
    for name in ("FPFormat", "quantize", "trace", "open_run", "fit", "pruning", "fpanalysis",
                 "recommend", "Plan", "apply"):
        assert name in gradstats.__all__
    assert callable(gradstats.quantize) and callable(gradstats.apply) and callable(gradstats.recommend)


def test_import_is_lazy():
    code = "import sys, gradstats; print('torch' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gradstats.nope  # noqa: B018


# ------------------------------------------------------------------- installs: pins and environments
ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    """A package name as registries compare them (PEP 503: case and ``-_.`` runs do not matter)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, req
    return _norm(m.group(1))


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment_yml() -> dict:
    """channels, conda dependencies and pip entries of environment.yml (a line parse of its simple form)."""
    out: dict = {"channels": [], "conda": [], "pip": []}
    section = None
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split(" #")[0].rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        text = line.strip()
        if indent == 0:
            section = text.rstrip(":") if text.endswith(":") else None
            continue
        assert text.startswith("- "), f"environment.yml: unexpected line {raw!r}"
        item = text[2:].strip()
        if section == "channels":
            out["channels"].append(item)
        elif section == "dependencies":
            if item == "pip:":
                section = "pip"
            else:
                out["conda"].append(item)
        elif section == "pip":
            if indent <= 2:  # back at the level of the conda dependencies
                section = "dependencies"
                out["conda"].append(item)
            else:
                out["pip"].append(item)
    return out


def test_environment_yml_is_conda_forge_only_and_covers_the_dependencies():
    env = _environment_yml()
    assert env["channels"] == ["conda-forge"]
    names = {_req_name(d) for d in env["conda"]}
    assert "cpuonly" not in names and "pytorch" not in env["channels"]
    assert not any("triton" in p for p in env["pip"]), "no pip-installed triton in a CPU environment"
    assert env["pip"] == ["-e ."], "pip installs gradstats only (no extras: they would pull packages from pip)"
    project = _pyproject()["project"]
    conda_for = {"torch": ("pytorch", "pytorch-cpu")}
    for req in project["dependencies"]:
        n = _req_name(req)
        assert set(conda_for.get(n, (n,))) & names, f"environment.yml lacks {req!r} (runtime dependency)"
    for req in project["optional-dependencies"]["dev"]:
        n = _req_name(req)
        # left out on purpose: conda-forge builds triton for CUDA; nvdlfw-inspect is on PyPI only
        if n not in ("triton", "nvdlfw-inspect"):
            assert n in names, f"environment.yml lacks {req!r} (dev extra)"


def _constraints() -> list[tuple[str, str]]:
    pins = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!_-]*)", line.strip())
        assert m, f"constraints.txt: not an exact pin 'name==version': {line!r}"
        pins.append((_norm(m.group(1)), m.group(2)))
    return pins


def test_constraints_pin_every_dependency_once():
    pins = _constraints()
    names = [n for n, _ in pins]
    assert len(names) == len(set(names)), f"duplicates: {sorted(n for n in set(names) if names.count(n) > 1)}"
    assert "torch" not in names and "gradstats" not in names and "pip" not in names
    project = _pyproject()["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    for req in wanted:
        n = _req_name(req)
        if n != "torch":  # torch==2.13.0 comes from the Makefile, installed first
            assert n in names, f"constraints.txt does not pin {req!r}"
    head = (ROOT / "constraints.txt").read_text().splitlines()[0]
    assert head.startswith("#")


def _make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """The Makefile's rules: target -> (prerequisites, recipe lines)."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    target = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("\t") and target:
            rules[target][1].append(line.strip())
        elif re.match(r"^[$()A-Za-z0-9_.-]+:(?!=)", line):
            target, deps = line.split(":", 1)
            rules[target] = (deps.split(), [])
        elif not line.startswith("\t"):
            target = None
    return rules


def test_makefile_installs_through_the_constraints():
    rules = _make_rules()
    deps, recipe = rules["$(STAMP)"]
    assert "constraints.txt" in deps and "pyproject.toml" in deps
    installs = [r for r in recipe + rules["$(RUNTIME)"][1] if "pip install" in r and "--upgrade pip" not in r]
    assert any("-e '.[dev]'" in r for r in installs)
    for r in installs:
        assert "-c constraints.txt" in r, r
    latest = [r for r in rules["test-latest"][1] if "pip install" in r and "--upgrade pip" not in r]
    assert latest and not any("-c " in r or "constraint" in r for r in latest)
    assert "$(PYTEST_DEFAULT)" in rules["test"][1][0] and "$(PYTEST_DEFAULT)" in rules["test-latest"][1][-1]
    assert "constraints" in rules
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M) and "test-latest" not in ci
    assert ".venv-latest" in (ROOT / ".gitignore").read_text()


def test_make_demo_installs_the_runtime_only_and_make_test_adds_dev():
    rules = _make_rules()
    assert rules["demo"][0] == ["$(RUNTIME)"]                 # not the dev extra (~3 GB more)
    deps, recipe = rules["$(RUNTIME)"]
    assert "constraints.txt" in deps and "pyproject.toml" in deps
    installs = [r for r in recipe if "pip install" in r and "--upgrade pip" not in r]
    assert "$(TORCH)" in installs[0]                          # torch==2.13.0 first
    assert installs[-1].endswith("-e .") and not any("[" in r for r in installs)
    assert "$(RUNTIME)" in rules["$(STAMP)"][0]               # dev goes on top, into the same venv
    assert rules["venv"][0] == ["$(STAMP)"] and "venv" in rules["test"][0]
