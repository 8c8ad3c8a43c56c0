"""Hooks into training frameworks that drive a Loader, found duck-typed (no import of them).

Hugging Face Accelerate decides when an accumulated gradient step ends (`Accelerator.accumulate`,
`sync_with_dataloader`) from its `GradientState`: the dataloader registered there last says
`end_of_dataloader` when it yields its last batch, and `remainder` how many samples of the last
global batch are real (-1: unknown, `gather_for_metrics` then drops nothing). Accelerate's own
loaders register themselves; a Loader's iterator does the same, so an epoch's last, partial
accumulation window still steps the optimizer, as with a prepared torch DataLoader.

PyTorch Lightning restores a Loader's position (`load_state_dict`, called from its
`CombinedLoader`) and then counts the batches it restored as done: it stops the resumed epoch
after `len(loader) - done` more batches. A position re-dealt to a larger world size leaves more
batches than that, so `Loader.load_state_dict` refuses such a resume when Lightning is the caller
(`step_counting_caller`, `refuse_uncounted_resume`) instead of letting Lightning skip the rest.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["gradient_state", "refuse_uncounted_resume", "step_counting_caller"]

# modules whose code calls `load_state_dict` on a dataloader and then counts the restored batches as done
_COUNTING_CALLERS = {
    "lightning.pytorch.utilities.combined_loader": "PyTorch Lightning",
    "pytorch_lightning.utilities.combined_loader": "PyTorch Lightning",
}
_CALLER_DEPTH = 5  # frames above `Loader.set_state` looked at (the first: its `load_state_dict` entry point)


def gradient_state() -> Any:
    """Accelerate's `GradientState` when an `Accelerator` has been created in this process, else None."""
    state_mod = sys.modules.get("accelerate.state")
    cls = getattr(state_mod, "GradientState", None)
    if cls is None or not getattr(cls, "_shared_state", None):
        return None
    return cls()


def step_counting_caller() -> str | None:
    """The framework ("PyTorch Lightning") whose code called the function calling this one (a few
    frames up), when it counts restored batches as done, else None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_CALLER_DEPTH):
        if frame is None:
            return None
        name = _COUNTING_CALLERS.get(frame.f_globals.get("__name__", ""))
        if name is not None:
            return name
        frame = frame.f_back
    return None


def refuse_uncounted_resume(
    framework: str,
    *,
    epoch: int,
    received: int,
    left: int | None,
    epoch_batches: int,
    saved_world: int | None,
    world: int,
) -> None:
    """Raise `ValueError` when `framework`, having counted `received` batches of `epoch` as done,
    would stop after `epoch_batches - received` of the `left` batches this Loader has left (a
    position saved at world size `saved_world`, re-dealt to `world`): never a silent skip."""
    if left is None or left <= epoch_batches - received:
        return
    stops = max(0, epoch_batches - received)
    raise ValueError(
        f"cannot resume this checkpoint under {framework}: it was saved in epoch {epoch} after {received} batches "
        f"per process at world size {saved_world}; at world size {world} an epoch has {epoch_batches} batches per "
        f"process and this Loader has {left} left, but {framework} counts the {received} batches already done "
        f"against the {epoch_batches} and would stop after {stops}, skipping {left - stops} batches of unseen "
        f"samples. Resume on {saved_world} device(s), the count the checkpoint was saved with, or from a "
        "checkpoint saved at the end of an epoch (an epoch boundary resumes on any device count)"
    )
