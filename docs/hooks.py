"""mkdocs hook: a package tree the API reference is read from, laid out as installed.

`formats/` and `cuda_ops/` install as `fastload.formats` and `fastload.cuda_ops`
(setup.py's package_dir), which a static reader of the source tree cannot see. Before the build
this writes `build/docs-pkg/fastload/` with a symlink per entry of `fastload/` plus `formats`
and `cuda_ops`; mkdocs.yml points mkdocstrings at `build/docs-pkg`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.path.join(ROOT, "build", "docs-pkg")
MAPPED = {"formats": "formats", "cuda_ops": "cuda_ops"}  # name inside fastload -> directory in the repository


def on_startup(**kwargs: Any) -> None:
    pkg = os.path.join(TREE, "fastload")
    shutil.rmtree(TREE, ignore_errors=True)
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(ROOT, "fastload")):
        if name != "__pycache__":
            os.symlink(os.path.join(ROOT, "fastload", name), os.path.join(pkg, name))
    for name, src in MAPPED.items():
        os.symlink(os.path.join(ROOT, src), os.path.join(pkg, name))


if __name__ == "__main__":  # the Makefile's type check reads the same tree
    on_startup()
