"""Checkpoint format, storage, lock and state conversion: pure unit and hypothesis tests."""

from __future__ import annotations

import errno
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from elastic_train.checkpoint import format as fmt
from elastic_train.checkpoint.lock import CheckpointLock
from elastic_train.checkpoint.manager import CheckpointConfig, load, select_checkpoint
from elastic_train.checkpoint.state import assign_shards, capture_rng, flatten, restore_rng, unflatten
from elastic_train.checkpoint.storage import point_latest, retention_victims, write_atomic
from elastic_train.checkpoint.tensor_io import write_shard
from elastic_train.errors import UsageError

FINGERPRINT = {"model": "vit", "batch_size": 32}


# ---------------------------------------------------------------------------- shard assignment
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**7), max_size=60), st.integers(1, 16))
def test_shard_assignment_covers_each_tensor_once_and_balances_bytes(sizes: dict[str, int], world: int) -> None:
    owner = assign_shards(sizes, world)
    assert set(owner) == set(sizes), "every tensor is written, by exactly one rank"
    assert all(0 <= r < world for r in owner.values())
    loads = [sum(sizes[k] for k, r in owner.items() if r == rank) for rank in range(world)]
    largest = max(sizes.values(), default=0)
    assert max(loads) - min(loads) <= largest
    assert assign_shards(dict(reversed(list(sizes.items()))), world) == owner, "must not depend on dict order"


# ---------------------------------------------------------------------------- manifest
entries = st.builds(
    fmt.FileEntry,
    size=st.integers(0, 2**40),
    sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
    xxh3=st.text("0123456789abcdef", min_size=32, max_size=32),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


@given(
    step=st.integers(0, 10**8),
    files=st.dictionaries(st.text(min_size=1, max_size=12), entries, max_size=5),
    trainer=st.dictionaries(st.text(max_size=8), json_values, max_size=5),
    finished=st.booleans(),
)
def test_manifest_round_trips_through_json(
    step: int, files: dict[str, fmt.FileEntry], trainer: dict[str, object], finished: bool
) -> None:
    m = fmt.Manifest(
        step=step,
        epoch=3,
        batch_in_epoch=7,
        world_size=4,
        files=files,
        tensors={f"model.w{i}": name for i, name in enumerate(files)},
        fingerprint=FINGERPRINT,
        trainer=trainer,
        config={"epochs": 10},
        versions={"torch": "x"},
        finished=finished,
    )
    assert fmt.Manifest.from_json(m.to_json(), Path("m.json")) == m


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other"}', "not an elastic-train manifest"),
        ('{"format": "elastic-train-checkpoint", "version": 99}', "format version 99"),
        ('{"format": "elastic-train-checkpoint", "version": 1, "files": {}}', "malformed manifest"),
    ],
)
def test_bad_manifests_are_rejected_with_the_file_name(text: str, problem: str) -> None:
    with pytest.raises(fmt.CheckpointInvalid, match=problem) as info:
        fmt.Manifest.from_json(text, Path("/ck/step-00000001/manifest.json"))
    assert "/ck/step-00000001/manifest.json" in str(info.value)


# ---------------------------------------------------------------------------- state conversion
def trained(optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    )
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_flatten_unflatten_restores_model_and_optimizer_exactly(optimizer: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = trained(optimizer)
    tensors, meta = flatten(*get_state_dict(model, opt))
    json.dumps(meta)  # the non-tensor rest must be plain JSON
    assert all(k.startswith(("model.", "optim.state.")) for k in tensors)
    fresh_model, fresh_opt = trained(optimizer)
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)
    model_sd, optim_sd = unflatten({k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta)))
    set_state_dict(fresh_model, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    again, meta_again = flatten(*get_state_dict(fresh_model, fresh_opt))
    assert again.keys() == tensors.keys() and meta_again == meta
    assert all(torch.equal(again[k], tensors[k]) and again[k].dtype == tensors[k].dtype for k in tensors)


def test_rng_streams_round_trip() -> None:
    state = capture_rng(torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1))
    restore_rng(state, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


# ---------------------------------------------------------------------------- folders on disk
def make_checkpoint(
    root: Path, step: int, finished: bool = False, fingerprint: dict[str, object] | None = None
) -> Path:
    folder = root / fmt.step_dir_name(step)
    folder.mkdir(parents=True)
    name = fmt.shard_name(0, 1)
    entry = write_shard(folder / name, {"model.w": torch.full((64,), float(step))}, {})
    manifest = fmt.Manifest(
        step=step,
        epoch=step,
        batch_in_epoch=0,
        world_size=1,
        files={name: entry},
        tensors={"model.w": name},
        fingerprint=fingerprint or FINGERPRINT,
        trainer={},
        config={},
        versions={},
        finished=finished,
    )
    write_atomic(folder / fmt.MANIFEST, manifest.to_json().encode())
    point_latest(root, folder)
    return folder


def choose(root: Path, mode: str = "auto") -> Path | None:
    return select_checkpoint(CheckpointConfig(root=root, resume=mode), FINGERPRINT)


def corrupt(folder: Path, how: str) -> str:
    shard = folder / fmt.shard_name(0, 1)
    if how == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        return "checksum mismatch"
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
        return "truncated"
    if how == "missing":
        shard.unlink()
        return "is missing"
    (folder / fmt.MANIFEST).write_text('{"format": "elastic-train-checkpoint", "vers')
    return "not valid JSON"


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "manifest"])
def test_a_damaged_latest_is_reported_by_file_and_the_newest_older_valid_one_is_taken(tmp_path: Path, how: str) -> None:
    make_checkpoint(tmp_path, 1)
    older = make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 3)
    problem = corrupt(newest, how)
    with capture_logs() as logs:
        assert choose(tmp_path) == older
    invalid = [e for e in logs if e["event"] == "checkpoint_invalid"]
    assert invalid and problem in invalid[0]["error"] and str(newest) in invalid[0]["error"]
    fallback = [e for e in logs if e["event"] == "checkpoint_fallback"]
    assert fallback and fallback[0]["chosen"] == str(older)
    assert newest.exists(), "a damaged checkpoint is reported, never deleted"


def test_a_dangling_latest_falls_back_to_the_newest_valid_folder(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 1)
    kept = make_checkpoint(tmp_path, 2)
    os.replace(tmp_path / "latest", tmp_path / "old-link")
    os.symlink("step-00000099", tmp_path / "latest")
    assert choose(tmp_path) == kept


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    corrupt(make_checkpoint(tmp_path, 1), "flip")
    corrupt(make_checkpoint(tmp_path, 2), "manifest")
    with pytest.raises(UsageError, match="none is valid") as info:
        choose(tmp_path)
    assert "--resume never" in str(info.value) and len(fmt.step_folders(tmp_path)) == 2


def test_empty_or_missing_directory_starts_fresh(tmp_path: Path) -> None:
    assert choose(tmp_path / "nothing") is None
    assert choose(tmp_path) is None


def test_resume_never_refuses_to_overwrite_existing_checkpoints(tmp_path: Path) -> None:
    assert choose(tmp_path, "never") is None
    make_checkpoint(tmp_path, 5)
    with pytest.raises(UsageError, match="already holds checkpoints"):
        choose(tmp_path, "never")


def test_resume_path_takes_that_checkpoint_or_fails(tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    assert choose(tmp_path, str(first)) == first
    corrupt(first, "flip")
    with pytest.raises(UsageError, match="checksum mismatch"):
        choose(tmp_path, str(first))


def test_an_incompatible_checkpoint_is_refused_naming_the_difference(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 1, fingerprint={"model": "resnet18", "batch_size": 32})
    with pytest.raises(UsageError, match="model: checkpoint 'resnet18', this run 'vit'"):
        choose(tmp_path)


def test_load_verifies_and_reads_every_tensor(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path, 4)
    loaded = load(folder)
    assert torch.equal(loaded.tensors["model.w"], torch.full((64,), 4.0))
    corrupt(folder, "flip")
    with pytest.raises(fmt.CheckpointInvalid, match="checksum mismatch"):
        load(folder)


def test_retention_keeps_the_newest_and_spares_the_protected(tmp_path: Path) -> None:
    folders = [make_checkpoint(tmp_path, s) for s in (1, 2, 3, 4, 5)]
    partial_old = tmp_path / fmt.step_dir_name(0)
    partial_new = tmp_path / fmt.step_dir_name(9)  # possibly a save in progress
    partial_old.mkdir()
    partial_new.mkdir()
    victims = retention_victims(tmp_path, keep_last=2, protect={folders[4]})
    assert sorted(victims) == sorted([folders[0], folders[1], folders[2], partial_old])
    assert retention_victims(tmp_path, keep_last=2, protect={folders[0]}).count(folders[0]) == 0


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    write_atomic(target, b"old")

    def disk_full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, b"new", before_rename=disk_full)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_latest_moves_atomically(tmp_path: Path) -> None:
    a, b = make_checkpoint(tmp_path, 1), make_checkpoint(tmp_path, 2)
    assert fmt.latest_target(tmp_path) == b
    point_latest(tmp_path, a)
    assert fmt.latest_target(tmp_path) == a and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


# ---------------------------------------------------------------------------- lock
def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    first = CheckpointLock(tmp_path, owner="job-1")
    first.acquire()
    try:
        with pytest.raises(UsageError, match="in use by run 'job-1'") as info:
            CheckpointLock(tmp_path, owner="job-2").acquire()
        assert "another --checkpoint-dir" in str(info.value)
        CheckpointLock(tmp_path, owner="job-1").acquire()  # the same job after a restart
    finally:
        first.release()


def test_a_crashed_runs_lock_does_not_block_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = {"owner": "job-dead", "host": "elsewhere", "pid": 1, "heartbeat": time.time() - 3600}
    (tmp_path / ".lock").write_text(json.dumps(stale))
    lock = CheckpointLock(tmp_path, owner="job-new")
    lock.acquire()
    lock.release()
    assert not (tmp_path / ".lock").exists()
    # Same host, fresh heartbeat, but the process is gone: taken over at once.
    gone = {"owner": "job-dead", "host": lock.host, "pid": 2**22 + 7, "heartbeat": time.time()}
    (tmp_path / ".lock").write_text(json.dumps(gone))
    lock.acquire()
    lock.release()


@settings(max_examples=20)
@given(st.integers(1, 5))
def test_step_folder_names_sort_by_step(steps: int) -> None:
    names = [fmt.step_dir_name(s) for s in range(0, 10**steps, max(1, 10**steps // 7))]
    assert sorted(names) == names and all(fmt.step_of(Path(n)) == int(n[5:]) for n in names)


def test_a_commit_interrupted_before_latest_moved_still_counts(tmp_path: Path) -> None:
    older = make_checkpoint(tmp_path, 1)
    newer = make_checkpoint(tmp_path, 2)
    point_latest(tmp_path, older)  # as if the process died between manifest and `latest`
    assert choose(tmp_path) == newer


def test_folders_without_a_manifest_are_not_checkpoints(tmp_path: Path) -> None:
    (tmp_path / fmt.step_dir_name(3)).mkdir(parents=True)  # the very first save died half-way
    assert choose(tmp_path) is None
    kept = make_checkpoint(tmp_path, 1)
    assert choose(tmp_path) == kept


def test_sha256_is_audited_by_the_thorough_verify(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path, 1)
    manifest = fmt.read_manifest(folder)
    name, entry = next(iter(manifest.files.items()))
    manifest.files[name] = fmt.FileEntry(entry.size, "0" * 64, entry.xxh3)
    (folder / fmt.MANIFEST).write_text(manifest.to_json())
    fmt.verify(folder)  # the fast load-time check passes
    with pytest.raises(fmt.CheckpointInvalid, match="sha256 mismatch"):
        fmt.verify(folder, sha256=True)


DTYPE_CHOICES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(DTYPE_CHOICES), st.lists(st.integers(0, 5), max_size=3)), max_size=8),
    st.integers(0, 2**31),
)
def test_our_shard_writer_produces_files_the_official_parser_reads_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, spec: list[tuple[torch.dtype, list[int]]], seed: int
) -> None:
    import safetensors.torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": (torch.randn(shape, generator=gen) * 50).to(dtype) for i, (dtype, shape) in enumerate(spec)}
    path = tmp_path_factory.mktemp("shard") / "s.safetensors"
    entry = write_shard(path, tensors, {"step": "3"})
    back = safetensors.torch.load_file(str(path))
    assert back.keys() == tensors.keys()
    assert all(
        back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v) for k, v in tensors.items()
    )
    assert entry.size == path.stat().st_size and fmt.file_digests(path, sha256=True)[1:] == (entry.xxh3, entry.sha256)
