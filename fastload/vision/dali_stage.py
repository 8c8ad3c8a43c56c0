"""`DaliStage`: the image preset's DALI backend, one batch at a time (`dali_pipeline` runs it).

Builds its `DaliRunner` on first use. A batch DALI rejects is decoded image by image with the
CPU decoder to find the culprits; they are reported, and the rest retried without them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastload.vision.cpu_decode import decode_rgb
from fastload.vision.dali_pipeline import DaliRunner

__all__ = ["DaliStage"]


class DaliStage:
    """DALI's mixed (nvJPEG ROI) or CPU pipeline for a preset's settings (`runner_kw`)."""

    def __init__(self, *, mixed: bool, device: torch.device, **runner_kw: Any) -> None:
        self.mixed, self.device, self.runner_kw = mixed, device, runner_kw
        self._runner: DaliRunner | None = None

    def runner(self, threads: int) -> DaliRunner:
        """The pipeline runner, built on first use with `threads` CPU threads."""
        if self._runner is None:
            self._runner = DaliRunner(
                mode="mixed" if self.mixed else "cpu",
                threads=threads,
                device_id=(self.device.index or 0) if self.mixed else None,
                **self.runner_kw,
            )
        return self._runner

    def empty(self) -> torch.Tensor:
        """A batch of no images, in the output's shape, dtype and device."""
        oh, ow = self.runner_kw["out_hw"]
        shape = (0, 3, oh, ow) if self.runner_kw["layout"] == "NCHW" else (0, oh, ow, 3)
        return torch.empty(shape, dtype=self.runner_kw["dtype"], device=self.device)

    def run(
        self,
        arrays: list[np.ndarray],
        windows: np.ndarray,
        flips: np.ndarray,
        *,
        skip: set[int],
        raise_errors: bool,
        threads: int,
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """Images (but `skip`) -> (output, {position: error}); with `raise_errors` the output of a
        batch with failures is not made (the caller raises)."""
        good = [i for i in range(len(arrays)) if i not in skip]
        failed: dict[int, str] = {}
        if not good:
            return self.empty(), failed
        try:
            return self.runner(threads).run([arrays[i] for i in good], windows[good], flips[good]), failed
        except RuntimeError as e:
            dali_error = e
        for i in good:  # find the culprit(s) with the CPU decoder, then retry without them
            try:
                decode_rgb(arrays[i])
            except (ValueError, OSError) as e:
                failed[i] = f"{type(e).__name__}: {e}"
        if not failed:
            raise RuntimeError(
                f"DALI failed on a batch whose images all decode on the CPU: {dali_error}"
            ) from dali_error
        good = [i for i in good if i not in failed]
        if raise_errors or not good:
            return self.empty(), failed
        return self.runner(threads).run([arrays[i] for i in good], windows[good], flips[good]), failed
