"""The wheel holds every package: pyproject's explicit ``packages`` list names each folder of
flashcore/ and backends/ that has an ``__init__.py`` (an editable install finds a missing
one through the folders; a wheel then lacks it: the hopper kernels once did)."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    dirs = {name: ROOT / path for name, path in setup["package-dir"].items()}
    found = set()
    for top in ("flashcore", "flashcore.backends"):
        base = dirs[top]
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts or (top == "flashcore" and rel.parts[:1] == ("backends",)):
                continue
            found.add(".".join((top, *rel.parts)) if rel.parts else top)
    assert found - listed == set(), f"packages missing from pyproject.toml: {found - listed}"
    assert listed - found == set(), f"pyproject.toml lists packages with no folder: {listed - found}"
