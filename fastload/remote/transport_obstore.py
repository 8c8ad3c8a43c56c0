"""Shard transfers through obstore (Rust `object_store`): S3, GCS, Azure and HTTP(S) in one client.

`ObstoreTransport` reads one dataset's objects. Each call runs in the calling thread (a `RemoteStorage`
fetch thread) with the GIL released while it waits. Streamed bodies (a shard's download, a reader's
long out-of-order GET) are received by `HttpReceiver` (`fastload.remote.receive_http`: the standard
library's `http.client` reading into one reused buffer per thread) from a URL obstore gives: the
object's own for http(s), a signed one (`obstore.sign`) for S3, GCS and Azure. A store that cannot sign
(anonymous access, requester-pays, credentials without a signing key) streams through obstore itself
(`receive="obstore"`, also forced by `transport="obstore-stream"`). Small reads (manifest, the block
table, a reader's short out-of-order ranges) go through obstore. Python code runs once per `chunk`
of body (write into the cache file and hash), not per socket read. obstore's own retries are off
(`max_retries=0`): fastload's `RetryPolicy` counts every attempt. Errors of either are turned into
the standard exceptions `fastload.retry.is_transient` judges (`TimeoutError`, `ConnectionError`,
`FileNotFoundError`, `PermissionError`, `HTTPStatusError` with the status), each with the first line
of the server's or obstore's message.

`store_config` maps fsspec-style `storage_options` (s3fs, gcsfs, adlfs, http keys) onto the obstore
client; options it cannot map raise `UnmappedOptions` (the "auto" transport then keeps fsspec).

obstore's runtime (tokio) does not survive `fork`: a process forked after its parent used obstore
(`usable_here()` False: a Loader's process workers) reads through fsspec instead.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any

from fastload.remote.receive_http import HttpReceiver, HTTPStatusError
from fastload.remote.transfer_stats import TransferStats

__all__ = [
    "OBSTORE_SCHEMES",
    "STREAM_CHUNK",
    "TRANSPORTS",
    "HTTPStatusError",
    "ObstoreTransport",
    "UnmappedOptions",
    "choose_transport",
    "store_config",
]

TRANSPORTS = ("auto", "obstore", "obstore-stream", "fsspec")
OBSTORE_SCHEMES = {
    "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure", "abfs": "azure",
    "abfss": "azure", "http": "http", "https": "http",
}
# Body bytes handed to the sink per Python call (a reader's streamed GET; a shard's own download uses
# `storage.DOWNLOAD_CHUNK`): a piece this small is still in the CPU's L2 when it is written and hashed.
STREAM_CHUNK = 256 << 10
_PARTS_IN_FLIGHT = 4  # ranged GETs of one shard outstanding at once
SIGN_EXPIRES_S = 3600  # a signed URL is made for each GET: its life only has to cover that GET
RECEIVERS = ("http", "obstore")

log = logging.getLogger("fastload.remote.storage")

# fsspec options that configure fsspec's own instance bookkeeping, not the connection: ignored here
_FSSPEC_ONLY = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous",
                "loop", "default_block_size", "default_cache_type", "default_fill_cache", "cache_regions"}


_STARTED_IN: int | None = None  # the process whose obstore runtime was started by this module


def usable_here() -> bool:
    """Whether obstore works in this process: no obstore client was built before a fork into it."""
    return _STARTED_IN is None or os.getpid() == _STARTED_IN


class UnmappedOptions(ValueError):
    """`storage_options` hold keys the obstore client has no equivalent for."""


def _bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


def store_config(url: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(obstore `config`, `client_options`) for `url` from fsspec-style `storage_options`.

    s3: `key`/`secret`/`token` (or `aws_access_key_id`/...) -> credentials, `anon` -> `skip_signature`,
    `endpoint_url` (top level or in `client_kwargs`) -> `endpoint` (http:// allowed), `region_name`
    (top level, `client_kwargs` or `config_kwargs`) -> `region`, `requester_pays` -> `request_payer`,
    `config_kwargs={"s3": {"addressing_style": "virtual"}}` -> `virtual_hosted_style_request`.
    gcs: `token="anon"` -> `skip_signature`, another `token` string -> `service_account` (a key file);
    `endpoint_url` -> `base_url`. azure: `account_name`, `account_key`, `sas_token` -> `sas_key`,
    `anon` -> `skip_signature`. http(s): `headers` (or `client_kwargs["headers"]`) -> `default_headers`.
    Every scheme: `config_kwargs` connect/read timeouts and `retries` are fastload's own settings and
    are ignored here, as are fsspec's instance options. Anything else raises `UnmappedOptions`."""
    kind = OBSTORE_SCHEMES[url.split("://", 1)[0].lower()]
    opts = {k: v for k, v in options.items() if k not in _FSSPEC_ONLY}
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    config_kwargs = dict(opts.pop("config_kwargs", None) or {})
    for k in ("connect_timeout", "read_timeout", "retries"):
        config_kwargs.pop(k, None)
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}

    def take(src: dict[str, Any], names: tuple[str, ...], dest: str, conv: Any = None) -> None:
        for n in names:
            if n in src:
                v = src.pop(n)
                if v is not None:
                    config[dest] = conv(v) if conv else v

    if kind == "s3":
        for src in (opts, client_kwargs):
            take(src, ("key", "aws_access_key_id"), "access_key_id")
            take(src, ("secret", "aws_secret_access_key"), "secret_access_key")
            take(src, ("token", "aws_session_token"), "session_token")
            take(src, ("endpoint_url",), "endpoint")
            take(src, ("region_name",), "region")
        take(config_kwargs, ("region_name",), "region")
        take(opts, ("anon",), "skip_signature", _bool)
        take(opts, ("requester_pays",), "request_payer", _bool)
        s3 = dict(config_kwargs.pop("s3", None) or {})
        style = s3.pop("addressing_style", None)
        if style is not None:
            config["virtual_hosted_style_request"] = style == "virtual"
        if s3:
            config_kwargs["s3"] = s3  # left unmapped
    elif kind == "gcs":
        tok = opts.pop("token", None)
        if tok == "anon":
            config["skip_signature"] = True
        elif isinstance(tok, str):
            config["service_account"] = tok
        elif tok is not None:
            opts["token"] = tok  # a credentials object: left unmapped
        take(opts, ("endpoint_url",), "base_url")
        take(opts, ("anon",), "skip_signature", _bool)
        opts.pop("project", None)  # billing project: reads of a named bucket do not need it
    elif kind == "azure":
        take(opts, ("account_name",), "account_name")
        take(opts, ("account_key",), "account_key")
        take(opts, ("sas_token",), "sas_key")
        take(opts, ("anon",), "skip_signature", _bool)
    else:
        headers = opts.pop("headers", None) or client_kwargs.pop("headers", None)
        if headers:
            client["default_headers"] = {str(k): str(v) for k, v in dict(headers).items()}
    if str(config.get("endpoint", config.get("base_url", ""))).startswith("http://") or kind == "http":
        client["allow_http"] = True
    left = sorted(opts) + [f"client_kwargs[{k!r}]" for k in sorted(client_kwargs)] + [
        f"config_kwargs[{k!r}]" for k in sorted(config_kwargs)
    ]
    if left:
        raise UnmappedOptions(f"{url}: storage_options {', '.join(left)} have no obstore equivalent")
    return config, client


def choose_transport(url: str, transport: str, options: dict[str, Any]) -> str:
    """"obstore" or "fsspec" for `url`: "auto" picks obstore for s3/gs/az/http(s) URLs whose
    `storage_options` it can map (`store_config`), fsspec otherwise; "obstore" (or "obstore-stream",
    the same client receiving its bodies itself) on another scheme or with unmappable options raises
    ValueError naming them (ImportError without obstore)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"{url}: transport={transport!r}; expected one of {', '.join(map(repr, TRANSPORTS))}")
    if transport == "fsspec":
        return "fsspec"
    forced = transport != "auto"
    scheme = url.split("://", 1)[0].lower()
    if scheme not in OBSTORE_SCHEMES:
        if forced:
            raise ValueError(f"{url}: transport={transport!r} reads {', '.join(sorted(OBSTORE_SCHEMES))} URLs only")
        return "fsspec"
    try:
        store_config(url, options)
        import obstore  # noqa: F401 - a dependency; without it "auto" keeps fsspec
    except (UnmappedOptions, ImportError):
        if forced:
            raise
        return "fsspec"
    return "obstore"


_STATUS = re.compile(r"\b(?:status(?: code)?[:=]?\s*|non-2xx status code: )(\d{3})\b", re.IGNORECASE)


def translate(exc: BaseException, what: str) -> BaseException:
    """A standard exception for an obstore error (`exc` itself when it is not one)."""
    import obstore.exceptions as oe

    if not isinstance(exc, oe.BaseError):
        return exc
    text = str(exc)
    head = f"{what}: {text.splitlines()[0] if text else type(exc).__name__}"
    if isinstance(exc, oe.NotFoundError):
        return FileNotFoundError(head)
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        return PermissionError(head)
    if "kind: Timeout" in text or "TimedOut" in text or "timed out" in text.lower():
        return TimeoutError(head)
    m = _STATUS.search(text)
    if m:
        return HTTPStatusError(head, int(m.group(1)))
    if "HTTP error" in text or "error sending request" in text or "connection" in text.lower():
        return ConnectionError(head)  # no response status: refused, reset, closed mid-body, cut short
    return exc


class ObstoreTransport:
    """GETs of `url`'s objects (paths relative to it) through one obstore client of this process.

    `connect_timeout` bounds each connection's set-up, `read_timeout` each wait for body bytes (obstore's
    `ClientConfig`, and `HttpReceiver`'s); no request retries inside obstore. `receive`: who receives
    streamed bodies, "http" (`HttpReceiver`, where the store gives a URL to GET) or "obstore"."""

    def __init__(self, url: str, options: dict[str, Any], *, connect_timeout: float, read_timeout: float,
                 receive: str = "http") -> None:
        from obstore.store import from_url

        global _STARTED_IN
        if receive not in RECEIVERS:
            raise ValueError(f"{url}: receive={receive!r}; expected one of {', '.join(map(repr, RECEIVERS))}")
        if not usable_here():
            raise RuntimeError(f"{url}: obstore cannot run in a process forked after its parent used it")
        _STARTED_IN = os.getpid()
        self.url = url.rstrip("/")
        self.kind = OBSTORE_SCHEMES[self.url.split("://", 1)[0].lower()]
        config, client = store_config(self.url, options)
        headers = dict(client.get("default_headers", {}))
        client.setdefault("connect_timeout", timedelta(seconds=connect_timeout))
        client.setdefault("read_timeout", timedelta(seconds=read_timeout))
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=0)}
        self.store = from_url(self.url, config=config or None, client_options=client, retry_config=retry)
        # signing needs credentials and covers no extra headers: those stores stream through obstore
        signable = self.kind == "http" or not (config.get("skip_signature") or config.get("request_payer"))
        self.receiver = (
            HttpReceiver(connect_timeout=connect_timeout, read_timeout=read_timeout, headers=headers)
            if receive == "http" and signable else None
        )

    def url_of(self, path: str) -> str | None:
        """A URL `HttpReceiver` can GET `path` from: the object's own (http(s)), a signed one (S3, GCS,
        Azure); None when bodies stream through obstore (`receive="obstore"`, or a store that cannot
        sign: from the first failure on)."""
        if self.receiver is None:
            return None
        if self.kind == "http":
            return f"{self.url}/{urllib.parse.quote(path, safe='/')}"
        import obstore

        try:
            return str(obstore.sign(self.store, "GET", path, timedelta(seconds=SIGN_EXPIRES_S)))
        except Exception as exc:  # noqa: BLE001 - credentials that cannot sign: obstore streams instead
            log.debug("%s: cannot sign GETs (%r): bodies stream through obstore", self.url, exc)
            self.receiver = None
            return None

    def close(self) -> None:
        """Close the receiver's idle connections."""
        if self.receiver is not None:
            self.receiver.close()

    def cat(self, path: str) -> bytes:
        """The whole object at `path` (small files: manifest, meta)."""
        import obstore

        try:
            return bytes(obstore.get(self.store, path).bytes())
        except Exception as exc:
            raise translate(exc, f"{self.url}/{path}") from exc

    def _body(self, path: str, stats: TransferStats, chunk: int, **options: Any) -> Iterator[Any]:
        """One GET of `path` (obstore `options`: `range`), its body in `chunk`-byte pieces as they arrive
        (`HttpReceiver`'s, each valid until the next is asked for, where `url_of` gives a URL; else
        obstore's): each counted in `stats`' bytes; time to the response headers counts as `request_s`,
        the waits for pieces as `receive_s`; errors translated. Closing it drops the response."""
        receiver = self.receiver
        url = None if receiver is None else self.url_of(path)
        if receiver is not None and url is not None:
            yield from receiver.body(url, f"{self.url}/{path}", stats, chunk, options.get("range"))
            return
        import obstore

        t0 = t1 = time.perf_counter()
        recv = 0.0
        try:
            result = obstore.get(self.store, path, options=options or None)
            t1 = time.perf_counter()
            stream = result.stream(min_chunk_size=chunk)
            while True:
                t = time.perf_counter()
                try:
                    b = next(stream)
                except StopIteration:
                    break
                recv += time.perf_counter() - t
                stats.add("bytes", len(b))
                yield b
        except Exception as exc:
            raise translate(exc, f"{self.url}/{path}") from exc
        finally:
            stats.add_many(request_s=t1 - t0, receive_s=recv)

    def stream_into(self, path: str, sink: Any, stats: TransferStats, chunk: int = STREAM_CHUNK) -> None:
        """One whole-object GET of `path`, each `chunk` of body handed to `sink.write` as it arrives."""
        for b in self._body(path, stats, chunk):
            sink.write(b)

    def range_into(self, path: str, start: int, end: int, write: Any, stats: TransferStats,
                   chunk: int = STREAM_CHUNK) -> None:
        """Bytes [start, end) of `path` in one ranged GET, each `chunk` of body handed to
        `write(offset, piece)` as it arrives; a `write` that returns False ends the GET there (the
        response is dropped). A body of another length raises `ConnectionError`."""
        pos = start
        more = True
        body = self._body(path, stats, chunk, range=(start, end))
        try:
            for b in body:
                if pos + len(b) > end:
                    raise ConnectionError(f"{self.url}/{path}: more than the {end - start} bytes of [{start}, {end})")
                more = write(pos, b)
                pos += len(b)
                if not more and pos < end:
                    break  # the rest is not wanted: the response is dropped (a body read to its end is not)
        finally:
            body.close()
        stats.add("ranged_parts", 1)
        if more and pos != end:
            raise ConnectionError(f"{self.url}/{path}: range [{start}, {end}) ended after {pos - start} bytes")

    def ranges(self, path: str, starts: list[int], ends: list[int], stats: TransferStats) -> list[Any]:
        """Bytes [starts[i], ends[i]) of `path` for every i, in one call: obstore runs the GETs at once,
        one per range, with the GIL released (not merged: bytes between ranges would be received and
        dropped; the caller merges the ranges worth merging); buffers of other lengths are returned as
        they came (the caller checks). A store that refuses ranges raises `NoRanges`."""
        import obstore
        import obstore.exceptions as oe

        from fastload.remote.get import NoRanges

        t0 = time.perf_counter()
        try:
            got = obstore.get_ranges(self.store, path, starts=starts, ends=ends, coalesce=0)
        except oe.NotSupportedError as exc:
            raise NoRanges from exc
        except Exception as exc:
            raise translate(exc, f"{self.url}/{path}") from exc
        stats.add_many(receive_s=time.perf_counter() - t0, bytes=sum(len(b) for b in got))
        return list(got)

    def ranged_into(self, path: str, sink: Any, part: int, stats: TransferStats) -> None:
        """The object in ranged GETs of `part` bytes, `_PARTS_IN_FLIGHT` at a time on threads of
        this call, each handed to `sink.write_at` as it arrives. A part of the wrong length (or a
        store that refuses ranges) raises `NoRanges`; on a failure no part not yet started starts."""
        import obstore
        import obstore.exceptions as oe

        from fastload.remote.get import NoRanges

        size = sink.size
        lock = threading.Lock()

        def one(start: int) -> None:
            end = min(size, start + part)
            t0 = time.perf_counter()
            try:
                data = obstore.get_range(self.store, path, start=start, end=end)
            except oe.NotSupportedError as exc:
                raise NoRanges from exc
            except Exception as exc:
                raise translate(exc, f"{self.url}/{path}") from exc
            stats.add_many(receive_s=time.perf_counter() - t0, bytes=len(data), ranged_parts=1)
            if len(data) != end - start:
                raise NoRanges
            with lock:
                sink.write_at(start, data)

        with ThreadPoolExecutor(_PARTS_IN_FLIGHT, thread_name_prefix="fastload-part") as pool:
            futures = [pool.submit(one, start) for start in range(0, size, part)]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
            if failed:
                for f in futures:
                    f.cancel()
                wait(futures)
                raise failed[0].exception()  # type: ignore[misc]
