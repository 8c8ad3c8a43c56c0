"""Image classification with the one-line swap: torch's DataLoader -> fastload.Loader.

    python examples/image_classification.py                   # fastload.Loader on a synthetic dataset
    python examples/image_classification.py --loader torch    # the same loop with torch's DataLoader
    python examples/image_classification.py --data DIR        # a fastload dataset with `image` + `label`

The dataset is written once in fastload's format (`fastload.formats.write`); the training loop
is the same for both loaders. Given the same `generator`, both draw the same shuffled order, so
the batches and therefore the losses are identical: the swap changes how batches are read, not
what they hold. For JPEG files, convert an image folder with `fastload convert` and decode with
`fastload.vision.ImagePreset`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import fastload
from fastload.formats import write

CLASSES = 4
SHAPE = (3, 16, 16)


def make_dataset(path: str, n: int = 256, seed: int = 0) -> None:
    """`n` uint8 images whose mean colour depends on the label: learnable in a few steps."""
    rng = np.random.default_rng(seed)

    def samples():
        for i in range(n):
            label = i % CLASSES
            image = rng.integers(0, 128, SHAPE, dtype=np.uint8)
            image[label % 3] += np.uint8(64 * (1 + label // 3))
            yield {"image": image, "label": label}

    write(samples(), path, progress=False)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, CLASSES),
    )


def train(data: str, *, loader_kind: str, epochs: int, batch_size: int, workers: int) -> list[float]:
    """Train and return the loss of every step."""
    torch.manual_seed(0)
    ds = fastload.open_dataset(data)
    generator = torch.Generator().manual_seed(0)
    if loader_kind == "torch":
        loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, generator=generator)
    else:
        loader = fastload.Loader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, generator=generator)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        for batch in loader:
            x = batch["image"].float().div_(255.0)
            loss = nn.functional.cross_entropy(model(x), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"epoch {epoch}: loss {losses[-1]:.4f}")
    return losses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="fastload dataset with `image` (uint8 3x16x16) and `label` (default: synthetic)")
    ap.add_argument("--loader", choices=("fastload", "torch"), default="fastload")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--losses", help="write every step's loss here (one per line, repr)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastload-example-") as tmp:
        data = args.data
        if data is None:
            data = os.path.join(tmp, "images-fl")
            make_dataset(data)
        losses = train(data, loader_kind=args.loader, epochs=args.epochs, batch_size=args.batch_size,
                       workers=args.workers)
    if args.losses:
        with open(args.losses, "w") as fh:
            fh.write("".join(f"{v!r}\n" for v in losses))


if __name__ == "__main__":
    main()
