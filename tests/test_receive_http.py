"""`HttpReceiver`: bodies and ranges byte for byte in full pieces of one reused buffer, keep-alive
connections (and a replaced stale one), errors by status, bodies cut short, ranges ignored, bounded
waits, each through both ways of receiving a body (the C recv loop `_recv.recv_into`, and
`http.client`); which bodies take the C loop; the obstore transport's choice of receiver (signed S3
URLs, anonymous stores streaming through obstore); a piece's buffer reused after `Download` took it."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading
import time

import numpy as np
import pytest
from s3_fixtures import moto, upload_dir  # noqa: F401

from fastload.remote import receive_http
from fastload.remote.receive_http import HttpReceiver, HTTPStatusError
from fastload.remote.retry import is_transient
from fastload.remote.transfer_stats import TransferStats

DATA = np.random.default_rng(7).integers(0, 256, 1_000_003, dtype=np.uint8).tobytes()


class _Server:
    """HTTP/1.1 with keep-alive on 127.0.0.1: `/data` (ranges honoured), `/norange` (ranges ignored),
    `/status/N`, `/short` (announces more than it sends, then closes), `/slow` (headers, then silence);
    `connections` counts accepted connections, `close_idle()` closes the ones waiting for a request."""

    def __init__(self) -> None:
        self.connections = 0
        self.idle: list[socket.socket] = []
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                server.connections += 1
                server.idle.append(self.connection)

            def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
                      length: int | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                rng = self.headers.get("Range")
                if self.path == "/data" and rng:
                    a, b = (int(x) for x in rng.split("=", 1)[1].split("-"))
                    self._send(206, DATA[a : b + 1], {"Content-Range": f"bytes {a}-{b}/{len(DATA)}"})
                elif self.path in ("/data", "/norange"):
                    self._send(200, DATA)
                elif self.path.startswith("/status/"):
                    self._send(int(self.path.split("?")[0].rsplit("/", 1)[1]), b"NoSuchKey: the key does not exist\n")
                elif self.path == "/short":
                    self._send(200, DATA[:1000], length=5000)
                    self.close_connection = True
                elif self.path == "/together":  # the status, the headers and the body in one send
                    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(DATA)}\r\n\r\n".encode()
                    self.wfile.write(head + DATA)
                elif self.path == "/chunked":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for at in range(0, len(DATA), 300_000):
                        part = DATA[at : at + 300_000]
                        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                elif self.path == "/slow":
                    self.send_response(200)
                    self.send_header("Content-Length", "10")
                    self.end_headers()
                    self.wfile.flush()
                    server.release.wait(10)
                    self.close_connection = True
                else:
                    self._send(404, b"")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close_idle(self) -> None:
        for conn in self.idle:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.idle.clear()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(params=["c", "http.client"])
def server(request, monkeypatch):
    """The server, with bodies received by the C loop (`c`) or by `http.client` (the fallback)."""
    if request.param == "http.client":
        monkeypatch.setattr(receive_http, "_c_recv_into", None)
    elif receive_http._c_recv_into is None:
        pytest.skip("fastload.remote._recv was not built (no C compiler)")
    s = _Server()
    yield s
    s.stop()


def _receiver(**kw) -> HttpReceiver:
    return HttpReceiver(connect_timeout=kw.pop("connect_timeout", 2.0), read_timeout=kw.pop("read_timeout", 2.0), **kw)


def test_a_body_comes_whole_in_full_pieces_of_one_reused_buffer(server):
    rx, stats = _receiver(), TransferStats()
    pieces, buffers = [], set()
    for piece in rx.body(f"{server.url}/data", "obj", stats, 65536):
        pieces.append(bytes(piece))
        buffers.add(id(piece.obj))
    assert b"".join(pieces) == DATA
    assert [len(p) for p in pieces[:-1]] == [65536] * (len(pieces) - 1)  # full pieces: block-aligned
    assert len(buffers) == 1
    assert stats.snapshot()["bytes"] == len(DATA)
    # the next GET reuses the connection and the buffer
    assert b"".join(bytes(p) for p in rx.body(f"{server.url}/data", "obj", stats, 65536)) == DATA
    assert server.connections == 1
    rx.close()


def _get(rx: HttpReceiver, url: str, stats: TransferStats) -> bytes:
    return b"".join(bytes(p) for p in rx.body(url, "obj", stats, 1 << 20))


def test_threads_one_after_another_share_one_connection(server):
    rx, stats = _receiver(), TransferStats()
    got: list[bytes] = []
    for _ in range(6):  # each GET in a thread of its own, as a download thread per shard does
        t = threading.Thread(target=lambda: got.append(_get(rx, f"{server.url}/data", stats)))
        t.start()
        t.join()
    assert got == [DATA] * 6
    assert server.connections == 1 and stats.snapshot()["connections"] == 1
    rx.close()


def test_gets_at_once_open_a_connection_each_and_later_ones_reuse_them(server, monkeypatch):
    rx, stats = _receiver(), TransferStats()
    first, second = (rx.body(f"{server.url}/data", "obj", stats, 4096) for _ in range(2))
    assert bytes(next(first)) == bytes(next(second)) == DATA[:4096]  # both responses under way at once
    assert b"".join(bytes(p) for p in first) == b"".join(bytes(p) for p in second) == DATA[4096:]
    assert server.connections == 2
    assert [_get(rx, f"{server.url}/data", stats) for _ in range(3)] == [DATA] * 3
    assert server.connections == 2
    # a full pool closes what is given back beyond it
    monkeypatch.setattr(receive_http, "MAX_IDLE", 1)
    rx.close()
    first, second = (rx.body(f"{server.url}/data", "obj", stats, 1 << 20) for _ in range(2))
    next(first), next(second)
    list(first), list(second)
    assert server.connections == 4
    third, fourth = (rx.body(f"{server.url}/data", "obj", stats, 1 << 20) for _ in range(2))
    next(third), next(fourth)
    list(third), list(fourth)
    assert server.connections == 5 and stats.snapshot()["connections"] == 5
    rx.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents(server):
    rx, stats = _receiver(), TransferStats()
    assert _get(rx, f"{server.url}/data", stats) == DATA
    pid = os.fork()
    if pid == 0:  # the child: its GET must not go over the parent's idle connection
        code = 1
        try:
            mine = TransferStats()
            code = 0 if _get(rx, f"{server.url}/data", mine) == DATA and mine.snapshot()["connections"] == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _get(rx, f"{server.url}/data", stats) == DATA  # the parent's connection still serves it
    assert server.connections == 2 and stats.snapshot()["connections"] == 1
    rx.close()


def test_a_range_comes_byte_for_byte_and_an_ignored_range_is_an_error(server):
    rx, stats = _receiver(), TransferStats()
    got = b"".join(bytes(p) for p in rx.body(f"{server.url}/data", "obj", stats, 4096, (70_000, 200_001)))
    assert got == DATA[70_000:200_001]
    with pytest.raises(ConnectionError, match=r"obj: bytes \[0, 100\) came back as HTTP 200"):
        list(rx.body(f"{server.url}/norange", "obj", stats, 4096, (0, 100)))
    # the connection whose body was left unread is not reused
    assert b"".join(bytes(p) for p in rx.body(f"{server.url}/data", "obj", stats, 1 << 20, (5, 10))) == DATA[5:10]
    assert server.connections == 2


def test_a_body_dropped_part_way_closes_its_connection(server):
    rx, stats = _receiver(), TransferStats()
    body = rx.body(f"{server.url}/data", "obj", stats, 4096)
    assert bytes(next(body)) == DATA[:4096]
    body.close()
    assert b"".join(bytes(p) for p in rx.body(f"{server.url}/data", "obj", stats, 1 << 20)) == DATA
    assert server.connections == 2


def test_a_connection_the_server_closed_while_idle_is_replaced(server):
    rx, stats = _receiver(), TransferStats()
    assert b"".join(bytes(p) for p in rx.body(f"{server.url}/data", "obj", stats, 1 << 20)) == DATA
    server.close_idle()
    time.sleep(0.1)
    assert b"".join(bytes(p) for p in rx.body(f"{server.url}/data", "obj", stats, 1 << 20)) == DATA
    assert server.connections == 2


@pytest.mark.parametrize("status, kind, transient", [
    (404, FileNotFoundError, False), (403, PermissionError, False), (401, PermissionError, False),
    (503, HTTPStatusError, True), (500, HTTPStatusError, True), (429, HTTPStatusError, True),
    (400, HTTPStatusError, False), (301, HTTPStatusError, False),
])
def test_an_error_status_raises_the_standard_exception(server, status, kind, transient):
    rx = _receiver()
    with pytest.raises(kind, match=rf"^obj: HTTP {status} .*NoSuchKey") as info:
        list(rx.body(f"{server.url}/status/{status}?X-Amz-Signature=secret", "obj", TransferStats(), 4096))
    assert "secret" not in str(info.value)
    assert is_transient(info.value) is transient


def test_a_body_cut_short_is_a_connection_error(server):
    with pytest.raises(ConnectionError, match="obj: the body ended after 1000 of its 5000 bytes") as info:
        list(_receiver().body(f"{server.url}/short", "obj", TransferStats(), 4096))
    assert is_transient(info.value)


def test_every_wait_is_bounded(server):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="obj: timed out") as info:
        list(_receiver(read_timeout=0.3).body(f"{server.url}/slow", "obj", TransferStats(), 4096))
    assert time.monotonic() - t0 < 3
    assert is_transient(info.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(ConnectionError):
        list(_receiver().body(f"http://127.0.0.1:{port}/x", "obj", TransferStats(), 4096))


def _socket_reads(monkeypatch) -> list[int]:
    """The bytes of each of `http.client`'s reads of a socket (one Python call each) from now on."""
    sizes: list[int] = []
    read = socket.SocketIO.readinto

    def counted(self, b):
        n = read(self, b)
        sizes.append(n or 0)
        return n

    monkeypatch.setattr(socket.SocketIO, "readinto", counted)
    return sizes


def test_a_plain_body_of_known_length_is_received_in_c(server, monkeypatch):
    rx, stats = _receiver(), TransferStats()
    assert _get(rx, f"{server.url}/data", stats) == DATA  # the connection's first GET, before counting
    sizes = _socket_reads(monkeypatch)
    for path in ("/data", "/together"):  # /together: body bytes come in the headers' read
        assert b"".join(bytes(p) for p in rx.body(f"{server.url}{path}", "obj", stats, 65536)) == DATA
    assert server.connections == 1  # read to its end around http.client, the connection is reused
    if receive_http._c_recv_into is not None:
        # http.client reads only the headers (and the body's first bytes with them, or one buffer more),
        # in reads of at most its 8 KiB buffer: the rest of each 1 MB body came through the C loop
        assert sum(sizes) < 2 * 64 << 10, sizes
    else:
        assert sum(sizes) >= 2 * len(DATA) and len(sizes) > 10  # one Python call per recv
    rx.close()


def test_a_chunked_body_is_read_by_http_client(server):
    rx, stats = _receiver(), TransferStats()
    pieces = [bytes(p) for p in rx.body(f"{server.url}/chunked", "obj", stats, 65536)]
    assert b"".join(pieces) == DATA
    assert [len(p) for p in pieces[:-1]] == [65536] * (len(pieces) - 1)
    assert _get(rx, f"{server.url}/data", stats) == DATA
    assert server.connections == 1
    rx.close()


@pytest.mark.skipif(receive_http._c_recv_into is None, reason="fastload.remote._recv was not built")
def test_recv_into_fills_the_buffer_stops_at_the_end_and_bounds_each_wait():
    from fastload.remote._recv import recv_into

    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5.0)  # non-blocking underneath, as a Python socket with a timeout is
        threading.Timer(0.05, lambda: a.sendall(DATA[:300_000])).start()
        buf = bytearray(200_000)
        assert recv_into(b.fileno(), buf, 2.0) == 200_000 and buf == DATA[:200_000]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no data for 0.2 s"):
            recv_into(b.fileno(), bytearray(200_000), 0.2)  # 100,000 bytes, then nothing more
        assert time.monotonic() - t0 < 2
        a.sendall(b"tail")
        a.shutdown(socket.SHUT_WR)
        buf = bytearray(100)
        assert recv_into(b.fileno(), buf, 2.0) == 4 and buf[:4] == b"tail"  # the stream ended
        with pytest.raises(ValueError, match="timeout"):
            recv_into(b.fileno(), buf, 0.0)
        with pytest.raises(ValueError, match="closed"):
            recv_into(-1, buf, 1.0)
        with pytest.raises(BufferError):
            recv_into(b.fileno(), b"read-only", 1.0)
    c, d = socket.socketpair()
    with c, d:
        c.shutdown(socket.SHUT_RDWR)
        c.close()
        assert recv_into(d.fileno(), bytearray(10), 1.0) == 0  # a blocking socket whose peer is gone


def test_a_download_keeps_no_view_of_a_piece_after_taking_it(tmp_path):
    """The receiver refills its buffer after each piece: bytes of a block a piece ends inside, kept for
    the claim's next piece, are the piece's bytes then, not what the buffer holds later."""
    from fastload.formats import FastloadDataset, write
    from fastload.remote.cache.arrival import Arrival, BlockSpec
    from fastload.remote.cache.files import Download

    write(({"x": np.full(3000, i % 251, np.uint8)} for i in range(200)), str(tmp_path / "ds"), progress=False)
    local = FastloadDataset(str(tmp_path / "ds"))
    info, shift = local.manifest.shards[0], local.manifest.block_log2
    data = (tmp_path / "ds" / info.file).read_bytes()
    path = str(tmp_path / "tmp")
    arrival = Arrival(path, path + ".final", size=info.bytes, spec=BlockSpec(info.blocks_xxh3, shift),
                      where="shard", stall_s=5)
    sink = Download(path, size=info.bytes, xxh3=info.xxh3, where="shard", arrival=arrival)
    start, end = sink.table_range()
    sink.put_table(data[start:end])
    got = arrival.claim_next(0, len(arrival.published))
    assert got is not None
    claim, first, _ = got
    buf = bytearray(40_000)  # pieces end inside blocks (64 KiB)
    for at in range(first << shift, arrival.sections_end, len(buf)):
        piece = data[at : min(at + len(buf), arrival.sections_end)]
        buf[: len(piece)] = piece
        sink.write_claimed(claim, at, memoryview(buf)[: len(piece)])
        buf[:] = b"\xff" * len(buf)  # the receiver's next piece overwrites the buffer
    sink.release(claim)
    sink.check()
    assert bool(arrival.published.all())
    sink.close()
    with open(path, "rb") as fh:
        assert fh.read() == data


def test_s3_bodies_come_through_signed_urls_and_anonymous_ones_through_obstore(moto, tmp_path):  # noqa: F811
    from fastload.remote.transport_obstore import ObstoreTransport

    client = moto.client()
    client.create_bucket(Bucket="rxbkt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a b+c.bin").write_bytes(DATA)
    upload_dir(client, str(tmp_path / "d"), "rxbkt", "ds")
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto.endpoint,
                                                                       "region_name": "us-east-1"}}
    t = ObstoreTransport("s3://rxbkt/ds", opts, connect_timeout=5, read_timeout=5)
    url = t.url_of("a b+c.bin")
    assert url is not None and "X-Amz-Signature=" in url and "/rxbkt/ds/a%20b%2Bc.bin?" in url
    stats = TransferStats()
    got = bytearray()
    t.range_into("a b+c.bin", 100, 300_000, lambda at, piece: got.extend(piece) or True, stats, chunk=65536)
    assert bytes(got) == DATA[100:300_000]
    assert stats.snapshot()["bytes"] == 300_000 - 100
    t.close()
    streamed = ObstoreTransport("s3://rxbkt/ds", opts, connect_timeout=5, read_timeout=5, receive="obstore")
    assert streamed.url_of("x") is None
    anon = ObstoreTransport("s3://rxbkt/ds", {"anon": True, "client_kwargs": {"endpoint_url": moto.endpoint}},
                            connect_timeout=5, read_timeout=5)
    assert anon.receiver is None and anon.url_of("a b+c.bin") is None
