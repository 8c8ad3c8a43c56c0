"""Train a tiny model under PyTorch Lightning on a fastload Loader built in `__init__`; write the
sample ids each rank received, per epoch, to OUT/rank{r}.json (run by tests/test_frameworks.py;
the recipe of docs/frameworks/lightning.md). `--sampler token_budget`: the Loader's batches come from
a `TokenBudgetBatchSampler` built in `__init__` too (before the rank is known)."""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import numpy as np
import torch

from fastload import Loader
from fastload.order.bucketing import TokenBudgetBatchSampler

N, BATCH = 192, 8
LENGTHS = (np.arange(N) * 7) % 31 + 1  # token counts for the token-budget sampler
MAX_TOKENS = 64


class IdsDataset:
    """Sample i carries its id; `get_batch` is fastload's batched protocol."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"i": np.int64(i)}

    def get_batch(self, idx) -> dict:
        return {"i": np.asarray(idx, dtype=np.int64)}


class Model(L.LightningModule):
    def __init__(self, out: str, sampler: str = "seeded") -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(1, 1)
        # built before the process group exists: the Loader takes its rank at the first iter()
        if sampler == "token_budget":
            budget = TokenBudgetBatchSampler(LENGTHS, MAX_TOKENS, seed=0)
            self.loader = Loader(IdsDataset(), batch_sampler=budget, num_workers=1)
        else:
            self.loader = Loader(IdsDataset(), batch_size=BATCH, shuffle=True, seed=0, num_workers=1)
        self.seen: dict[int, list[list[int]]] = {}

    def train_dataloader(self):
        return self.loader

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).append(batch["i"].tolist())
        return self.layer(batch["i"].float()[:, None]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_train_end(self) -> None:
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump({"world": self.trainer.world_size, "epochs": self.seen}, f)


class SaveMidEpoch(L.Callback):
    """Save a checkpoint after batch `batch` of epoch `epoch` (the loader's position goes with it)."""

    def __init__(self, path: str, epoch: int, batch: int) -> None:
        self.path, self.epoch, self.batch = path, epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            trainer.save_checkpoint(self.path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save", default=None, help="checkpoint path, saved mid-epoch 1 (after its batch 4)")
    p.add_argument("--resume", default=None, help="checkpoint path to resume from")
    p.add_argument("--sampler", default="seeded", choices=["seeded", "token_budget"])
    a = p.parse_args()
    callbacks = [SaveMidEpoch(a.save, 1, 4)] if a.save else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy=a.strategy,
        max_epochs=a.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Model(a.out, a.sampler), ckpt_path=a.resume)


if __name__ == "__main__":
    main()
