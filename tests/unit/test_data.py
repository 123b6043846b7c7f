"""Dataset loading from real on-disk layouts (built by the tests: no network)."""

from __future__ import annotations

import itertools
import os
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic_train.config import TrainConfig
from elastic_train.data import Indexed, load_bundle, open_task_data, spread_indices
from elastic_train.data.datasets import Augment, TrainView
from elastic_train.data.folders import extract_atomically, load_imagefolder, prepare_tiny_imagenet
from elastic_train.data.synthetic import digits, synthetic
from elastic_train.distributed.env import DistEnv
from elastic_train.errors import DataError
from elastic_train.image_classification import image_task
from elastic_train.run_parts import run_fingerprint
from tests.datagen import WNIDS, imagefolder_tree, tiny_imagenet_tree, tiny_imagenet_zip


def test_tiny_imagenet_from_an_extracted_tree_uses_val_annotations_for_labels(tmp_path: Path) -> None:
    tiny_imagenet_tree(tmp_path)
    bundle = load_bundle(TrainConfig(dataset="tiny-imagenet", data_dir=tmp_path))
    assert (len(bundle.train), len(bundle.val), bundle.num_classes, bundle.image_size) == (24, 9, 3, 64)
    for i in range(len(bundle.val)):
        image, label = bundle.val.load(i)
        assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
        assert label == i // 3  # val_<label*3+k> was annotated with WNIDS[label]
    assert bundle.train.load(0)[1] == 0 and bundle.train.load(23)[1] == 2


def test_tiny_imagenet_zip_is_extracted_once_and_atomically(tmp_path: Path) -> None:
    archive = tiny_imagenet_zip(tmp_path)
    root = prepare_tiny_imagenet(tmp_path)
    assert root == tmp_path / "tiny-imagenet-200" and (root / "wnids.txt").read_text().split() == WNIDS
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name], "temporary folder left behind"
    stamp = (root / "wnids.txt").stat().st_mtime_ns
    assert prepare_tiny_imagenet(archive) == root  # the .zip path itself works too, and reuses the tree
    assert (root / "wnids.txt").stat().st_mtime_ns == stamp


def test_a_crash_mid_extract_never_leaves_a_tree_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tiny_imagenet_zip(tmp_path)
    real_extract = zipfile.ZipFile._extract_member  # type: ignore[attr-defined]

    def dying_extract(self: zipfile.ZipFile, member: zipfile.ZipInfo | str, *args: object) -> str:
        if str(getattr(member, "filename", member)).endswith("val_annotations.txt"):
            raise OSError("simulated crash")
        return str(real_extract(self, member, *args))

    monkeypatch.setattr(zipfile.ZipFile, "_extract_member", dying_extract)
    with pytest.raises(OSError, match="simulated"):
        extract_atomically(archive, tmp_path / "tiny-imagenet-200")
    assert not (tmp_path / "tiny-imagenet-200").exists()
    monkeypatch.undo()
    assert (prepare_tiny_imagenet(tmp_path) / "val" / "val_annotations.txt").is_file()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_corrupt_zip_is_a_data_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    archive = tiny_imagenet_zip(tmp_path)
    data = bytearray(archive.read_bytes())
    if damage == "flip":
        for offset in range(200, len(data) // 2, 997):  # inside compressed members
            data[offset] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a zip" * 100)
    archive.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"tiny-imagenet-200\.zip") as info:
        prepare_tiny_imagenet(tmp_path)
    assert "Fix:" in str(info.value)
    assert not (tmp_path / "tiny-imagenet-200").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_missing_or_malformed_tiny_imagenet_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        prepare_tiny_imagenet(tmp_path / "nope")
    with pytest.raises(DataError, match="no tiny-imagenet-200"):
        prepare_tiny_imagenet(tmp_path)
    root = tiny_imagenet_tree(tmp_path)
    annotations = root / "val" / "val_annotations.txt"
    annotations.write_text(annotations.read_text() + "val_99.JPEG\tn99999999\t0\t0\t1\t1\n")
    with pytest.raises(DataError, match=r"val_annotations.txt:10: malformed"):
        load_bundle(TrainConfig(dataset="tiny-imagenet", data_dir=tmp_path))


def test_imagefolder_reads_class_folders_and_resizes(tmp_path: Path) -> None:
    imagefolder_tree(tmp_path)
    bundle = load_imagefolder(tmp_path, image_size=32, augment_seed=0)
    assert (len(bundle.train), len(bundle.val), bundle.num_classes) == (18, 6, 3)
    assert bundle.train.load(0)[0].shape == (3, 32, 32)


def test_imagefolder_errors_name_the_folder(tmp_path: Path) -> None:
    imagefolder_tree(tmp_path)
    (tmp_path / "val" / "class_9").mkdir()
    with pytest.raises(DataError, match="class_9"):
        load_imagefolder(tmp_path, None, 0)
    os.rename(tmp_path / "val", tmp_path / "validation")
    with pytest.raises(DataError, match="val is not a folder"):
        load_imagefolder(tmp_path, None, 0)


def test_augmentation_is_a_pure_function_of_seed_epoch_and_index() -> None:
    image = torch.randint(0, 255, (3, 32, 32), dtype=torch.uint8)
    aug = Augment(seed=5)
    assert torch.equal(aug(image, 2, 17), aug(image, 2, 17))
    assert aug(image, 2, 17).shape == image.shape
    outputs = {aug(image, e, 17).sum().item() for e in range(20)}
    assert len(outputs) > 5, "different epochs should give different crops/flips"


def test_loader_items_carry_their_dataset_index() -> None:
    bundle = synthetic()
    view = Indexed(TrainView(bundle.train, bundle.augment), by_epoch=True)
    image, label, index = view[(3, 42)]
    assert index == 42 and label == int(bundle.train.labels[42]) and image.dtype == torch.uint8


def test_synthetic_is_deterministic_and_balanced() -> None:
    a, b = synthetic(), synthetic()
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.val.labels, b.val.labels)
    counts = torch.bincount(a.train.labels, minlength=10)
    assert counts.min() > 0.7 * counts.float().mean()


def test_digits_are_the_real_scikit_learn_digits() -> None:
    bundle = digits()
    assert len(bundle.train) + len(bundle.val) == 1797 and bundle.num_classes == 10
    assert bundle.train.load(0)[0].shape == (3, 32, 32)


# ---------------------------------------------------------------- identity (resume fingerprint)
def folder_identity(root: Path) -> dict[str, object]:
    return load_imagefolder(root, image_size=32, augment_seed=0).identity()


def test_a_folder_dataset_keeps_its_identity_when_moved(tmp_path: Path) -> None:
    imagefolder_tree(tmp_path / "a")
    before = folder_identity(tmp_path / "a")
    assert before == folder_identity(tmp_path / "a"), "identity must be reproducible"
    shutil.copytree(tmp_path / "a", tmp_path / "scratch" / "copy")  # e.g. staged to node-local disk
    assert folder_identity(tmp_path / "scratch" / "copy") == before
    assert before["train_samples"] == 18 and before["classes"] == 3
    assert str(before["train_content"]).startswith("18 files, sha256 ")


@pytest.mark.parametrize("change", ["replace", "add", "relabel", "rename"])
def test_a_folder_dataset_whose_files_change_gets_another_identity(tmp_path: Path, change: str) -> None:
    imagefolder_tree(tmp_path)
    before = folder_identity(tmp_path)
    image = tmp_path / "train" / "class_1" / "2.png"
    if change == "replace":  # another image of another size under the same name
        image.write_bytes(image.read_bytes() + b"\0" * 16)
    elif change == "add":
        shutil.copy(image, image.with_name("extra.png"))
    elif change == "relabel":  # same file, other class folder: the sample's label changed
        os.rename(image, tmp_path / "train" / "class_2" / "moved.png")
    else:
        os.rename(image, image.with_name("9.png"))
    after = folder_identity(tmp_path)
    assert after["train_content"] != before["train_content"]
    assert after["val_content"] == before["val_content"], "only the train split changed"


def test_tiny_imagenet_identity_covers_the_validation_labels(tmp_path: Path) -> None:
    root = tiny_imagenet_tree(tmp_path)
    cfg = TrainConfig(dataset="tiny-imagenet", data_dir=tmp_path)
    before = load_bundle(cfg).identity()
    annotations = root / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    lines[0] = lines[0].replace(WNIDS[0], WNIDS[1])  # one validation image relabelled
    annotations.write_text("\n".join(lines) + "\n")
    after = load_bundle(cfg).identity()
    assert after["val_content"] != before["val_content"] and after["train_content"] == before["train_content"]


def test_generated_datasets_are_identified_by_their_recipe() -> None:
    ident = synthetic().identity()
    assert ident == synthetic().identity()
    assert "data seed 1234" in str(ident["train_content"]) and ident["train_samples"] == 4096
    assert synthetic(64).identity() != ident, "another image size is another dataset"
    assert digits().identity()["train_content"] != ident["train_content"]


def test_the_identity_is_computed_once_and_adopted_without_reading_files_again(
    world_of_one: None, tmp_path: Path
) -> None:
    """open_task_data: rank 0 computes the identity (one stat per file) and every rank adopts
    that value; here, a world of one, the adopted value survives the files disappearing."""
    imagefolder_tree(tmp_path)
    cfg = TrainConfig(dataset="imagefolder", data_dir=tmp_path, batch_size=4, image_size=32)
    data = open_task_data(image_task(cfg), cfg, DistEnv())
    before = data.identify()
    assert before["train_samples"] == 18 and before["train_content"].startswith("18 files, sha256 ")
    shutil.rmtree(tmp_path / "train")  # reading the files now would fail
    assert data.identify() == before
    with pytest.raises(DataError, match="is not a folder"):
        load_imagefolder(tmp_path, image_size=32, augment_seed=0)


def test_max_val_samples_picks_samples_spread_over_a_class_sorted_folder_and_keeps_the_identity(
    world_of_one: None, tmp_path: Path
) -> None:
    """--max-val-samples: a folder dataset lists its validation files class by class, so the
    first N would be one class; the cap takes N spread over the set. The dataset's identity
    (and so the checkpoint's fingerprint) is the whole set's, with or without the cap."""
    imagefolder_tree(tmp_path, classes=4)  # 2 validation images per class, listed by class
    whole = TrainConfig(dataset="imagefolder", data_dir=tmp_path, batch_size=4, image_size=32)
    capped = replace(whole, max_val_samples=4)
    full = open_task_data(image_task(whole), whole, DistEnv())
    data = open_task_data(image_task(capped), capped, DistEnv())
    assert [int(full.val[i][1]) for i in range(len(full.val))] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted(int(data.val[i][1]) for i in range(len(data.val))) == [0, 1, 2, 3]
    assert data.identify() == full.identify()
    assert run_fingerprint(capped, image_task(capped), data.identify(), builtin=True) == run_fingerprint(
        whole, image_task(whole), full.identify(), builtin=True
    )
    assert data.describe().endswith(", validating on 4") and "8 val" in data.describe()
    more = replace(whole, max_val_samples=100)  # more than the set: every sample, as without it
    assert len(open_task_data(image_task(more), more, DistEnv()).val) == 8


@given(size=st.integers(1, 10_000), data=st.data())
def test_spread_indices_are_distinct_in_range_and_evenly_spaced(size: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, size))
    picked = spread_indices(size, n)
    assert len(picked) == n and picked == sorted(set(picked)) and picked[0] == 0 and picked[-1] < size
    gaps = {b - a for a, b in itertools.pairwise(picked)}
    assert gaps <= {size // n, -(-size // n)}, gaps  # every gap the floor or the ceiling of size / n
