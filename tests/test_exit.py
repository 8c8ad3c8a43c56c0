"""Objects collected while the interpreter exits, when module globals may already be None, clean up
what they can and report nothing ("Exception ignored in ... __del__" on every exit otherwise)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

from fastload.formats import sources
from fastload.remote import receive_http
from fastload.remote.cache import shard_cache


def _receiver():
    return receive_http.HttpReceiver(connect_timeout=1.0, read_timeout=1.0)


def _cache(tmp_path):
    return shard_cache.ShardCache(str(tmp_path / "cache"), limit="1MB")


def _json_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n')
    lines = sources.JsonLines(str(path))
    lines[0]  # opens its file
    return lines


@pytest.mark.parametrize(("module", "make"), [(receive_http, lambda _: _receiver()), (shard_cache, _cache),
                                              (sources, _json_lines)])
def test_collected_with_its_modules_globals_gone(module, make, tmp_path, monkeypatch):
    unraisable: list[str] = []
    obj = make(tmp_path)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_value!r} in {u.object!r}"))
    saved = module.os
    module.os = None  # what the interpreter's module teardown leaves
    try:
        del obj
        gc.collect()
    finally:
        module.os = saved
    assert unraisable == []


@pytest.mark.nginx
def test_a_remote_epoch_then_exit_prints_nothing(tmp_path):
    """A script that reads a remote dataset and exits without closing anything: no traceback at exit."""
    import numpy as np

    from fastload.formats import write

    root = tmp_path / "root"
    write(({"x": np.full(100, i, np.uint8)} for i in range(200)), str(root / "ds"), shard_size=5_000, progress=False)
    script = textwrap.dedent(f"""
        import boto3, fastload  # boto3 changes the order modules are torn down in
        from bench.remote import Nginx
        server = Nginx({str(root)!r}, {str(tmp_path)!r})
        ds = fastload.open_dataset(server.url + "/ds", cache_dir={str(tmp_path / "cache")!r}, cache_limit="64MB")
        for batch in fastload.Loader(ds, batch_size=16, shuffle=True, num_workers=2):
            pass
        print("read", len(ds))
        server.stop()  # the server only: the dataset, its storage and the loader are left to the exit
    """)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import boto3  # noqa: F401
    except ImportError:
        pytest.skip("needs boto3")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=repo)
    if "nginx" in run.stderr and run.returncode:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "read 200"
    assert run.stderr == "", run.stderr


@pytest.mark.nginx
def test_a_script_that_fails_leaves_no_nginx_and_no_open_pipe(tmp_path):
    """`bench.remote.Nginx` in a script that raises before `stop()`: the script's output ends with it
    (nginx holds none of its streams) and the server is gone once the script exited."""
    (tmp_path / "root").mkdir()
    script = textwrap.dedent(f"""
        from bench.remote import Nginx
        server = Nginx({str(tmp_path / "root")!r}, {str(tmp_path)!r})
        print(server.proc.pid, flush=True)
        raise SystemExit("failed before stop()")
    """)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=repo)
    if "nginx" in run.stderr and "failed before stop()" not in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.stderr.strip() == "failed before stop()"
    pid = int(run.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.nginx
def test_an_nginx_object_collected_stops_its_server(tmp_path):
    from bench.remote import Nginx

    (tmp_path / "root").mkdir()
    try:
        server = Nginx(str(tmp_path / "root"), str(tmp_path))
    except RuntimeError as e:
        pytest.skip(str(e))
    proc = server.proc
    assert proc.poll() is None
    del server
    gc.collect()
    assert proc.poll() is not None
