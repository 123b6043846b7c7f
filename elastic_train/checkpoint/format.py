"""The on-disk checkpoint format: names, the manifest, and verification. No torch here.

A checkpoint is a folder ``step-<N:08d>/`` holding one ``shard-<r:05d>-of-<W:05d>.safetensors``
per rank and ``manifest.json``. It counts only once ``manifest.json`` exists and verifies: the
manifest is written last, after every shard is durable, and lists each file's size and sha256.

A second, different checkpoint of the same step (the evaluated epoch end after a preemption
committed that step mid-epoch) goes to a new version of the folder, ``step-<N:08d>-v<K>``,
beside the first: newest is the highest ``(step, version)``. A folder set aside (found corrupt,
or of an abandoned timeline) is renamed ``<folder>.<reason>-<UTC time>``: no longer a step
folder, so resume and retention ignore it, and nothing ever deletes it.
See docs/checkpoint-format.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog
import xxhash
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from elastic_train.checkpoint.shard_plan import Box, covers_exactly_once
from elastic_train.errors import UsageError

FORMAT = "elastic-train-checkpoint"
# 2: `timeline` and `parent`; 3: the typed `payload` replaces the free-form `trainer` dict;
# 4: `sharded`, tensors saved as pieces by the ranks that hold them (FSDP2).
VERSION = 4
# A version-1 manifest reads as timeline "" (unknown), parent ""; versions 1 and 2 have their
# `trainer` dict converted to a `Payload` (``payload_from_trainer_dict``).
READABLE = (1, 2, 3, 4)
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{8})(?:-v([2-9]|[1-9]\d+))?$")
ASIDE_DIR = re.compile(r"^(step-\d{8}(?:-v\d+)?)\.(corrupt|abandoned)-(.+)$")
CORRUPT = "corrupt"  # failed verification when a run fell back to an older checkpoint
ABANDONED = "abandoned"  # newer than the checkpoint a run resumed from: a future that run discarded

log = structlog.get_logger(__name__)
T = TypeVar("T")

# "Cannot read now": the errors a network or cluster filesystem returns while the file may be
# fine: an I/O error reported by a soft NFS mount or a Lustre/GPFS client (EIO, EREMOTEIO), a
# file handle made stale by a server failover (ESTALE: a fresh open looks the path up again), a
# timeout or a broken link to the server (ETIMEDOUT, ENOLINK, ECOMM, ENOTCONN for a FUSE mount
# whose daemon restarts, the connection errors of CIFS and object-store mounts), and "try again"
# (EAGAIN, EINTR). These are retried. Any other OSError (EACCES, EPERM, EMFILE, EISDIR, ...) is
# not retried: waiting will not change it, but it is no proof of damage either, so it is
# ``CheckpointUnreadable`` too. Only content that was read and found wrong (a checksum, a size,
# the JSON, a missing file) is ``CheckpointInvalid``: proof of damage.
TRANSIENT_READ_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "ESTALE",
        "ETIMEDOUT",
        "EAGAIN",
        "EINTR",
        "ENOLINK",
        "EREMOTEIO",
        "ECOMM",
        "ENOTCONN",
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
    )
    if hasattr(errno, name)  # ENOLINK, EREMOTEIO and ECOMM are Linux names
)
READ_RETRY_VAR = "ELASTIC_TRAIN_READ_RETRY_S"
# How long one read of a checkpoint file (its manifest, a shard's checksum pass, a shard's load)
# is retried after a transient error before the run refuses to start (exit 2). Long enough for an
# NFS server failover or a remount; the run waits at start, before any training step.
READ_RETRY_S = 60.0
# Jittered exponential waits between tries (about 0.5, 1, 2, 4, 8, 8 ... s): peers that hit the
# same hiccup do not retry in lockstep. A module attribute so that tests can shorten it.
READ_RETRY_WAIT = wait_random_exponential(multiplier=0.5, max=8.0)


def step_dir_name(step: int, version: int = 1) -> str:
    return f"step-{step:08d}" if version == 1 else f"step-{step:08d}-v{version}"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def checkpoint_key(path: Path) -> tuple[int, int] | None:
    """``(step, version)`` of a step folder's name, the order of "newer"; None for other names."""
    match = STEP_DIR.match(path.name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 1)


def _key(path: Path) -> tuple[int, int]:
    return checkpoint_key(path) or (-1, 0)


class CheckpointInvalid(Exception):
    """A checkpoint folder that must not be trusted; the message names the file and the fault."""


class CheckpointTooNew(CheckpointInvalid):
    """Written by a newer elastic-train in a format this build cannot read: not damaged, so never
    moved aside, and never skipped for an older checkpoint (that would silently lose progress)."""


class CheckpointUnreadable(CheckpointInvalid):
    """The storage failed while reading (EIO, ESTALE, EACCES, ...; transient errors were retried
    first, see ``TRANSIENT_READ_ERRNOS``): the content may be fine. Never fallen back past, never
    moved aside: a run refuses to start instead (it may read fine next time)."""


def transient_read_error(exc: BaseException) -> bool:
    """Whether ``exc`` says "cannot read now" (worth retrying), see ``TRANSIENT_READ_ERRNOS``."""
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_READ_ERRNOS


def read_retry_s() -> float:
    """``ELASTIC_TRAIN_READ_RETRY_S`` if set (0: one try), else ``READ_RETRY_S``."""
    raw = os.environ.get(READ_RETRY_VAR, "").strip()
    if not raw:
        return READ_RETRY_S
    try:
        budget = float(raw)
    except ValueError:
        budget = -1.0
    if not budget >= 0:  # raised before any read: nothing is judged under a bad setting
        raise UsageError(
            f"{READ_RETRY_VAR}={raw!r} is not a number of seconds >= 0", f"unset {READ_RETRY_VAR}, or set e.g. 60"
        )
    return budget


def read_retrying(path: Path, read: Callable[[], T]) -> T:
    """``read()`` (idempotent: it only reads ``path``), retried on transient errors with jittered
    waits for up to ``read_retry_s()`` seconds. ``FileNotFoundError`` passes through (a missing
    file is the caller's verdict); any other ``OSError`` left becomes ``CheckpointUnreadable``
    naming ``path``, the error, and how long it was tried."""
    attempts = 0
    started = time.monotonic()

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        return read()

    def before_sleep(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("checkpoint_read_retry", path=str(path), attempt=state.attempt_number, error=repr(exc))

    retrying = Retrying(
        retry=retry_if_exception(transient_read_error),
        stop=stop_after_delay(read_retry_s()),
        wait=READ_RETRY_WAIT,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(attempt)
    except FileNotFoundError:
        raise
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "no errno")
        tried = f"{attempts} tries over {time.monotonic() - started:.1f}s" if attempts > 1 else "not retried"
        raise CheckpointUnreadable(f"{path}: cannot be read ({code}: {exc.strerror or exc}; {tried})") from None


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str  # cryptographic; checked by `python -m elastic_train.ckpt verify`
    xxh3: str  # xxh3-128, ~10x faster; checked on every load


def check_json(value: Any, where: str, finite: bool = False) -> None:
    """Raise ``ValueError`` naming the first part of ``value`` that would not come back from a
    JSON round trip as itself: keys other than strings, values other than dict, list, str,
    numbers, bools and None (a tuple reads back as a list, an int key as a string, a tensor or a
    numpy scalar not at all). A checkpoint stores only what it can give back. NaN and infinities
    round-trip through Python's json (an epoch's loss can be NaN); ``finite`` refuses them where
    values are compared (a fingerprint: NaN never equals itself)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is a {type(key).__name__}, not a str")
            check_json(item, f"{where}.{key}", finite)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]", finite)
    elif isinstance(value, float):
        if finite and (value != value or value in (float("inf"), float("-inf"))):
            raise ValueError(f"{where}: {value} is not a finite number")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise ValueError(f"{where}: {type(value).__name__} {value!r:.60} is not a JSON value (dict, list, str, number)")


@dataclass(frozen=True)
class Payload:
    """The JSON half of a checkpoint's training state; the tensors are in the shards.

    Typed so that nothing indexes a free-form dict by string keys: the optimizer's non-tensor
    state (``checkpoint.state.flatten``), the scheduler's and the loss scaler's state dicts,
    the goodput accounting (``resilience.goodput.Accounting``) and ``app``, the training loop's
    own JSON state (the built-in trainer keeps its early-stop counters and epoch history there;
    a custom loop keeps whatever it needs).
    """

    optimizer: dict[str, Any] = field(default_factory=dict)  # {"param_groups": [...], "optim_extra": {...}}
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    accounting: dict[str, Any] | None = None
    app: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Payload:
        return cls(**raw)


def payload_from_trainer_dict(trainer: dict[str, Any]) -> dict[str, Any]:
    """A version-1/2 manifest's ``trainer`` dict as a version-3 ``payload``: the same values,
    moved to their typed places (the built-in trainer's own keys go to ``app``)."""
    optimizer: dict[str, Any] = {key: trainer[key] for key in ("param_groups", "optim_extra") if key in trainer}
    app: dict[str, Any] = {key: trainer[key] for key in ("early_stop", "history") if key in trainer}
    return asdict(
        Payload(
            optimizer=optimizer,
            scheduler=trainer.get("scheduler"),
            scaler=trainer.get("scaler") or None,
            accounting=trainer.get("accounting"),
            app=app,
        )
    )


@dataclass(frozen=True)
class PieceEntry:
    """One saved piece of a sharded tensor: the box it holds, in ``file`` under the tensor's key."""

    file: str
    offsets: list[int]
    lengths: list[int]


@dataclass(frozen=True)
class ShardedEntry:
    """A tensor saved in pieces (format 4): its global shape and dtype (safetensors' name, e.g.
    ``F32``) and every non-empty piece. The pieces cover the tensor exactly once (checked at the
    commit and at every load: ``shard_plan.covers_exactly_once``)."""

    shape: list[int]
    dtype: str
    pieces: list[PieceEntry]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ShardedEntry:
        return cls(list(raw["shape"]), str(raw["dtype"]), [PieceEntry(**p) for p in raw["pieces"]])


@dataclass
class Manifest:
    """Everything that is not a tensor, plus the index of the tensors and files."""

    step: int
    epoch: int  # epochs completed
    batch_in_epoch: int  # global batches of epoch `epoch` already trained on
    world_size: int
    files: dict[str, FileEntry]
    tensors: dict[str, str]  # tensor key -> file holding it
    fingerprint: dict[str, Any]  # settings a resumed run must share (model, data, global batch, ...)
    payload: Payload  # optimizer param groups, scheduler, scaler, accounting, the loop's own state
    config: dict[str, Any]
    versions: dict[str, str]
    run_id: str = ""
    created: float = 0.0
    finished: bool = False  # saved after the last epoch: nothing left to train
    format: str = FORMAT
    version: int = VERSION
    # The line of training this state lies on: minted by a fresh start, inherited on resume,
    # minted again when a run resumes from a checkpoint older than the directory's newest
    # (a fork). Two checkpoints of one step are the same only on the same timeline.
    timeline: str = ""
    parent: str = ""  # the checkpoint folder the writing run resumed from ("" for a fresh start)
    # Format 4: tensors saved in pieces (FSDP2 parameters and optimizer state), by key. A key is
    # in ``tensors`` (whole, in one file) or here, never in both. Empty for a DDP run.
    sharded: dict[str, ShardedEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @property
    def position(self) -> tuple[int, int, int, bool]:
        """Where training stood: two checkpoints of one timeline at the same position hold the same
        state; the same step at another position (e.g. the evaluated epoch end) is a new state."""
        return self.step, self.epoch, self.batch_in_epoch, self.finished

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointInvalid(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointInvalid(f"{source}: not an elastic-train manifest")
        version = raw.get("version")
        if version not in READABLE:
            readable = ", ".join(map(str, READABLE))
            if isinstance(version, int) and version > max(READABLE):
                raise CheckpointTooNew(
                    f"{source}: format version {version} (this build reads {readable}), written by a newer "
                    "elastic-train. Fix: upgrade elastic-train, or point --checkpoint-dir elsewhere"
                )
            raise CheckpointInvalid(f"{source}: format version {version} (this build reads {readable})")
        try:
            raw["files"] = {name: FileEntry(**entry) for name, entry in raw["files"].items()}
            raw.pop("extra", None)  # an unused field of versions 1 and 2
            if raw["version"] < 3:
                raw["payload"] = payload_from_trainer_dict(raw.pop("trainer"))
            raw["payload"] = Payload.from_json(raw["payload"])
            raw["sharded"] = {key: ShardedEntry.from_json(entry) for key, entry in raw.get("sharded", {}).items()}
            return cls(**raw)
        except (TypeError, KeyError, AttributeError) as exc:
            raise CheckpointInvalid(f"{source}: malformed manifest ({exc})") from None


def file_digests(path: Path, sha256: bool) -> tuple[int, str, str]:
    """Size, xxh3-128 and (if asked) sha256 of a file, read through a memory map."""
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return 0, xxhash.xxh3_128(b"").hexdigest(), hashlib.sha256(b"").hexdigest() if sha256 else ""
        with mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                fast = xxhash.xxh3_128(view).hexdigest()
                slow = hashlib.sha256(view).hexdigest() if sha256 else ""
            finally:
                view.release()
    return size, fast, slow


def check_entry(path: Path, entry: FileEntry, sha256: bool = False) -> None:
    """Raise ``CheckpointInvalid`` naming ``path`` unless size and checksums match the manifest
    (``CheckpointUnreadable`` when the storage fails while reading, after retrying)."""

    def read() -> tuple[int, str, str]:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointInvalid(f"{path} is not a file")
        if st.st_size != entry.size:
            return st.st_size, "", ""  # judged below without hashing
        return file_digests(path, sha256)

    try:
        size, fast, slow = read_retrying(path, read)
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is missing") from None
    if size != entry.size:
        raise CheckpointInvalid(f"{path} has {size} bytes, the manifest says {entry.size} (truncated?)")
    if fast != entry.xxh3:
        raise CheckpointInvalid(f"{path}: checksum mismatch (xxh3), the file is corrupt")
    if sha256 and slow != entry.sha256:
        raise CheckpointInvalid(f"{path}: sha256 mismatch, the file is corrupt")


def read_manifest(folder: Path, retry: bool = True) -> Manifest:
    """The manifest of ``folder``. ``retry=False`` tries once (a caller that must not stall,
    e.g. a save deciding where to go while peers wait)."""
    path = folder / MANIFEST
    try:
        text = read_retrying(path, path.read_text) if retry else _read_once(path)
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is missing (an incomplete save)") from None
    manifest = Manifest.from_json(text, path)
    if step_of(folder) not in (None, manifest.step):
        raise CheckpointInvalid(f"{path}: step {manifest.step} does not match the folder name")
    return manifest


def _read_once(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "no errno")
        raise CheckpointUnreadable(f"{path}: cannot be read ({code}: {exc.strerror or exc}; not retried)") from None


def has_manifest(folder: Path) -> bool:
    """Whether ``folder`` is committed (its manifest exists). Unlike ``Path.exists``, a storage
    error is not taken for "no": it is retried, then raised as ``CheckpointUnreadable``."""

    def look() -> bool:
        try:
            os.stat(folder / MANIFEST)
        except NotADirectoryError:
            return False
        return True

    try:
        return read_retrying(folder / MANIFEST, look)
    except FileNotFoundError:
        return False


def verify(folder: Path, sha256: bool = False) -> Manifest:
    """The manifest, after checking every file it lists (size, xxh3; sha256 too if asked).
    Raises ``CheckpointInvalid`` naming the file."""
    manifest = read_manifest(folder)
    for name, entry in manifest.files.items():
        check_entry(folder / name, entry, sha256)
    missing = {f for f in manifest.tensors.values() if f not in manifest.files}
    missing |= {p.file for entry in manifest.sharded.values() for p in entry.pieces if p.file not in manifest.files}
    if missing:
        raise CheckpointInvalid(f"{folder / MANIFEST}: tensors point at unlisted files {sorted(missing)}")
    check_sharded(manifest, folder / MANIFEST)
    return manifest


def check_sharded(manifest: Manifest, source: Path) -> None:
    """Raise ``CheckpointInvalid`` unless each sharded tensor's pieces cover it exactly once and
    no key is both whole and sharded: a manifest that promises a tensor must deliver all of it."""
    both = sorted(set(manifest.sharded) & set(manifest.tensors))
    if both:
        raise CheckpointInvalid(f"{source}: {both[0]} is listed both whole and in pieces")
    for key, entry in manifest.sharded.items():
        try:
            boxes = [Box(tuple(p.offsets), tuple(p.lengths)) for p in entry.pieces]
        except ValueError as exc:
            raise CheckpointInvalid(f"{source}: {key}: {exc}") from None
        if not covers_exactly_once(entry.shape, boxes):
            raise CheckpointInvalid(
                f"{source}: the saved pieces of {key} do not cover its shape {entry.shape} exactly once"
            )


def step_folders(root: Path) -> list[Path]:
    """Step folders (``step-N`` and its versions ``step-N-vK``) under ``root``, newest
    ``(step, version)`` first, committed or not. Folders set aside are not among them."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=_key, reverse=True)


def versions_of(root: Path, step: int) -> list[Path]:
    """The folders of one step, oldest version first."""
    return sorted((f for f in step_folders(root) if step_of(f) == step), key=_key)


def aside_folders(root: Path) -> list[Path]:
    """Folders set aside (``<step folder>.corrupt-<time>``, ``.abandoned-<time>``), by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and ASIDE_DIR.match(p.name))


def aside_reason(path: Path) -> str | None:
    match = ASIDE_DIR.match(path.name)
    return match.group(2) if match else None


def latest_target(root: Path) -> Path | None:
    """Where ``latest`` points (None if absent); a dangling link still returns its target."""
    link = root / LATEST
    if not link.is_symlink():
        return None
    return root / link.readlink()
