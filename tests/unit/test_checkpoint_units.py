"""Checkpoint format, storage, lock and state conversion: pure unit and hypothesis tests."""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from elastic_train.checkpoint import format as fmt
from elastic_train.checkpoint import lock as lock_module
from elastic_train.checkpoint.format import Payload
from elastic_train.checkpoint.lock import CheckpointLock, lock_ttl
from elastic_train.checkpoint.manager import CheckpointConfig, Checkpointer, load, select_checkpoint
from elastic_train.checkpoint.snapshot import Position, Snapshot
from elastic_train.checkpoint.state import assign_shards, capture_rng, flatten, restore_rng, unflatten
from elastic_train.checkpoint.storage import move_aside, point_latest, retention_victims, write_atomic
from elastic_train.checkpoint.tensor_io import write_shard
from elastic_train.ckpt import main as ckpt_main
from elastic_train.distributed.env import DistEnv
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
    app=st.dictionaries(st.text(max_size=8), json_values, max_size=5),
    finished=st.booleans(),
    timeline=st.text(max_size=16),
)
def test_manifest_round_trips_through_json(
    step: int, files: dict[str, fmt.FileEntry], app: dict[str, object], finished: bool, timeline: str
) -> None:
    m = fmt.Manifest(
        step=step,
        epoch=3,
        batch_in_epoch=7,
        world_size=4,
        files=files,
        tensors={f"model.w{i}": name for i, name in enumerate(files)},
        fingerprint=FINGERPRINT,
        payload=fmt.Payload(optimizer={"param_groups": []}, scheduler={"last_epoch": step}, app=app),
        config={"epochs": 10},
        versions={"torch": "x"},
        finished=finished,
        timeline=timeline,
        parent="step-00000002",
    )
    assert fmt.Manifest.from_json(m.to_json(), Path("m.json")) == m


def test_a_format_1_manifest_still_loads_with_an_unknown_timeline(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path, 3)
    raw = json.loads((folder / fmt.MANIFEST).read_text())
    del raw["timeline"], raw["parent"], raw["payload"]
    raw["version"] = 1
    raw["trainer"] = {"history": []}  # versions 1 and 2 had a free-form trainer dict
    (folder / fmt.MANIFEST).write_text(json.dumps(raw))
    manifest = fmt.verify(folder)
    assert (manifest.version, manifest.timeline, manifest.parent) == (1, "", "")


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


@pytest.mark.parametrize("model_name", ["vit", "resnet18"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_our_fqn_state_dicts_equal_torch_dcps_and_load_back_the_same(model_name: str, optimizer: str) -> None:
    """The trainer names optimizer state by FQN itself (DCP's module costs 0.6 s per worker start):
    same tensors and JSON as get_state_dict, and loading gives what set_state_dict gives."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elastic_train.checkpoint.state import load_state_dicts, state_dicts
    from elastic_train.models import build_model

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = build_model(model_name, 10, 16)
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-3)
            if optimizer == "adamw"
            else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
        )
        return model, opt

    model, opt = make()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3, 16, 16)).sum().backward()
        opt.step()
    ours, theirs = flatten(*state_dicts(model, opt)), flatten(*get_state_dict(model, opt))
    assert ours[1] == theirs[1] and ours[0].keys() == theirs[0].keys()
    assert all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0])
    (ours_model, ours_opt), (dcp_model, dcp_opt) = make(), make()
    load_state_dicts(ours_model, ours_opt, *state_dicts(model, opt))
    set_state_dict(
        dcp_model, dcp_opt, model_state_dict=model.state_dict(), optim_state_dict=get_state_dict(model, opt)[1]
    )
    a, b = flatten(*state_dicts(ours_model, ours_opt)), flatten(*state_dicts(dcp_model, dcp_opt))
    assert a[1] == b[1] and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def test_rng_streams_round_trip() -> None:
    state = capture_rng(torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1))
    restore_rng(state, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


# ---------------------------------------------------------------------------- folders on disk
def make_checkpoint(
    root: Path,
    step: int,
    finished: bool = False,
    fingerprint: dict[str, object] | None = None,
    timeline: str = "t-made",
    version: int = 1,
) -> Path:
    folder = root / fmt.step_dir_name(step, version)
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
        payload=fmt.Payload(),
        config={},
        versions={},
        finished=finished,
        timeline=timeline,
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
    assert "empty --checkpoint-dir" in str(info.value) and len(fmt.step_folders(tmp_path)) == 2
    assert "--resume never" not in str(info.value)  # refused in turn for this directory: never suggested


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


def test_versions_of_a_step_sort_between_it_and_the_next_step_and_set_aside_folders_are_not_step_folders(
    tmp_path: Path,
) -> None:
    for name in ("step-00000004", "step-00000003-v10", "step-00000003", "step-00000003-v2", "step-00000002"):
        (tmp_path / name).mkdir()
    for odd in ("step-00000003-v1", "step-00000003-v0", "step-00000003.corrupt-20261201T000000Z", "step-3"):
        (tmp_path / odd).mkdir()
    order = [p.name for p in fmt.step_folders(tmp_path)]
    assert order == ["step-00000004", "step-00000003-v10", "step-00000003-v2", "step-00000003", "step-00000002"]
    assert [p.name for p in fmt.versions_of(tmp_path, 3)] == ["step-00000003", "step-00000003-v2", "step-00000003-v10"]
    assert fmt.checkpoint_key(tmp_path / "step-00000003-v2") == (3, 2) and fmt.step_dir_name(3, 2) == "step-00000003-v2"
    assert [p.name for p in fmt.aside_folders(tmp_path)] == ["step-00000003.corrupt-20261201T000000Z"]


def test_retention_counts_versions_and_never_touches_folders_set_aside(tmp_path: Path) -> None:
    old = [make_checkpoint(tmp_path, s) for s in (1, 2)]
    mid = make_checkpoint(tmp_path, 3)
    end = make_checkpoint(tmp_path, 3, version=2)
    in_progress = tmp_path / fmt.step_dir_name(3, 3)
    in_progress.mkdir()
    aside = move_aside(make_checkpoint(tmp_path, 4), fmt.CORRUPT)
    victims = retention_victims(tmp_path, keep_last=2, protect={end})
    assert sorted(victims) == sorted(old), "keep step 3 and its newer version; spare the save in progress"
    assert mid not in victims and in_progress not in victims and aside not in victims


def test_moving_aside_renames_and_never_deletes_even_twice_in_a_second(tmp_path: Path) -> None:
    first = move_aside(make_checkpoint(tmp_path, 7), fmt.CORRUPT)
    second = move_aside(make_checkpoint(tmp_path, 7, timeline="again"), fmt.CORRUPT)
    assert first != second and first.name.startswith("step-00000007.corrupt-")
    assert all((p / fmt.MANIFEST).exists() and (p / fmt.shard_name(0, 1)).exists() for p in (first, second))
    assert fmt.step_folders(tmp_path) == []


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
TTL = 60.0


def plant_lock(root: Path, age_s: float, content: str | None = None, host: str = "elsewhere") -> Path:
    """A lock of another run whose last heartbeat was ``age_s`` ago."""
    path = root / ".lock"
    record = {"owner": "job-other", "host": host, "pid": 1, "ttl": TTL}
    path.write_text(json.dumps(record) if content is None else content)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    first = CheckpointLock(tmp_path, owner="job-1", ttl_s=TTL)
    first.acquire()
    again = CheckpointLock(tmp_path, owner="job-1", ttl_s=TTL)
    try:
        with pytest.raises(UsageError, match="in use by run 'job-1'") as info:
            CheckpointLock(tmp_path, owner="job-2", ttl_s=TTL).acquire()
        assert "another --checkpoint-dir" in str(info.value)
        again.acquire()  # the same job after a restart takes its lock back
        assert first.lost() and not again.lost()
    finally:
        first.release()
        assert (tmp_path / ".lock").exists(), "releasing a lock that was taken over must leave the new holder's"
        again.release()
    assert not (tmp_path / ".lock").exists()
    assert [p.name for p in tmp_path.iterdir()] == [], "no private or stale lock files left behind"


def test_a_crashed_runs_lock_does_not_block_forever(tmp_path: Path) -> None:
    plant_lock(tmp_path, age_s=TTL + 5)
    lock = CheckpointLock(tmp_path, owner="job-new", ttl_s=TTL)
    with capture_logs() as logs:
        lock.acquire()
    assert any(e["event"] == "checkpoint_lock_taken_over" for e in logs)
    assert json.loads((tmp_path / ".lock").read_text())["owner"] == "job-new"
    lock.release()
    assert not (tmp_path / ".lock").exists()
    # Same host, fresh heartbeat, but the process is gone: taken over at once.
    plant_lock(tmp_path, age_s=0, content=json.dumps({"owner": "job-dead", "host": lock.host, "pid": 2**22 + 7}))
    lock.acquire()
    lock.release()
    # The same host name, but another PID namespace (a container on the host's network): that
    # pid means nothing here, so the lock is held until its heartbeat is older than its TTL.
    alien = {"owner": "job-alien", "host": lock.host, "pidns": "1", "pid": 2**22 + 7}
    plant_lock(tmp_path, age_s=0, content=json.dumps(alien))
    with pytest.raises(UsageError, match="in use by run 'job-alien'"):
        lock.acquire()


def test_a_fresh_lock_that_cannot_be_read_counts_as_held_until_it_is_stale(tmp_path: Path) -> None:
    plant_lock(tmp_path, age_s=1, content="")  # e.g. a holder between O_EXCL create and write
    with pytest.raises(UsageError, match="in use by a run"):
        CheckpointLock(tmp_path, owner="job-new", ttl_s=TTL).acquire()
    plant_lock(tmp_path, age_s=TTL + 5, content="")
    lock = CheckpointLock(tmp_path, owner="job-new", ttl_s=TTL)
    lock.acquire()
    lock.release()


def test_the_ttl_a_holder_wrote_is_the_one_others_judge_it_by(tmp_path: Path) -> None:
    record = {"owner": "job-slow", "host": "elsewhere", "pid": 1, "ttl": 1000.0}
    plant_lock(tmp_path, age_s=500, content=json.dumps(record))
    with pytest.raises(UsageError, match="stale after 1000s"):
        CheckpointLock(tmp_path, owner="job-new", ttl_s=TTL).acquire()


@pytest.mark.parametrize("existing", ["none", "stale"])
def test_of_many_racing_starters_exactly_one_takes_the_lock(tmp_path: Path, existing: str) -> None:
    if existing == "stale":
        plant_lock(tmp_path, age_s=TTL + 5)
    locks = [CheckpointLock(tmp_path, owner=f"job-{i}", ttl_s=TTL) for i in range(8)]
    barrier = threading.Barrier(len(locks))
    won: list[CheckpointLock] = []

    def start(lock: CheckpointLock) -> None:
        barrier.wait()
        try:
            lock.acquire()
            won.append(lock)
        except UsageError:
            pass

    threads = [threading.Thread(target=start, args=(lock,)) for lock in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert len(won) == 1, f"{len(won)} runs hold the lock"
        assert json.loads((tmp_path / ".lock").read_text())["owner"] == won[0].owner
    finally:
        for lock in won:
            lock.release()


def test_a_takeover_backs_off_when_the_holder_beats_in_between(tmp_path: Path) -> None:
    path = plant_lock(tmp_path, age_s=TTL + 5)
    contender = CheckpointLock(tmp_path, owner="job-new", ttl_s=TTL)
    judged = contender.inspect()
    assert judged is not None and contender.blocks_us(judged) is None
    os.utime(path)  # the holder was only slow: it beats before the contender renames
    assert contender._take_over(judged) is False
    held = contender.inspect()
    assert held is not None and held.inode == judged.inode and held.record["owner"] == "job-other"
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_a_mutex_left_by_a_node_that_froze_mid_commit_delays_a_restart_but_never_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder on another host SIGSTOPped (or cut off) while it committed leaves a fresh mutex
    that no pid check can clear: a replica of the same job that starts meanwhile waits until the
    mutex is stale and then takes its job's lock, instead of giving up (exit 2, final)."""
    assert lock_module.ACQUIRE_TIMEOUT_S > lock_module.MUTEX_STALE_S, "a stale mutex would refuse the directory"
    monkeypatch.setattr(lock_module, "MUTEX_STALE_S", 0.6)  # scaled down: 30 s in production
    monkeypatch.setattr(lock_module, "ACQUIRE_TIMEOUT_S", 0.6 + 10.0)
    frozen = {"owner": "job-1", "host": "elsewhere", "pidns": "1", "pid": 1, "ttl": TTL}
    plant_lock(tmp_path, age_s=1, content=json.dumps(frozen))
    (tmp_path / lock_module.MUTEX_NAME).write_text("elsewhere 1 1 token-of-the-frozen-commit\n")
    lock = CheckpointLock(tmp_path, owner="job-1", ttl_s=TTL)
    started = time.monotonic()
    lock.acquire()  # the same job: taken over once the mutex is stale
    waited = time.monotonic() - started
    try:
        assert waited >= 0.4, f"the frozen holder's mutex was not respected ({waited:.2f} s)"
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_takeover_mutex_left_by_a_crashed_contender_is_cleared(tmp_path: Path) -> None:
    plant_lock(tmp_path, age_s=TTL + 5)
    mutex = tmp_path / lock_module.MUTEX_NAME
    mutex.write_text("elsewhere 1\n")
    then = time.time() - lock_module.MUTEX_STALE_S - 5
    os.utime(mutex, (then, then))
    lock = CheckpointLock(tmp_path, owner="job-new", ttl_s=TTL)
    lock.acquire()
    lock.release()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_the_holder_beats_and_notices_when_its_lock_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    lock = CheckpointLock(tmp_path, owner="job-1", ttl_s=TTL)
    lock.acquire()
    try:
        then = time.time() - 30
        os.utime(lock.path, (then, then))
        deadline = time.monotonic() + 5
        while time.time() - lock.path.stat().st_mtime > 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.time() - lock.path.stat().st_mtime < 10, "the heartbeat did not refresh the lock"
        other = tmp_path / "other"
        other.write_text(json.dumps({"owner": "job-2", "host": "elsewhere", "pid": 1}))
        with capture_logs() as logs:
            os.replace(other, lock.path)
            deadline = time.monotonic() + 5
            while not any(e["event"] == "checkpoint_lock_lost" for e in logs) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert lock.lost() and any(e["event"] == "checkpoint_lock_lost" for e in logs)
    finally:
        lock.release()
    assert json.loads(lock.path.read_text())["owner"] == "job-2", "release must not remove another run's lock"


def test_a_lock_taken_by_another_replica_of_the_same_job_is_a_hand_over_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quorum mode: the replica saving now takes the job's lock from the one that saved before.
    The previous holder notices (it commits nothing more under it) but logs no error."""
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    lock = CheckpointLock(tmp_path, owner="job-1", ttl_s=TTL)
    lock.acquire()
    try:
        other = tmp_path / "other"
        other.write_text(json.dumps({"owner": "job-1", "host": "elsewhere", "pid": 1}))
        with capture_logs() as logs:
            os.replace(other, lock.path)
            deadline = time.monotonic() + 5
            while not any(e["event"] == "checkpoint_lock_handed_over" for e in logs) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert lock.lost()
        handed = [e for e in logs if e["event"] == "checkpoint_lock_handed_over"]
        assert handed and handed[0]["log_level"] == "info" and handed[0]["to_host"] == "elsewhere"
        assert not [e for e in logs if e["log_level"] == "error"], logs
    finally:
        lock.release()


def test_the_lock_ttl_outlasts_the_hang_timeout_unless_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lock_module.TTL_VAR, raising=False)
    for hang in (30.0, 90.0, 300.0):
        assert lock_ttl(hang) >= hang + 120, "a frozen holder's job must be able to restart and retake it"
    assert lock_ttl(0.0) == lock_module.NO_WATCHDOG_TTL_S
    monkeypatch.setenv(lock_module.TTL_VAR, "7")
    assert lock_ttl(300.0) == 7.0
    monkeypatch.setenv(lock_module.TTL_VAR, "soon")
    with pytest.raises(UsageError, match="ELASTIC_TRAIN_LOCK_TTL='soon'"):
        lock_ttl(300.0)


# ---------------------------------------------------------------------------- save decisions
@pytest.fixture
def group(world_of_one: None) -> None:
    """The checkpointer's collectives need a process group (tests/unit/conftest.py)."""


def checkpointer(root: Path, resume: str = "auto") -> Checkpointer:
    ck = Checkpointer(CheckpointConfig(root=root, resume=resume, keep_last=10), DistEnv(run_id="unit"), FINGERPRINT)
    ck.start()
    return ck


def snap(step: int, epoch: int, batch: int, finished: bool = False) -> Snapshot:
    return Snapshot(
        position=Position(step, epoch, batch, finished),
        replicated={"model.w": torch.full((16,), float(step * 100 + epoch * 10 + batch))},
        per_rank={},
        payload=Payload(),
    )


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())


@pytest.mark.usefixtures("group")
def test_a_saver_that_lost_the_lock_to_a_peer_never_commits_its_older_pending_save(tmp_path: Path) -> None:
    """Quorum mode: replica A's background save of step 2 is still pending when replica B (same
    job, same timeline) takes the lock over and commits step 4. When A saves again, it takes the
    lock back only after its pending save was judged under the lock it lost: refused, so
    ``latest`` never goes back from B's step 4 to A's step 2."""
    a = checkpointer(tmp_path)
    b = Checkpointer(CheckpointConfig(root=tmp_path, keep_last=10), DistEnv(run_id="unit"), FINGERPRINT)
    try:
        a.take_lock()
        assert a.save(snap(2, 0, 2), sync=False) is None
        while not a.local_done():
            time.sleep(0.01)
        b.timeline = a.timeline  # replicated between replicas, healed with the weights
        b.take_lock()  # the same job's lock: taken over from A
        assert b.save(snap(4, 0, 4), sync=True) is True
        with capture_logs() as logs:
            a.take_lock()
        assert any(e["event"] == "checkpoint_failed" and e.get("step") == 2 for e in logs), logs
        assert fmt.latest_target(tmp_path) == tmp_path / fmt.step_dir_name(4)
        assert not (tmp_path / fmt.step_dir_name(2) / fmt.MANIFEST).exists(), "the older save was committed"
        assert a.save(snap(6, 0, 6), sync=True) is True  # A holds the lock again
        assert fmt.latest_target(tmp_path) == tmp_path / fmt.step_dir_name(6)
    finally:
        a.close()
        b.close()


@pytest.mark.usefixtures("group")
def test_the_same_state_on_the_same_timeline_is_committed_once(tmp_path: Path) -> None:
    ck = checkpointer(tmp_path)
    try:
        assert ck.resume() is None
        assert ck.save(snap(4, 1, 0), sync=True) is True
        before = (tmp_path / fmt.step_dir_name(4) / fmt.MANIFEST).read_bytes()
        with capture_logs() as logs:
            assert ck.save(snap(4, 1, 0), sync=True) is True
        assert [e["event"] for e in logs if e["event"].startswith("checkpoint_")] == ["checkpoint_exists"]
        assert names(tmp_path) == [fmt.step_dir_name(4)]
        assert (tmp_path / fmt.step_dir_name(4) / fmt.MANIFEST).read_bytes() == before
    finally:
        ck.close()


@pytest.mark.usefixtures("group")
def test_an_epoch_end_after_a_mid_epoch_save_of_the_same_step_is_committed_as_a_new_version(tmp_path: Path) -> None:
    first = checkpointer(tmp_path)
    first.resume()
    assert first.save(snap(3, 0, 3), sync=True) is True  # preempted on the epoch's last batch
    first.close()
    mid = (tmp_path / fmt.step_dir_name(3) / fmt.MANIFEST).read_bytes()
    resumed = checkpointer(tmp_path)
    try:
        loaded = resumed.resume()
        assert loaded is not None and loaded.manifest.batch_in_epoch == 3
        assert resumed.save(snap(3, 1, 0), sync=True) is True  # the evaluated epoch end
        assert resumed.save(snap(3, 1, 0, finished=True), sync=True) is True  # and then finished
    finally:
        resumed.close()
    assert names(tmp_path) == [fmt.step_dir_name(3), fmt.step_dir_name(3, 2), fmt.step_dir_name(3, 3)]
    assert (tmp_path / fmt.step_dir_name(3) / fmt.MANIFEST).read_bytes() == mid, "the committed one is untouched"
    assert fmt.latest_target(tmp_path) == tmp_path / fmt.step_dir_name(3, 3)
    newest = fmt.verify(tmp_path / fmt.step_dir_name(3, 3))
    assert newest.position == (3, 1, 0, True) and newest.timeline == loaded.manifest.timeline
    assert choose(tmp_path) == tmp_path / fmt.step_dir_name(3, 3), "auto resume takes the newest version"


@pytest.mark.usefixtures("group")
def test_a_corrupt_checkpoint_found_on_fallback_is_moved_aside_and_its_step_written_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = checkpointer(tmp_path)
    first.resume()
    for step in (1, 2, 3):
        first.save(snap(step, 0, step), sync=True)
    first.close()
    corrupt(tmp_path / fmt.step_dir_name(3), "flip")
    resumed = checkpointer(tmp_path)
    try:
        loaded = resumed.resume()
        assert loaded is not None and loaded.manifest.step == 2
        aside = fmt.aside_folders(tmp_path)
        assert [fmt.aside_reason(a) for a in aside] == ["corrupt"] and aside[0].name.startswith("step-00000003.")
        assert (aside[0] / fmt.shard_name(0, 1)).exists(), "set aside, never deleted"
        assert fmt.latest_target(tmp_path) == tmp_path / fmt.step_dir_name(2)
        assert resumed.save(snap(3, 0, 3), sync=True) is True
    finally:
        resumed.close()
    assert fmt.verify(tmp_path / fmt.step_dir_name(3)).timeline == loaded.manifest.timeline
    assert ckpt_main(["list", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert f"{aside[0].name}  set aside (corrupt" in listing and "step-00000003  ok" in listing


@pytest.mark.usefixtures("group")
def test_no_valid_checkpoint_moves_nothing_aside(tmp_path: Path) -> None:
    corrupt(make_checkpoint(tmp_path, 1), "flip")
    ck = checkpointer(tmp_path)
    try:
        with pytest.raises(UsageError, match="none is valid"):
            ck.resume()
    finally:
        ck.close()
    assert names(tmp_path) == [fmt.step_dir_name(1)]


@pytest.mark.usefixtures("group")
def test_resuming_from_an_older_checkpoint_moves_the_abandoned_future_aside(tmp_path: Path) -> None:
    first = checkpointer(tmp_path)
    first.resume()
    for step in (1, 2, 3, 4):
        first.save(snap(step, 0, step), sync=True)
    first.close()
    old_timeline = fmt.read_manifest(tmp_path / fmt.step_dir_name(4)).timeline
    forked = checkpointer(tmp_path, resume=str(tmp_path / fmt.step_dir_name(2)))
    try:
        with capture_logs() as logs:
            loaded = forked.resume()
        assert loaded is not None and loaded.manifest.step == 2
        fork = [e for e in logs if e["event"] == "checkpoint_timeline_forked"]
        assert fork and fork[0]["abandoned"] == [fmt.step_dir_name(4), fmt.step_dir_name(3)]
        assert forked.timeline != old_timeline
        assert fmt.latest_target(tmp_path) == tmp_path / fmt.step_dir_name(2)
        assert forked.save(snap(3, 0, 3), sync=True) is True
    finally:
        forked.close()
    ours = fmt.verify(tmp_path / fmt.step_dir_name(3))
    assert (ours.timeline, ours.parent) == (forked.timeline, fmt.step_dir_name(2))
    assert [fmt.aside_reason(a) for a in fmt.aside_folders(tmp_path)] == ["abandoned", "abandoned"]
    assert choose(tmp_path) == tmp_path / fmt.step_dir_name(3), "a later auto resume continues our timeline"


@pytest.mark.usefixtures("group")
def test_a_checkpoint_of_another_timeline_at_the_step_being_saved_is_moved_aside_not_taken_for_ours(
    tmp_path: Path,
) -> None:
    ck = checkpointer(tmp_path)
    try:
        ck.resume()
        make_checkpoint(tmp_path, 5, timeline="someone-else")  # same step, same position, other timeline
        with capture_logs() as logs:
            assert ck.save(snap(5, 5, 0), sync=True) is True
        assert any(e["event"] == "checkpoint_other_timeline" for e in logs)
    finally:
        ck.close()
    assert fmt.verify(tmp_path / fmt.step_dir_name(5)).timeline == ck.timeline
    assert [fmt.aside_reason(a) for a in fmt.aside_folders(tmp_path)] == ["abandoned"]


@pytest.mark.usefixtures("group")
def test_a_run_whose_lock_was_taken_over_commits_nothing(tmp_path: Path) -> None:
    ck = checkpointer(tmp_path)
    try:
        ck.resume()
        other = tmp_path / "other-lock"
        other.write_text(json.dumps({"owner": "job-2", "host": "elsewhere", "pid": 1}))
        os.replace(other, tmp_path / ".lock")
        with capture_logs() as logs:
            assert ck.save(snap(1, 0, 1), sync=True) is False
        failed = [e for e in logs if e["event"] == "checkpoint_failed"]
        assert failed and "taken over" in failed[0]["error"]
    finally:
        ck.close()
    assert not (tmp_path / fmt.step_dir_name(1) / fmt.MANIFEST).exists()
    assert json.loads((tmp_path / ".lock").read_text())["owner"] == "job-2"


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


def test_pinned_keys_go_to_their_rank_and_the_rest_still_balance() -> None:
    sizes = {"model.w1": 400, "model.w2": 300, "model.bn.running_mean": 8, "model.bn.running_var": 8}
    pins = {"model.bn.running_mean": 0, "model.bn.running_var": 0}
    for world in (1, 2, 3, 5):
        owner = assign_shards(sizes, world, pinned=pins)
        assert owner["model.bn.running_mean"] == 0 and owner["model.bn.running_var"] == 0
        assert set(owner) == set(sizes)
    # Without pins a small buffer lands wherever the balance puts it (here: not on rank 0).
    assert assign_shards(sizes, 2)["model.bn.running_mean"] != 0 or assign_shards(sizes, 2)["model.bn.running_var"] != 0


def test_waiting_for_a_slow_shard_write_keeps_the_step_watchdog_fed() -> None:
    import time as _time
    from concurrent.futures import ThreadPoolExecutor

    from elastic_train.checkpoint.manager import Checkpointer

    ck = Checkpointer.__new__(Checkpointer)  # only the waiting logic, no process group
    beats: list[float] = []
    ck.heartbeat = lambda: beats.append(_time.monotonic())
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(lambda: (_time.sleep(2.5), "written")[1])
        assert ck._wait_beating(slow) == "written"  # type: ignore[arg-type]
    assert len(beats) >= 2, beats


def test_the_checkpoint_tool_reads_a_run_folder_and_a_folder_of_runs(tmp_path: Path) -> None:
    from elastic_train.ckpt import checkpoint_roots

    for run in ("a", "b"):
        (tmp_path / "runs" / run / "checkpoints" / fmt.step_dir_name(2)).mkdir(parents=True)
    (tmp_path / "old" / fmt.step_dir_name(4)).mkdir(parents=True)  # a plain checkpoint directory
    runs = tmp_path / "runs"
    assert checkpoint_roots(runs / "a") == [runs / "a" / "checkpoints"]
    assert checkpoint_roots(runs) == [runs / "a" / "checkpoints", runs / "b" / "checkpoints"]
    assert checkpoint_roots(tmp_path / "old") == [tmp_path / "old"]
    assert checkpoint_roots(tmp_path) == [tmp_path / "old"]  # runs/ is two levels down from here
