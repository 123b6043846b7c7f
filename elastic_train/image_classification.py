"""The built-in task: image classification on the seed's datasets with ``--model`` (``vit``,
``resnet18`` or ``torchvision:<name>``). The trainer knows nothing of images: everything
image-specific (extraction, normalisation on the device, the classifier) lives here, as a
``Task`` like any plug-in's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from elastic_train.config import TrainConfig
from elastic_train.data import load_bundle, prepare_on_disk
from elastic_train.data.datasets import DataBundle, EvalView, TrainView
from elastic_train.models import build_model
from elastic_train.task import Task, TaskData


class ImageClassification:
    """Holds the opened ``DataBundle`` between ``data()`` and the per-step ``to_device``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.bundle: DataBundle | None = None
        self._norm: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self) -> None:
        prepare_on_disk(self.cfg)

    def data(self) -> TaskData:
        bundle = load_bundle(self.cfg)
        self.bundle = bundle
        description = (
            f"{bundle.name} ({len(bundle.train)} train / {len(bundle.val)} val, "
            f"{bundle.num_classes} classes, {bundle.image_size}px)"
        )
        return TaskData(
            train=TrainView(bundle.train, bundle.augment),
            val=EvalView(bundle.val),
            identity=bundle.identity,
            description=description,
            name=bundle.name,
            train_by_epoch=True,
        )

    def model(self, data: TaskData) -> nn.Module:
        del data
        assert self.bundle is not None, "data() first"
        return build_model(self.cfg.model, self.bundle.num_classes, self.bundle.image_size)

    def to_device(self, batch: Sequence[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images travel as bytes (4x less than floats) and are normalised on the device."""
        images, labels = batch
        if self._norm is None or self._norm[0].device != device:
            assert self.bundle is not None, "data() first"
            shape = (1, 3, 1, 1)
            self._norm = (
                torch.tensor(self.bundle.mean, device=device).view(shape),
                torch.tensor(self.bundle.std, device=device).view(shape),
            )
        mean, std = self._norm
        x = images.to(device, non_blocking=True).float().div_(255.0).sub_(mean).div_(std)
        return x, labels.to(device, non_blocking=True)


def image_task(cfg: TrainConfig) -> Task:
    """The seed's task, selected by ``--model`` and ``--dataset``."""
    impl = ImageClassification(cfg)
    return Task(
        name=cfg.model,  # the start-up line's "model: vit"
        data=impl.data,
        model=impl.model,
        prepare=impl.prepare,
        to_device=impl.to_device,
        samples_are="images",
    )
