"""``--keep-best K --best-metric NAME``: the K best epoch-end checkpoints survive retention beside
the newest ``--keep-last`` ones, and ``best.json`` names them. Pure: fake committed folders whose
manifests are written by the real writer, with the built-in trainer's epoch records."""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path

import pytest

from elastic_train.checkpoint import format as fmt
from elastic_train.checkpoint import storage
from elastic_train.checkpoint.manager import CheckpointConfig
from elastic_train.checkpoint.storage import BEST, Purger, read_best, record_best, retention_victims
from elastic_train.errors import UsageError
from elastic_train.metrics import EpochRecord

STEPS = 2  # per epoch
RECORD = EpochRecord(
    epoch=0,
    world_size=1,
    train_loss=1.0,
    train_acc=0.5,
    val_loss=1.0,
    val_acc=0.5,
    epoch_time=1.0,
    throughput=32.0,
    samples_seen=64,
    sample_digest="0-0",
    val_samples=64,
    step=0,
)


def checkpoint(
    root: Path, step: int, epoch: int, history: list[dict[str, object]], batch_in_epoch: int = 0, version: int = 1
) -> Path:
    """A committed folder (no shards: retention reads only manifests); ``latest`` moves to it."""
    folder = root / fmt.step_dir_name(step, version)
    folder.mkdir(parents=True)
    manifest = fmt.Manifest(
        step=step,
        epoch=epoch,
        batch_in_epoch=batch_in_epoch,
        world_size=1,
        files={},
        tensors={},
        fingerprint={},
        payload=fmt.Payload(app={"early_stop": {}, "history": history}),
        config={},
        versions={},
    )
    storage.write_atomic(folder / fmt.MANIFEST, manifest.to_json().encode())
    storage.point_latest(root, folder)
    return folder


def epoch_ends(root: Path, metric: str, values: list[float]) -> list[Path]:
    """One epoch-end checkpoint per value of ``metric``, each holding the history so far."""
    history: list[dict[str, object]] = []
    folders = []
    for epoch, value in enumerate(values, start=1):
        record = dataclasses.replace(RECORD, epoch=epoch, step=epoch * STEPS, **{metric: value})
        history.append(record.to_json())
        folders.append(checkpoint(root, epoch * STEPS, epoch, list(history)))
    return folders


def retain(root: Path, keep_last: int, keep_best: int, metric: str = "val_acc") -> set[Path]:
    """One retention pass as ``Checkpointer._clean_up`` runs it; the folders left."""
    purger = Purger()
    purger.purge(root, keep_last, protect=record_best(root, keep_best, metric))
    purger.join()
    return set(fmt.step_folders(root))


def test_the_best_epoch_survives_beside_the_newest_and_best_json_names_it(tmp_path: Path) -> None:
    _, e2, e3, e4 = epoch_ends(tmp_path, "val_acc", [0.5, 0.9, 0.6, 0.7])
    assert retain(tmp_path, keep_last=2, keep_best=1) == {e2, e3, e4}
    best = read_best(tmp_path)
    assert [(b.folder, b.epoch, b.value) for b in best] == [(e2.name, 2, 0.9)]
    raw = json.loads((tmp_path / BEST).read_text())
    assert raw["metric"] == "val_acc" and raw["better"] == "max" and raw["best"][0]["folder"] == e2.name
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "written atomically: no temp file left"


@pytest.mark.parametrize(
    ("metric", "values", "best_epoch"),
    [
        ("val_loss", [0.9, 0.3, 0.5, 0.4], 2),  # lower is better
        ("train_loss", [0.9, 0.8, 0.2, 0.4], 3),
        ("val_acc", [0.4, 0.3, 0.5, 0.2], 3),  # higher is better
        ("train_acc", [0.9, 0.3, 0.5, 0.4], 1),
    ],
)
def test_each_metric_is_ranked_in_its_direction(
    tmp_path: Path, metric: str, values: list[float], best_epoch: int
) -> None:
    folders = epoch_ends(tmp_path, metric, values)
    left = retain(tmp_path, keep_last=2, keep_best=1, metric=metric)
    assert folders[best_epoch - 1] in left and len(left) == 3 - (best_epoch > 2)
    assert [b.epoch for b in read_best(tmp_path)] == [best_epoch]


def test_ties_keep_the_newer_checkpoint(tmp_path: Path) -> None:
    _, e2, e3, e4 = epoch_ends(tmp_path, "val_acc", [0.8, 0.8, 0.5, 0.4])
    assert retain(tmp_path, keep_last=2, keep_best=1) == {e2, e3, e4}
    assert [b.folder for b in read_best(tmp_path)] == [e2.name]


def test_k_best_are_listed_best_first_and_an_old_best_is_released_when_beaten(tmp_path: Path) -> None:
    e1, e2, e3, e4 = epoch_ends(tmp_path, "val_acc", [0.7, 0.9, 0.1, 0.2])
    assert retain(tmp_path, keep_last=2, keep_best=2) == {e1, e2, e3, e4}
    assert [b.folder for b in read_best(tmp_path)] == [e2.name, e1.name]
    history = json.loads((e4 / fmt.MANIFEST).read_text())["payload"]["app"]["history"]
    e5 = checkpoint(tmp_path, 10, 5, [*history, {**history[-1], "epoch": 5, "val_acc": 0.95}])
    assert retain(tmp_path, keep_last=2, keep_best=2) == {e2, e4, e5}, "epoch 1 dropped out of the 2 best"
    assert [b.folder for b in read_best(tmp_path)] == [e5.name, e2.name]


def test_only_evaluated_epoch_ends_are_candidates(tmp_path: Path) -> None:
    e1, e2 = epoch_ends(tmp_path, "val_acc", [0.5, 0.6])
    history = json.loads((e2 / fmt.MANIFEST).read_text())["payload"]["app"]["history"]
    glowing = [*history[:1], {**history[1], "val_acc": 0.99}]  # metrics of a state the folder does not hold
    mid = checkpoint(tmp_path, 5, 2, glowing, batch_in_epoch=1)  # mid-epoch: the model moved on since epoch 2
    last_batch = checkpoint(tmp_path, 6, 2, glowing, batch_in_epoch=2)  # a save on the epoch's last batch
    checkpoint(tmp_path, 6, 3, [*glowing, {**history[1], "epoch": 3, "val_acc": 0.1}], version=2)
    custom = checkpoint(tmp_path, 7, 3, [])  # a custom loop: no history
    no_metric = checkpoint(tmp_path, 8, 4, [{"epoch": 4, "val_loss": 0.1}])  # the task's history lacks it
    aside = storage.move_aside(checkpoint(tmp_path, 9, 5, [{"epoch": 5, "val_acc": 1.0}]), fmt.CORRUPT)
    best = record_best(tmp_path, 3, "val_acc")
    assert best == {e2, e1, tmp_path / fmt.step_dir_name(6, 2)}
    assert not best & {mid, last_batch, custom, no_metric, aside}
    assert aside.exists() and aside not in retention_victims(tmp_path, 1, best)


def test_a_manifest_that_cannot_be_read_now_stops_the_pass_instead_of_losing_a_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e1, *_ = epoch_ends(tmp_path, "val_acc", [0.9, 0.5, 0.6])
    real = storage.read_manifest

    def flaky(folder: Path, retry: bool = True) -> fmt.Manifest:
        if folder == e1:
            raise fmt.CheckpointUnreadable(f"{folder}: cannot be read ({errno.errorcode[errno.EIO]})")
        return real(folder, retry)

    monkeypatch.setattr(storage, "read_manifest", flaky)
    with pytest.raises(fmt.CheckpointUnreadable):
        record_best(tmp_path, 1, "val_acc")  # _clean_up logs it; retention waits for the next commit


def test_keep_best_0_is_keep_last_alone_and_drops_a_leftover_best_json(tmp_path: Path) -> None:
    e1, e2, e3, e4 = epoch_ends(tmp_path, "val_acc", [0.5, 0.9, 0.6, 0.7])
    assert record_best(tmp_path, 1, "val_acc") == {e2}
    assert record_best(tmp_path, 0, "val_acc") == set()
    assert not (tmp_path / BEST).exists(), "an earlier run's best.json must not name folders now deleted"
    assert sorted(retention_victims(tmp_path, 2, protect={e4})) == [e1, e2]
    assert retain(tmp_path, keep_last=2, keep_best=0) == {e3, e4} and read_best(tmp_path) == []


def test_the_folder_latest_points_to_is_never_a_victim(tmp_path: Path) -> None:
    e1, e2, *_ = epoch_ends(tmp_path, "val_acc", [0.5, 0.9, 0.6, 0.7])
    storage.point_latest(tmp_path, e1)  # e.g. a run resumed with --resume PATH from an old folder
    assert retention_victims(tmp_path, 2, protect=set()) == [e2]


def test_a_library_callers_checkpoint_config_refuses_an_unknown_metric_naming_the_choices(tmp_path: Path) -> None:
    assert CheckpointConfig(root=tmp_path).keep_best == 0, "off unless asked for"
    with pytest.raises(UsageError, match="best_metric='f1' is not one of val_acc, train_acc, val_loss, train_loss"):
        CheckpointConfig(root=tmp_path, keep_best=1, best_metric="f1")
    with pytest.raises(UsageError, match="keep_best=-1 must be >= 0"):
        CheckpointConfig(root=tmp_path, keep_best=-1)
