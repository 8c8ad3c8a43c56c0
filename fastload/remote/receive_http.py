"""`HttpReceiver`: GET bodies received by the standard library straight into a reused buffer.

obstore hands each received piece to Python as a new `bytes` (zero-filled, then filled: two passes in
user mode over every byte, and a fresh buffer that evicts the cache the batches are read from).
Here `http.client` reads the body with `readinto` into one buffer per thread, kept across GETs: the
kernel copies each byte once, into memory that stays in the CPU's cache while it is written to the
cache file and hashed. `bench.remote` and `bench.remote_cpu` measure the two side by side. Over plain
HTTP, a body whose length the response gives is received from the socket by `_recv.recv_into` (a C
loop over recv, the GIL released) once the bytes `http.client` read with the headers are taken: the
standard library would make one Python call for each recv of about 100 KB.

A piece (`memoryview`) is valid until the receiver is asked for the next one: whoever takes a piece
keeps no reference to it after that (`Download` copies the part of a block a piece ends inside).

Keep-alive connections are pooled per host, across threads: a GET takes the most recently used idle
one (or opens one) and gives it back once its body was read to the end, so a thread started for one
download (or one ranged part) reuses a connection an earlier GET left, and a cold epoch over HTTPS
pays a TLS handshake per connection in use at once, not per thread. Every wait is bounded:
`connect_timeout` for the connection, `read_timeout` for each read. A connection reused from an
earlier GET that fails before any response arrives (the server closed it while idle) is replaced
and the request sent once more; every other failure is raised as the standard exception
`fastload.retry.is_transient` judges: `TimeoutError`, `ConnectionError` (refused, reset, a body cut
short), `FileNotFoundError` (404), `PermissionError` (401, 403), `HTTPStatusError` (any other
status). Messages name the object, never a signed URL's query.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator

from fastload.remote.transfer_stats import TransferStats

try:
    from fastload.remote._recv import recv_into as _c_recv_into
except ImportError:  # built without it: `http.client` reads every body
    _c_recv_into = None

__all__ = ["HTTPStatusError", "HttpReceiver"]

_ERROR_BODY = 4096  # bytes of an error response's body kept for the message
MAX_IDLE = 32  # idle connections kept per host; one given back beyond that is closed


class HTTPStatusError(OSError):
    """A response with an error status (`status`; 5xx, 408 and 429 are transient)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class HttpReceiver:
    """GETs of URLs through `http.client`, bodies handed over in pieces of one reused buffer."""

    def __init__(self, *, connect_timeout: float, read_timeout: float, headers: dict[str, str] | None = None) -> None:
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self.headers = dict(headers or {})
        self._local = threading.local()  # each thread's receive buffer
        self._tls: ssl.SSLContext | None = None
        self._lock = threading.Lock()  # guards `_idle`
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}  # by (scheme, host:port)
        self._pid = os.getpid()

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
        key, conn, resp = self._respond(url, what, headers, stats)
        t1 = time.perf_counter()
        recv = 0.0
        done = False
        try:
            expected = self._check(resp, what, byte_range)
            view = self._buffer(chunk)
            fd = self._direct_fd(conn, resp, expected)
            buffered = 0 if fd is None else self._buffered(resp, what, expected)
            timeout = self.read_timeout
            got = 0
            while True:
                t = time.perf_counter()
                if fd is None:
                    n = self._fill(resp, view, what)
                else:
                    piece = view[: min(chunk, (expected or 0) - got)]
                    n = self._take_buffered(resp, piece, what, buffered) if buffered else 0  # the first piece only
                    buffered -= n
                    if n < len(piece):
                        try:
                            n += _c_recv_into(fd, piece[n:], timeout)
                        except BaseException as exc:
                            raise _standard(exc, what, self) from exc
                recv += time.perf_counter() - t
                got += n
                if n == 0:
                    break
                stats.add("bytes", n)  # as it arrives: the read-ahead's window measures the rate from it
                yield view[:n]
                if n < chunk:
                    break
            if expected is not None and got != expected:
                raise ConnectionError(f"{what}: the body ended after {got} of its {expected} bytes")
            if fd is not None:  # read to its end around `http.client`: closing the response frees the connection
                resp.close()
                done = True
            else:
                done = resp.isclosed() or self._drained(resp)
        finally:
            if done:
                self._give_back(key, conn)
            else:  # a body not read to its end (dropped, failed): the connection cannot be reused
                conn.close()
            stats.add_many(request_s=t1 - t0, receive_s=recv)

    def close(self) -> None:
        """Close the idle connections (one in use by a GET now is given back, or closed, when it ends)."""
        with self._pool_lock():
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def __del__(self) -> None:
        # module globals may already be None at interpreter exit (the OS closes the sockets then)
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:  # noqa: BLE001 - nothing to report to during interpreter shutdown
            pass

    # -- internals ---------------------------------------------------------------------------------
    def _buffer(self, size: int) -> memoryview:
        """This thread's buffer of `size` bytes (a new one when the size changes: a caller uses one)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) != size:
            buffer = self._local.buffer = memoryview(bytearray(size))
        return buffer

    def _pool_lock(self) -> threading.Lock:
        """The pool's lock. A forked child starts with an empty pool: the idle connections are its
        parent's (left unclosed), and the lock may have been held by a thread the child does not have."""
        if self._pid != os.getpid():
            self._lock, self._idle, self._pid = threading.Lock(), {}, os.getpid()
        return self._lock

    def _give_back(self, key: tuple[str, str], conn: http.client.HTTPConnection) -> None:
        """Return a connection whose response was read to its end to the idle pool (closed when full)."""
        with self._pool_lock():
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def _connection(self, key: tuple[str, str], parts: urllib.parse.SplitResult,
                    stats: TransferStats) -> tuple[http.client.HTTPConnection, bool]:
        """(an idle connection to `parts`' host, else a new one (counted in `stats` as `connections`),
        whether it served an earlier GET)."""
        with self._pool_lock():
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        stats.add("connections", 1)
        if parts.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()  # honours SSL_CERT_FILE / SSL_CERT_DIR
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=self.connect_timeout,
                                               context=self._tls)
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=self.connect_timeout)
        return conn, False

    def _respond(
        self, url: str, what: str, headers: dict[str, str], stats: TransferStats
    ) -> tuple[tuple[str, str], http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the GET and read the response's headers: (pool key, connection, response). A reused
        connection that fails before any response is closed and the request sent once more."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{url.split('?', 1)[0]}: not an http(s) URL")
        key = (parts.scheme, parts.netloc)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        while True:
            conn, reused = self._connection(key, parts, stats)
            try:
                if conn.sock is None:
                    conn.connect()
                    conn.sock.settimeout(self.read_timeout)
                conn.request("GET", target or "/", headers=headers)
                return key, conn, conn.getresponse()
            except (BrokenPipeError, ConnectionResetError) as exc:  # http.client.RemoteDisconnected too
                conn.close()
                if reused:
                    continue  # closed by the server while idle: once more on another connection
                raise ConnectionError(f"{what}: {exc or type(exc).__name__}") from exc
            except BaseException as exc:
                conn.close()
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

    @staticmethod
    def _direct_fd(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                   expected: int | None) -> int | None:
        """The socket to receive the body from in C (`body`): a plain TCP connection kept open
        after the response, whose body has the length `expected` (not chunked); else None (`_fill`)."""
        sock = conn.sock
        if (_c_recv_into is None or expected is None or resp.chunked or resp.will_close or sock is None
                or type(sock) is not socket.socket or resp.length != expected):
            return None
        return sock.fileno()

    def _buffered(self, resp: http.client.HTTPResponse, what: str, expected: int) -> int:
        """How many of the body's first bytes `http.client` holds in its buffer (read with the headers;
        when none are, one read of the socket brings some)."""
        if not expected:
            return 0
        try:
            return min(len(resp.fp.peek()), expected)
        except BaseException as exc:
            raise _standard(exc, what, self) from exc

    def _take_buffered(self, resp: http.client.HTTPResponse, view: memoryview, what: str, buffered: int) -> int:
        """Bytes of the body that `http.client` holds in its buffer (`buffered` of them: they came with the
        headers) into the start of `view`, without reading the socket: how many."""
        if not len(view):
            return 0
        try:
            return resp.readinto(view[: min(buffered, len(view))])
        except BaseException as exc:
            raise _standard(exc, what, self) from exc

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
