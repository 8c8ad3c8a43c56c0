"""Hooks into training frameworks that drive a Loader, found duck-typed (no import of them).

Hugging Face Accelerate decides when an accumulated gradient step ends (`Accelerator.accumulate`,
`sync_with_dataloader`) from its `GradientState`: the dataloader registered there last says
`end_of_dataloader` when it yields its last batch, and `remainder` how many samples of the last
global batch are real (-1: unknown, `gather_for_metrics` then drops nothing). Accelerate's own
loaders register themselves; a Loader's iterator does the same, so an epoch's last, partial
accumulation window still steps the optimizer, as with a prepared torch DataLoader.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["gradient_state"]


def gradient_state() -> Any:
    """Accelerate's `GradientState` when an `Accelerator` has been created in this process, else None."""
    state_mod = sys.modules.get("accelerate.state")
    cls = getattr(state_mod, "GradientState", None)
    if cls is None or not getattr(cls, "_shared_state", None):
        return None
    return cls()
