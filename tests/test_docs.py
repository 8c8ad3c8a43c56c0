"""The API reference: every public name of the documented modules has a docstring, and py.typed ships."""

from __future__ import annotations

import importlib
import inspect
import os
import re

import pytest

import fastload

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _documented_modules() -> list[str]:
    """Every `::: module.or.object` target in docs/api, reduced to its module."""
    names = set()
    for page in os.listdir(os.path.join(DOCS, "api")):
        with open(os.path.join(DOCS, "api", page)) as fh:
            for target in re.findall(r"^::: ([\w.]+)", fh.read(), flags=re.M):
                parts = target.split(".")
                for cut in range(len(parts), 0, -1):
                    try:
                        importlib.import_module(".".join(parts[:cut]))
                    except ImportError:
                        continue
                    names.add(".".join(parts[:cut]))
                    break
    return sorted(names)


MODULES = _documented_modules()


def test_every_api_page_names_objects():
    assert {"fastload.loader", "fastload.dataset", "fastload.formats", "fastload.order.bucketing",
            "fastload.fetch.text_collate", "fastload.vision", "fastload.cuda_ops", "fastload.benchmark",
            "fastload.remote.storage"} <= set(MODULES)


@pytest.mark.parametrize("module", ["fastload", *MODULES])
def test_public_names_have_docstrings(module):
    mod = importlib.import_module(module)
    assert inspect.getdoc(mod), f"{module} has no module docstring"
    missing = []
    for name in getattr(mod, "__all__", ()):
        obj = getattr(mod, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
            missing.append(name)
    assert not missing, f"{module}: public names without a docstring: {missing}"


def test_py_typed_ships():
    pkg = os.path.dirname(fastload.__file__)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    with open(os.path.join(os.path.dirname(pkg), "setup.py")) as fh:
        assert '"fastload": ["py.typed"]' in fh.read()
