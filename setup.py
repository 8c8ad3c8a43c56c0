"""fastload: keeps GPUs fed during training.

`formats/` and `cuda_ops/` live at the top of the repository (the design card) but
install as `fastload.formats` and `fastload.cuda_ops`, so no generic top-level name
lands in site-packages.
"""

from setuptools import find_packages, setup

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
        "fastload.formats": ["FORMAT.md"],
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
    ],
    extras_require={
        "s3": ["s3fs>=2024.1"],  # unbounded, pip picks s3fs 0.4 (2020, pre-aiobotocore) beside moto
        "dali": ["nvidia-dali-cuda130"],
        # NVRTC + driver API for cuda_ops kernels, compiled at first use (never at install time).
        "cuda": ["cuda-bindings>=13,<14", "cuda-toolkit[nvrtc,cudart]==13.*"],
        "image": ["simplejpeg", "pillow"],
        "plot": ["matplotlib"],
        "ray": ["ray[data]>=2.60,<3"],  # the Ray version tested; write_ray / read_ray / `fastload convert --engine ray`
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
    entry_points={"console_scripts": ["fastload=fastload.cli:main"]},
)
