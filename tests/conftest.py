"""pytest configuration shared by the test modules: marker registration."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "frameworks: runs real training frameworks (Lightning, Accelerate, torchrun, HF datasets); "
        "deselect with -m 'not frameworks'",
    )
