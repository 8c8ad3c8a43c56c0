"""What an image preset reports: its configuration (`describe`) and its counters (`stats`).

`PresetCounters` is the one ledger of a preset's work, shared by the threads that run its
batches (one lock): images, skipped samples, batches, seconds and images per decode mode.
`describe(preset)` / `stats(preset)` read the preset's public settings and its counters.
"""

from __future__ import annotations

import threading
from typing import Any

from fastload.vision import cpu_decode

__all__ = ["PresetCounters", "describe", "stats"]


class PresetCounters:
    """Images, skipped samples, batches, seconds and images per decode mode; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {"images": 0, "skipped": 0, "batches": 0, "seconds": 0.0}
        self._modes: dict[str, int] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add_batch(self, *, images: int, skipped: int, seconds: float) -> None:
        """One batch done: `images` returned, `skipped` dropped, in `seconds`."""
        with self._lock:
            t = self._totals
            t["images"] += images
            t["skipped"] += skipped
            t["batches"] += 1
            t["seconds"] += seconds

    def add_modes(self, modes: dict[str, int]) -> None:
        """Images per decode mode of one batch (`cpu_batch.MODES`)."""
        with self._lock:
            for mode, count in modes.items():
                self._modes[mode] = self._modes.get(mode, 0) + count

    def snapshot(self) -> tuple[dict[str, Any], dict[str, int]]:
        """(totals, images per decode mode), copied."""
        with self._lock:
            return dict(self._totals), dict(self._modes)


def threads_rule(preset: Any) -> str:
    """Why the preset decodes a batch on `preset.threads` threads."""
    if preset.threads_requested is not None:
        return "threads="
    if preset.loader_workers is not None:
        return f"Loader num_workers={preset.loader_workers}: each batch on the worker that fetches it"
    return "usable cores"


def _decoder(backend: str) -> str:
    if backend == "dali-mixed":
        return "DALI decoders.image_slice, mixed (nvJPEG ROI decode)"
    if backend == "dali-cpu":
        return "DALI decoders.image_slice, cpu (libjpeg-turbo ROI decode)"
    if cpu_decode.decode_windows is not None:
        return "libjpeg-turbo window decode (fastload.vision._jpegwin)"
    return "simplejpeg / Pillow whole-image decode"


def _decode_modes(preset: Any) -> list[str]:
    """The decode modes this configuration can take for a JPEG (CPU backend)."""
    win = "window" if cpu_decode.decode_windows is not None else "whole image"
    if preset.backend != "cpu":
        return ["window (ROI)"]
    if preset.dct_downscale and preset.resize is not None:
        return [win] + [f"{win} {f}" for f in ("1/2", "1/4", "1/8")]
    return [win]


def _restart_path(preset: Any) -> str | None:
    """How the window decoder uses a JPEG's restart index; None where no window decoder runs."""
    if preset.backend != "cpu" or cpu_decode.decode_windows is None:
        return None
    return (
        "a JPEG with a restart index (fastload convert's default) is decoded from the restart intervals its "
        "window covers only: no MCU row above or below it, no column group beside it (an index of one interval "
        "per MCU row: rows only); one without, from its first row down to the window's last"
    )


def _output_memory(preset: Any) -> str | None:
    """Where the CPU stage's returned batches live; None where no CPU stage returns them."""
    if preset.backend != "cpu":
        return None
    if preset.device.type != "cpu":
        return "a fresh page-locked uint8 block per batch, copied to the device without waiting"
    return "blocks reused once the caller has dropped every reference to an earlier batch, else fresh ones"


def _crop(preset: Any) -> dict[str, Any]:
    """The crop / flip parameters of the preset's kind."""
    if preset.kind == "train":
        return {"scale": tuple(preset.scale), "ratio": tuple(preset.ratio), "flip_p": preset.flip_p}
    return {"crop_fraction": preset.crop_fraction if preset.resize is not None else None, "flip_p": preset.flip_p}


def _seed_rule(preset: Any) -> str:
    if preset.seed is not None:
        return f"seed={preset.seed}"
    return "the Loader's run seed" if preset.run is not None else "0 (no Loader bound)"


def describe(preset: Any) -> dict[str, Any]:
    """The preset's configuration: what runs, where, with how many threads, the crop settings,
    which decode modes, and the restart path (`_restart_path`)."""
    return {
        "stage": "ImagePreset",
        "kind": preset.kind,
        "size": preset.out_hw,
        "resize": preset.resize,
        "crop": _crop(preset),
        "seed": _seed_rule(preset),
        "backend": preset.backend,
        "decoder": _decoder(preset.backend),
        "decode_modes": _decode_modes(preset),
        "dct_downscale": preset.dct_downscale,
        "restart_path": _restart_path(preset),
        "on_error": preset.on_error,
        "threads": preset.threads,
        "threads_rule": threads_rule(preset),
        "output": {
            "dtype": str(preset.dtype).replace("torch.", ""),
            "layout": preset.layout,
            "normalized": preset.normalize_output,
            "device": str(preset.device),
            "memory": _output_memory(preset),
        },
    }


def stats(preset: Any) -> dict[str, Any]:
    """The preset's counters for `loader.stats()`, with its backend and threads."""
    s, modes = preset.counters.snapshot()
    return {
        "vision_backend": preset.backend,
        "vision_threads": preset.threads,
        "vision_threads_rule": threads_rule(preset),
        "vision_window_decode": cpu_decode.decode_windows is not None,
        "vision_decode_modes": modes,
        "vision_images": s["images"],
        "vision_skipped": s["skipped"],
        "vision_batches": s["batches"],
        "vision_seconds": s["seconds"],
        "vision_images_per_s": s["images"] / s["seconds"] if s["seconds"] > 0 else 0.0,
    }
