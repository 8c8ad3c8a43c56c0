"""Every public class, function and method in fastload/ and formats/ has a docstring."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fastload", "formats")


def _public_defs(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    found: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            found.append((node.name, node))
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not member.name.startswith("_"):
                        found.append((f"{node.name}.{member.name}", member))
    return found


def test_every_public_name_has_a_docstring() -> None:
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if any(part.startswith("_") and part != "__init__.py" for part in path.relative_to(ROOT).parts):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for name, node in _public_defs(tree):
                if ast.get_docstring(node) is None:  # type: ignore[arg-type]
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")  # type: ignore[attr-defined]
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)
