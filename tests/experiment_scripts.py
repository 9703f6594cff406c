"""The scripts of experiments/ as modules, for the tests that run or inspect them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load_experiment(name: str) -> ModuleType:
    """``experiments/<name>.py`` imported as a module (its folder on ``sys.path`` for its own imports)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(f"exp_{name}", EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod              # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod
