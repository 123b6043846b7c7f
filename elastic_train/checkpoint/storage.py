"""Durable file operations for checkpoints: atomic writes, the ``latest`` link, retention and
the ``best.json`` record of the checkpoints kept for their metric.

Every durable write goes to a temporary name in the same folder, is fsynced, renamed into
place, and the folder is fsynced, so a crash at any instant leaves either the old file or the
new one, never a torn one. Retries wrap these idempotent operations only (tenacity, bounded,
jittered), never a collective.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import structlog
import xxhash
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

from elastic_train.checkpoint.format import (
    LATEST,
    MANIFEST,
    CheckpointInvalid,
    CheckpointUnreadable,
    FileEntry,
    Manifest,
    checkpoint_key,
    latest_target,
    read_manifest,
    step_folders,
)
from elastic_train.config import BEST_METRICS

log = structlog.get_logger(__name__)

# Errors a retry cannot fix: the disk is full, read-only, or we lack permission.
_PERMANENT = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno not in _PERMANENT


io_retry = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(3),
    wait=wait_random_exponential(multiplier=0.2, max=2.0),
    reraise=True,
)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """An open temporary file that hashes (sha256, xxh3-128) everything written to it.

    sha256 is ~9x slower than xxh3 (0.18 s against 0.02 s for 200 MB here, as long as writing
    the bytes): it runs on a thread of its own, fed in write order, so that it overlaps the
    writes and the fsync after them (hashlib releases the GIL) instead of adding to them.
    ``entry`` waits for it. The bytes written must stay unchanged until then: a bytes object,
    or a tensor's memory that the (blocking) save holds still.
    """

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.size = fh, 0
        self._sha, self._fast = hashlib.sha256(), xxhash.xxh3_128()
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")
        self._updates: list[Future[None]] = []

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self._fast.update(data)
        self._updates.append(self._hasher.submit(self._sha.update, data))
        self.size += memoryview(data).nbytes

    def entry(self) -> FileEntry:
        self._hasher.shutdown(wait=True)
        for update in self._updates:
            update.result()  # re-raises a failed update
        return FileEntry(size=self.size, sha256=self._sha.hexdigest(), xxh3=self._fast.hexdigest())

    def abandon(self) -> None:
        """The write failed: drop the queued hashing."""
        self._hasher.shutdown(wait=True, cancel_futures=True)


@contextmanager
def atomic_file(path: Path, before_rename: Callable[[], None] | None = None) -> Iterator[HashingWriter]:
    """Write ``path`` durably: a temporary name, fsync, rename into place, fsync the folder.

    On any error the temporary file is removed and ``path`` is left as it was.
    ``before_rename`` is a hook for fault injection (a full disk at the last moment).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer: HashingWriter | None = None
    try:
        with tmp.open("wb", buffering=0) as fh:
            writer = HashingWriter(fh)
            yield writer
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        if writer is not None:
            writer.abandon()
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@io_retry
def write_atomic(path: Path, data: bytes, before_rename: Callable[[], None] | None = None) -> FileEntry:
    """Write ``data`` to ``path`` durably; returns its size and checksums."""
    with atomic_file(path, before_rename) as out:
        out.write(data)
    return out.entry()


@io_retry
def point_latest(root: Path, folder: Path) -> None:
    """Move ``root/latest`` to ``folder`` atomically: a new link, renamed over the old one."""
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(folder.name, tmp)
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def committed(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def move_aside(folder: Path, reason: str) -> Path:
    """Rename ``folder`` to ``<name>.<reason>-<UTC time>`` (never deleted: kept for a post-mortem)
    so that its step can be written again; resume and retention no longer see it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = folder.with_name(f"{folder.name}.{reason}-{stamp}")
    n = 1
    while target.exists():  # set aside twice within a second
        n += 1
        target = folder.with_name(f"{folder.name}.{reason}-{stamp}-{n}")
    os.rename(folder, target)
    fsync_dir(folder.parent)
    log.warning("checkpoint_moved_aside", path=str(folder), to=str(target), reason=reason)
    return target


def repair_latest(root: Path, prefer: Path | None) -> None:
    """After folders were set aside: if ``latest`` no longer resolves, point it at ``prefer`` (the
    checkpoint a run resumed from), else at the newest committed folder, else remove it."""
    target = latest_target(root)
    if target is None or target.exists():
        return
    fallback = [f for f in step_folders(root) if committed(f)]
    in_root = prefer is not None and prefer.parent.resolve() == root.resolve()
    choice = prefer if in_root and prefer is not None and committed(prefer) else None
    choice = choice or (fallback[0] if fallback else None)
    if choice is None:
        (root / LATEST).unlink(missing_ok=True)
    else:
        point_latest(root, choice)
    log.info("checkpoint_latest_repaired", was=target.name, now=choice.name if choice else None)


def retention_victims(root: Path, keep_last: int, protect: set[Path]) -> list[Path]:
    """Folders to delete: committed ones beyond the newest ``keep_last`` (each version of a step
    counts as one), and incomplete ones older than the newest committed checkpoint (an
    incomplete folder newer than that may be a save in progress). Neither ``protect`` (the
    folder just committed, the best ones of ``record_best``) nor the folder ``latest`` points to
    is ever returned. Folders set aside are not step folders: never touched."""
    folders = step_folders(root)
    done = [f for f in folders if committed(f)]
    if not done:
        return []
    newest = checkpoint_key(done[0]) or (0, 0)
    victims = done[keep_last:]
    victims += [f for f in folders if not committed(f) and (checkpoint_key(f) or (0, 0)) < newest]
    latest = latest_target(root)
    resolved = {p.resolve() for p in (*protect, *([latest] if latest is not None else []))}
    return [v for v in victims if v.resolve() not in resolved]


BEST = "best.json"  # in the checkpoint root: the folders kept for their metric (--keep-best)
BEST_FORMAT = "elastic-train-best"
BEST_VERSION = 1


@dataclass(frozen=True)
class Best:
    """One checkpoint kept for its metric, as ``best.json`` lists it."""

    folder: str  # its name in the checkpoint root
    step: int
    epoch: int  # epochs completed, as in the manifest (= the 1-based epoch its metric is from)
    value: float


def epoch_metric(manifest: Manifest, metric: str) -> float | None:
    """``metric`` of the state a checkpoint holds, from the built-in trainer's epoch history
    (``payload.app["history"]``); None when it has none. Only an epoch-end save (after at least
    one epoch, ``batch_in_epoch == 0``) holds the state its epoch was evaluated in: a mid-epoch
    save's model moved on since. A custom loop's checkpoint, or a NaN, is simply no candidate."""
    if manifest.epoch < 1 or manifest.batch_in_epoch != 0:
        return None
    history = manifest.payload.app.get("history")
    records = [r for r in history if isinstance(r, dict)] if isinstance(history, list) else []
    value = next((r.get(metric) for r in records if r.get("epoch") == manifest.epoch), None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best_checkpoints(root: Path, keep: int, metric: str) -> list[Best]:
    """The ``keep`` best committed checkpoints by ``metric`` (its direction: ``BEST_METRICS``),
    best first; of equal values the newer wins. A folder without a manifest (incomplete, being
    deleted) or with a damaged one is no candidate. Manifests are read once, without retries (rank
    0 runs this while its peers wait); one that cannot be read now raises ``CheckpointUnreadable``:
    a pass that cannot see every candidate might drop a best one, so it must delete nothing."""
    sign = 1.0 if BEST_METRICS[metric] == "max" else -1.0
    ranked: list[tuple[float, tuple[int, int], Best]] = []
    for folder in step_folders(root):
        try:
            manifest = read_manifest(folder, retry=False)
        except CheckpointUnreadable:
            raise
        except CheckpointInvalid:
            continue
        value = epoch_metric(manifest, metric)
        if value is not None:
            key = checkpoint_key(folder) or (0, 0)
            ranked.append((sign * value, key, Best(folder.name, manifest.step, manifest.epoch, value)))
    ranked.sort(key=lambda item: item[:2], reverse=True)
    return [best for _, _, best in ranked[:keep]]


def record_best(root: Path, keep: int, metric: str) -> set[Path]:
    """Rank the checkpoints in ``root``, rewrite ``best.json`` (atomically) to name the ``keep``
    best, and return their folders for retention to spare. ``best.json`` is written before
    anything is deleted: if that fails, the caller purges nothing this time, so the file never
    names a deleted folder. ``keep=0`` (off) removes a ``best.json`` left by an earlier run, as
    retention no longer spares what it names."""
    if keep == 0:
        try:
            (root / BEST).unlink()
            log.info("checkpoint_best_dropped", path=str(root / BEST), detail="--keep-best is 0")
        except FileNotFoundError:
            pass
        return set()
    best = best_checkpoints(root, keep, metric)
    doc = {
        "format": BEST_FORMAT,
        "version": BEST_VERSION,
        "metric": metric,
        "better": BEST_METRICS[metric],
        "best": [asdict(b) for b in best],
    }
    write_atomic(root / BEST, (json.dumps(doc, indent=1) + "\n").encode())
    return {root / b.folder for b in best}


def read_best(root: Path) -> list[Best]:
    """What ``best.json`` in ``root`` names, best first; empty without one (``--keep-best 0``).
    Raises ``ValueError`` for a file this build did not write."""
    try:
        doc = json.loads((root / BEST).read_text())
    except FileNotFoundError:
        return []
    if not isinstance(doc, dict) or doc.get("format") != BEST_FORMAT or doc.get("version") != BEST_VERSION:
        raise ValueError(f"{root / BEST}: not an elastic-train best.json of version {BEST_VERSION}")
    return [Best(**entry) for entry in doc["best"]]


class Purger:
    """Deletes old checkpoints in a daemon thread, so training never waits on ``rmtree``.

    A failed delete is logged and retried on the next purge; it never stops training.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def purge(self, root: Path, keep_last: int, protect: set[Path]) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # the previous purge is still running; the next commit will catch up
        victims = retention_victims(root, keep_last, protect)
        if victims:
            self._thread = threading.Thread(target=self._delete, args=(victims,), name="ckpt-purge", daemon=True)
            self._thread.start()

    @staticmethod
    def _delete(victims: list[Path]) -> None:
        for folder in victims:
            try:
                # Drop the manifest first: a half-deleted folder must not look committed.
                (folder / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(folder)
                log.info("checkpoint_deleted", path=str(folder))
            except OSError as exc:
                log.error("checkpoint_delete_failed", path=str(folder), error=repr(exc))

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def describe(folder: Path) -> str:
    try:
        m = read_manifest(folder)
    except Exception as exc:  # a listing shows whatever is wrong
        return f"INVALID ({exc})"
    return f"step {m.step}, epoch {m.epoch}, world size {m.world_size}{', finished' if m.finished else ''}"
