"""`EpochProgress`: which epoch a Loader runs and where its consumer is in it (its resume state).

State, read and written only in the consumer's thread (the iterator's hooks run there too):

* `epoch`: the epoch the next `iter()` runs;
* `resume`: a position loaded by `load_state_dict` (or unpickled) that the next `iter()` starts
  from, taken by `begin()`; None: the next `iter()` starts at the epoch's start;
* the live epoch iterator (held weakly: the consumer owns it; deleting it ends its workers) and
  the epoch it runs (`set_epoch` may have moved on since);
* the position the last iterator stopped at (None at an epoch's start or once it is complete);
* how many batches of this epoch the consumer received before the position's own count began
  (a resume re-dealt to another world size counts its position from 0 again, while a framework
  such as Lightning counts the whole epoch: `received()` gives that whole count).

Resume contract: `saved()` is the position of the last batch the consumer received — the live
iterator's, else where the last one stopped, else a loaded `resume` not yet started; batches in
flight are never part of it. An epoch advances only when the live iterator of the current epoch
reports its last batch delivered (`complete`), so a stale iterator cannot move the Loader on.
"""

from __future__ import annotations

import weakref
from typing import Any

from fastload.order.choice import batches_from
from fastload.order.sampling import SamplerOrder, SeededOrder

__all__ = ["EpochProgress"]


class EpochProgress:
    """The epoch counter, the consumer's position and the pending resume of one Loader."""

    __slots__ = ("_active_epoch", "_active_ref", "_before", "_position", "_resume_received", "epoch", "resume")

    def __init__(self) -> None:
        self.epoch = 0
        self.resume: dict[str, Any] | None = None
        self._before = 0  # batches of this epoch received before the position's own count began
        self._resume_received = 0  # with `resume`: the batches of its epoch received up to it
        self._position: dict[str, Any] | None = None
        self._active_ref: weakref.ref[Any] | None = None
        self._active_epoch = 0

    @property
    def active(self) -> Any:
        """The live epoch iterator, or None."""
        return self._active_ref() if self._active_ref is not None else None

    def stop_active(self) -> None:
        """Close the live iterator (its `closed` hook records its position) and forget it."""
        active = self.active
        if active is not None:
            active.close()
        self._active_ref = None

    def begin(self) -> dict[str, Any] | None:
        """Start an `iter()`: close the live iterator and hand over the pending resume position."""
        self.stop_active()
        resume, self.resume = self.resume, None
        return resume

    def attach(self, it: Any, start: dict[str, Any] | None, resumed: bool = False) -> None:
        """`it` now runs the current epoch from `start` (`resumed`: the position `begin()` handed over)."""
        self._before = max(0, self._resume_received - _count(start)) if resumed else 0
        self._resume_received = 0
        self._position = start
        self._active_ref, self._active_epoch = weakref.ref(it), self.epoch

    def complete(self, it: Any) -> bool:
        """`it` delivered its epoch's last batch: advance the epoch when `it` is the live
        iterator of the current epoch (True), else nothing (False)."""
        if it is self.active and self._active_epoch == self.epoch:
            self.epoch += 1
            self._position, self._before = None, 0
            return True
        return False

    def served(self, epoch: int) -> None:
        """`epoch` was delivered by other means (a torch DataLoader iterating the Loader's
        `batch_sampler` view to its end): the next `iter()` runs the next epoch. Nothing when the
        Loader has moved to another epoch meanwhile."""
        if epoch == self.epoch:
            self.stop_active()
            self.epoch += 1
            self.resume = self._position = None
            self._before = self._resume_received = 0

    def closed(self, it: Any) -> None:
        """`it` stopped (closed, exhausted or deleted): keep where its consumer was."""
        current = self.active
        if current is it or current is None:
            if self._active_epoch == self.epoch and not it.complete:
                self._position = it.position
            self._active_ref = None

    def set_epoch(self, epoch: int) -> None:
        """Run `epoch` next; another epoch than the current one drops the position and resume."""
        if epoch != self.epoch:
            self.resume = self._position = None
            self._before = self._resume_received = 0
        self.epoch = epoch

    def restore(self, epoch: int, position: dict[str, Any] | None, received: int | None = None) -> None:
        """Continue `epoch` after `position` at the next `iter()` (a loaded or unpickled state);
        `received`: the batches of that epoch received up to it (default: the position's count)."""
        self.epoch = epoch
        self.resume = self._position = position
        self._before = 0
        self._resume_received = _count(position) if received is None else max(int(received), _count(position))

    def received(self) -> int:
        """Batches of the current epoch the consumer received, over all its resumes: what a
        framework that counts its steps (Lightning) has counted at `saved()`."""
        if self.resume is not None:
            return self._resume_received
        return self._before + _count(self.saved())

    def saved(self) -> dict[str, Any] | None:
        """The position `state_dict()` records (see the module docstring)."""
        if self.resume is not None:
            return self.resume
        active = self.active
        if active is not None and self._active_epoch == self.epoch:
            return active.position
        return self._position

    def length(self, order: SeededOrder | SamplerOrder, drop_last: bool) -> int:
        """Batches the next `iter()` yields: the rest of the epoch after a resume, else all of it."""
        if self.resume is not None:
            left = batches_from(order, self.resume, drop_last)
            if left is not None:
                return left
        return len(order)


def _count(position: dict[str, Any] | None) -> int:
    return int(position["batches"]) if position else 0
