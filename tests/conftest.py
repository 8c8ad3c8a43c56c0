"""Pytest markers of the suite (deselect a group with `-m "not NAME"`)."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "examples: runs the scripts in examples/ (torchrun on CPU included)")
