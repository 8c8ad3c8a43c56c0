"""fastload: keeps GPUs fed during training.

`formats/` and `cuda_ops/` live at the top of the repository (the design card) but
install as `fastload.formats` and `fastload.cuda_ops`, so no generic top-level name
lands in site-packages.
"""

import os
import re
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class _OptionalBuildExt(build_ext):
    """The vision extensions speed up stages that also run without them (same output): a failed
    build (no C compiler or Python headers) warns and installs fastload without them."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - CCompilerError, DistutilsExecError, missing headers
            print(f"WARNING: could not build {ext.name} ({e}); fastload runs without it, slower")


def _ranges_extension() -> Extension:
    """fastload.formats._ranges with xxHash (formats/vendor, BSD 2-Clause) built in: on x86 with its
    run-time dispatcher (baseline flags: the widest vector unit is chosen when it runs)."""
    sources = ["formats/_ranges.c", "formats/vendor/xxhash.c"]
    macros = [("XXH_NAMESPACE", "fastload_")]  # no clash with another copy of xxHash in the process
    if re.search(r"x86_64|amd64|i[3-6]86", sysconfig.get_platform().lower()):
        sources.append("formats/vendor/xxh_x86dispatch.c")
        macros.append(("FASTLOAD_XXH_X86_DISPATCH", "1"))
    return Extension("fastload.formats._ranges", sources, define_macros=macros,
                     extra_compile_args=["-O3", "-fvisibility=hidden"],
                     depends=["formats/vendor/xxhash.h", "formats/vendor/xxh3.h", "formats/vendor/xxh_x86dispatch.h"])


def _vision_extensions() -> list[Extension]:
    """The image preset's C stages: fastload.vision._lut (the normalising lookup), and
    fastload.vision._jpegwin (windowed JPEG decode) when libjpeg-turbo's headers are present
    (Debian: libjpeg62-turbo-dev, installed by .ci/run); without it the preset decodes whole
    images with simplejpeg (same pixels, slower)."""
    exts = [Extension("fastload.vision._lut", ["fastload/vision/_lut.c"], extra_compile_args=["-O3"])]
    dirs = [sysconfig.get_config_var("INCLUDEDIR") or "/usr/include", "/usr/include", "/usr/local/include"]
    if any(os.path.exists(os.path.join(d, "jpeglib.h")) for d in dirs):
        exts.append(
            Extension(
                "fastload.vision._jpegwin",
                ["fastload/vision/_jpegwin.c"],
                libraries=["jpeg"],
                extra_compile_args=["-O2"],
            )
        )
    return exts


setup(
    name="fastload",
    version="0.1.0",
    description="A data loader that keeps GPUs fed: sharded format, zero-pickle workers, pinned ring, side-stream H2D.",
    python_requires=">=3.10",
    packages=[
        "fastload",
        *(f"fastload.{p}" for p in find_packages("fastload")),
        "fastload.formats",
        "fastload.cuda_ops",
    ],
    package_dir={
        "fastload": "fastload",
        "fastload.formats": "formats",
        "fastload.cuda_ops": "cuda_ops",
    },
    package_data={
        "fastload": ["py.typed"],
        "fastload.formats": ["FORMAT.md", "vendor/LICENSE-xxhash"],
        "fastload.cuda_ops": ["kernels/*.cu"],
    },
    install_requires=[
        "torch",
        "numpy",
        "h5py",
        "fsspec",
        "lmdb",
        "xxhash",
        "tqdm",
        "psutil",
        "pillow",
        "obstore>=0.12",  # the default transport of s3/gs/az/http(s) datasets (fastload.remote.transport_obstore)
    ],
    extras_require={
        "s3": ["s3fs>=2024.1"],  # unbounded, pip picks s3fs 0.4 (2020, pre-aiobotocore) beside moto
        "dali": ["nvidia-dali-cuda130"],
        # NVRTC + driver API for cuda_ops kernels, compiled at first use (never at install time).
        "cuda": ["cuda-bindings>=13,<14", "cuda-toolkit[nvrtc,cudart]==13.*"],
        "image": ["simplejpeg", "pillow"],
        "plot": ["matplotlib"],
        # frameworks driving a Loader, exercised by tests/test_frameworks.py and test_hf_datasets.py
        "frameworks": ["lightning", "accelerate", "datasets"],
        "ray": ["ray[data]>=2.60,<3"],  # the Ray version tested; write_ray / read_ray / `fastload convert --engine ray`
        # other loaders' formats: Lance (pylance) and Parquet (pyarrow) read in place or converted, Grain's
        # ArrayRecord files converted, TFRecord CRCs (crc32c), zstd-compressed MDS shards (zstandard),
        # brace patterns of WebDataset shards (braceexpand); WebDataset, TFRecord, MDS and LitData
        # chunks are read without their own libraries
        "migrate": ["pylance", "pyarrow", "array-record", "crc32c>=2.4", "zstandard>=0.22", "braceexpand>=0.1.7"],
        # the writers tests/test_migrate.py converts from (webdataset's ShardWriter, the tfrecord
        # package's TFRecordWriter), what MosaicML Streaming's MDSWriter imports (its compressors) and
        # what its StreamingDataset imports (catalogue; the `bench.remote --peers` Streaming rows).
        # mosaicml-streaming and litdata themselves are installed by the Makefile with --no-deps: their
        # own pins (numpy, transformers, torchvision) do not install beside torch 2.13.
        "migrate-test": ["webdataset>=1.0", "tfrecord>=1.14", "brotli", "python-snappy", "zstd", "catalogue>=2"],
        # `make docs`: the API reference (mkdocs + mkdocstrings, strict); `make test` builds it and type-checks.
        "docs": ["mkdocs>=1.6", "mkdocstrings[python]>=0.26", "mypy>=1.10"],
        "dev": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "moto[server]",
            "s3fs>=2024.1",
            "ruff",
            "simplejpeg",
            "cuda-bindings>=13,<14",
            "nvidia-cuda-nvrtc>=13,<14",
        ],
    },
    # fastload.formats._ranges: GIL-free copy of a batch's variable-length ranges and block checksums
    # (optional like the vision ones: without it, reads join memoryview slices and blocks are hashed one
    # Python call each; same bytes, slower)
    # fastload.remote._recv: an HTTP body's recv loop in C (optional too: without it `http.client` reads
    # the body, one Python call per recv)
    ext_modules=[
        *_vision_extensions(),
        _ranges_extension(),
        Extension("fastload.remote._recv", ["fastload/remote/_recv.c"], extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": _OptionalBuildExt},
    entry_points={"console_scripts": ["fastload=fastload.cli:main"]},
)
