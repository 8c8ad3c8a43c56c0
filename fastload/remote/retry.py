"""Retrying remote reads: which errors are transient, and the bounded retry loop.

`RetryPolicy` bounds the attempts and their total time (full-jitter exponential backoff);
`is_transient` decides from the exception chain (connection resets, timeouts, HTTP 5xx/408/429,
short reads and checksum mismatches are worth another try; missing files, permissions and format
errors are not); `retry_call` runs a callable under a policy and raises `RemoteFetchError` naming
the URL and the attempts when they run out.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastload.formats.errors import ChecksumError, FormatError

__all__ = ["RemoteFetchError", "RetryPolicy", "is_transient", "retry_call"]

log = logging.getLogger("fastload.remote.storage")
T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EBUSY,
    errno.EAGAIN,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FormatError)
_TRANSIENT_NAMES = {
    # aiohttp / urllib3 / botocore / requests class names, matched by name to avoid importing them
    "ServerDisconnectedError",
    "ClientConnectionError",
    "ClientPayloadError",
    "ClientOSError",
    "ServerTimeoutError",
    "ProtocolError",
    "IncompleteRead",
    "IncompleteReadError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ResponseStreamingError",
    "ReadTimeout",
    "ConnectTimeout",
    "ChunkedEncodingError",
    "NewConnectionError",
    "RemoteDisconnected",
    "HTTPClientError",
    "FSTimeoutError",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "503",
    "500",
    "502",
    "504",
}


class RemoteFetchError(OSError):
    """A remote read failed for good (permanent error, or transient errors past the retry limit)."""


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` attempts in all, sleeping uniform(0, min(cap, base * 2**k)) before retry k;
    no attempt starts (and no sleep runs) past `total` seconds after the first one started.
    Defaults: 10 attempts, base 0.1 s, cap 5 s, total 30 s."""

    attempts: int = 10
    base: float = 0.1
    cap: float = 5.0
    total: float = 30.0

    def delay(self, k: int) -> float:
        """Seconds to sleep before retry `k` (0-based): full jitter up to `min(cap, base * 2**k)`."""
        return random.uniform(0.0, min(self.cap, self.base * (2**k)))


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        v = getattr(exc, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        meta = resp.get("ResponseMetadata") or {}
        v = meta.get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def _one_transient(exc: BaseException) -> bool | None:
    """True/False when this exception alone decides; None to look at its causes."""
    if isinstance(exc, ChecksumError):
        return True  # a truncated or damaged transfer: fetch again
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    if name in _TRANSIENT_NAMES:
        return True
    status = _status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict) and (resp.get("Error") or {}).get("Code") in _TRANSIENT_CODES:
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc).lower()
    if any(
        s in text
        for s in (
            "retries exceeded",
            "timed out",
            "connection reset",
            "slowdown",
            "service unavailable",
            "connection aborted",
            "broken pipe",
            "503",
            "500 internal",
        )
    ):
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether an error is worth retrying: connection resets, timeouts, HTTP 5xx/429, short reads."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        verdict = _one_transient(cur)
        if verdict is not None:
            return verdict
        cur = cur.__cause__ or cur.__context__
    return False


def retry_call(fn: Callable[[], T], *, url: str, policy: RetryPolicy, stop: threading.Event | None = None) -> T:
    """`fn()` until it succeeds, a permanent error, or `policy` runs out (`RemoteFetchError` then)."""
    last: BaseException | None = None
    start = time.monotonic()
    deadline = start + policy.total
    made = 0
    for k in range(max(1, policy.attempts)):
        if k:
            pause = policy.delay(k - 1)
            if time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
        made += 1
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                if isinstance(exc, (FileNotFoundError, PermissionError)):
                    raise type(exc)(f"{url}: {exc}") from exc
                raise RemoteFetchError(f"{url}: {type(exc).__name__}: {exc}") from exc
            last = exc
            log.debug("transient error on %s (attempt %d/%d): %r", url, k + 1, policy.attempts, exc)
            if stop is not None and stop.is_set():
                break
    took = time.monotonic() - start
    raise RemoteFetchError(
        f"{url}: giving up after {made} attempts in {took:.1f}s (retry budget {policy.attempts} attempts, "
        f"{policy.total:g}s); last error {type(last).__name__}: {last}"
    ) from last
