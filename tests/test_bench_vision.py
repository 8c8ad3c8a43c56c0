"""`bench.vision` runs its peer and restart-index rows on a handful of images (a smoke test: the
rows build and produce images; no timing is checked)."""

from __future__ import annotations

import re

import pytest

from fastload.vision import dali_available

pytest.importorskip("simplejpeg")


def test_peer_and_restart_rows_run(capsys) -> None:
    from bench.vision import main

    main(["--quick", "--images", "8", "--batch-size", "4", "--rounds", "1", "--set", "400x300",
          "--rows", "peer", "--rows", "restart index"])
    out = capsys.readouterr().out
    rows = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^(\S.*?)\s{2,}(\d+) \(", out, re.M)}
    expected = ["peer: torchvision-style PIL eval uint8 NHWC", "peer: torchvision-style PIL train uint8 NHWC",
                "cpu preset train RRC+flip uint8 NHWC, restart index",
                "cpu preset train RRC+flip uint8 NHWC, restart index, 1 thread"]
    if dali_available():
        expected += ["peer: DALI CPU pipeline eval uint8 NHWC", "peer: DALI CPU pipeline train uint8 NHWC"]
    for label in expected:
        assert rows.get(label, 0) > 0, f"{label!r} missing from:\n{out}"
