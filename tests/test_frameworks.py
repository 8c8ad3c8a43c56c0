"""fastload.Loader driven by real frameworks, each in its own processes: PyTorch Lightning (ddp
with a mid-epoch checkpoint resumed on one device, ddp_spawn), and torchrun with plain DDP and
Hugging Face Accelerate. The scripts in tests/frameworks/ are the recipes of docs/frameworks/."""

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


def _run(args: list[str], timeout: float = 300) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]  # nothing printed at interpreter exit


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
