"""Run under `torchrun --nproc-per-node 2`: plain DDP, then Hugging Face Accelerate, on fastload
Loaders; writes OUT/rank{r}.json (run by tests/test_frameworks.py; the recipes of
docs/frameworks/torchrun.md and accelerate.md).

Plain DDP: the Loader deals each rank an equal, disjoint share (rank/world from torch.distributed
at the first iter()), reshuffled per epoch. Accelerate: `prepare` leaves the Loader as it is,
gradient accumulation steps per epoch match a prepared torch DataLoader's, and
`register_for_checkpointing` + `save_state`/`load_state` resume mid-epoch exactly.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from fastload import Loader

N, BATCH, ACCUM = 200, 8, 4


class IdsDataset:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"i": torch.tensor(i)}

    def get_batch(self, idx) -> dict:
        return {"i": np.asarray(idx, dtype=np.int64)}


def plain_ddp(report: dict) -> None:
    loader = Loader(IdsDataset(), batch_size=BATCH, shuffle=True, seed=0, num_workers=1)  # before init: fine
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    report["ddp"] = {"len": len(loader), "epochs": []}
    for _epoch in range(2):
        ids = []
        for batch in loader:
            ids.append(batch["i"].tolist())
            model(batch["i"].float()[:, None]).mean().backward()  # an all-reduce per step: counts must match
            opt.step()
            opt.zero_grad()
        report["ddp"]["epochs"].append(ids)


def steps_per_epoch(accelerator, model, opt, loader) -> int:
    steps = 0
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["i"].float()[:, None]).mean())
            if accelerator.sync_gradients:
                steps += 1
            opt.step()
            opt.zero_grad()
    return steps


def with_accelerate(report: dict) -> None:
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list

    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model, opt = accelerator.prepare(torch.nn.Linear(1, 1), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0))
    loader = Loader(IdsDataset(), batch_size=BATCH, shuffle=True, seed=0)
    prepared = accelerator.prepare(loader)
    torch_loader = accelerator.prepare(torch.utils.data.DataLoader(IdsDataset(), batch_size=BATCH, shuffle=True))
    out = report["accelerate"] = {
        "prepare_returns_the_loader": prepared is loader,
        "steps": steps_per_epoch(accelerator, model, opt, loader),
        "torch_steps": steps_per_epoch(accelerator, model, opt, torch_loader),
        "batches": len(loader),
        "torch_batches": len(torch_loader),
    }
    # mid-epoch resume: the Loader is a checkpointed object; its state is rank-agnostic (a position
    # in the seeded order), so every rank can load the main process's copy
    accelerator.register_for_checkpointing(loader)
    ckpt = [tempfile.mkdtemp(prefix="fastload-accel-") if accelerator.is_main_process else None]
    broadcast_object_list(ckpt)
    it = iter(loader)
    head = [next(it)["i"].tolist() for _ in range(5)]
    accelerator.save_state(ckpt[0])
    accelerator.wait_for_everyone()  # the main process writes the files: the others load them after it
    out["rest"] = [b["i"].tolist() for b in it]
    out["head"] = head
    fresh = Loader(IdsDataset(), batch_size=BATCH, shuffle=True, seed=0)
    accelerator._custom_objects.clear()
    accelerator.register_for_checkpointing(fresh)
    accelerator.load_state(ckpt[0])
    out["resumed_len"] = len(fresh)
    out["resumed"] = [b["i"].tolist() for b in fresh]
    out["next_epoch_equal"] = [b["i"].tolist() for b in fresh] == [b["i"].tolist() for b in loader]


def main() -> None:
    out_dir = sys.argv[1]
    report: dict = {}
    plain_ddp(report)
    with_accelerate(report)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
