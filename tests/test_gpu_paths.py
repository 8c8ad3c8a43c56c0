"""GPU-path choices: the pad_value check on both paths, the staging ring's device guard, stream and
lock discipline, the ring's fence wait outside its lock, worker threads' device and stream.

CPU tests drive the CUDA-facing code through fakes of `torch.cuda`; the CUDA tests skip without a GPU.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from fastload.fetch.text_collate import PinnedStaging, TextCollate
from fastload.formats.ragged import Ragged
from fastload.transfer.ring import BufferRing
from fastload.transfer.side_stream import use_worker_stream, worker_stream
from fastload.workers.kept import thread_init as _thread_init

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tokens(dtype=np.uint16) -> Ragged:
    return Ragged(np.arange(1, 8, dtype=dtype), np.array([0, 3, 7], dtype=np.int64))


# -- pad_value ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [None, "cpu", "cuda"])
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_pad_value_outside_the_token_dtype_raises_on_every_path(device, mode):
    """The check runs before the path is chosen: a CUDA collate raises here without touching CUDA."""
    collate = TextCollate(pad_value=-1, mode=mode, device=device)
    with pytest.raises(ValueError, match=r"pad_value=-1 does not fit the 'input_ids' tokens' dtype uint16"):
        collate({"input_ids": _tokens()})
    assert TextCollate(pad_value=7, mode=mode)({"input_ids": _tokens()})["input_ids"].dtype == torch.int64


def test_pad_values_outside_the_output_dtypes_raise_at_construction():
    with pytest.raises(ValueError, match=r"pad_value=300 does not fit the output dtype uint8"):
        TextCollate(pad_value=300, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"labels_pad_value=.* does not fit the labels dtype int64"):
        TextCollate(labels=True, labels_pad_value=2**63)


# -- the staging ring through a fake torch.cuda ---------------------------------------------------------
class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class FakeCuda:
    """Records which device is current when each call happens; an event's `synchronize` calls
    `on_sync()` (when set) and records what it returns."""

    def __init__(self) -> None:
        self.current: torch.device | None = None
        self.calls: list[tuple[str, object, object]] = []
        self.on_sync = None
        fake = self

        class Event:
            def record(self, stream) -> None:
                fake.calls.append(("record", stream.device, fake.current))

            def synchronize(self) -> None:
                on_sync, fake.on_sync = fake.on_sync, None
                fake.calls.append(("synchronize", on_sync() if on_sync else None, fake.current))

        self.Event = Event

    @contextlib.contextmanager
    def device(self, device):
        before, self.current = self.current, torch.device(device)
        try:
            yield
        finally:
            self.current = before

    def current_stream(self, device) -> FakeStream:
        self.calls.append(("current_stream", torch.device(device), self.current))
        return FakeStream(torch.device(device))


def _finishes_in_another_thread(fn) -> bool:
    """Whether `fn()` run by another thread returns within 2 s (it would block on a lock held here)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(2.0)
    return not t.is_alive()


def test_staging_guards_the_device_records_on_its_stream_and_waits_outside_the_lock(monkeypatch):
    fake = FakeCuda()
    staging = PinnedStaging(slots=2, pin=False, cuda=fake)
    allocated_under: list[object] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        allocated_under.append(fake.current)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    target = torch.device("meta")  # a device `.to` reaches without a GPU; the fake sees which one is used
    parts = [np.arange(3, dtype=np.int64), np.arange(5, dtype=np.uint16)]
    out = staging.transfer(parts, target)
    assert [t.device for t in out] == [target, target] and [t.shape for t in out] == [(3,), (5,)]
    assert out[1].dtype == torch.uint16
    staging.transfer(parts, target)  # the second slot
    # the first slot again: while its copy is waited for, another thread transfers through the second
    fake.on_sync = lambda: _finishes_in_another_thread(lambda: staging.transfer(parts, target))
    staging.transfer(parts, target)
    assert allocated_under == [target, target]  # the pinned allocations ran under the target device's guard
    records = [c for c in fake.calls if c[0] == "record"]
    assert records == [("record", target, target)] * 4  # on the target device's stream, under its guard
    syncs = [c for c in fake.calls if c[0] == "synchronize"]
    # outside the lock (the other thread's transfer finished meanwhile) and before any device guard;
    # then the other thread's own wait for the second slot's copy
    assert syncs == [("synchronize", None, None), ("synchronize", True, None)]


def test_staging_round_trips_bytes_on_cpu():
    fake = FakeCuda()
    fake.device = lambda d: contextlib.nullcontext()
    staging = PinnedStaging(slots=2, pin=False, cuda=fake)
    parts = [np.array([0, 5, 9], dtype=np.int64), np.arange(9, dtype=np.int32) * 7]
    for _ in range(3):
        out = staging.transfer(parts, torch.device("cpu"))
        assert [o.numpy().tolist() for o in out] == [p.tolist() for p in parts]


# -- the buffer ring waits on a fence outside its lock --------------------------------------------------
def test_ring_waits_on_a_fence_outside_its_lock():
    ring = BufferRing(2, pin=False)
    seen: list[bool] = []
    first, slot = ring.write({"x": torch.arange(4)})
    second, other = ring.write({"x": torch.arange(4)})
    del first, second  # dropped by the user: the slots may be rewritten once their fences complete

    class Fence:
        def synchronize(self) -> None:  # while it is waited for, another thread takes the other slot
            seen.append(_finishes_in_another_thread(lambda: ring.write({"x": torch.arange(4)})))

    class Pending:  # a copy still reading the other slot, done once waited for
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            pass

    ring.release(slot, Fence())
    ring.release(other, Pending())
    out, again = ring.write({"x": torch.arange(4) + 1})  # both fenced, none to allocate: the oldest
    assert seen == [True] and again is slot and out["x"].tolist() == [1, 2, 3, 4]


class _Copy:
    """A fence: a copy reading a slot, done when `done` is set; records the waits."""

    def __init__(self, waits: list[str], name: str) -> None:
        self.waits, self.name, self.done = waits, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits.append(self.name)
        self.done = True


def test_ring_packs_the_next_batch_beside_the_copies_in_flight():
    """A ring takes a free slot whose copy has finished; while it may hold more buffers it
    allocates one rather than wait for a copy still reading a free slot; only with every slot
    allocated and fenced does it wait, for the oldest."""
    ring = BufferRing(3, pin=False)
    waits: list[str] = []
    copies = []
    for k in range(3):  # each batch's copy is still running when the next batch is packed
        batch, slot = ring.write({"x": torch.full((4,), k)})
        del batch
        copies.append(_Copy(waits, f"copy{k}"))
        ring.release(slot, copies[-1])
    assert ring.allocations == 3 and waits == []
    copies[1].done = True  # the second copy finished: its slot is taken, nobody waits
    batch, slot = ring.write({"x": torch.full((4,), 3)})
    assert waits == [] and ring.allocations == 3
    del batch
    ring.release(slot, _Copy(waits, "copy3"))
    batch, slot = ring.write({"x": torch.full((4,), 4)})  # all fenced, none finished: the oldest
    assert waits == ["copy0"] and ring.allocations == 3 and batch["x"].tolist() == [4] * 4


def test_ring_reuses_the_most_recently_released_finished_slot():
    """Of the free slots whose copies have finished, the newest is taken: packing batch after
    batch alone keeps rewriting one buffer (warm in the CPU's caches), not each in turn."""
    ring = BufferRing(3, pin=False)
    held = [ring.write({"x": torch.full((4,), k)}) for k in range(3)]
    slots = [slot for _, slot in held]
    del held
    for slot in slots:
        ring.release(slot)
    batch, slot = ring.write({"x": torch.full((4,), 7)})
    assert slot is slots[2] and batch["x"].tolist() == [7] * 4
    del batch
    ring.release(slot)
    for k in range(4):
        batch, again = ring.write({"x": torch.full((4,), k)})
        assert again is slots[2] and batch["x"].tolist() == [k] * 4
        del batch
        ring.release(again)
    waits: list[str] = []
    pending = _Copy(waits, "copy")  # the newest is still being copied: the newest finished one instead
    batch, slot = ring.write({"x": torch.full((4,), 8)})
    del batch
    ring.release(slot, pending)
    batch, other = ring.write({"x": torch.full((4,), 9)})
    assert batch["x"].tolist() == [9] * 4
    assert other is slots[1] and waits == [] and ring.allocations == 3


# -- worker threads: the Loader's device and the consumer's stream -----------------------------------------
class FakeThreadCuda:
    def __init__(self) -> None:
        self.local = threading.local()
        self.log: list[tuple[str, object, str]] = []

    def current_stream(self, index: int) -> tuple[str, int, str]:
        return ("stream", index, threading.current_thread().name)

    def set_device(self, index: int) -> None:
        self.log.append(("set_device", index, threading.current_thread().name))

    def set_stream(self, stream) -> None:
        self.log.append(("set_stream", stream, threading.current_thread().name))


def test_worker_threads_take_the_loaders_device_and_the_starting_threads_stream(monkeypatch):
    fake = FakeThreadCuda()
    for name in ("current_stream", "set_device", "set_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    ran: list[int] = []
    init = _thread_init(ran.append, 1)  # built by the consumer's thread at iter(loader)
    consumer = threading.current_thread().name
    t = threading.Thread(target=init, args=(0,), name="fastload-0")
    t.start()
    t.join()
    assert fake.log == [("set_device", 1, "fastload-0"), ("set_stream", ("stream", 1, consumer), "fastload-0")]
    assert ran == [0]


def test_no_cuda_device_means_no_cuda_calls(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("no CUDA call expected")

    monkeypatch.setattr(torch.cuda, "set_device", boom)
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    assert worker_stream(None) is None
    use_worker_stream(None, None)
    _thread_init(None, None)(0)


# -- on a GPU ------------------------------------------------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_cuda_collate_equals_cpu_and_checks_pad_value(mode):
    batch = {"input_ids": _tokens(np.int32)}
    cpu = TextCollate(mode=mode, pad_value=3, labels=True)(batch)
    dev = TextCollate(mode=mode, pad_value=3, labels=True, device="cuda")(batch)
    for k, v in cpu.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dev[k].cpu(), v), k
    with pytest.raises(ValueError, match="pad_value=-1"):
        TextCollate(mode=mode, pad_value=-1, device="cuda")({"input_ids": _tokens()})


@cuda_only
def test_cuda_staging_on_the_last_gpu_records_on_its_stream():
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    recorded: list[object] = []

    class Cuda:  # torch.cuda, noting the stream each copy's event is recorded on
        device, current_stream = staticmethod(torch.cuda.device), staticmethod(torch.cuda.current_stream)

        class Event(torch.cuda.Event):
            def record(self, stream=None) -> None:
                recorded.append(stream)
                super().record(stream)

    staging = PinnedStaging(slots=1, cuda=Cuda)
    side = torch.cuda.Stream(last)
    with torch.cuda.device(last), torch.cuda.stream(side):
        for i in range(4):
            out = staging.transfer([np.full(1000, i, dtype=np.int64)], last)
            assert out[0].device == last and int(out[0].sum()) == 1000 * i
    assert recorded == [side] * 4


@cuda_only
def test_cuda_transform_in_worker_threads_is_ordered_before_the_consumer():
    from fastload import Loader

    class OnGpu(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            x = torch.full((1 << 16,), float(i), device="cuda")
            for _ in range(20):  # queue enough work that an unordered read would see it unfinished
                x = x * 1.0
            return x

    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        loader = Loader(OnGpu(), batch_size=4, num_workers=2, worker_type="thread", device="cuda")
        for b, batch in enumerate(loader):
            expect = torch.arange(4 * b, 4 * b + 4, device="cuda", dtype=torch.float32)
            assert torch.equal(batch[:, 0], expect)


def test_pin_fence_without_a_device_waits_for_every_stream_of_the_device():
    """pin_memory without `device`: the user's copies may be on any stream, so the slot's fence
    waits for the whole device (not one stream's event) before the slot is rewritten."""
    from fastload.transfer.side_stream import DeviceWideFence

    calls: list[int] = []

    class Cuda:
        def synchronize(self, index: int) -> None:
            calls.append(index)

    ring = BufferRing(1, pin=False)
    first, slot = ring.write({"x": torch.arange(3)})
    del first
    ring.release(slot, DeviceWideFence(2, cuda=Cuda()))
    assert calls == []
    ring.write({"x": torch.arange(3)})
    assert calls == [2]


def test_a_closed_ring_lets_go_of_its_buffers():
    """An epoch's end closes its ring: free slots are dropped at once and slots given back later
    are dropped too, so their (pinned) memory returns to torch's allocator for the next epoch; a
    batch the user still holds keeps its own buffer."""
    import gc
    import weakref

    ring = BufferRing(3, pin=False)
    kept, slot_kept = ring.write({"x": torch.arange(4)})
    out, slot_out = ring.write({"x": torch.arange(4) + 10})
    dropped, slot_free = ring.write({"x": torch.arange(4) + 20})
    del dropped
    ring.release(slot_free)
    free_buf = weakref.ref(slot_free.buf)
    del slot_free
    assert ring.live == 3
    ring.close()
    gc.collect()
    assert ring.live == 2 and free_buf() is None
    out_buf = weakref.ref(slot_out.buf)
    del out
    ring.release(slot_out)
    del slot_out
    gc.collect()
    assert ring.live == 1 and out_buf() is None
    ring.release(slot_kept)
    del slot_kept
    assert ring.live == 0 and kept["x"].tolist() == [0, 1, 2, 3]  # the user's batch is untouched


@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "worker_type": "thread"}])
def test_an_epochs_end_closes_its_ring(workers):
    """Once an epoch is delivered its ring holds no buffer (the next epoch's ring reuses the memory
    through torch's allocator), and the batch the user kept is still intact."""
    from fastload import Loader

    class DS:
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((8,), i)}

    loader = Loader(DS(), batch_size=10, buffer_ring=True, **workers)
    it = iter(loader)
    first = next(it)
    assert it.ring is not None and it.ring.live >= 1
    rest = [b["x"][:, 0].tolist() for b in it]
    assert it.ring.live == 0
    assert first["x"][:, 0].tolist() == list(range(10)) and rest[-1] == list(range(90, 100))


def test_a_wait_for_a_free_slot_is_counted_apart_from_the_copy():
    """`ring.write(batch, timings)`: the wait for a slot (here a copy still reading the only slot)
    goes under "ring_wait", the copy under "pin"; `Loader.stats()` reports both."""
    import time

    class SlowCopy:  # a copy that reads the slot for 50 ms more
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            time.sleep(0.05)

    ring = BufferRing(1, pin=False)
    out, slot = ring.write({"x": torch.arange(4)})
    del out
    ring.release(slot, SlowCopy())
    timings: dict[str, float] = {}
    out, _ = ring.write({"x": torch.arange(4) + 1}, timings)
    assert timings["ring_wait"] >= 0.05 > timings["pin"] and out["x"].tolist() == [1, 2, 3, 4]

    from fastload import Loader

    class DS:
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((1024,), i)}

    loader = Loader(DS(), batch_size=8, buffer_ring=True, num_workers=2, worker_type="thread")
    assert sum(int(b["x"].shape[0]) for b in loader) == 64
    stats = loader.stats()
    assert stats["pin_s"] > 0 and stats["ring_wait_s"] >= 0
