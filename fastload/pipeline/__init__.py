"""One epoch of the Loader as a chain of stages: order -> fetch -> transform -> pin -> device.

* `config`: `LoaderConfig`, the settings resolved once (every default rule in one place).
* `epoch`: `EpochIterator`, the chain for one epoch, reporting to its owner through `EpochHooks`,
  built from its `EpochStages`.
* `progress`: `EpochProgress`, a Loader's epoch, position and resume.
* `intake`: `build_stages`, the Loader's arguments to its settings, fetcher and kept workers.
* `autotune`: `ThreadProbe`, the opt-in inline-vs-threads comparison (`Loader(autotune=True)`).
"""

from fastload.pipeline.autotune import ThreadProbe
from fastload.pipeline.config import LoaderConfig, resolve_config
from fastload.pipeline.epoch import EpochHooks, EpochIterator, EpochStages

__all__ = ["EpochHooks", "EpochIterator", "EpochStages", "LoaderConfig", "ThreadProbe", "resolve_config"]
