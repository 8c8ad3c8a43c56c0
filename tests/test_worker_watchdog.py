"""A process worker ends soon after its parent is SIGKILLed, also inside a long transform."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import psutil
import torch

from fastload import Loader


class Slow(torch.utils.data.Dataset):
    """Writes the worker's pid, then sleeps in `__getitem__` (a long transform: the worker's main
    thread never gets back to its task loop)."""

    def __init__(self, pid_file: str) -> None:
        self.pid_file = pid_file

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        with open(self.pid_file + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(self.pid_file + ".tmp", self.pid_file)
        time.sleep(120)
        return i


def _parent(pid_file: str) -> None:
    for _ in Loader(Slow(pid_file), batch_size=2, num_workers=1, worker_type="process"):
        pass


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_worker_exits_when_its_parent_is_killed_mid_transform(tmp_path):
    pid_file = str(tmp_path / "worker.pid")
    parent = mp.get_context("fork").Process(target=_parent, args=(pid_file,))
    parent.start()
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(pid_file), "the worker never started its transform"
        with open(pid_file) as fh:
            worker = int(fh.read())
        assert worker != parent.pid and not _gone(worker)
        os.kill(parent.pid, signal.SIGKILL)
        parent.join()
        t0 = time.monotonic()
        while not _gone(worker) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert _gone(worker), "the worker outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.join()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)
