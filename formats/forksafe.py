"""Process-local state that must not cross a fork: a child forked while one of the parent's
threads held a lock would inherit that lock locked, forever.

`reset_in_child(obj, reset)` registers `reset(obj)` to run in every forked child right after the
fork, before any of the child's own code (`os.register_at_fork`), for as long as `obj` lives.
`reset` gives `obj` new locks and drops what belonged to the parent's threads.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["reset_in_child"]

log = logging.getLogger(__name__)

_REGISTERED: dict[int, tuple[weakref.ref[Any], Callable[[Any], None]]] = {}
_REGISTERED_LOCK = threading.Lock()  # guards _REGISTERED; replaced in the child (below)


def reset_in_child(obj: Any, reset: Callable[[Any], None]) -> None:
    """Run `reset(obj)` in each child forked while `obj` is alive (once per object; the last call wins)."""
    key = id(obj)

    def forget(_: weakref.ref[Any], key: int = key) -> None:
        with _REGISTERED_LOCK:
            entry = _REGISTERED.get(key)
            if entry is not None and entry[0]() is None:
                del _REGISTERED[key]

    with _REGISTERED_LOCK:
        _REGISTERED[key] = (weakref.ref(obj, forget), reset)


def _reset_all_in_child() -> None:
    """Every registered reset runs: one that fails (say, over a file the parent removed) is reported
    and does not leave the objects after it holding the parent's locks."""
    global _REGISTERED_LOCK
    _REGISTERED_LOCK = threading.Lock()
    for ref, reset in list(_REGISTERED.values()):
        obj = ref()
        if obj is not None:
            try:
                reset(obj)
            except Exception:  # reported; the next reset still runs
                log.warning("resetting %r in a forked child failed", type(obj).__name__, exc_info=True)


os.register_at_fork(after_in_child=_reset_all_in_child)
