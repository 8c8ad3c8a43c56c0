"""`HttpReceiver`: GET bodies received by the standard library straight into a reused buffer.

obstore hands each received piece to Python as a new `bytes` (zero-filled, then filled: two passes in
user mode over every byte, and a fresh buffer that evicts the cache the batches are read from).
Here `http.client` reads the body with `readinto` into one buffer per thread, kept across GETs: the
kernel copies each byte once, into memory that stays in the CPU's cache while it is written to the
cache file and hashed. `bench.remote` and `bench.remote_cpu` measure the two side by side.

A piece (`memoryview`) is valid until the receiver is asked for the next one: whoever takes a piece
keeps no reference to it after that (`Download` copies the part of a block a piece ends inside).

Each thread keeps one keep-alive connection per host. Every wait is bounded: `connect_timeout` for
the connection, `read_timeout` for each read. A connection reused from an earlier GET that fails
before any response arrives (the server closed it while idle) is replaced and the request sent once
more; every other failure is raised as the standard exception `fastload.retry.is_transient` judges:
`TimeoutError`, `ConnectionError` (refused, reset, a body cut short), `FileNotFoundError` (404),
`PermissionError` (401, 403), `HTTPStatusError` (any other status). Messages name the object, never a
signed URL's query.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator

from fastload.remote.transfer_stats import TransferStats

__all__ = ["HTTPStatusError", "HttpReceiver"]

_ERROR_BODY = 4096  # bytes of an error response's body kept for the message


class HTTPStatusError(OSError):
    """A response with an error status (`status`; 5xx, 408 and 429 are transient)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _ThreadState:
    """One thread's connections by (scheme, host:port) and its receive buffer; the connections close
    when the thread ends (or the receiver is dropped). A child forked while the thread received drops
    them unclosed: its copy of a response's reader may be locked by the thread that is not there."""

    def __init__(self) -> None:
        self.conns: dict[tuple[str, str], http.client.HTTPConnection] = {}
        self.buffer = memoryview(b"")
        self.pid = os.getpid()

    def close(self) -> None:
        conns, self.conns = self.conns, {}
        if os.getpid() == self.pid:
            for conn in conns.values():
                conn.close()

    def __del__(self) -> None:
        self.close()


class HttpReceiver:
    """GETs of URLs through `http.client`, bodies handed over in pieces of one reused buffer."""

    def __init__(self, *, connect_timeout: float, read_timeout: float, headers: dict[str, str] | None = None) -> None:
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self.headers = dict(headers or {})
        self._local = threading.local()
        self._tls: ssl.SSLContext | None = None

    def body(self, url: str, what: str, stats: TransferStats, chunk: int,
             byte_range: tuple[int, int] | None = None) -> Iterator[memoryview]:
        """One GET of `url` (bytes [start, end) with `byte_range`), its body in pieces of `chunk` bytes
        (the last may be shorter), each valid until the next is asked for; counted in `stats` as
        obstore's are (`bytes` per piece, `request_s` to the response headers, `receive_s` waiting
        for pieces). `what` names the object in errors. A body shorter than the response says raises
        `ConnectionError`; a ranged GET answered with the whole object raises `ConnectionError` too."""
        headers = dict(self.headers)
        if byte_range is not None:
            start, end = byte_range
            headers["Range"] = f"bytes={start}-{end - 1}"
        t0 = time.perf_counter()
        conn, resp = self._respond(url, what, headers)
        t1 = time.perf_counter()
        recv = 0.0
        done = False
        try:
            expected = self._check(resp, what, byte_range)
            view = self._buffer(chunk)
            got = 0
            while True:
                t = time.perf_counter()
                n = self._fill(resp, view, what)
                recv += time.perf_counter() - t
                got += n
                if n == 0:
                    break
                stats.add("bytes", n)
                yield view[:n]
                if n < chunk:
                    break
            if expected is not None and got != expected:
                raise ConnectionError(f"{what}: the body ended after {got} of its {expected} bytes")
            done = resp.isclosed() or self._drained(resp)
        finally:
            if not done:  # a body not read to its end (dropped, failed): the connection cannot be reused
                self._drop(url, conn)
            stats.add_many(request_s=t1 - t0, receive_s=recv)

    def close(self) -> None:
        """Close this thread's connections (other threads' close when their threads end)."""
        self._state().close()

    # -- internals ---------------------------------------------------------------------------------
    def _state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
        return state

    def _buffer(self, size: int) -> memoryview:
        """This thread's buffer of `size` bytes (a new one when the size changes: a caller uses one)."""
        state = self._state()
        if len(state.buffer) != size:
            state.buffer = memoryview(bytearray(size))
        return state.buffer

    def _connection(self, url: str) -> tuple[http.client.HTTPConnection, bool]:
        """(connection to `url`'s host, whether it served an earlier GET)."""
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        conns = self._state().conns
        conn = conns.get(key)
        if conn is not None:
            return conn, True
        if parts.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()  # honours SSL_CERT_FILE / SSL_CERT_DIR
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=self.connect_timeout,
                                               context=self._tls)
        elif parts.scheme == "http":
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=self.connect_timeout)
        else:
            raise ValueError(f"{url.split('?', 1)[0]}: not an http(s) URL")
        conns[key] = conn
        return conn, False

    def _drop(self, url: str, conn: http.client.HTTPConnection) -> None:
        conn.close()
        parts = urllib.parse.urlsplit(url)
        conns = self._state().conns
        if conns.get((parts.scheme, parts.netloc)) is conn:
            del conns[(parts.scheme, parts.netloc)]

    def _respond(self, url: str, what: str, headers: dict[str, str]) -> tuple[http.client.HTTPConnection,
                                                                              http.client.HTTPResponse]:
        """Send the GET and read the response's headers; a reused connection that fails before any
        response is replaced and the request sent once more."""
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        while True:
            conn, reused = self._connection(url)
            try:
                if conn.sock is None:
                    conn.connect()
                    conn.sock.settimeout(self.read_timeout)
                conn.request("GET", target or "/", headers=headers)
                return conn, conn.getresponse()
            except (BrokenPipeError, ConnectionResetError) as exc:  # http.client.RemoteDisconnected too
                self._drop(url, conn)
                if reused:
                    continue  # closed by the server while idle: once more on a new connection
                raise ConnectionError(f"{what}: {exc or type(exc).__name__}") from exc
            except BaseException as exc:
                self._drop(url, conn)
                raise _standard(exc, what, self) from exc

    def _check(self, resp: http.client.HTTPResponse, what: str, byte_range: tuple[int, int] | None) -> int | None:
        """The body's length (None when the response does not say); raises for an error status or a
        ranged GET answered with something else than its range."""
        status = resp.status
        if status >= 300:
            try:
                text = resp.read(_ERROR_BODY).decode("utf-8", "replace").strip().splitlines()
            except (OSError, http.client.HTTPException):
                text = []
            detail = f"HTTP {status} {resp.reason}" + (f": {text[0][:200]}" if text else "")
            if status == 404:
                raise FileNotFoundError(f"{what}: {detail}")
            if status in (401, 403):
                raise PermissionError(f"{what}: {detail}")
            raise HTTPStatusError(f"{what}: {detail}", status)
        length = resp.getheader("Content-Length")
        expected = int(length) if length is not None and length.isdigit() else None
        if byte_range is not None:
            want = byte_range[1] - byte_range[0]
            if status != 206 or (expected is not None and expected != want):
                raise ConnectionError(
                    f"{what}: bytes [{byte_range[0]}, {byte_range[1]}) came back as HTTP {status} with "
                    f"{expected if expected is not None else 'unknown'} bytes"
                )
        return expected

    def _fill(self, resp: http.client.HTTPResponse, view: memoryview, what: str) -> int:
        """Read into `view` until it is full or the body ended: bytes read."""
        n, size = 0, len(view)
        try:
            while n < size:
                got = resp.readinto(view[n:])
                if not got:
                    break
                n += got
        except BaseException as exc:
            raise _standard(exc, what, self) from exc
        return n

    @staticmethod
    def _drained(resp: http.client.HTTPResponse) -> bool:
        """Whether the whole body was read (the connection may serve the next GET)."""
        if resp.length:  # bytes the response still owes
            return False
        resp.read()  # b"" at the end: lets http.client mark the response closed
        return resp.isclosed()


def _standard(exc: BaseException, what: str, receiver: HttpReceiver) -> BaseException:
    """The standard exception for a failure of a GET (`exc` itself when it is not a network error)."""
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return TimeoutError(f"{what}: timed out (connect {receiver.connect_timeout:g}s, read "
                            f"{receiver.read_timeout:g}s): {exc}")
    if isinstance(exc, (http.client.HTTPException, ConnectionError)):
        return ConnectionError(f"{what}: {exc or type(exc).__name__}")
    if isinstance(exc, ssl.SSLError):
        return ConnectionError(f"{what}: TLS: {exc}")
    return exc
