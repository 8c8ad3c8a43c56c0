"""One way for the tests to start a local Ray cluster in this process.

Every test module that starts Ray goes through `local_ray`, so all of them run with the same
environment: Ray remembers a session's authentication mode in the process, and a second
`ray.init` in the same pytest process with another mode leaves its workers unable to report
their results (tasks then hang in `take_all`)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


@contextmanager
def local_ray(extra_env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A 2-CPU local Ray cluster (small object store, no dashboard) for the `with` block; yields its
    GCS address and restores the environment afterwards."""
    import ray

    env = {**RAY_ENV, **(extra_env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             logging_level="WARNING", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
