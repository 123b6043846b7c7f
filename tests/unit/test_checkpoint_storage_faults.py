"""Storage that fails for a moment, or for good, never costs a checkpoint, and never wedges a rank.

Faults are injected at the exact read or write (a monkeypatched function raising ``OSError``),
so every test is deterministic: "cannot read now" is retried and then refused without touching
the directory, while "read fine and is corrupt" (tests/unit/test_checkpoint_units.py) is moved
aside; a clean-up failure after a commit is logged, not raised; a lock whose heartbeat is stuck
in a wedged mount is released within a bound.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from structlog.testing import capture_logs
from tenacity import wait_none

from elastic_train.checkpoint import format as fmt
from elastic_train.checkpoint import lock as lock_module
from elastic_train.checkpoint.lock import CheckpointLock
from elastic_train.checkpoint.manager import load
from elastic_train.checkpoint.storage import Purger
from elastic_train.errors import UsageError
from tests.unit.test_checkpoint_units import checkpointer, choose, make_checkpoint, snap


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries without the production waits (0.5 s growing to 8 s, for up to 60 s)."""
    monkeypatch.setattr(fmt, "READ_RETRY_WAIT", wait_none(), raising=False)
    monkeypatch.setenv("ELASTIC_TRAIN_READ_RETRY_S", "0.3")


def snapshot(root: Path) -> tuple[list[str], str | None]:
    """Everything under ``root`` (names and sizes) and where ``latest`` points."""
    files = sorted(f"{p.relative_to(root)} {p.stat().st_size if p.is_file() else '-'}" for p in root.rglob("*"))
    latest = fmt.latest_target(root)
    return files, latest.name if latest else None


class Failing:
    """Raise ``OSError(code)`` from calls that touch ``path``: the first ``times`` of them."""

    def __init__(self, real: Callable[..., Any], path: Path, code: int, times: int) -> None:
        self.real, self.path, self.code, self.times, self.calls = real, path, code, times, 0

    def __call__(self, target: Path, *args: Any, **kwargs: Any) -> Any:
        if isinstance(target, (str, os.PathLike)) and Path(target) == self.path:
            self.calls += 1
            if self.calls <= self.times:
                raise OSError(self.code, os.strerror(self.code), str(self.path))
        return self.real(target, *args, **kwargs)


def inject(monkeypatch: pytest.MonkeyPatch, newest: Path, where: str, code: int, times: int) -> Failing:
    """Fail the read of the newest checkpoint's manifest, or the checksum pass over its shard."""
    if where == "manifest":
        failing = Failing(Path.read_text, newest / fmt.MANIFEST, code, times)
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: failing(self, *a, **k))
    else:
        failing = Failing(fmt.file_digests, newest / fmt.shard_name(0, 1), code, times)
        monkeypatch.setattr(fmt, "file_digests", failing)
    return failing


# ---------------------------------------------------------------------------- transient reads
@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("where", ["manifest", "shard"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_a_read_error_once_on_the_newest_checkpoint_is_retried_and_that_checkpoint_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, code: int
) -> None:
    for step in (1, 2):
        make_checkpoint(tmp_path, step)
    newest = make_checkpoint(tmp_path, 3)
    before = snapshot(tmp_path)
    failing = inject(monkeypatch, newest, where, code, times=1)
    ck = checkpointer(tmp_path)
    try:
        with capture_logs() as logs:
            loaded = ck.resume()
    finally:
        ck.close()
    assert loaded is not None and loaded.folder == newest and loaded.manifest.step == 3
    assert failing.calls >= 2, "the fault fired and the read was tried again"
    assert [e for e in logs if e["event"] == "checkpoint_read_retry"], "the retry is logged"
    assert snapshot(tmp_path) == before, "nothing moved aside, latest unchanged"


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("where", ["manifest", "shard"])
def test_a_read_error_that_persists_refuses_the_run_naming_the_file_and_changes_nothing_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    for step in (1, 2):
        make_checkpoint(tmp_path, step)
    newest = make_checkpoint(tmp_path, 3)
    before = snapshot(tmp_path)
    failing = inject(monkeypatch, newest, where, errno.EIO, times=10**9)
    ck = checkpointer(tmp_path)
    try:
        with pytest.raises(UsageError) as info:
            ck.resume()
    finally:
        ck.close()
    message = str(info.value)
    assert str(failing.path) in message and "EIO" in message and "cannot be read" in message, message
    assert "Fix:" in message and "storage" in message, message
    assert failing.calls >= 2, "retried before refusing"
    assert snapshot(tmp_path) == before, "an unreadable checkpoint is neither fallen back past nor moved aside"


def test_resume_path_to_an_unreadable_checkpoint_is_refused_as_unreadable_not_as_invalid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_checkpoint(tmp_path, 1)
    inject(monkeypatch, folder, "shard", errno.ESTALE, times=10**9)
    with pytest.raises(UsageError, match="ESTALE") as info:
        choose(tmp_path, str(folder))
    assert "cannot be read" in str(info.value) and "check the storage" in str(info.value)


def test_a_shard_whose_load_fails_once_with_an_io_error_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports the errno only in its message ("(os error 5)"): still retried."""
    folder = make_checkpoint(tmp_path, 1)
    real, calls = safetensors.torch.load_file, []

    def flaky(filename: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(filename)
        if len(calls) == 1:
            raise OSError("Input/output error (os error 5)")
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", flaky)
    assert load(folder).manifest.step == 1 and len(calls) == 2


def test_only_errors_that_can_pass_are_retried_and_any_storage_error_is_unreadable_not_corrupt(
    tmp_path: Path,
) -> None:
    calls: list[int] = []

    def read(code: int) -> Callable[[], str]:
        def fail() -> str:
            calls.append(code)
            raise OSError(code, os.strerror(code))

        return fail

    for code, retried in [(errno.EIO, True), (errno.ETIMEDOUT, True), (errno.EACCES, False), (errno.EMFILE, False)]:
        calls.clear()
        with pytest.raises(fmt.CheckpointUnreadable, match=errno.errorcode[code]) as info:
            fmt.read_retrying(tmp_path / "f", read(code))
        assert (len(calls) > 1) == retried, (errno.errorcode[code], len(calls))
        assert str(tmp_path / "f") in str(info.value)
    with pytest.raises(FileNotFoundError):  # a missing file is the caller's verdict (corrupt), not retried
        fmt.read_retrying(tmp_path / "f", (tmp_path / "f").read_text)


def test_the_read_retry_budget_is_set_by_its_env_var_and_a_bad_value_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(fmt.READ_RETRY_VAR)
    assert fmt.read_retry_s() == fmt.READ_RETRY_S == 60.0
    monkeypatch.setenv(fmt.READ_RETRY_VAR, "0")
    assert fmt.read_retry_s() == 0.0
    monkeypatch.setenv(fmt.READ_RETRY_VAR, "-1")
    with pytest.raises(UsageError, match="ELASTIC_TRAIN_READ_RETRY_S='-1'"):
        fmt.read_retry_s()


def test_a_manifest_whose_existence_cannot_be_checked_is_unreadable_not_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_checkpoint(tmp_path, 1)
    failing = Failing(os.stat, folder / fmt.MANIFEST, errno.EIO, times=10**9)
    monkeypatch.setattr(fmt.os, "stat", failing)
    with pytest.raises(fmt.CheckpointUnreadable, match="EIO"):
        fmt.has_manifest(folder)
    monkeypatch.undo()
    assert fmt.has_manifest(folder) and not fmt.has_manifest(tmp_path / "step-00000009")


# ---------------------------------------------------------------------------- clean-up after a commit
class BrokenPurger(Purger):
    def purge(self, root: Path, keep_last: int, protect: set[Path]) -> None:
        raise OSError(errno.EIO, "Input/output error", str(root))


@pytest.mark.usefixtures("world_of_one")
def test_a_clean_up_failure_after_a_commit_is_logged_and_the_commit_stands(tmp_path: Path) -> None:
    ck = checkpointer(tmp_path)
    try:
        ck.resume()
        ck.purger = BrokenPurger()
        with capture_logs() as logs:
            assert ck.save(snap(1, 0, 1), sync=True) is True
            assert ck.save(snap(2, 0, 2), sync=True) is True, "training and saving go on"
    finally:
        ck.close()
    failed = [e for e in logs if e["event"] == "checkpoint_cleanup_failed"]
    assert len(failed) == 2 and "Input/output error" in failed[0]["error"], failed
    assert fmt.latest_target(tmp_path) == tmp_path / fmt.step_dir_name(2)
    assert fmt.verify(tmp_path / fmt.step_dir_name(2)).step == 2


# ---------------------------------------------------------------------------- lock release
@pytest.fixture
def wedged_heartbeat(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The lock's heartbeat write blocks (a hard NFS mount whose server went away) until the
    test ends: yields (entered, unblock)."""
    entered, unblock = threading.Event(), threading.Event()
    real = os.utime

    def stuck(target: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(target, int):  # the holder's descriptor: only the heartbeat touches by fd
            entered.set()
            unblock.wait()
        real(target, *args, **kwargs)

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.02)
    monkeypatch.setattr(os, "utime", stuck)
    try:
        yield entered, unblock
    finally:
        unblock.set()


def test_releasing_a_lock_whose_heartbeat_is_stuck_returns_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wedged_heartbeat: tuple[threading.Event, threading.Event]
) -> None:
    entered, _ = wedged_heartbeat
    monkeypatch.setattr(lock_module, "RELEASE_JOIN_S", 0.5, raising=False)  # 10 s in production
    lock = CheckpointLock(tmp_path, owner="job", ttl_s=60.0)
    lock.acquire()
    assert entered.wait(30), "the heartbeat never ran"
    done = threading.Event()
    with capture_logs() as logs:
        releaser = threading.Thread(target=lambda: (lock.release(), done.set()), daemon=True)
        started = time.monotonic()
        releaser.start()
        returned = done.wait(20)  # generous: the machine is shared
    took = time.monotonic() - started
    assert returned, "release() hung on the heartbeat thread"
    assert took < 10, took
    stuck = [e for e in logs if e["event"] == "checkpoint_lock_heartbeat_stuck"]
    assert stuck and str(tmp_path / ".lock") in stuck[0]["path"], logs
