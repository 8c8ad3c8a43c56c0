"""Pytest markers of the suite (deselect a group with `-m "not NAME"`)."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: needs Ray Data (fastload[ray]); starts local Ray clusters")
