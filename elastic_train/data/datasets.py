"""Dataset containers and the train/eval views the loaders read.

Every dataset yields ``uint8`` images of shape ``[3, S, S]``; conversion to float and
normalisation happen on the training device (cheaper to move bytes than floats). The loaders
(``data.Indexed``) add each item's dataset index, so the trainer can prove which samples it
trained on.

``DataBundle.identity`` says which data a run trained on (sizes, classes and a fingerprint of
each split's content); it is part of the resume fingerprint, so a checkpoint is never continued
on a dataset whose index -> sample mapping (and so the data order) changed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from elastic_train.errors import DataError

Sample = tuple[torch.Tensor, int]  # (uint8 image [3,S,S], label); the loaders add the dataset index


class ImageSource:
    """Random access to ``(image, label)`` by index."""

    num_classes: int
    image_size: int

    def __len__(self) -> int:
        raise NotImplementedError

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def identity(self) -> str:
        """What this source holds, as a short string that changes when its content does."""
        raise NotImplementedError


class TensorImages(ImageSource):
    """Images held in memory as one ``uint8`` tensor ``[N, 3, S, S]``.

    ``origin`` names how they were made (generator and parameters): it is their identity, so
    identical parameters must produce identical images.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, origin: str) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 [N,3,S,S] images, got {images.dtype} {tuple(images.shape)}")
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self.images = images
        self.labels = labels
        self.num_classes = num_classes
        self.image_size = images.shape[-1]
        self.origin = origin

    def identity(self) -> str:
        return self.origin

    def __len__(self) -> int:
        return self.images.shape[0]

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class FileImages(ImageSource):
    """Images decoded from files on demand (JPEG/PNG), resized to ``image_size`` squares.

    Every file lies under ``root``; the identity hashes the paths relative to it, so a dataset
    copied elsewhere (e.g. to node-local scratch) keeps its identity.
    """

    def __init__(
        self, files: Sequence[Path], labels: Sequence[int], num_classes: int, image_size: int, root: Path
    ) -> None:
        if len(files) != len(labels):
            raise ValueError(f"{len(files)} files but {len(labels)} labels")
        self.files = list(files)
        self.labels = list(labels)
        self.num_classes = num_classes
        self.image_size = image_size
        self.root = root
        self._identity: str | None = None

    def identity(self) -> str:
        """sha256 of each file's (relative path, size, label), in index order.

        One ``stat`` per file (seconds for 10^5 files on a parallel file system): computed once,
        by one rank (``data.open_task_data`` shares it). Sizes catch a replaced or truncated file, not an
        edit that keeps the size.
        """
        if self._identity is None:
            digest = hashlib.sha256()
            for path, label in zip(self.files, self.labels, strict=True):
                try:
                    size = path.stat().st_size
                except OSError as exc:
                    raise DataError(f"cannot read {path}: {exc}", "check the dataset folder") from None
                digest.update(f"{path.relative_to(self.root)}\0{size}\0{label}\n".encode())
            self._identity = f"{len(self.files)} files, sha256 {digest.hexdigest()[:32]}"
        return self._identity

    def __len__(self) -> int:
        return len(self.files)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.files[index]
        try:
            with Image.open(path) as opened:
                img = opened.convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            raise RuntimeError(f"cannot decode image {path}: {exc}") from exc
        if img.size != (self.image_size, self.image_size):
            img = img.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())
        return pixels.permute(2, 0, 1).contiguous(), self.labels[index]


@dataclass(frozen=True)
class Augment:
    """Random crop (zero padding ``pad``) and optional horizontal flip, per sample.

    The randomness is a pure function of ``(seed, epoch, index)``: the same sample gets the same
    augmentation in the same epoch whichever rank, worker or world size loads it, which keeps
    resumed and re-sized runs exact.
    """

    seed: int
    pad: int = 4
    flip: bool = True

    def __call__(self, img: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        rng = random.Random((self.seed * 1_000_003 + epoch) * 1_000_003 + index)
        if self.pad:
            size = img.shape[-1]
            padded = F.pad(img, (self.pad,) * 4)
            top, left = rng.randint(0, 2 * self.pad), rng.randint(0, 2 * self.pad)
            img = padded[:, top : top + size, left : left + size]
        if self.flip and rng.random() < 0.5:
            img = img.flip(-1)
        return img.contiguous()


class TrainView(Dataset[Sample]):
    """Training items keyed by ``(epoch, index)`` as yielded by ``GlobalBatchSampler``."""

    def __init__(self, source: ImageSource, augment: Augment | None) -> None:
        self.source = source
        self.augment = augment

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> Sample:
        epoch, index = key
        img, label = self.source.load(index)
        if self.augment is not None:
            img = self.augment(img, epoch, index)
        return img, label


class EvalView(Dataset[Sample]):
    def __init__(self, source: ImageSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Sample:
        return self.source.load(index)


@dataclass(frozen=True)
class DataBundle:
    """A dataset ready for the loaders: sources, augmentation and normalisation constants."""

    name: str
    train: ImageSource
    val: ImageSource
    num_classes: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: Augment | None = None

    def identity(self) -> dict[str, Any]:
        """Which data this is: JSON values that differ whenever the samples behind the indices do.
        May read every file's size: one rank computes it (``data.open_task_data``)."""
        return {
            "train_samples": len(self.train),
            "val_samples": len(self.val),
            "classes": self.num_classes,
            "image_size": self.image_size,
            "train_content": self.train.identity(),
            "val_content": self.val.identity(),
        }
