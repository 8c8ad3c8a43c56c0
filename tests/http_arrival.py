"""A local HTTP server for tests of shards read while they arrive: serves a directory on 127.0.0.1
with `Range` support, and can pause a shard's body at a byte offset, drop the connection there, or
flip a byte of the body (each for the first N body requests of every shard, or for all)."""

from __future__ import annotations

import http.server
import os
import re
import threading
import urllib.parse

_PIECE = 64 << 10


class ArrivalServer:
    """`url` serves `root`. Faults apply to requests under `shards/` whose range holds the byte `at`:
    `pause(at)` holds the first GET of each shard whose range holds byte `at` (the download's own GET;
    the readers' GETs that follow pass) at byte `at` until `release()`; `drop(at, times)`
    closes its connection there (the first `times` such requests of each shard); `corrupt(at, times)`
    flips the byte at `at` (`times` None: every time). `body_requests` counts, per shard path, the
    requests that held the byte to drop or flip; `gets` lists every GET as (path, start, end), in the
    order they came."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.gate = threading.Event()
        self.pause_at: int | None = None
        self.paused = threading.Event()  # set once a body request is held at `pause_at`
        self.drop_at: int | None = None
        self.drops = 0
        self.corrupt_at: int | None = None
        self.corrupts: int | None = None
        self.body_requests: dict[str, int] = {}
        self.held: set[str] = set()  # shards whose GET was held at `pause_at` already
        self.gets: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, *, body: bool) -> None:
                rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
                full = os.path.join(server.root, rel)
                if not os.path.isfile(full):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with open(full, "rb") as fh:
                    data = fh.read()
                start, end = 0, len(data)
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if m:
                    start, end = int(m.group(1)), min(len(data), int(m.group(2)) + 1 if m.group(2) else len(data))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(end - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if body:
                    with server._lock:
                        server.gets.append((rel, start, end))
                    server._send(self, rel, data, start, end)

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        self._srv.handle_error = lambda *a: None  # clients that gave up close their end mid-body
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()

    def pause(self, at: int) -> None:
        """Hold every shard body at byte `at` until `release()`."""
        self.gate.clear()
        self.pause_at = at

    def release(self) -> None:
        """Let held bodies go on (and pause no more)."""
        self.pause_at = None
        self.gate.set()

    def drop(self, at: int, times: int) -> None:
        """Close the first `times` body requests of each shard at byte `at`."""
        self.drop_at, self.drops = at, times

    def corrupt(self, at: int, times: int | None) -> None:
        """Flip the byte at `at` in the first `times` bodies of each shard (None: in every one)."""
        self.corrupt_at, self.corrupts = at, times

    def _send(self, handler: http.server.BaseHTTPRequestHandler, rel: str, data: bytes, start: int, end: int) -> None:
        shard = "shards/" in rel

        def hits(at: int | None) -> bool:
            return shard and at is not None and start <= at < end

        drop = flip = None
        if hits(self.drop_at) or hits(self.corrupt_at):
            with self._lock:
                n = self.body_requests[rel] = self.body_requests.get(rel, 0) + 1
            drop = self.drop_at if hits(self.drop_at) and n <= self.drops else None
            flip = self.corrupt_at if hits(self.corrupt_at) and (self.corrupts is None or n <= self.corrupts) else None
        pause = None
        if hits(self.pause_at):
            with self._lock:
                if rel not in self.held:  # the first GET over the byte: the download's own
                    self.held.add(rel)
                    pause = self.pause_at
        pos = start
        while pos < end:
            if pause is not None and pos == pause and self.pause_at is not None:
                self.paused.set()
                self.gate.wait(30)
            stop = min(end, (pos // _PIECE + 1) * _PIECE)
            for at in (pause, drop):
                if at is not None and pos < at < stop:
                    stop = at
            if drop is not None and pos == drop:
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            piece = bytearray(data[pos:stop])
            if flip is not None and pos <= flip < stop:
                piece[flip - pos] ^= 0xFF
            handler.wfile.write(piece)
            handler.wfile.flush()
            pos = stop

    def stop(self) -> None:
        """Release held bodies and stop serving."""
        self.release()
        self._srv.shutdown()
        self._srv.server_close()
        self._thread.join(5)
