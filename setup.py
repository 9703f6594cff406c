"""Build hook: the wheel carries the committed data (``data/``: the Fashion-MNIST and Shakespeare
subsets, the digits and the sample run, about 6 MB) as ``gradstats/_data``, so that an installed
gradstats runs its demo, notebooks and Quickstart outside the repository. Everything else is in
pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA = Path(__file__).resolve().parent / "data"


class BuildWithData(build_py):
    def run(self) -> None:
        super().run()
        if DATA.is_dir() and not self.editable_mode:     # an editable install reads data/ in place
            target = Path(self.build_lib) / "gradstats" / "_data"
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(DATA, target, ignore=shutil.ignore_patterns("__pycache__", ".*"))


setup(cmdclass={"build_py": BuildWithData})
