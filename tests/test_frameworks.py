"""fastload.Loader driven by real frameworks, each in its own processes: PyTorch Lightning (ddp
with a mid-epoch checkpoint resumed on one device, a one-device checkpoint refused on two,
ddp_spawn, a `TokenBudgetBatchSampler` under ddp), and torchrun with plain DDP and Hugging Face
Accelerate (`prepare`, checkpointing, `skip_first_batches`). The scripts in tests/frameworks/ are
the recipes of docs/frameworks/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from fastload import Loader

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(400)]

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frameworks")
N_LIGHTNING, N_TORCHRUN = 192, 200


def _run(args: list[str], timeout: float = 300, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]  # nothing printed at interpreter exit
    return proc


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(out, world: int) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def _check_epochs(ranks: list[dict], epochs: int) -> None:
    """Every epoch: equal batch counts per rank, each sample exactly once over the ranks, a new order."""
    for r in ranks:
        assert r["world"] == len(ranks)
    for e in map(str, range(epochs)):
        assert len({len(r["epochs"][e]) for r in ranks}) == 1
        assert sorted(i for r in ranks for i in _flat(r["epochs"][e])) == list(range(N_LIGHTNING))
    for r in ranks:
        assert r["epochs"]["0"] != r["epochs"]["1"]  # reshuffled


def test_lightning_ddp_then_mid_epoch_resume_on_one_device(tmp_path):
    ddp, one = tmp_path / "ddp", tmp_path / "one"
    ddp.mkdir()
    one.mkdir()
    ckpt = str(tmp_path / "mid.ckpt")  # saved after batch 4 of epoch 1
    script = os.path.join(HERE, "lightning_run.py")
    _run([script, "--out", str(ddp), "--devices", "2", "--strategy", "ddp", "--epochs", "2", "--save", ckpt])
    ranks = _ranks(ddp, 2)
    _check_epochs(ranks, 2)
    _run([script, "--out", str(one), "--devices", "1", "--epochs", "3", "--resume", ckpt])
    resumed = _ranks(one, 1)[0]["epochs"]
    seen = [i for r in ranks for i in _flat(r["epochs"]["1"][:5])]
    rest = _flat(resumed["1"])
    assert len(seen) == 2 * 5 * 8 and sorted(seen + rest) == list(range(N_LIGHTNING))  # no replay, no skip
    assert len(resumed["1"]) == -(-len(rest) // 8)
    # then a full epoch on one device: the seeded order of epoch 2, every sample once
    expected = Loader(_Ids(), batch_size=8, shuffle=True, seed=0, rank=0, world_size=1)
    expected.set_epoch(2)
    assert resumed["2"] == [b.tolist() for b in expected]
    expected.set_epoch(1)
    assert resumed["2"] != [b.tolist() for b in expected]


class _Ids:
    def __len__(self) -> int:
        return N_LIGHTNING

    def __getitem__(self, i: int) -> int:
        return i


def test_lightning_ddp_spawn(tmp_path):
    script = os.path.join(HERE, "lightning_run.py")
    _run([script, "--out", str(tmp_path), "--devices", "2", "--strategy", "ddp_spawn", "--epochs", "2"])
    _check_epochs(_ranks(tmp_path, 2), 2)


def test_torchrun_ddp_and_accelerate(tmp_path):
    port = _port()
    script = os.path.join(HERE, "torchrun_run.py")
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={port}", script, str(tmp_path)])
    ranks = _ranks(tmp_path, 2)
    batches = -(-N_TORCHRUN // 2 // 8)
    for e in range(2):
        assert [len(r["ddp"]["epochs"][e]) for r in ranks] == [batches, batches] == [r["ddp"]["len"] for r in ranks]
        assert sorted(i for r in ranks for i in _flat(r["ddp"]["epochs"][e])) == list(range(N_TORCHRUN))
    assert ranks[0]["ddp"]["epochs"][0] != ranks[0]["ddp"]["epochs"][1]
    for r in ranks:
        acc = r["accelerate"]
        assert acc["prepare_returns_the_loader"]
        assert acc["steps"] == acc["torch_steps"] == -(-batches // 4)  # the last, partial window steps too
        assert acc["batches"] == acc["torch_batches"]
        assert acc["resumed"] == acc["rest"] and acc["resumed_len"] == batches - 5
        assert acc["next_epoch_equal"]
    rest = [i for r in ranks for i in _flat(r["accelerate"]["head"] + r["accelerate"]["rest"])]
    assert sorted(rest) == list(range(N_TORCHRUN))


def test_lightning_resume_on_more_devices_is_refused_and_exact_on_the_same_count(tmp_path):
    """A checkpoint saved mid-epoch on one device cannot resume on two: Lightning would count its 5
    restored batches against the 12 of a two-device epoch and stop after 7 of the 10 left. The
    Loader refuses it, naming the way out, before any batch; that way out (one device) is exact."""
    one, two, again = tmp_path / "one", tmp_path / "two", tmp_path / "again"
    for d in (one, two, again):
        d.mkdir()
    ckpt = str(tmp_path / "mid.ckpt")  # saved after batch 4 of epoch 1, on one device
    script = os.path.join(HERE, "lightning_run.py")
    _run([script, "--out", str(one), "--devices", "1", "--epochs", "2", "--save", ckpt])
    saved = _ranks(one, 1)[0]["epochs"]
    proc = _run([script, "--out", str(two), "--devices", "2", "--strategy", "ddp", "--epochs", "3", "--resume", ckpt],
                ok=False)
    assert proc.returncode != 0
    assert ("ValueError: cannot resume this checkpoint under PyTorch Lightning: it was saved in epoch 1 after 5 "
            "batches per process at world size 1; at world size 2 an epoch has 12 batches per process and this "
            "Loader has 10 left") in proc.stderr
    assert "would stop after 7, skipping 3 batches of unseen samples. Resume on 1 device(s)" in proc.stderr
    assert not list(two.iterdir())  # refused before any training step
    _run([script, "--out", str(again), "--devices", "1", "--epochs", "2", "--resume", ckpt])
    resumed = _ranks(again, 1)[0]["epochs"]["1"]
    assert resumed == saved["1"][5:]  # exactly the rest of the uninterrupted epoch


def test_lightning_ddp_token_budget_sampler_three_epochs(tmp_path):
    script = os.path.join(HERE, "lightning_run.py")
    _run([script, "--out", str(tmp_path), "--devices", "2", "--strategy", "ddp", "--epochs", "3",
          "--sampler", "token_budget"], timeout=120)
    ranks = _ranks(tmp_path, 2)
    orders = []
    for e in map(str, range(3)):
        assert len({len(r["epochs"][e]) for r in ranks}) == 1  # every rank the same number of steps
        assert sorted(i for r in ranks for i in _flat(r["epochs"][e])) == list(range(N_LIGHTNING))  # once each
        orders.append([r["epochs"][e] for r in ranks])
    assert orders[0] != orders[1] != orders[2] != orders[0]  # a new order every epoch


def test_accelerate_skip_first_batches_yields_exactly_the_rest(tmp_path):
    """`accelerator.skip_first_batches(loader, n)` rebuilds a torch DataLoader from the Loader's
    attributes: per rank it yields exactly the Loader's batches after the first n of the epoch (the
    seeded order, also in a fresh process after `set_epoch`; `TokenBudgetBatchSampler` with
    `TextCollate` as the transform, tensors compared; `ImagePreset(kind="train")` as the transform,
    pixels compared, and refused with worker processes), and the Loader then runs the next epoch."""
    script = os.path.join(HERE, "accelerate_skip.py")
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={_port()}", script, str(tmp_path)],
         timeout=120)
    ranks = _ranks(tmp_path, 2)
    assert [r["world"] for r in ranks] == [2, 2]
    for r in ranks:
        s = r["seeded"]
        epochs = s["epochs"]
        assert s["head"] == epochs[0][:5] and s["rest"] == epochs[0][5:] and s["len"] == len(epochs[0]) - 5
        assert s["next_epoch"] == epochs[1]
        assert s["fresh_rest"] == epochs[1][5:] and s["fresh_then"] == epochs[2]
        t = r["token_budget"]
        assert t["head"] == t["expected"][:3] and t["rest"] == t["expected"][3:] and t["len"] == len(t["rest"])
        assert t["fresh_rest"] == t["expected_1"][3:] and t["expected_1"] != t["expected"]
    seen = [i for r in ranks for i in _flat(r["seeded"]["head"] + r["seeded"]["rest"])]
    assert sorted(seen) == list(range(200))  # no sample missed, none twice
    ids = [i for r in ranks for b in r["token_budget"]["head"] + r["token_budget"]["rest"] for i in b["id"]]
    assert sorted(ids) == list(range(240))
    for r in ranks:  # ImagePreset(kind="train"): the Loader's pixels without workers, a refusal with them
        assert r["augmented"]["pixels_equal"]
        refusal = r["augmented"]["refusal"]
        assert refusal is not None and "dataset indices of this batch cannot be known" in refusal
        assert "num_workers=0 for the resumed epoch" in refusal
    assert sorted(i for r in ranks for b in r["augmented"]["labels"] for i in b) == list(range(48))
