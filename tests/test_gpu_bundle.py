"""bench.gpu_bundle: DALI's wheels split into carry-sized parts, received call by call, reassembled and
checked against the manifest (no network: small wheels made here)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.gpu_bundle import MANIFEST, ManifestError, assemble, environment, pack_dali, receive, split_file


def _wheel(path, files: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return str(path)


def _members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


@pytest.fixture
def wheels(tmp_path):
    src = tmp_path / "downloaded"
    src.mkdir()
    rnd = os.urandom(50_000)  # incompressible: several parts at the part size used below
    return [
        _wheel(src / "big-1.0-py3-none-any.whl", {"big/lib.so": rnd, "big-1.0.dist-info/RECORD": b"r\n"}),
        _wheel(src / "small-2.0-py3-none-any.whl", {"small/__init__.py": b"x = 1\n" * 1000}),
    ]


def _carry(bundle, names, remote_bundle) -> None:
    """One call: the manifest and the named parts copied into the remote tree's bundle."""
    (remote_bundle / "dali").mkdir(parents=True, exist_ok=True)
    for name in [MANIFEST, *names]:
        shutil.copyfile(bundle / "dali" / name, remote_bundle / "dali" / name)


def test_parts_fit_and_reassemble_to_the_same_wheels_over_several_calls(tmp_path, wheels):
    bundle, remote, stash = tmp_path / "bundle", tmp_path / "remote", tmp_path / "stash"
    manifest = pack_dali(wheels, str(bundle / "dali"), part_bytes=16_000, preset=0)
    parts = [p["name"] for p in manifest["parts"]]
    sizes = [os.path.getsize(bundle / "dali" / n) for n in parts]
    assert len(parts) >= 4 and all(s <= 16_000 for s in sizes) and sum(sizes) == manifest["archive"]["size"]
    assert [p["sha256"] for p in manifest["parts"]] == [
        hashlib.sha256((bundle / "dali" / n).read_bytes()).hexdigest() for n in parts]

    _carry(bundle, [parts[-1]], remote)  # the smallest part rides with the first call
    have, missing = receive(str(remote), str(stash))
    assert have == [parts[-1]] and missing == parts[:-1]
    assert not (remote / "dali" / parts[-1]).exists()  # moved out of the tree into the stash
    with pytest.raises(ManifestError, match=f"part {parts[0]}: missing"):
        assemble(str(stash), str(tmp_path / "out"))
    for name in parts[:-1]:
        _carry(bundle, [name], remote)
        have, missing = receive(str(remote), str(stash))
    assert have == parts and missing == []

    got = assemble(str(stash), str(tmp_path / "out"))
    assert sorted(os.path.basename(p) for p in got) == sorted(os.path.basename(w) for w in wheels)
    for original in wheels:
        rebuilt = tmp_path / "out" / os.path.basename(original)
        assert _members(rebuilt) == _members(original)  # same files: the same wheel to pip
        with zipfile.ZipFile(rebuilt) as zf:
            assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}


def test_a_corrupt_or_short_part_is_refused_naming_it(tmp_path, wheels):
    bundle, stash = tmp_path / "bundle", tmp_path / "stash"
    manifest = pack_dali(wheels, str(bundle / "dali"), part_bytes=16_000, preset=0)
    name = manifest["parts"][1]["name"]
    data = bytearray((bundle / "dali" / name).read_bytes())
    data[100] ^= 0xFF
    (bundle / "dali" / name).write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=f"part {name}: sha256 [0-9a-f]+, the manifest says"):
        receive(str(bundle), str(stash))
    (bundle / "dali" / name).write_bytes(bytes(data[:-1]))
    with pytest.raises(ManifestError, match=f"part {name}: {len(data) - 1} bytes, the manifest says {len(data)}"):
        receive(str(bundle), str(stash))


def test_a_wheel_that_does_not_match_the_manifest_is_refused(tmp_path, wheels):
    bundle, stash = tmp_path / "bundle", tmp_path / "stash"
    pack_dali(wheels, str(bundle / "dali"), part_bytes=16_000, preset=0)
    path = bundle / "dali" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["wheels"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    receive(str(bundle), str(stash))
    with pytest.raises(ManifestError, match=f"wheel {manifest['wheels'][0]['name']} has sha256 .*the manifest says 0+"):
        assemble(str(stash), str(tmp_path / "out"))
    assert not any(p.endswith(".tmp") for p in os.listdir(tmp_path / "out"))


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".."])
def test_manifest_names_must_be_plain_file_names(tmp_path, wheels, bad):
    bundle = tmp_path / "bundle"
    pack_dali(wheels, str(bundle / "dali"), part_bytes=16_000, preset=0)
    path = bundle / "dali" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["parts"][0]["name"] = bad
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="part name .* is not a plain file name"):
        receive(str(bundle), str(tmp_path / "stash"))


def test_parts_that_do_not_add_up_to_the_archive_are_refused(tmp_path, wheels):
    bundle = tmp_path / "bundle"
    pack_dali(wheels, str(bundle / "dali"), part_bytes=16_000, preset=0)
    path = bundle / "dali" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["parts"].pop()
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="parts add up to .* bytes, the archive is"):
        receive(str(bundle), str(tmp_path / "stash"))


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3000), part_bytes=st.integers(1, 700))
def test_split_file_parts_concatenate_to_the_file(tmp_path_factory, data, part_bytes):
    tmp = tmp_path_factory.mktemp("split")
    (tmp / "f").write_bytes(data)
    parts = split_file(str(tmp / "f"), str(tmp / "parts"), part_bytes=part_bytes)
    assert len(parts) == max(1, -(-len(data) // part_bytes))
    assert b"".join((tmp / "parts" / p.name).read_bytes() for p in parts) == data
    assert all(p.size <= part_bytes for p in parts)
    assert [p.sha256 for p in parts] == [hashlib.sha256((tmp / "parts" / p.name).read_bytes()).hexdigest()
                                         for p in parts]


def test_the_environment_over_a_virtual_environment_sees_its_packages(tmp_path):
    """The GPU host's python3 is itself a venv: the env made over it imports that venv's packages (a
    .pth file), and nothing is written into the host's venv."""
    host = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(host)], check=True, timeout=120)
    host_python = host / "bin" / "python"
    host_site = subprocess.run([str(host_python), "-c", "import site; print(site.getsitepackages()[0])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(host_site, "only_on_the_host.py"), "w") as fh:
        fh.write("VALUE = 42\n")
    before = sorted(os.listdir(host_site))
    python = environment(str(tmp_path / "env"), str(host_python))
    assert python == str(tmp_path / "env" / "bin" / "python")
    res = subprocess.run([python, "-c", "import sys, only_on_the_host; print(only_on_the_host.VALUE, sys.prefix)"],
                         capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["42", str(tmp_path / "env")]
    assert sorted(os.listdir(host_site)) == before
    assert environment(str(tmp_path / "env"), str(host_python)) == python  # made once, reused
