"""A local HTTP server for remote-read tests: serves a directory on 127.0.0.1 and can freeze (accept
and read shard requests, never answer them) or be killed (connections refused from then on)."""

from __future__ import annotations

import functools
import http.server
import threading
from typing import Any


class ShardServer:
    """`url` serves `root` (every request listed in `requests`). `freeze()`: requests under `shards/`
    are read and counted (`frozen_requests`) but never answered; `kill()`: the port is closed."""

    def __init__(self, root: str) -> None:
        self._thaw = threading.Event()
        self._frozen = False
        self._lock = threading.Lock()
        self.frozen_requests: list[str] = []
        self.requests: list[str] = []  # every request, "GET /path"
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _hold(self) -> bool:
                with server._lock:
                    server.requests.append(f"{self.command} {self.path}")
                if not (server._frozen and "/shards/" in self.path):
                    return False
                with server._lock:
                    server.frozen_requests.append(f"{self.command} {self.path}")
                server._thaw.wait()
                self.close_connection = True
                return True

            def do_GET(self) -> None:
                if not self._hold():
                    super().do_GET()

            def do_HEAD(self) -> None:
                if not self._hold():
                    super().do_HEAD()

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self._srv.daemon_threads = True
        self._srv.handle_error = lambda *a: None  # a client that gave up closes its end mid-request
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()
        self._alive = True

    def freeze(self) -> None:
        """From now on, shard requests are accepted and never answered."""
        self._frozen = True

    def kill(self) -> None:
        """Stop serving and close the port: new connections are refused."""
        if self._alive:
            self._alive = False
            self._srv.shutdown()
            self._srv.server_close()
            self._thread.join(5)

    def stop(self) -> None:
        """Release frozen requests and stop."""
        self._thaw.set()
        self.kill()


def assert_attempts_within_total(attempts: int, stated: float, retry: Any, read_s: float) -> None:
    """Attempts that each wait `read_s` start while less than `retry.total` has passed: ceil(total /
    read_s) of them when each attempt's own set-up is quick. One fewer only when the set-ups
    of the earlier ones took so long that the next would have started past `total` (a starved
    machine), never more."""
    expected = -(-retry.total // read_s)
    assert attempts == expected or (attempts == expected - 1 and stated >= retry.total - retry.cap - 0.05), (
        attempts, stated)
