"""A small language model trained with DDP on variable-length text: token-budget batches.

    torchrun --standalone --nproc_per_node=2 examples/text_ddp.py --out runs/text
    torchrun --standalone --nproc_per_node=2 examples/text_ddp.py --out runs/text --resume runs/text/ckpt

Every rank builds the same `TokenBudgetBatchSampler` (rank and world size come from
`torch.distributed`): batches of similar-length sequences under `--max-tokens` padded tokens,
the same number of batches on every rank, so no rank waits for another at the epoch's end.
`TextCollate` pads each batch (`input_ids`, `attention_mask`, `labels`). Runs on CPU with the
gloo backend, or on GPUs with NCCL (`--backend nccl`; batches then go to each rank's device).

`--checkpoint-at N` saves the model, the optimizer and each rank's `loader.state_dict()` after
global step N into `OUT/ckpt/` (and keeps training); `--resume OUT/ckpt` continues from there:
the same batches in the same order, so the losses after step N repeat exactly. Every step is
logged to `OUT/log.rank{R}.jsonl` (epoch, step, loss, a checksum of the batch's tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fastload
from fastload import TextCollate, TokenBudgetBatchSampler
from fastload.formats import write

VOCAB = 128


def make_dataset(path: str, n: int = 400, seed: int = 0) -> None:
    """`n` token sequences of 4..96 tokens that count up modulo VOCAB from a random start."""
    rng = np.random.default_rng(seed)

    def samples():
        for _ in range(n):
            length, start = int(rng.integers(4, 97)), int(rng.integers(0, VOCAB))
            yield {"input_ids": ((start + np.arange(length)) % VOCAB).astype(np.int32)}

    write(samples(), path, progress=False)


class TinyLM(nn.Module):
    """Embedding -> GRU -> next-token logits."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))
        return self.head(out)


def _checksum(t: torch.Tensor) -> int:
    return zlib.crc32(t.cpu().numpy().tobytes())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory: logs, checkpoint, the synthetic dataset")
    ap.add_argument("--data", help="fastload dataset with an `input_ids` token field (default: synthetic)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1024, help="padded tokens per batch per rank")
    ap.add_argument("--checkpoint-at", type=int, default=None, help="save a checkpoint after this global step")
    ap.add_argument("--resume", help="checkpoint directory to continue from")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = ap.parse_args(argv)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    os.makedirs(args.out, exist_ok=True)
    data = args.data or os.path.join(args.out, "tokens-fl")
    if args.data is None and rank == 0 and not os.path.exists(os.path.join(data, "index.json")):
        make_dataset(data)
    dist.barrier()  # the dataset is complete before any rank opens it

    ds = fastload.open_dataset(data)
    sampler = TokenBudgetBatchSampler.from_dataset(ds, max_tokens=args.max_tokens, field="input_ids", seed=0,
                                                   pad_to_multiple_of=8)
    loader = fastload.Loader(ds, batch_sampler=sampler, device=device if device.type == "cuda" else None,
                             transform=TextCollate(pad_to_multiple_of=8, labels=True))
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM().to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    step, start_epoch = 0, 0
    if args.resume:
        ckpt: dict[str, Any] = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step, start_epoch = ckpt["step"], ckpt["loader"]["epoch"]

    log_path = os.path.join(args.out, f"log.rank{rank}.jsonl")
    with open(log_path, "a" if args.resume else "w") as log:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)  # the resumed epoch keeps its position; later ones start fresh
            batches = 0
            for batch in loader:
                logits = model(batch["input_ids"])
                loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                   batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                batches += 1
                log.write(json.dumps({"epoch": epoch, "step": step, "loss": loss.item(),
                                      "tokens": _checksum(batch["input_ids"])}) + "\n")
                if step == args.checkpoint_at:
                    ckpt_dir = os.path.join(args.out, "ckpt")
                    os.makedirs(ckpt_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "loader": loader.state_dict(), "step": step}, os.path.join(ckpt_dir, f"rank{rank}.pt"))
            counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(counts, torch.tensor([batches], device=device))
            if rank == 0:
                print(f"epoch {epoch}: batches per rank {[int(c) for c in counts]}, loss {loss.item():.4f}", flush=True)
    dist.barrier()
    # DDP's reducer and the loader let go of their tensors and the process group while Python still
    # runs: left to interpreter shutdown, a gloo thread freeing a tensor that references a Python
    # object can abort the process ("terminate called without an active exception").
    del model, opt, loader, batch, logits, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
