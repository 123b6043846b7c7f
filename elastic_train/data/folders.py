"""Image datasets on disk: ``tiny-imagenet`` (folder or .zip) and any ``imagefolder`` tree.

Extraction of the tiny-imagenet archive is done by ONE process (the caller decides which, see
``should_prepare_dataset``) into a hidden temporary folder that is renamed into place only once
complete: a crash mid-extract leaves a hidden ``.partial`` folder, never a half tree that looks
finished. ``zipfile`` checks every member's CRC while reading, so a corrupt archive fails here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
import zlib
from pathlib import Path

from elastic_train.data.datasets import Augment, DataBundle, FileImages
from elastic_train.errors import DataError

TINY_FOLDER = "tiny-imagenet-200"
TINY_ARCHIVE = "tiny-imagenet-200.zip"
TINY_SIZE = 64
TINY_HINT = (
    "download http://cs231n.stanford.edu/tiny-imagenet-200.zip and pass --data-dir pointing at "
    "the .zip, the folder holding it, or the extracted tiny-imagenet-200 folder"
)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# ---------------------------------------------------------------- tiny-imagenet: find / extract
def _tiny_root(path: Path) -> Path | None:
    for candidate in (path, path / TINY_FOLDER):
        if (candidate / "wnids.txt").is_file():
            return candidate
    return None


def _tiny_archive(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".zip":
        return path
    archive = path / TINY_ARCHIVE
    return archive if archive.is_file() else None


def prepare_tiny_imagenet(data_dir: Path) -> Path:
    """Return the extracted root, extracting the archive first if only the .zip is there."""
    if not data_dir.exists():
        raise DataError(f"--data-dir {data_dir} does not exist", TINY_HINT)
    root = _tiny_root(data_dir)
    if root is not None:
        return root
    archive = _tiny_archive(data_dir)
    if archive is None:
        raise DataError(f"no {TINY_FOLDER}/ (with wnids.txt) or {TINY_ARCHIVE} in {data_dir}", TINY_HINT)
    existing = _tiny_root(archive.parent)
    if existing is not None:
        return existing
    return extract_atomically(archive, archive.parent / TINY_FOLDER)


def _check_member(name: str, archive: Path) -> None:
    parts = Path(name).parts
    if name.startswith("/") or ".." in parts:
        raise DataError(f"{archive} holds an unsafe path {name!r}", "use the original archive")


def extract_atomically(archive: Path, final: Path) -> Path:
    """Extract ``archive`` (whose top folder is ``final.name``) and rename it to ``final``."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        try:
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    _check_member(name, archive)
                zf.extractall(tmp)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise DataError(f"{archive} is corrupt or not a zip archive ({exc})", TINY_HINT) from None
        extracted = _tiny_root(tmp)
        if extracted is None:
            raise DataError(f"{archive} does not contain {final.name}/wnids.txt", TINY_HINT)
        try:
            os.rename(extracted, final)
        except OSError:
            # Someone else finished first; theirs is complete (it was renamed into place too).
            if _tiny_root(final) is None:
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- tiny-imagenet: read
def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"{path} is missing", TINY_HINT)
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _tiny_train(root: Path, wnids: list[str]) -> tuple[list[Path], list[int]]:
    files: list[Path] = []
    labels: list[int] = []
    for label, wnid in enumerate(wnids):
        folder = root / "train" / wnid / "images"
        images = sorted(p for p in folder.glob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise DataError(f"no training images in {folder}", TINY_HINT)
        files += images
        labels += [label] * len(images)
    return files, labels


def _tiny_val(root: Path, class_of: dict[str, int]) -> tuple[list[Path], list[int]]:
    annotations = root / "val" / "val_annotations.txt"
    files: list[Path] = []
    labels: list[int] = []
    for number, line in enumerate(_read_lines(annotations), start=1):
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in class_of:
            raise DataError(f"{annotations}:{number}: malformed line {line!r}", TINY_HINT)
        image = root / "val" / "images" / fields[0]
        if not image.is_file():
            raise DataError(f"{annotations}:{number}: {image} is missing", TINY_HINT)
        files.append(image)
        labels.append(class_of[fields[1]])
    if not files:
        raise DataError(f"{annotations} lists no images", TINY_HINT)
    return files, labels


def load_tiny_imagenet(root: Path, image_size: int | None, augment_seed: int) -> DataBundle:
    """Read the tree: labels from ``wnids.txt``, validation labels from ``val_annotations.txt``."""
    wnids = _read_lines(root / "wnids.txt")
    if not wnids:
        raise DataError(f"{root / 'wnids.txt'} is empty", TINY_HINT)
    size = image_size or TINY_SIZE
    class_of = {wnid: i for i, wnid in enumerate(wnids)}
    train = FileImages(*_tiny_train(root, wnids), num_classes=len(wnids), image_size=size, root=root)
    val = FileImages(*_tiny_val(root, class_of), num_classes=len(wnids), image_size=size, root=root)
    augment = Augment(seed=augment_seed, pad=size // 8)
    return DataBundle("tiny-imagenet", train, val, len(wnids), size, IMAGENET_MEAN, IMAGENET_STD, augment)


# ---------------------------------------------------------------- imagefolder
FOLDER_HINT = "lay the data out as DIR/train/<class>/<image> and DIR/val/<class>/<image>"


def _scan(split: Path, classes: list[str] | None) -> tuple[list[str], list[Path], list[int]]:
    if not split.is_dir():
        raise DataError(f"{split} is not a folder", FOLDER_HINT)
    found = sorted(d.name for d in split.iterdir() if d.is_dir())
    if not found:
        raise DataError(f"{split} has no class folders", FOLDER_HINT)
    names = classes if classes is not None else found
    unknown = sorted(set(found) - set(names))
    if unknown:
        raise DataError(f"{split} has classes not in train/: {', '.join(unknown[:5])}", FOLDER_HINT)
    files: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(names):
        folder = split / name
        images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        if not images and classes is None:
            raise DataError(f"class folder {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})", FOLDER_HINT)
        files += images
        labels += [label] * len(images)
    if not files:
        raise DataError(f"{split} holds no images", FOLDER_HINT)
    return names, files, labels


def load_imagefolder(data_dir: Path, image_size: int | None, augment_seed: int) -> DataBundle:
    if not data_dir.is_dir():
        raise DataError(f"--data-dir {data_dir} is not a folder", FOLDER_HINT)
    size = image_size or TINY_SIZE
    classes, train_files, train_labels = _scan(data_dir / "train", None)
    _, val_files, val_labels = _scan(data_dir / "val", classes)
    train = FileImages(train_files, train_labels, len(classes), size, root=data_dir)
    val = FileImages(val_files, val_labels, len(classes), size, root=data_dir)
    augment = Augment(seed=augment_seed, pad=size // 8)
    return DataBundle("imagefolder", train, val, len(classes), size, IMAGENET_MEAN, IMAGENET_STD, augment)
