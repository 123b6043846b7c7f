"""In-memory datasets that need no download: ``synthetic`` and ``digits``.

``synthetic`` is learnable on purpose: each class has a smooth colour pattern; a sample is its
class pattern, shifted by a few pixels, with per-sample brightness and Gaussian noise, so a
small model climbs from chance to >90% accuracy in a few epochs. It is generated from a fixed
data seed, independent of ``--seed``, so every run and every rank sees the same dataset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_train.data.datasets import Augment, DataBundle, TensorImages
from elastic_train.errors import DataError

DATA_SEED = 1234
SYNTHETIC_CLASSES = 10
SYNTHETIC_TRAIN = 4096
SYNTHETIC_VAL = 1024
SYNTHETIC_SIZE = 32
# Noise standard deviation relative to a pattern amplitude of 1: higher is harder.
SYNTHETIC_NOISE = 2.2
MAX_SHIFT = 4
HALF = (0.5, 0.5, 0.5)


def _class_patterns(num_classes: int, size: int, gen: torch.Generator) -> torch.Tensor:
    coarse = torch.randn(num_classes, 3, 4, 4, generator=gen)
    return F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)


def _render(patterns: torch.Tensor, count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    num_classes = patterns.shape[0]
    labels = torch.randint(0, num_classes, (count,), generator=gen)
    shifts = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (count, 2), generator=gen)
    # Every shifted version of every pattern, then one gather: [shift_y, shift_x, class, 3, S, S].
    span = range(-MAX_SHIFT, MAX_SHIFT + 1)
    table = torch.stack([torch.stack([torch.roll(patterns, (dy, dx), dims=(2, 3)) for dx in span]) for dy in span])
    images = table[shifts[:, 0] + MAX_SHIFT, shifts[:, 1] + MAX_SHIFT, labels]
    images = images + 0.3 * torch.randn(count, 1, 1, 1, generator=gen)  # brightness
    images += SYNTHETIC_NOISE * torch.randn(images.shape, generator=gen)
    as_bytes = ((images * 0.25 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return as_bytes, labels


def synthetic(image_size: int | None = None) -> DataBundle:
    size = image_size or SYNTHETIC_SIZE
    gen = torch.Generator().manual_seed(DATA_SEED)
    patterns = _class_patterns(SYNTHETIC_CLASSES, size, gen)
    # Everything the images depend on (bump v1 when the generating code changes).
    recipe = (
        f"synthetic v1: data seed {DATA_SEED}, {SYNTHETIC_CLASSES} classes, {SYNTHETIC_TRAIN}+{SYNTHETIC_VAL} "
        f"samples, {size}px, noise {SYNTHETIC_NOISE}, max shift {MAX_SHIFT}"
    )
    train = TensorImages(*_render(patterns, SYNTHETIC_TRAIN, gen), SYNTHETIC_CLASSES, origin=f"{recipe}: train")
    val = TensorImages(*_render(patterns, SYNTHETIC_VAL, gen), SYNTHETIC_CLASSES, origin=f"{recipe}: val")
    return DataBundle("synthetic", train, val, SYNTHETIC_CLASSES, size, HALF, HALF)


def digits(image_size: int | None = None, augment_seed: int = 0) -> DataBundle:
    """scikit-learn's 1797 real 8x8 handwritten digits, upscaled; a fixed 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError(
            "--dataset digits needs scikit-learn, which is not installed",
            "pip install 'elastic-train[digits]' (or pip install scikit-learn)",
        ) from None
    size = image_size or 32
    raw = load_digits()
    pixels = torch.as_tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N,1,8,8]
    pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
    images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = torch.as_tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(DATA_SEED))
    cut = int(0.8 * len(order))
    recipe = f"scikit-learn load_digits: {len(labels)} images, {size}px, 80/20 split by data seed {DATA_SEED}"
    train = TensorImages(images[order[:cut]], labels[order[:cut]], 10, origin=f"{recipe}: train")
    val = TensorImages(images[order[cut:]], labels[order[cut:]], 10, origin=f"{recipe}: val")
    # No flip: a mirrored digit is another symbol.
    augment = Augment(seed=augment_seed, pad=size // 8, flip=False)
    return DataBundle("digits", train, val, 10, size, (0.3, 0.3, 0.3), (0.4, 0.4, 0.4), augment)
