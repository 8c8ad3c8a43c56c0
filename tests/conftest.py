"""Pytest configuration shared by the test modules: marker registration (deselect a group with `-m "not NAME"`)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "frameworks: runs real training frameworks (Lightning, Accelerate, torchrun, HF datasets); "
        "deselect with -m 'not frameworks'",
    )
    config.addinivalue_line("markers", "ray: needs Ray Data (fastload[ray]); starts local Ray clusters")
    config.addinivalue_line("markers", "nginx: serves a dataset over HTTP with a local nginx (skips without it)")
    config.addinivalue_line(
        "markers",
        "migrate: converts files written by other loaders' own writers (webdataset, tfrecord, "
        "mosaicml-streaming, litdata.optimize: fastload[migrate-test] and the Makefile)",
    )
    config.addinivalue_line("markers", "examples: runs the scripts in examples/ (torchrun on CPU included)")
