"""Settings resolved once (`fastload.pipeline.config`): workers as asked, the rules on faked
machines, `describe()`, and autotuning only when asked for."""

from __future__ import annotations

import threading

import numpy as np
import psutil
import pytest

import fastload.pipeline.config as config_module
from fastload.loader import Loader
from fastload.pipeline import resolve_config


class ColumnsDS:
    """A batched dataset (the fast path's `get_batch`): threads by the worker-kind rule."""

    def __init__(self, n: int = 256) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"y": np.int64(i)}

    def get_batch(self, idx) -> dict:
        return {"y": np.asarray(idx, dtype=np.int64)}


class ItemDS(ColumnsDS):
    """A per-sample dataset: processes by the worker-kind rule."""

    get_batch = None  # type: ignore[assignment]


def _fastload_threads() -> set[threading.Thread]:
    """Live worker threads (a closed pool's threads may still be on their way out: compare sets)."""
    return {t for t in threading.enumerate() if t.name.startswith("fastload-") and t.name[9:].isdigit()}


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize(("ds", "kind"), [(ColumnsDS, "thread"), (ItemDS, "process")])
def test_num_workers_starts_exactly_that_many_workers(ds, kind, workers):
    """`num_workers=N` runs N workers of the rule's kind (threads for `get_batch`, processes
    otherwise), counted live while the epoch runs; the batches are those of 0 workers."""
    threads0, children0 = _fastload_threads(), _children()
    loader = Loader(ds(), batch_size=16, shuffle=True, seed=3, num_workers=workers)
    want = "inline" if workers == 0 else kind
    assert (loader.describe()["worker_kind"], loader.describe()["num_workers"]) == (want, workers)
    it = iter(loader)
    got = [next(it)["y"].tolist()]
    assert len(_fastload_threads() - threads0) == (workers if want == "thread" else 0)
    assert len(_children() - children0) == (workers if want == "process" else 0)
    got += [b["y"].tolist() for b in it]
    loader.close()
    assert got == [b["y"].tolist() for b in Loader(ds(), batch_size=16, shuffle=True, seed=3)]


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_worker_type_overrides_the_rule(kind):
    loader = Loader(ItemDS(64) if kind == "thread" else ColumnsDS(64), batch_size=16, num_workers=1, worker_type=kind)
    assert loader.describe()["worker_kind"] == kind
    assert sorted(int(y) for b in loader for y in b["y"]) == list(range(64))


@pytest.mark.parametrize(("ds", "kind"), [(ColumnsDS, "thread"), (ItemDS, "process")])
def test_torchs_warning_about_worker_processes_only_for_processes(ds, kind):
    """More workers than cores: torch's DataLoader warns that it "will create N worker processes";
    a Loader gives that warning when its workers are processes, not when they are threads."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = Loader(ds(), batch_size=16, num_workers=512)  # built, not iterated: no worker starts
    assert loader.describe()["worker_kind"] == kind
    said = [str(w.message) for w in caught if "worker processes in total" in str(w.message)]
    assert len(said) == (1 if kind == "process" else 0), said


@pytest.mark.parametrize("cores", [2, 8, 64])
@pytest.mark.parametrize("workers", [0, 1, 4, 16, 64])
def test_the_rules_on_a_faked_core_count(cores, workers):
    """Worker count never follows the cores; the consumer steals only while the workers leave a
    core free ("bounded" with CUDA, where its thread launches the GPU step); batches in flight
    are `prefetch_factor` per worker (+2 for a stealing consumer)."""
    for cuda in (False, True):
        cfg = resolve_config(
            mode="columns", num_workers=workers, worker_type="auto", prefetch_factor=2 if workers else None,
            timeout=0, worker_init=False, pin_memory=False, device=None, buffer_ring=None, ring_slots=None,
            prefetch=2, autotune=False, order_ahead=None, epoch_plan=True, cores=cores, cuda=cuda,
        )
        assert cfg.num_workers == workers and cfg.worker_kind == ("thread" if workers else "inline")
        steals = 0 < workers < cores
        assert cfg.steal == (("bounded" if cuda else "always") if steals else False)
        assert cfg.depth == (1 if workers == 0 else 2 * workers + 2 * steals)
        order_ahead = config_module.order_ahead_rule(cfg, direct=True, torch_threads=cores)
        busy = cores if workers == 0 else workers + steals  # alone on the direct path: torch's threads
        assert order_ahead == (cores > busy)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("cores", [8, 64])
def test_a_many_core_machine_runs_the_workers_asked_for(monkeypatch, cores):
    monkeypatch.setattr(config_module, "usable_cores", lambda: cores)
    threads0 = _fastload_threads()
    loader = Loader(ColumnsDS(), batch_size=16, shuffle=True, seed=1, num_workers=4)
    info = loader.describe()
    assert (info["cores"], info["worker_kind"], info["num_workers"], info["steal"]) == (cores, "thread", 4, "always")
    it = iter(loader)
    next(it)
    assert len(_fastload_threads() - threads0) == 4
    it.close()
    loader.close()


def test_describe_reports_the_resolved_settings():
    loader = Loader(ColumnsDS(), batch_size=16, shuffle=True, seed=0, num_workers=1, buffer_ring=True)
    info = loader.describe()
    assert info["order"] == "seeded shuffle" and info["direct_path"] is False and info["autotune"] is False
    assert info["ring_slots"] == info["depth"] + info["prefetch"] + 3 and info["pin"] is False
    assert info["h2d"] is None and info["mode"] == "columns"
    assert Loader(ItemDS(), batch_size=4).describe()["order"] == "sampler"


def test_autotune_is_opt_in_and_reports_its_decisions(monkeypatch):
    from fastload.pipeline import ThreadProbe

    plain = Loader(ColumnsDS(), batch_size=4, num_workers=1)
    list(plain)
    assert plain.autotune_probe is None and "thread_mode" not in plain.stats()
    for name, value in (("FIRST_S", 0.0), ("MIN_WINDOW_S", 0.0), ("WINDOW", 3), ("FILL", 3), ("MARGIN", 1e9)):
        monkeypatch.setattr(ThreadProbe, name, value)
    tuned = Loader(ColumnsDS(), batch_size=4, num_workers=1, autotune=True)
    list(tuned)
    report = tuned.describe()["autotune"]
    assert report["choice"] == "inline" and report["trials"] >= 1
    first = report["decisions"][0]
    assert first["choice"] == "inline" and first["inline_batches_per_s"] > 0 and first["threads_batches_per_s"] > 0
    stats = tuned.stats()
    assert stats["thread_mode"] == "inline" and stats["autotune_decisions"] == len(report["decisions"])
