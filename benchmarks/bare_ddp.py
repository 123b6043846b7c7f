"""The baseline for benchmarks/overhead.py: the seed's bare DDP loop, nothing else.

Same model, data, global batch and optimizer as elastic-train's defaults; a DistributedSampler
and a DataLoader over the in-memory tensors; per-epoch training time MAX-reduced over ranks.
Run under torchrun; prints one JSON line per epoch on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_train.data.datasets import TensorImages
from elastic_train.data.synthetic import synthetic
from elastic_train.models import build_model


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
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()  # type: ignore[no-untyped-call]
        images = 0
        start = time.perf_counter()
        for step, (x, y) in enumerate(loader):
            if step == args.steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = (x.float() / 255 - 0.5) / 0.5
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            images += x.shape[0] * world
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"epoch": epoch + 1, "throughput": images / elapsed.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
