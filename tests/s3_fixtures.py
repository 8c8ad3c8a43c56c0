"""Real S3 for tests: a `moto` server subprocess on 127.0.0.1 and a fault-injecting HTTP proxy.

`MotoServer` runs `python -m moto.server` on a free port (`kill()` / `start()` for crash tests), over
HTTPS when given a certificate (`make_tls_files` writes a CA and a 127.0.0.1 certificate it signed).
`FaultProxy` forwards HTTP to it and, for a fraction of requests, answers 503 SlowDown, drops the
connection before answering, or cuts a response body short; it counts requests per method/path.
Import the pytest fixtures from this module in a test file: `from s3_fixtures import moto, ...`.
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import pytest

__all__ = ["FaultProxy", "MotoServer", "TlsFiles", "free_port", "make_tls_files", "moto", "s3_bucket",
           "storage_options", "upload_dir"]

REGION = "us-east-1"
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class TlsFiles(NamedTuple):
    """PEM files: `ca` (trust it: `SSL_CERT_FILE`, `AWS_CA_BUNDLE`), the server's `cert` and `key`."""

    ca: str
    cert: str
    key: str


def make_tls_files(directory: str) -> TlsFiles:
    """A CA valid for a day and a certificate for 127.0.0.1 it signed, written under `directory`
    (a separate CA: rustls, obstore's TLS, refuses a CA certificate used as the server's own)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fastload test CA")])

    def signed(subject: x509.Name, public_key: Any, *, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    files = TlsFiles(*(os.path.join(directory, n) for n in ("ca.pem", "cert.pem", "key.pem")))
    pem = serialization.Encoding.PEM
    with open(files.ca, "wb") as f:
        f.write(signed(ca_name, ca_key.public_key(), ca=True).public_bytes(pem))
    with open(files.cert, "wb") as f:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
        f.write(signed(name, key.public_key(), ca=False).public_bytes(pem))
    with open(files.key, "wb") as f:
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


class MotoServer:
    """`moto.server` in a subprocess on 127.0.0.1 (state lives in that process); over HTTPS with
    `tls` (clients must trust `tls.ca`)."""

    def __init__(self, port: int | None = None, *, tls: TlsFiles | None = None) -> None:
        self.port = port or free_port()
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        tls = ["-c", self.tls.cert, "-k", self.tls.key] if self.tls else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port), *tls],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        _wait_port(self.port)
        return self

    def kill(self) -> None:
        """SIGKILL the server (its objects are lost, like a crashed node)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id="testing", aws_secret_access_key="testing",
                            verify=self.tls.ca if self.tls else None)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _forward(self) -> None:
        proxy = self.server.owner
        body = b""
        if "content-length" in self.headers:
            body = self.rfile.read(int(self.headers["content-length"]))
        fault = proxy.pick_fault(self.command)
        proxy.count(self.command, self.path, fault)
        if fault == "503":
            msg = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Reduce request rate</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        if fault == "drop":
            self._drop()
            return
        try:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
        except OSError:
            with proxy._lock:
                proxy.fault_counts["upstream-down"] += 1
            self._drop()  # upstream down: the client sees a reset connection
            return
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "truncate" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self._drop()
            return
        self.wfile.write(data)

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # resets are the point of this proxy
            super().handle_error(request, client_address)


class FaultProxy:
    """Reverse proxy to `upstream_port` that injects faults into a `fail_rate` fraction of requests.

    `faults` chooses among "503", "drop" (no answer, connection reset) and "truncate" (half a body,
    then reset; GETs only). `down = True` answers every request with 503. `counts` holds
    (method, path) -> requests that reached the proxy; `gets(prefix)` counts successful GETs.
    """

    def __init__(self, upstream_port: int, *, fail_rate: float = 0.0,
                 faults: tuple[str, ...] = ("503", "drop", "truncate"), seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.fail_rate, self.faults = fail_rate, faults
        self.down = False
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.fault_counts: Counter[str] = Counter()
        self.ok_gets: Counter[str] = Counter()
        self.server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self.server.owner = self
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def pick_fault(self, method: str) -> str | None:
        with self._lock:
            if self.down:
                return "503"
            if self.fail_rate <= 0 or self._rng.random() >= self.fail_rate:
                return None
            choices = [f for f in self.faults if f != "truncate" or method == "GET"]
            return self._rng.choice(choices) if choices else None

    def count(self, method: str, path: str, fault: str | None) -> None:
        with self._lock:
            self.counts[(method, path.split("?", 1)[0])] += 1
            if fault:
                self.fault_counts[fault] += 1
            elif method == "GET":
                self.ok_gets[path.split("?", 1)[0]] += 1

    def gets(self, prefix: str = "") -> int:
        """GET requests (any outcome) whose path starts with `prefix`."""
        with self._lock:
            return sum(n for (m, p), n in self.counts.items() if m == "GET" and p.startswith(prefix))

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.fault_counts.clear()
            self.ok_gets.clear()


def storage_options(endpoint: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """s3fs options for a local endpoint; botocore's own retries are off so fastload's are tested."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": timeout, "read_timeout": timeout},
        "skip_instance_cache": True,
    }


def upload_dir(client: Any, local_dir: str, bucket: str, prefix: str) -> list[str]:
    """Upload every file under `local_dir` to s3://bucket/prefix/...; returns the keys."""
    keys = []
    for dirpath, _, files in os.walk(local_dir):
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            key = f"{prefix}/{os.path.relpath(path, local_dir)}"
            client.upload_file(path, bucket, key)
            keys.append(key)
    return keys


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    """A moto S3 server for the test module, stopped afterwards."""
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3_bucket(moto: MotoServer) -> str:
    """A fresh bucket on the module's moto server."""
    name = f"b{random.getrandbits(40):x}"
    moto.client().create_bucket(Bucket=name)
    return name
