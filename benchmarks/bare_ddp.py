"""The baseline for benchmarks/overhead.py: the seed's bare DDP loop, nothing else.

Same model, data, global batch and optimizer as elastic-train's defaults; a DistributedSampler
and a DataLoader over the in-memory tensors; per-epoch training time MAX-reduced over ranks.
Run under torchrun; prints one JSON line per epoch on rank 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_train.data.datasets import TensorImages
from elastic_train.data.synthetic import synthetic
from elastic_train.models import build_model

T = TypeVar("T")


@dataclass(frozen=True)
class Timed:
    images: int  # across all ranks
    seconds: float  # this rank's


def timed_epoch(loader: Iterable[T], steps: int, train_step: Callable[[T], int], settle: Callable[[], None]) -> Timed:
    """Train on the first ``steps`` batches of ``loader``, timing the fetches and the steps.

    Only those batches are fetched inside the window: a loop that breaks at ``step == steps``
    has already fetched (sampled, collated and, under CUDA, pinned) batch ``steps + 1`` by the
    time it breaks, and charges it to the baseline. ``settle`` waits for queued device work.
    """
    images = 0
    start = time.perf_counter()
    for batch in itertools.islice(loader, steps):
        images += train_step(batch)
    settle()
    return Timed(images, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bundle = synthetic()
    torch.manual_seed(42)
    module = build_model("vit", bundle.num_classes, bundle.image_size).to(device)
    model = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    assert isinstance(bundle.train, TensorImages)  # the synthetic set lives in memory
    data = TensorDataset(bundle.train.images, bundle.train.labels)
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, drop_last=True, pin_memory=cuda)

    def train_step(batch: list[torch.Tensor]) -> int:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        x = (x.float() / 255 - 0.5) / 0.5
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return int(x.shape[0]) * world

    def settle() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()  # type: ignore[no-untyped-call]

        timed = timed_epoch(loader, args.steps, train_step, settle)
        elapsed = torch.tensor([timed.seconds], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"epoch": epoch + 1, "throughput": timed.images / elapsed.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
