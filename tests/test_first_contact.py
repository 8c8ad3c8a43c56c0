"""First contact: the CLI's version, lazy imports and argument errors; Loader / open_dataset messages."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import fastload
from fastload.cli import main
from fastload.formats import write
from fastload.formats.units import plural

# Runs the CLI in a fresh interpreter and reports whether torch got imported.
_PROBE = (
    "import atexit, sys; atexit.register(lambda: print('TORCH', 'torch' in sys.modules, file=sys.stderr)); "
    "from fastload.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.fixture(scope="module")
def small_ds(tmp_path_factory):
    out = tmp_path_factory.mktemp("fc") / "ds"
    write(({"x": np.full(4, i, np.float32), "t": np.arange(i % 3 + 1)} for i in range(40)), str(out), progress=False)
    return str(out)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastload {fastload.__version__}"


@pytest.mark.parametrize("args", [["--help"], ["inspect", "{ds}"], ["verify", "{ds}"], ["convert", "--help"]])
def test_cli_does_not_import_torch(small_ds, args):
    res = _cli(*(a.format(ds=small_ds) for a in args))
    assert res.returncode == 0, res.stderr
    assert "TORCH False" in res.stderr


def test_bench_help_still_lists_its_options():
    res = _cli("bench", "--help")
    assert res.returncode == 0, res.stderr
    assert "--step-ms" in res.stdout and "--workers" in res.stdout


@pytest.mark.parametrize("value, words", [("-2", "expected a number >= 0, got -2"), ("two", "expected a whole number")])
def test_convert_rejects_bad_workers(tmp_path, capsys, value, words):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.uint8))
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "out"), "--workers", value])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plurals(tmp_path, capsys):
    assert plural(1, "shard") == "1 shard" and plural(2, "shard") == "2 shards" and plural(0, "sample") == "0 samples"
    np.save(tmp_path / "x.npy", np.zeros((3, 2), np.uint8))
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "ds"), "--quiet"]) == 0
    assert "wrote 3 samples in 1 shard (" in capsys.readouterr().out
    shard = next((tmp_path / "ds" / "shards").iterdir())
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "ds")]) == 1
    assert "1 problem found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(seed="abc"), TypeError, "seed must be an int, got 'abc' (str)"),
        (dict(seed=1.5), TypeError, "seed must be an int, got 1.5 (float)"),
        (dict(seed=True), TypeError, "seed must be an int"),
        (dict(num_workers=1.5), TypeError, "num_workers must be an int"),
        (dict(rank=2, world_size=2), ValueError, "rank must be < world_size, got rank=2, world_size=2"),
        (dict(world_size=0), ValueError, "world_size must be >= 1, got 0"),
        (dict(prefetch=0), ValueError, "prefetch must be >= 1, got 0"),
        (dict(ring_slots=2), ValueError, "ring_slots must be >= 3, got 2"),
        (dict(worker_type="fiber"), ValueError, "worker_type must be one of"),
        (dict(device="gpu"), ValueError, "device='gpu' is not a device"),
        (dict(device=1.0), TypeError, "device must be None, a str, an int or a torch.device"),
    ],
)
def test_loader_argument_errors(small_ds, kw, exc, words):
    ds = fastload.open_dataset(small_ds)
    with pytest.raises(exc) as err:
        fastload.Loader(ds, batch_size=4, **kw)
    assert words in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message needs a machine without CUDA")
def test_cuda_device_without_cuda_names_what_was_found(small_ds):
    ds = fastload.open_dataset(small_ds)
    with pytest.raises(RuntimeError) as err:
        fastload.Loader(ds, batch_size=4, device="cuda")
    text = str(err.value)
    assert "device='cuda' needs CUDA" in text and torch.__version__ in text and "device='cpu'" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_index_past_the_devices():
    from fastload.validate import check_device

    with pytest.raises(ValueError, match="CUDA device"):
        check_device("device", f"cuda:{torch.cuda.device_count()}")


def test_open_dataset_on_files_says_what_to_do(tmp_path, small_ds):
    h5 = tmp_path / "data.h5"
    h5.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"read it in place with fastload\.HDF5Dataset.*fastload convert"):
        fastload.open_dataset(h5)
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(FileNotFoundError, match=r"is a file, not a fastload dataset directory; convert it first"):
        fastload.open_dataset(npy)
    with pytest.raises(FileNotFoundError, match="open its directory"):
        fastload.open_dataset(f"{small_ds}/index.json")
    lmdb = pytest.importorskip("lmdb")
    env = lmdb.open(str(tmp_path / "db"))
    env.close()
    with pytest.raises(FileNotFoundError, match=r"LMDB environment.*fastload\.LMDBDataset"):
        fastload.open_dataset(tmp_path / "db")


def test_missing_s3_backend_names_the_extra(monkeypatch):
    import importlib
    import importlib.util
    import sys

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "s3fs", None)  # importing it raises ImportError, as when it is absent
    # an earlier test that read s3:// left s3fs registered: as absent, it is not
    monkeypatch.delitem(importlib.import_module("fsspec.registry")._registry, "s3", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'fastload\[s3\]'"):
        fastload.open_dataset("s3://bucket/ds")


def test_installed_backend_is_found_without_importing_it():
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("s3fs") is None:
        pytest.skip("s3fs is not installed: this checks that an installed backend is found without importing it")

    code = "import sys, fastload.dataset as d; d._check_protocol('s3://b/x'); print('s3fs' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_unknown_protocol():
    with pytest.raises(ValueError, match="unknown storage protocol 'nosuch'"):
        fastload.open_dataset("nosuch://bucket/ds")


def test_text_collate_unknown_field_names_the_fields(tmp_path):
    write(({"input_ids": np.arange(i % 5 + 1, dtype=np.int32), "y": i} for i in range(20)), str(tmp_path / "t"),
          progress=False)
    ds = fastload.open_dataset(tmp_path / "t")
    loader = fastload.Loader(ds, batch_size=4, transform=fastload.TextCollate(field="tokens"))
    with pytest.raises(KeyError) as err:
        next(iter(loader))
    assert "TextCollate(field='tokens'): no such field in the batch (fields: ['input_ids', 'y'])" in str(err.value)


def test_inspect_quantiles_match_numpy(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101, 5000):
        lengths = rng.integers(0, 300, n)
        out = tmp_path / f"ds{n}"
        write(({"t": bytes(int(k))} for k in lengths), str(out), progress=False)
        assert main(["inspect", str(out)]) == 0
        text = capsys.readouterr().out
        shown = re.search(r"length: min \d+, mean [\d.]+, p50 (\d+), p99 (\d+), max", text)
        assert shown is not None, text
        assert [int(x) for x in shown.groups()] == [int(np.percentile(lengths, 100 * q)) for q in (0.5, 0.99)]


@pytest.mark.parametrize("package", ["fastload", "fastload.formats"])
def test_every_public_name_imports(package):
    # in a fresh interpreter, so that no name is found only because another test imported its module
    code = (f"import importlib; m = importlib.import_module({package!r}); "
            "missing = [n for n in m.__all__ if n not in ('read_ray', 'write_ray') and getattr(m, n, None) is None]; "
            "print(sorted(m.__all__) == sorted(set(m.__all__)), missing)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True []"


def test_ray_names_resolve_or_name_the_extra():
    import fastload.formats as formats

    try:
        assert callable(formats.write_ray)
    except ImportError as exc:
        assert "ray" in str(exc).lower()


def test_unknown_name_is_an_attribute_error():
    import fastload.formats as formats

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        formats.nope  # noqa: B018
    with pytest.raises(ImportError):
        exec("from fastload.formats import nope", {})


_HEAVY = ("torch", "h5py", "lmdb", "fsspec", "PIL", "psutil", "fastload.formats.writer", "fastload.loader")


def test_inspect_imports_only_the_reader(small_ds):
    code = (
        "import sys, contextlib, io; from fastload.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()): rc = main(['inspect', {small_ds!r}])\n"
        f"print(rc, [m for m in {_HEAVY!r} if m in sys.modules])"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0 []"

