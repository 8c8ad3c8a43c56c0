"""Run under `torchrun --nproc-per-node 2`: Hugging Face Accelerate's mid-epoch recipe,
`accelerator.skip_first_batches(loader, n)`, on fastload Loaders; writes OUT/rank{r}.json (run by
tests/test_frameworks.py; the recipe of docs/frameworks/accelerate.md).

Accelerate answers `skip_first_batches` with a torch DataLoader built from the Loader's `dataset`,
`batch_sampler`, `collate_fn` and worker settings. Each case records, per rank, what that DataLoader
yields next to what the Loader itself yields for the same epoch:

* seeded order (`seed=0`): in the same process after `n` batches, in a fresh process resuming
  epoch 1 (`set_epoch(1)`), and the Loader's next epoch after the skipped one;
* `TokenBudgetBatchSampler` + `transform=TextCollate()` over a fastload dataset of token arrays, in
  the same process after `n` batches and in a fresh process resuming epoch 1;
* `transform=ImagePreset(kind="train")` over a fastload dataset of JPEGs: with `num_workers=0` the
  DataLoader's pixels next to the Loader's (epoch 1, mid-epoch), and with worker processes the
  error it raises.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import torch

from fastload import Loader

N, BATCH, SKIP = 200, 8, 5
N_TEXT, MAX_TOKENS, SKIP_TEXT = 240, 96, 3
N_IMAGES, SKIP_IMAGES = 48, 2


class IdsDataset:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"i": torch.tensor(i)}

    def get_batch(self, idx) -> dict:
        return {"i": np.asarray(idx, dtype=np.int64)}


def _ids(batches) -> list[list[int]]:
    return [b["i"].tolist() for b in batches]


def seeded(accelerator) -> dict:
    def make(**kw) -> Loader:
        return Loader(IdsDataset(), batch_size=BATCH, shuffle=True, seed=0, **kw)

    reference = make()
    epochs = [_ids(reference) for _ in range(3)]  # this rank's uninterrupted epochs 0, 1, 2
    loader = make(num_workers=2)
    it = iter(loader)
    head = [next(it)["i"].tolist() for _ in range(SKIP)]
    skipped = accelerator.skip_first_batches(loader, SKIP)
    out = {"epochs": epochs, "head": head, "len": len(skipped), "rest": _ids(skipped)}
    out["next_epoch"] = _ids(loader)  # the skipped DataLoader delivered epoch 0: the Loader runs epoch 1
    fresh = make()  # a new process resuming epoch 1 after SKIP batches, as Accelerate's examples do
    fresh.set_epoch(1)
    out["fresh_rest"] = _ids(accelerator.skip_first_batches(fresh, SKIP))
    out["fresh_then"] = _ids(fresh)
    return out


def token_budget(accelerator) -> dict:
    from fastload.fetch.text_collate import TextCollate
    from fastload.formats import FastloadDataset, write
    from fastload.order.bucketing import TokenBudgetBatchSampler

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, N_TEXT)
    samples = [{"id": i, "input_ids": np.arange(n, dtype=np.int32) + 1000 * i} for i, n in enumerate(lengths)]
    root = tempfile.mkdtemp(prefix="fastload-accel-text-")
    write(samples, root, progress=False)
    ds = FastloadDataset(root)

    def make() -> Loader:
        sampler = TokenBudgetBatchSampler.from_dataset(ds, MAX_TOKENS, seed=0)  # rank from the run
        return Loader(ds, batch_sampler=sampler, transform=TextCollate(pad_to_multiple_of=8))

    def flat(batch: dict) -> dict:
        return {k: v.tolist() for k, v in batch.items()}

    reference = make()
    expected = [flat(b) for b in reference]
    reference.set_epoch(1)
    expected_1 = [flat(b) for b in reference]
    loader = make()
    it = iter(loader)
    head = [flat(next(it)) for _ in range(SKIP_TEXT)]
    skipped = accelerator.skip_first_batches(loader, SKIP_TEXT)
    out = {"expected": expected, "head": head, "len": len(skipped), "rest": [flat(b) for b in skipped]}
    fresh = make()  # a new process resuming epoch 1: the epoch reaches the sampler through the Loader
    fresh.set_epoch(1)
    out["fresh_rest"] = [flat(b) for b in accelerator.skip_first_batches(fresh, SKIP_TEXT)]
    out["expected_1"] = expected_1
    return out


def augmented(accelerator) -> dict:
    import io

    from PIL import Image

    from fastload.formats import FastloadDataset, write
    from fastload.vision import ImagePreset

    rng = np.random.default_rng(0)
    samples = []
    for i in range(N_IMAGES):
        buf = io.BytesIO()
        Image.fromarray((rng.random((20 + i % 5, 24 + i % 7, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG")
        samples.append({"image": buf.getvalue(), "label": i})
    root = tempfile.mkdtemp(prefix="fastload-accel-images-")
    write(samples, root, progress=False)
    ds = FastloadDataset(root)

    def make(**kw) -> Loader:
        preset = ImagePreset(kind="train", size=16, backend="cpu", dtype=torch.float32)
        loader = Loader(ds, batch_size=BATCH, shuffle=True, seed=0, transform=preset, **kw)
        loader.set_epoch(1)
        return loader

    expected = list(make())
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(SKIP_IMAGES)]
    rest = list(accelerator.skip_first_batches(loader, SKIP_IMAGES))
    got = head + rest
    same = [torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"]) for a, b in zip(got, expected)]
    out = {"labels": [b["label"].tolist() for b in got], "pixels_equal": len(got) == len(expected) and all(same)}
    try:
        list(accelerator.skip_first_batches(make(num_workers=2), SKIP_IMAGES))
        out["refusal"] = None
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        out["refusal"] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    report = {"rank": accelerator.process_index, "world": accelerator.num_processes}
    report["seeded"] = seeded(accelerator)
    report["token_budget"] = token_budget(accelerator)
    report["augmented"] = augmented(accelerator)
    with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
