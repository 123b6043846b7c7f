"""Miniature on-disk datasets for tests: a tiny-imagenet-200 tree (and .zip) and an imagefolder."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import torch
from PIL import Image

WNIDS = ["n01443537", "n01629819", "n01641577"]


def _image(label: int, k: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(label * 1000 + k)
    img = torch.full((3, size, size), 40, dtype=torch.uint8)
    img[label % 3] = 200  # class colour: learnable
    noise = torch.randint(0, 40, (3, size, size), generator=gen, dtype=torch.uint8)
    return img + noise


def _encode(img: torch.Tensor, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format=fmt)
    return buf.getvalue()


def tiny_imagenet_tree(parent: Path, per_class: int = 8, val_per_class: int = 3, size: int = 64) -> Path:
    root = parent / "tiny-imagenet-200"
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    (root / "words.txt").write_text("".join(f"{w}\tclass {i}\n" for i, w in enumerate(WNIDS)))
    lines = []
    for label, wnid in enumerate(WNIDS):
        images = root / "train" / wnid / "images"
        images.mkdir(parents=True)
        for k in range(per_class):
            (images / f"{wnid}_{k}.JPEG").write_bytes(_encode(_image(label, k, size), "JPEG"))
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        for k in range(val_per_class):
            name = f"val_{label * val_per_class + k}.JPEG"
            (root / "val" / "images" / name).write_bytes(_encode(_image(label, 100 + k, size), "JPEG"))
            lines.append(f"{name}\t{wnid}\t0\t0\t{size - 1}\t{size - 1}")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def tiny_imagenet_zip(parent: Path, **kwargs: int) -> Path:
    build = parent / "build"
    root = tiny_imagenet_tree(build, **kwargs)
    archive = parent / "tiny-imagenet-200.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(root.rglob("*")):
            zf.write(path, path.relative_to(build))
    return archive


def imagefolder_tree(parent: Path, classes: int = 3, per_class: int = 6, size: int = 24) -> Path:
    for split, count in (("train", per_class), ("val", 2)):
        for label in range(classes):
            folder = parent / split / f"class_{label}"
            folder.mkdir(parents=True)
            for k in range(count):
                (folder / f"{k}.png").write_bytes(_encode(_image(label, k, size), "PNG"))
    return parent
