"""What a GPU run carries: wheels for a GPU host with no network, DALI in carry-sized parts.

    python -m bench.gpu_bundle build    [--out build/gpu-bundle] [--python-version 3.12] [--no-dali]
    python -m bench.gpu_bundle receive  [--bundle build/gpu-bundle]            # on the GPU host, per call
    python -m bench.gpu_bundle install  [--bundle build/gpu-bundle] [--dali]   # on the GPU host

The GPU host (docs/gpu.md) has a `python3` (itself a virtual environment) with torch, numpy, h5py,
fsspec, xxhash, pillow, opencv, lightning, accelerate, pytest and hypothesis, and no network; each
call to it carries the working tree plus ignored files, at most 64 MiB in all. `build` (here, with network) downloads:

- `wheels/`: the runtime and test dependencies the host lacks (`CORE_WHEELS`, every one pinned and
  listed with its dependencies, downloaded `--no-deps` for the host's Python and platform), plus the
  pip that installs them; a few MiB, one carry path.
- `dali/part-NN` + `dali/manifest.json`: `nvidia-dali-cuda130` and the wheels it needs that the host
  lacks (`DALI_WHEELS`), each rewritten uncompressed (same files, so the same wheel to pip), tarred,
  xz-compressed and split into parts that fit one call's carry each. The manifest holds the sha256
  of every part, of the whole archive and of every wheel in it.

On the host, `receive` checks the parts a call carried against the manifest and moves them to a
stash outside the working tree (kept while the machine stays warm); `install` builds an environment
that sees every package of the host's `python3` (`environment`: the host's torch stays, and nothing
of the host's own environment changes), installs the wheels with `--no-index` from the bundle
only, installs fastload editable (its C extensions built by the host's compiler) and, with
`--dali`, assembles the parts (every sha256 checked) and installs DALI. Only the standard library
is needed to run this module.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = [
    "CORE_REQUIREMENTS",
    "CORE_WHEELS",
    "DALI_WHEELS",
    "ManifestError",
    "Part",
    "assemble",
    "build",
    "environment",
    "install",
    "load_manifest",
    "main",
    "pack_dali",
    "receive",
    "split_file",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BUNDLE = os.path.join(ROOT, "build", "gpu-bundle")
DEFAULT_ENV = os.path.join(ROOT, "build", "gpu-env")
DEFAULT_STASH = os.path.join(os.path.expanduser("~"), ".cache", "fastload-gpu-bundle")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# One call carries at most 64 MiB in all: the working tree (~2 MiB) rides along, so a part stays below 60 MiB.
PART_BYTES = 58 << 20

# What the host lacks, with everything each needs that is not on the host either: simplejpeg and
# lmdb (runtime), cuda-bindings + cuda-pathfinder (cuda_ops' NVRTC and driver API, normally already
# there with torch's CUDA build), tqdm and psutil (runtime, normally there with lightning/accelerate),
# pytest, pytest-timeout and hypothesis (the CUDA tests). `pip` installs the rest, run from its wheel.
CORE_WHEELS = (
    "pip==26.3",
    "simplejpeg==1.9.0",
    "lmdb==3.0.0",
    "cuda-bindings==13.5.0",
    "cuda-pathfinder==1.9.1",
    "tqdm==4.70.1",
    "psutil==7.2.2",
    "pytest==9.2.0",
    "pluggy==1.7.0",
    "iniconfig==2.3.1",
    "packaging==26.3",
    "pygments==2.21.0",
    "pytest-timeout==2.4.0",
    "hypothesis==6.170.17",
    "sortedcontainers==2.4.0",
)
# Installed by name with no version: what the host already has satisfies them and stays as it is.
CORE_REQUIREMENTS = (
    "simplejpeg", "lmdb", "cuda-bindings>=13,<14", "cuda-pathfinder", "tqdm", "psutil", "pytest", "pytest-timeout",
    "hypothesis",
)
# nvidia-dali-cuda130 and its dependencies that are not on the host (numpy, packaging and six are).
DALI_WHEELS = (
    "nvidia-dali-cuda130==2.4.0",
    "nvidia-libnvcomp-cu13==5.3.0.16",
    "nvidia-nvimgcodec-cu13==0.9.0.20",
    "nvidia-nvjpeg==13.3.2.43",
    "nvidia-nvjpeg2k-cu13==0.11.0.51",
    "nvidia-nvtiff-cu13==0.8.0.82",
    "nvtx==0.2.17",
    "libcst==1.9.0",
    "pyyaml==6.0.4",
    "optree==0.20.0",
    "typing-extensions==4.16.0",
    "astunparse==1.6.3",
    "gast==0.7.0",
    "makefun==1.16.0",
    "six==1.17.0",
    "wheel==0.48.0",
)
DALI_REQUIREMENT = "nvidia-dali-cuda130"
MANIFEST = "manifest.json"
ARCHIVE = "dali-wheels.tar.xz"


class ManifestError(RuntimeError):
    """A bundle part or wheel that is missing or does not match its manifest."""


@dataclass(frozen=True)
class Part:
    """One piece of a split file: its name (a plain file name), size and sha256."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- split / join


def split_file(path: str, out_dir: str, *, part_bytes: int = PART_BYTES, prefix: str = "part-") -> list[Part]:
    """Cut `path` into `out_dir/<prefix>NN` files of at most `part_bytes` each."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    os.makedirs(out_dir, exist_ok=True)
    parts: list[Part] = []
    with open(path, "rb") as src:
        while True:
            chunk = src.read(part_bytes)
            if not chunk and parts:
                break
            name = f"{prefix}{len(parts):02d}"
            with open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(chunk)
            parts.append(Part(name, len(chunk), hashlib.sha256(chunk).hexdigest()))
            if len(chunk) < part_bytes:
                break
    return parts


def _plain_name(name: Any, what: str) -> str:
    """A manifest's file name, refused unless it is a plain name (the manifest is not trusted)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ManifestError(f"manifest: {what} name {name!r} is not a plain file name")
    return name


def load_manifest(path: str) -> dict[str, Any]:
    """Read and check the shape of a DALI manifest; every name in it is a plain file name."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ManifestError(f"manifest {path}: cannot read it ({exc})") from exc
    try:
        archive = data["archive"]
        parts = [Part(_plain_name(p["name"], "part"), int(p["size"]), str(p["sha256"])) for p in data["parts"]]
        wheels = {_plain_name(w["name"], "wheel"): str(w["sha256"]) for w in data["wheels"]}
        archive = {"name": _plain_name(archive["name"], "archive"), "size": int(archive["size"]),
                   "sha256": str(archive["sha256"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"manifest {path}: malformed ({exc!r})") from exc
    if not parts:
        raise ManifestError(f"manifest {path}: lists no parts")
    if sum(p.size for p in parts) != archive["size"]:
        raise ManifestError(f"manifest {path}: parts add up to {sum(p.size for p in parts)} bytes, "
                            f"the archive is {archive['size']}")
    return {**data, "archive": archive, "parts": parts, "wheels": wheels}


def _check_part(path: str, part: Part) -> None:
    if not os.path.isfile(path):
        raise ManifestError(f"part {part.name}: missing ({path})")
    size = os.path.getsize(path)
    if size != part.size:
        raise ManifestError(f"part {part.name}: {size} bytes, the manifest says {part.size} ({path})")
    digest = sha256_file(path)
    if digest != part.sha256:
        raise ManifestError(f"part {part.name}: sha256 {digest}, the manifest says {part.sha256} ({path})")


class _Joined(io.RawIOBase):
    """The parts read back to back as one stream, each checked against its sha256 as it ends."""

    def __init__(self, directory: str, parts: Sequence[Part]) -> None:
        self._dir, self._parts, self._index = directory, list(parts), -1
        self._fh: BinaryIO | None = None
        self._part_hash = hashlib.sha256()
        self._part_size = 0
        self.whole = hashlib.sha256()
        self.size = 0
        self._next()

    def _next(self) -> None:
        if self._fh is not None:
            part = self._parts[self._index]
            self._fh.close()
            if self._part_size != part.size or self._part_hash.hexdigest() != part.sha256:
                raise ManifestError(f"part {part.name}: changed while being read "
                                    f"({self._part_size} bytes, sha256 {self._part_hash.hexdigest()})")
        self._index += 1
        self._fh = None
        if self._index < len(self._parts):
            self._fh = open(os.path.join(self._dir, self._parts[self._index].name), "rb")  # noqa: SIM115
            self._part_hash, self._part_size = hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._fh is not None:
            n = self._fh.readinto(buffer)
            if n:
                view = memoryview(buffer)[:n]
                self._part_hash.update(view)
                self.whole.update(view)
                self._part_size += n
                self.size += n
                return n
            self._next()
        return 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        super().close()


# ----------------------------------------------------------------------------- build (CPU side, with network)


def _stored_copy(src: str, dst: str) -> None:
    """Rewrite a wheel with every member uncompressed: the same files (so the same RECORD hashes and
    the same wheel to pip), but xz then compresses the whole much better than per-file deflate."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED, allowZip64=True) as zout:
        for info in zin.infolist():
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_STORED
            with zin.open(info) as fin, zout.open(out, "w", force_zip64=info.file_size >= 1 << 31) as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)


def pack_dali(wheel_paths: Sequence[str], out_dir: str, *, part_bytes: int = PART_BYTES,
              preset: int = 6) -> dict[str, Any]:
    """Wheels -> uncompressed copies -> one tar.xz -> parts in `out_dir`, with `out_dir/manifest.json`."""
    os.makedirs(out_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(out_dir, "part-*")):
        os.remove(stale)
    wheels = []
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        archive = os.path.join(tmp, ARCHIVE)
        with lzma.open(archive, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w|") as tar:
            for path in sorted(wheel_paths, key=os.path.basename):
                name = os.path.basename(path)
                stored = os.path.join(tmp, name)
                _stored_copy(path, stored)
                wheels.append({"name": name, "sha256": sha256_file(stored), "size": os.path.getsize(stored),
                               "download_size": os.path.getsize(path)})
                info = tar.gettarinfo(stored, arcname=name)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                with open(stored, "rb") as fh:
                    tar.addfile(info, fh)
                os.remove(stored)
        parts = split_file(archive, out_dir, part_bytes=part_bytes)
        manifest = {"archive": {"name": ARCHIVE, "size": os.path.getsize(archive), "sha256": sha256_file(archive)},
                    "parts": [p.to_json() for p in parts], "wheels": wheels, "requirement": DALI_REQUIREMENT}
    with open(os.path.join(out_dir, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")
    return manifest


def _clean_pip_env() -> dict[str, str]:
    """The environment for pip with every PIP_* setting and pip config file out of the way, so that
    only the command line decides where packages come from (here and on the host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def download(requirements: Sequence[str], dest: str, *, python_version: str) -> None:
    """`pip download --only-binary=:all: --no-deps` of pinned requirements for the host's Python/platform."""
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
           "--python-version", python_version, *[f"--platform={p}" for p in PLATFORMS], "-d", dest, *requirements]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _wheel_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.whl")))


def build(out: str, *, python_version: str, dali: bool, part_bytes: int) -> None:
    """Fill `out` with `wheels/` (one carry path) and, with `dali`, `dali/part-NN` + `dali/manifest.json`."""
    wheels = os.path.join(out, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    download(CORE_WHEELS, wheels, python_version=python_version)
    core = _wheel_files(wheels)
    core_bytes = sum(os.path.getsize(p) for p in core)
    print(f"wheels/: {len(core)} wheels, {core_bytes / 2**20:.1f} MiB")
    if not dali:
        return
    src = os.path.join(out, "dali-download")  # what pip downloaded: not carried
    download(DALI_WHEELS, src, python_version=python_version)
    downloaded = _wheel_files(src)
    print(f"packing {len(downloaded)} DALI wheels ({sum(map(os.path.getsize, downloaded)) / 2**20:.1f} MiB "
          "as downloaded) into xz parts; a few minutes", flush=True)
    manifest = pack_dali(downloaded, os.path.join(out, "dali"), part_bytes=part_bytes)
    archive = manifest["archive"]["size"]
    print(f"dali/: {len(manifest['parts'])} parts of at most {part_bytes / 2**20:.0f} MiB, "
          f"{archive / 2**20:.1f} MiB in all (sha256 {manifest['archive']['sha256'][:16]}...)")


# ----------------------------------------------------------------------------- the GPU host


def receive(bundle: str, stash: str) -> tuple[list[str], list[str]]:
    """Check the parts this call carried (under `bundle/dali`) against the manifest and move them to
    `stash`; returns (part names now in the stash, names still missing)."""
    manifest = load_manifest(os.path.join(bundle, "dali", MANIFEST))
    os.makedirs(stash, exist_ok=True)
    shutil.copyfile(os.path.join(bundle, "dali", MANIFEST), os.path.join(stash, MANIFEST))
    have, missing = [], []
    for part in manifest["parts"]:
        carried, kept = os.path.join(bundle, "dali", part.name), os.path.join(stash, part.name)
        if os.path.isfile(carried):
            _check_part(carried, part)
            shutil.move(carried, kept)
        if os.path.isfile(kept):
            have.append(part.name)
        else:
            missing.append(part.name)
    return have, missing


def assemble(stash: str, dest: str) -> list[str]:
    """Join the stashed parts, check every sha256 (parts, archive, wheels) and unpack the wheels into
    `dest`; returns their paths. Raises ManifestError naming the first part or wheel that is wrong."""
    manifest = load_manifest(os.path.join(stash, MANIFEST))
    for part in manifest["parts"]:
        _check_part(os.path.join(stash, part.name), part)
    os.makedirs(dest, exist_ok=True)
    joined = _Joined(stash, manifest["parts"])
    got: list[str] = []
    with io.BufferedReader(joined, 1 << 20) as raw, tarfile.open(fileobj=raw, mode="r|xz") as tar:
        for member in tar:
            name = _plain_name(member.name, "archive member")
            if name not in manifest["wheels"] or not member.isfile():
                raise ManifestError(f"{ARCHIVE}: member {name!r} is not a wheel the manifest lists")
            src = tar.extractfile(member)
            assert src is not None  # a regular file
            path = os.path.join(dest, name)
            h = hashlib.sha256()
            with open(path + ".tmp", "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != manifest["wheels"][name]:
                os.remove(path + ".tmp")
                raise ManifestError(f"{ARCHIVE}: wheel {name} has sha256 {h.hexdigest()}, "
                                    f"the manifest says {manifest['wheels'][name]}")
            os.replace(path + ".tmp", path)
            got.append(path)
        raw.read()  # to the end: the whole archive's sha256 covers every byte
    archive = manifest["archive"]
    if joined.size != archive["size"] or joined.whole.hexdigest() != archive["sha256"]:
        raise ManifestError(f"{ARCHIVE}: {joined.size} bytes with sha256 {joined.whole.hexdigest()}, "
                            f"the manifest says {archive['size']} bytes, {archive['sha256']}")
    missing = sorted(set(manifest["wheels"]) - {os.path.basename(p) for p in got})
    if missing:
        raise ManifestError(f"{ARCHIVE}: the manifest's wheels {missing} are not in it")
    return got


def _pip_command(python: str, wheels: str) -> list[str]:
    """The bundled pip, run from its wheel by `python` (the host's own pip may be old or missing)."""
    found = sorted(glob.glob(os.path.join(wheels, "pip-*.whl")))
    if not found:
        raise ManifestError(f"no pip wheel in {wheels}: run `make gpu-bundle` on a machine with network first")
    return [python, os.path.join(found[-1], "pip"), "--disable-pip-version-check"]


def _run(cmd: Sequence[str], **kwargs: Any) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(list(cmd), check=True, env=_clean_pip_env(), **kwargs)


def environment(env_dir: str, base_python: str) -> str:
    """The Python to install into: `env_dir`, a venv that sees every package of `base_python` (created
    once; nothing of the host's own environment is changed). Over a system Python the venv's
    `--system-site-packages` does that; where `base_python` is itself a virtual environment (the GPU
    host's `python3` is), a `.pth` file adds that environment's site-packages after the venv's own."""
    probe = subprocess.run(
        [base_python, "-c", "import json, site, sys; print(json.dumps([sys.prefix != sys.base_prefix, "
                            "site.getsitepackages()]))"],
        capture_output=True, text=True, check=True)
    in_venv, site_dirs = json.loads(probe.stdout)
    python = os.path.join(env_dir, "bin", "python")
    if not os.path.exists(python):
        _run([base_python, "-m", "venv", "--without-pip", "--system-site-packages", env_dir])
    if in_venv:
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(purelib, "_fastload_host_site.pth"), "w") as fh:
            fh.write("".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs))
        print(f"{base_python} is a virtual environment: {env_dir} sees its packages through "
              f"{purelib}/_fastload_host_site.pth")
    return python


def install(bundle: str, *, env_dir: str, base_python: str, dali: bool, stash: str) -> str:
    """Install the bundle's wheels, fastload (editable, its C extensions built here) and, with `dali`,
    the assembled DALI wheels, from the bundle only (`--no-index`); returns the Python to run."""
    wheels = os.path.join(bundle, "wheels")
    python = environment(env_dir, base_python)
    pip = _pip_command(python, wheels)
    links = ["--no-index", "--find-links", wheels]
    _run([*pip, "install", *links, *CORE_REQUIREMENTS])
    _run([*pip, "install", *links, "--no-deps", "--no-build-isolation", "-e", ROOT])
    if dali:
        have, missing = receive(bundle, stash)  # the last part rides with this call
        if missing:
            raise ManifestError(f"DALI parts {' '.join(missing)} never reached {stash} (have {' '.join(have)}): "
                                "carry them with `receive` calls first (docs/gpu.md)")
        dali_wheels = os.path.join(bundle, "dali-wheels")
        assemble(stash, dali_wheels)
        _run([*pip, "install", *links, "--find-links", dali_wheels, DALI_REQUIREMENT])
    report = ("import sys, torch, fastload, glob, os; "
              "print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, "
              "'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); "
              "print('C extensions', sorted(os.path.basename(p) for d in ('fastload/vision', 'formats') "
              "for p in glob.glob(os.path.join(d, '*.so'))))")
    _run([python, "-c", report], cwd=ROOT)
    return python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and pack the bundle (needs network)")
    b.add_argument("--out", default=DEFAULT_BUNDLE)
    b.add_argument("--python-version", default="3.12", help="the GPU host's Python (default 3.12)")
    b.add_argument("--no-dali", action="store_true", help="only wheels/, no DALI parts")
    b.add_argument("--part-mib", type=float, default=PART_BYTES / 2**20, help="DALI part size (MiB)")
    for name in ("receive", "install", "assemble"):
        p = sub.add_parser(name)
        p.add_argument("--bundle", default=DEFAULT_BUNDLE)
        p.add_argument("--stash", default=os.environ.get("FASTLOAD_GPU_STASH", DEFAULT_STASH),
                       help="where received DALI parts wait for the last one (outside the working tree)")
        if name == "install":
            p.add_argument("--env", default=DEFAULT_ENV, help="the venv over the system Python")
            p.add_argument("--python", default="python3", help="the host's Python (default python3)")
            p.add_argument("--dali", action="store_true", help="also assemble and install DALI")
    args = ap.parse_args(argv)
    try:
        if args.command == "build":
            build(args.out, python_version=args.python_version, dali=not args.no_dali,
                  part_bytes=int(args.part_mib * 2**20))
        elif args.command == "receive":
            have, missing = receive(args.bundle, args.stash)
            print(f"DALI parts in {args.stash}: {len(have)} of {len(have) + len(missing)}"
                  + (f"; still to carry: {' '.join(missing)}" if missing else "; all here"))
        elif args.command == "assemble":
            got = assemble(args.stash, os.path.join(args.bundle, "dali-wheels"))
            print(f"assembled and verified {len(got)} wheels")
        else:
            python = install(args.bundle, env_dir=args.env, base_python=args.python, dali=args.dali,
                             stash=args.stash)
            print(f"gpu-install: done; run the check with `make gpu-check GPU_PYTHON={python}`")
    except (ManifestError, subprocess.CalledProcessError) as exc:
        print(f"gpu-bundle {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
