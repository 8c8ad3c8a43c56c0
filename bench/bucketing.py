"""Token-budget bucketing vs random batches: padding waste, rank balance, end-to-end tokens/s.

    python -m bench.bucketing            # 200k sequences, log-normal lengths in [16, 2048]
    python -m bench.bucketing --quick    # 20k sequences (CI smoke run)

Writes the sequences as a fastload dataset (one `varray` int32 field `input_ids`), then reports:
padding waste of the bucketed batches (pad_to_multiple_of 1 and 8) beside random batches with
the same mean batch size; the per-step padded-token imbalance over 8 simulated ranks; and real
tokens/s of the full path (read + bucket + collate) for `fastload.Loader` + `TokenBudgetBatchSampler`
+ `TextCollate` against a torch `DataLoader` with random batches and a Python pad-collate.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from fastload.fetch.text_collate import TextCollate
from fastload.formats import (
    Block,
    BlockSource,
    FastloadDataset,
    Field,
    Ragged,
    Schema,
    write,
)
from fastload.order.bucketing import TokenBudgetBatchSampler, padding_stats, step_imbalance

__all__ = ["main", "make_lengths", "write_dataset"]


def make_lengths(n: int, *, seed: int = 0) -> np.ndarray:
    """Log-normal sequence lengths (median 200, sigma 1) clipped to [16, 2048]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(200), 1.0, n), 16, 2048).astype(np.int64)


def write_dataset(lengths: np.ndarray, out_dir: str, *, seed: int = 0, block: int = 20000) -> None:
    """Random int32 token ids with the given lengths, written columnar (no per-sample Python)."""
    rng = np.random.default_rng(seed)
    schema = Schema((Field("input_ids", "varray", np.dtype(np.int32)),))

    def blocks(start: int) -> Iterator[Block]:
        for lo in range(start, len(lengths), block):
            lens = lengths[lo : lo + block]
            offsets = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            values = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
            yield Block(len(lens), {"input_ids": Ragged(values, offsets, "varray")})

    write(
        BlockSource(schema=schema, num_samples=len(lengths), blocks=blocks),
        out_dir,
        progress=False,
        overwrite=True,
    )


def python_pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The usual hand-written collate: per-sample tensors, `pad_sequence`, mask from the lengths."""
    seqs = [torch.as_tensor(s["input_ids"], dtype=torch.int64) for s in samples]
    lens = torch.tensor([len(t) for t in seqs])
    ids = pad_sequence(seqs, batch_first=True, padding_value=0)
    mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}


class _Meter:
    """Real/padded tokens and time, accumulated over several timed rounds."""

    def __init__(self, make: Callable[[], Iterable[dict[str, torch.Tensor]]]) -> None:
        self.make, self.it = make, iter(make())
        self.real = self.padded = self.batches = 0
        self.seconds = 0.0

    def run(self, seconds: float) -> None:
        """Consume batches for `seconds` (starting new epochs as needed)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = next(self.it, None)
            if batch is None:
                self.it = iter(self.make())
                continue
            self.real += int(batch["attention_mask"].sum())
            self.padded += batch["input_ids"].numel()
            self.batches += 1
        self.seconds += time.perf_counter() - t0

    def result(self) -> dict[str, float]:
        return {
            "batches": self.batches,
            "real_tok_s": self.real / self.seconds,
            "padded_tok_s": self.padded / self.seconds,
            "waste": 1 - self.real / max(self.padded, 1),
        }


def _fastload_batches(ds: Any, sampler: TokenBudgetBatchSampler, collate: TextCollate, workers: int) -> Iterable[Any]:
    """`fastload.Loader` on its columnar fast path: `get_batch` per batch, `collate` on the columns."""
    try:
        from fastload.loader import Loader
    except ImportError:  # the Loader has not landed: the same path without its pipelining
        return (collate(ds.get_batch(b)) for b in sampler)
    return Loader(ds, batch_sampler=sampler, transform=collate, num_workers=workers)


def _row(name: str, *cells: str) -> str:
    return f"| {name:<46} | " + " | ".join(f"{c:>22}" for c in cells) + " |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20k sequences, shorter timing")
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="number of sequences (default 200000, 20000 with --quick)",
    )
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=0, help="loader workers for both paths")
    p.add_argument("--seconds", type=float, default=None, help="time limit per throughput run")
    p.add_argument("--data", default=None, help="dataset directory (default: a temporary one)")
    args = p.parse_args(argv)
    # one intra-op thread, as in DataLoader workers: on small machines torch's parallel fills of
    # big padded tensors otherwise thrash (tens of ms per batch) and would flatter fastload.
    torch.set_num_threads(1)
    n = args.n or (20000 if args.quick else 200000)
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    lengths = make_lengths(n)
    print(
        f"{n} sequences, log-normal lengths in [16, 2048]: mean {lengths.mean():.0f}, "
        f"total {lengths.sum() / 1e6:.1f}M tokens; max_tokens={args.max_tokens}, {args.world_size} ranks"
    )

    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmp:
        root = args.data or os.path.join(tmp, "tokens")
        t0 = time.perf_counter()
        write_dataset(lengths, root)
        ds = FastloadDataset(root)
        assert np.array_equal(ds.lengths("input_ids"), lengths)
        print(f"wrote the dataset in {time.perf_counter() - t0:.1f}s")

        # --- padding waste and rank balance (pure index work, no data reads)
        rows = []
        mean_bs = 0.0
        for mult in (1, 8):
            s = TokenBudgetBatchSampler(
                ds.lengths("input_ids"),
                args.max_tokens,
                rank=0,
                world_size=args.world_size,
                pad_to_multiple_of=mult,
                seed=0,
            )
            t0 = time.perf_counter()
            plan = s.plan()
            plan_s = time.perf_counter() - t0
            batches = [b for step in plan for b in step]
            mean_bs = mean_bs or float(np.mean([len(b) for b in batches]))
            waste = padding_stats(lengths, batches, pad_to_multiple_of=mult)["waste"]
            imb = step_imbalance(s.step_costs())
            rows.append((mult, waste, imb, len(plan), plan_s))
        rng = np.random.default_rng(0)
        perm = rng.permutation(n)
        size = round(mean_bs)
        random_waste = padding_stats(lengths, [perm[i : i + size] for i in range(0, n, size)])["waste"]

        # --- end-to-end real tokens/s, both paths in this run
        sampler = TokenBudgetBatchSampler(
            ds.lengths("input_ids"),
            args.max_tokens,
            rank=0,
            world_size=1,
            pad_to_multiple_of=8,
            seed=0,
        )
        collate = TextCollate(pad_to_multiple_of=8)
        ours = _Meter(lambda: _fastload_batches(ds, sampler, collate, args.workers))
        base = _Meter(
            lambda: torch.utils.data.DataLoader(
                ds,
                batch_size=size,
                shuffle=True,
                collate_fn=python_pad_collate,
                num_workers=args.workers,
            )
        )
        for _ in range(4):  # alternate short rounds so both paths see the same machine load
            ours.run(seconds / 4)
            base.run(seconds / 4)
        ours, base = ours.result(), base.result()

    print()
    print(_row("metric", "fastload bucketing", "random batches", "target"))
    print("|" + "-" * 48 + "|" + "|".join("-" * 24 for _ in range(3)) + "|")
    print(
        _row(
            "padding waste (pad_to_multiple_of=1)",
            f"{rows[0][1]:.2%}",
            f"{random_waste:.2%}",
            "<= 3%",
        )
    )
    print(_row("padding waste (pad_to_multiple_of=8)", f"{rows[1][1]:.2%}", "", ""))
    for mult, _, imb, _, _ in rows:
        print(
            _row(
                f"rank imbalance max/min-1, x{mult}: mean|p99|max",
                f"{imb.mean():.2%} | {np.percentile(imb, 99):.2%} | {imb.max():.2%}",
                "",
                "<= 5%",
            )
        )
    print(
        _row(
            "steps per epoch (8 ranks) / plan time",
            f"{rows[1][3]} / {rows[1][4] * 1e3:.0f} ms",
            "",
            "",
        )
    )
    print(_row("mean batch size (samples)", f"{mean_bs:.1f}", f"{size}", ""))
    print(
        _row(
            "full path real tokens/s (read+bucket+collate)",
            f"{ours['real_tok_s'] / 1e6:.1f}M",
            f"{base['real_tok_s'] / 1e6:.1f}M",
            ">= 3x",
        )
    )
    print(
        _row(
            "full path padded tokens/s",
            f"{ours['padded_tok_s'] / 1e6:.1f}M",
            f"{base['padded_tok_s'] / 1e6:.1f}M",
            "",
        )
    )
    print(
        _row(
            "measured padding waste (delivered batches)",
            f"{ours['waste']:.2%}",
            f"{base['waste']:.2%}",
            "",
        )
    )
    print(
        _row(
            "speedup (real tokens/s)",
            f"{ours['real_tok_s'] / base['real_tok_s']:.1f}x",
            "1.0x",
            ">= 3x",
        )
    )
    print(
        f"\nbatches timed: fastload {ours['batches']}, torch {base['batches']} "
        f"({seconds:.0f}s each, 4 alternating rounds); "
        f"loader={'fastload.Loader' if _has_loader() else 'sampler+get_batch+collate loop'}"
    )


def _has_loader() -> bool:
    try:
        from fastload.loader import Loader  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
