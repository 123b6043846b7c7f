"""Saving and resuming: the commit protocol, async writes, fallback on load, timelines.

Save (``save``, main thread, at a step boundary, called by every rank):
  0. rank 0 decides where the save goes and broadcasts it (``SaveTarget``): nowhere if this very
     state (same step, epoch, batch, finished flag) is already committed on this run's
     timeline; a new version of the step folder (``step-N-v2``) if this step was committed in
     another state (the evaluated epoch end after a mid-epoch preemption save), never touching
     the committed one; a committed folder of another timeline, or one whose manifest is
     unreadable, is moved aside first (renamed, never deleted);
  1. every rank copies the tensors it owns (``assign_shards``) plus its per-rank state to reused
     CPU buffers, in the writer thread, while the next step's forward and backward run; the
     trainer calls ``wait_staged`` before anything changes that state (the optimizer step);
  2. a background thread serialises them to ``shard-<r>-of-<W>.safetensors``, fsyncs and renames
     it (no collectives off the main thread, ever);
  3. at a later step boundary, once every rank reports its shard durable (``poll``, one tiny
     all-reduce), the ranks exchange file sizes and sha256s; rank 0 writes ``manifest.json``
     (temp, fsync, rename, fsync dir), then moves ``latest`` (new link + rename). A failure
     anywhere leaves the previous checkpoint and ``latest`` untouched; training goes on.

Load (``resume``): rank 0 picks ``latest`` or the newest older valid checkpoint (verifying
manifest, sizes and checksums), every rank then reads and re-verifies the files it loads.
Nothing is unpickled: safetensors and JSON only. Once every rank has loaded it, rank 0 moves
aside the checkpoints that fallback skipped as corrupt (``.corrupt-<time>``), so those steps can
be written again, and settles the timeline: the loaded checkpoint's, or a new one when newer
committed checkpoints exist (``--resume PATH`` to an older step): that abandoned future is moved
aside (``.abandoned-<time>``) so that neither a later ``--resume auto`` nor a save of the same
step can mistake it for this run's.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import safetensors
import structlog
import torch
import torch.distributed as dist

from elastic_train import __version__
from elastic_train.checkpoint.format import (
    ABANDONED,
    CORRUPT,
    MANIFEST,
    READ_RETRY_VAR,
    CheckpointInvalid,
    CheckpointTooNew,
    CheckpointUnreadable,
    FileEntry,
    Manifest,
    Payload,
    PieceEntry,
    ShardedEntry,
    check_json,
    check_sharded,
    checkpoint_key,
    has_manifest,
    latest_target,
    read_manifest,
    shard_name,
    step_dir_name,
    step_folders,
    verify,
    versions_of,
)
from elastic_train.checkpoint.lock import CheckpointLock, lock_ttl
from elastic_train.checkpoint.reshard import placed
from elastic_train.checkpoint.shard_plan import Box
from elastic_train.checkpoint.snapshot import Position, Snapshot
from elastic_train.checkpoint.state import assign_shards, nbytes, rank_key
from elastic_train.checkpoint.storage import (
    Purger,
    committed,
    move_aside,
    point_latest,
    record_best,
    repair_latest,
    write_atomic,
)
from elastic_train.checkpoint.tensor_io import DTYPE_NAMES, read_shards, write_shard
from elastic_train.config import BEST_METRICS, DATA_KEY, TASK_IGNORES
from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.process_group import all_gather_json, broadcast_json
from elastic_train.errors import UsageError

log = structlog.get_logger(__name__)
# The way out every refusal of a directory's checkpoints suggests: one that is never refused in
# turn (``--resume never`` is, for a directory that holds checkpoints).
START_FRESH = "start fresh in an empty --checkpoint-dir (e.g. another --run-dir)"

HEARTBEAT_EVERY_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints live and how a run picks one. *When* to save is the step boundary's
    business (``boundary.SavePolicy``), *how* is this module's."""

    root: Path
    keep_last: int = 3
    resume: str = "auto"  # auto | never | PATH
    hang_timeout: float = 60.0  # the run's --hang-timeout: the directory lock's TTL is derived from it
    # Retention also spares the keep_best best epoch-end checkpoints by best_metric, named in
    # <root>/best.json (storage.record_best); 0: off, only the newest keep_last are kept.
    keep_best: int = 0
    best_metric: str = "val_acc"

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise UsageError(f"keep_last={self.keep_last} would delete every checkpoint", "keep at least 2")
        if self.keep_best < 0:
            raise UsageError(f"keep_best={self.keep_best} must be >= 0", "pass 0 for off, or e.g. 1")
        if self.best_metric not in BEST_METRICS:
            raise UsageError(
                f"best_metric={self.best_metric!r} is not one of {', '.join(BEST_METRICS)}", "pick one of those"
            )
        if not self.resume:
            raise UsageError("resume is empty", "pass auto, never or a checkpoint folder")
        if self.hang_timeout < 0:
            raise UsageError(f"hang_timeout={self.hang_timeout} must be >= 0", "pass seconds, or 0 for off")


SaveStage = Literal["before_shard", "before_rename", "after_shard", "after_manifest"]


class SaveHooks(Protocol):
    """Called at each stage of a save (``before_rename``: the shard's bytes are written and
    fsynced, not yet renamed into place). Shard stages run in the writer thread, the manifest
    stage in the main thread of rank 0. An exception fails this save (the previous checkpoint
    stays ``latest``); fault injection (``faults.CheckpointFaults``) kills the process here."""

    def on_save(self, stage: SaveStage, step: int, path: Path) -> None: ...


@dataclass
class ShardResult:
    rank: int
    file: str = ""
    entry: FileEntry | None = None
    keys: list[str] = field(default_factory=list)  # whole tensors in ``file``
    error: str = ""
    # Pieces of sharded tensors in ``file``: key -> ``Box.to_json()`` (plain values on the wire).
    pieces: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As it travels between ranks (JSON, never pickle): the fields as they are (``asdict``
        would deep-copy every piece at each commit), the entry as a dict."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["entry"] = asdict(self.entry) if self.entry is not None else None
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardResult:
        entry = data.get("entry")
        return cls(**{**data, "entry": FileEntry(**entry) if entry is not None else None})


@dataclass
class Loaded:
    folder: Path
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    @property
    def position(self) -> Position:
        m = self.manifest
        return Position(m.step, m.epoch, m.batch_in_epoch, m.finished)

    @property
    def payload(self) -> Payload:
        return self.manifest.payload

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    def saved_keys(self) -> list[str]:
        """Every saved tensor's key, whole or in pieces."""
        return sorted({*self.tensors, *self.manifest.sharded})

    def tensor(self, key: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """Saved tensor ``key``, placed like ``like`` (``reshard.placed``): whole, or this rank's
        box of it as a DTensor when ``like`` is one."""
        return placed(self.folder, self.manifest, self.tensors, key, like)

    def whole(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every saved tensor under ``prefix``, whole (pieces assembled; for exports)."""
        return {key: self.tensor(key) for key in self.saved_keys() if key.startswith(prefix)}


@dataclass(frozen=True)
class SaveTarget:
    """Rank 0's answer to "where does this save go?", broadcast to every rank."""

    action: Literal["write", "committed", "failed"]
    folder: str = ""  # write: the step folder to write into; committed: the one that holds it
    error: str = ""  # failed: why


@dataclass(frozen=True)
class Selection:
    """The checkpoint a run continues from, and the committed folders fallback found invalid."""

    folder: Path | None
    manifest: Manifest | None = None
    invalid: tuple[Path, ...] = ()


class NewerCommitted(Exception):
    """A checkpoint newer than the one being resumed was committed meanwhile (``keep_newer``)."""


def new_timeline() -> str:
    return uuid.uuid4().hex[:16]


def should_manage_checkpoints(env: DistEnv) -> bool:
    """Rank 0 writes manifests, moves ``latest``, purges old checkpoints and holds the lock."""
    return env.is_main


def _versions() -> dict[str, str]:
    return {"elastic_train": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__}


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointConfig,
        env: DistEnv,
        fingerprint: dict[str, Any],
        group: dist.ProcessGroup | None = None,
        hooks: SaveHooks | None = None,
    ) -> None:
        """Collective when ``group`` is None and the default group is not gloo: the object
        collectives (tiny, CPU) need a gloo group, and one is created."""
        self.cfg = cfg
        self.env = env
        self.hooks = hooks
        try:
            check_json(fingerprint, "fingerprint", finite=True)
        except ValueError as exc:  # every rank holds the same fingerprint: every rank refuses it
            raise UsageError(
                str(exc), "make every fingerprint value plain JSON (str, number, bool, list, dict)"
            ) from None
        self.fingerprint = fingerprint
        if group is None and dist.is_initialized() and dist.get_backend() != "gloo":
            new = dist.new_group(backend="gloo")
            group = new if isinstance(new, dist.ProcessGroup) else None
        self.group = group  # gloo group for the JSON collectives (None: the default group)
        self.lock = CheckpointLock(cfg.root, owner=env.job_id, ttl_s=lock_ttl(cfg.hang_timeout))
        self.purger = Purger()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._pending: tuple[Snapshot, Path, Future[ShardResult]] | None = None
        # CPU copies for async saves, reused from save to save (a save starts only after the
        # previous one committed): no fresh allocation, no page faults, pinned for CUDA.
        self._staging: dict[str, torch.Tensor] = {}
        self._staged: threading.Event | None = None  # set once an async save's copy is done
        self._copy_stream: Any = None  # a CUDA stream for device-to-host staging copies
        self.last_committed_step: int | None = None
        # Which line of training this run extends (rank 0's value counts; ``resume`` shares it).
        self.timeline = new_timeline()
        self.parent: Path | None = None  # the checkpoint this run resumed from
        self._selection: Selection | None = None  # rank 0, between choosing and settling
        # Called about once a second while this rank waits for its own shard to be written (a
        # large synchronous save can take minutes): the trainer passes the step watchdog's
        # ``alive``, so a save in progress is never mistaken for a hang. Waits inside collectives
        # (a peer that froze mid-commit) do not call it: those are what the watchdog is for.
        self.heartbeat: Callable[[], None] | None = None
        # Asked on the committing rank before a step's manifest is written:
        # None lets the save commit, a reason refuses it (quorum mode's line record: a step
        # the record does not confirm is never a checkpoint, ``quorum.line``).
        self.commit_guard: Callable[[int], str | None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Collective: rank 0 takes the directory lock; a refusal fails every rank alike."""
        error: str | None = None
        if should_manage_checkpoints(self.env):
            try:
                self.lock.acquire()
            except UsageError as exc:
                error = str(exc)
            except OSError as exc:  # an unwritable or missing parent: bad input, not a crash
                error = str(
                    UsageError(
                        f"--checkpoint-dir {self.cfg.root} cannot be used: {exc}",
                        "pass a writable folder (on storage every node sees)",
                    )
                )
        shared = broadcast_json(error, src=0, group=self.group)
        if shared is not None:
            raise UsageError(shared)

    def close(self) -> None:
        self.wait_staged()
        self._pool.shutdown(wait=True)
        self.purger.join(timeout=30)
        if should_manage_checkpoints(self.env):
            self.lock.release()

    # ------------------------------------------------------------------ in flight
    @property
    def pending(self) -> bool:
        return self._pending is not None

    def local_done(self) -> bool:
        return self._pending is None or self._pending[2].done()

    # ------------------------------------------------------------------ save
    def take_lock(self) -> None:
        """Hold the directory lock for the next save, for a saver that changes with the
        membership (quorum mode: participant 0 of the step saves, whichever replica that is).

        A save still pending is committed first, under the lock it was started with: if another
        replica of the job took the lock over meanwhile and committed newer steps, that commit
        is refused. Taking the lock back first would let this older save through and move
        ``latest`` back. Raises ``UsageError`` when another job holds the directory.
        """
        if self._pending is not None:
            self.commit_pending()
        self.lock.ensure_held()

    def save(self, snap: Snapshot, sync: bool) -> bool | None:
        """Start a save (committing the previous one first). Collective: every rank calls it at
        the same step boundary; rank 0 decides where it goes (``SaveTarget``).

        Returns the commit outcome for a synchronous save (True also when this state was
        already committed on this timeline), None for an asynchronous one.
        """
        if self._pending is not None:
            self.commit_pending()
        self.wait_staged()
        target = self._agree_target(snap)
        if target.action == "committed":
            log.info("checkpoint_exists", step=snap.step, path=target.folder, detail="this state is already committed")
            self.last_committed_step = snap.step
            return True if sync else None
        if target.action == "failed":
            log.error("checkpoint_failed", step=snap.step, rank=self.env.rank, error=target.error)
            return False if sync else None
        folder = self.cfg.root / target.folder
        if sync:
            future = self._pool.submit(
                self._write_shard, folder, snap.step, self._select(snap, copy=False), _pieces_written(snap)
            )
        else:
            self._staged = threading.Event()
            ready = None
            held = [*snap.replicated.values(), *(piece.tensor for piece in snap.sharded.values())]
            device = next((t.device for t in held if t.is_cuda), None)
            if device is not None:
                # The copies must see the state as of now, after the compute queued on this
                # rank's device; the event is recorded on that device's current stream.
                ready = (torch.cuda.Event(), device)  # type: ignore[no-untyped-call]
                ready[0].record(torch.cuda.current_stream(device))
            future = self._pool.submit(self._stage_and_write, snap, folder, self._staged, ready)
        self._pending = (snap, folder, future)
        log.info("checkpoint_started", step=snap.step, sync=sync, path=str(folder))
        return self.commit_pending() if sync else None

    def _agree_target(self, snap: Snapshot) -> SaveTarget:
        """Collective: rank 0 looks at the step's folders and decides; every rank follows."""
        target = SaveTarget("failed", error="no decision")
        if should_manage_checkpoints(self.env):
            try:
                target = self._target(snap)
            except OSError as exc:
                target = SaveTarget("failed", error=f"cannot inspect {self.cfg.root}: {exc!r}")
        agreed = SaveTarget(**broadcast_json(asdict(target), src=0, group=self.group))
        # The folder is joined to the root: a name with a separator (or "..") would write elsewhere.
        name = agreed.folder
        if agreed.action == "write" and (Path(name).name != name or name in ("", ".", "..")):
            raise RuntimeError(f"rank 0 named {name!r} as the save's folder: not a folder name in {self.cfg.root}")
        return agreed

    def _target(self, snap: Snapshot) -> SaveTarget:
        """Rank 0: where ``snap`` goes. Never a committed folder: a committed checkpoint is only
        ever replaced by a newer one, and a folder of another timeline is moved, not reused."""
        root = self.cfg.root
        for folder in reversed(versions_of(root, snap.step)):  # newest version first
            if not committed(folder):
                continue
            try:
                # One try: peers wait in a collective meanwhile; unreadable is skipped (not moved).
                manifest = read_manifest(folder, retry=False)
            except CheckpointInvalid as exc:
                log.error("checkpoint_invalid", path=str(folder), error=str(exc))
                # A storage hiccup is no proof of damage, nor is a newer build's format.
                if not isinstance(exc, (CheckpointUnreadable, CheckpointTooNew)):
                    self._set_aside(folder, CORRUPT)
                continue
            if not self._ours(folder, manifest):
                log.warning(
                    "checkpoint_other_timeline",
                    path=str(folder),
                    theirs=manifest.timeline,
                    ours=self.timeline,
                    detail="a checkpoint this run does not descend from holds the step it is saving",
                )
                self._set_aside(folder, ABANDONED)
                continue
            if manifest.position == snap.position.key:
                return SaveTarget("committed", folder=str(folder))
            break  # ours, in another state of this step: the new state goes to a newer version
        versions = versions_of(root, snap.step)
        if versions and not committed(versions[-1]):
            return SaveTarget("write", folder=versions[-1].name)  # remains of a failed attempt: reused
        newest = checkpoint_key(versions[-1]) if versions else None
        return SaveTarget("write", folder=step_dir_name(snap.step, newest[1] + 1 if newest else 1))

    def _ours(self, folder: Path, manifest: Manifest) -> bool:
        """Does this run descend from ``folder``'s state? Its timeline, or the checkpoint it
        resumed from (or an older version of that step: a fork keeps its parent's timeline id)."""
        if manifest.timeline and manifest.timeline == self.timeline:
            return True
        parent = self.parent
        if parent is None or parent.parent.resolve() != folder.parent.resolve():
            return False
        mine, theirs = checkpoint_key(parent), checkpoint_key(folder)
        return mine is not None and theirs is not None and theirs <= mine

    def _set_aside(self, folder: Path, reason: str) -> None:
        """Rank 0: rename ``folder`` out of the way (never delete). A failure is logged: the
        folder then stays and the next save of that step is written beside it."""
        try:
            move_aside(folder, reason)
            repair_latest(self.cfg.root, None)
        except OSError as exc:
            log.error("checkpoint_move_aside_failed", path=str(folder), reason=reason, error=repr(exc))

    def guard(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Own the staging contract for ``module`` and ``optimizer``: every in-place change the
        loop or anyone else makes to them (an optimizer step, a ``load_state_dict``, e.g. a
        quorum heal applied by torchft from its own thread of control) first waits until a
        running async save has copied them. Without it a heal that lands while the writer
        copies commits a checkpoint holding two steps' weights under valid checksums.
        State outside these two (a task's extra state) goes through ``guarded``."""
        module.register_load_state_dict_pre_hook(lambda *_: self.wait_staged())  # type: ignore[no-untyped-call]
        optimizer.register_load_state_dict_pre_hook(lambda *_: self.wait_staged())
        optimizer.register_step_pre_hook(lambda *_: self.wait_staged())

    def guarded(self, load: Callable[[T], None]) -> Callable[[T], None]:
        """``load`` that first waits for a running async save's copies (see ``guard``)."""

        def wait_then_load(state: T) -> None:
            self.wait_staged()
            load(state)

        return wait_then_load

    def wait_staged(self) -> None:
        """Block until the running async save has copied its tensors. Call before the optimizer
        step (or anything else) changes the state being saved (``guard`` does it for the model
        and optimizer)."""
        if self._staged is not None:
            while not self._staged.wait(HEARTBEAT_EVERY_S):
                if self.heartbeat is not None:
                    self.heartbeat()
            self._staged = None

    def _stage_and_write(self, snap: Snapshot, folder: Path, staged: threading.Event, ready: Any) -> ShardResult:
        try:
            if ready is not None:
                event, device = ready
                # The current CUDA device is per thread and this one's would be GPU 0: bind it to
                # the state's device, or local ranks != 0 would queue their copies on GPU 0's
                # stream context and synchronise the wrong stream (and open a context on GPU 0).
                torch.cuda.set_device(device)
                if self._copy_stream is None:
                    self._copy_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                self._copy_stream.wait_event(event)
                with torch.cuda.stream(self._copy_stream):
                    mine = self._select(snap, copy=True)
                self._copy_stream.synchronize()
            else:
                mine = self._select(snap, copy=True)
        except Exception as exc:
            return ShardResult(self.env.rank, error=f"staging failed: {type(exc).__name__}: {exc}")
        finally:
            staged.set()
        return self._write_shard(folder, snap.step, mine, _pieces_written(snap))

    def _select(self, snap: Snapshot, copy: bool) -> dict[str, torch.Tensor]:
        """This rank's tensors on the CPU. An async save copies them now (training changes the
        originals at the next step); a synchronous one writes CPU tensors in place."""
        sizes = {k: nbytes(v) for k, v in snap.replicated.items()}
        owner = assign_shards(sizes, self.env.world_size, pinned=dict.fromkeys(snap.from_rank0, 0))
        mine = {k: v for k, v in snap.replicated.items() if owner[k] == self.env.rank}
        mine.update({rank_key(self.env.rank, k): v for k, v in snap.per_rank.items()})
        # Sharded tensors: this rank's own piece, under the tensor's key (one piece per file).
        mine.update({k: piece.tensor for k, piece in snap.sharded.items() if piece.writes})
        if not copy:
            return {k: v.detach().to("cpu").contiguous() for k, v in mine.items()}
        staged = {k: self._stage(k, v.detach()) for k, v in mine.items()}
        self._staging = staged
        return staged

    def _stage(self, key: str, value: torch.Tensor) -> torch.Tensor:
        buf = self._staging.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
        buf.copy_(value, non_blocking=value.is_cuda)
        return buf

    def _write_shard(
        self, folder: Path, step: int, tensors: dict[str, torch.Tensor], pieces: dict[str, Box]
    ) -> ShardResult:
        """Background thread: serialise, write, fsync, rename. Never a collective."""
        rank = self.env.rank
        name = shard_name(rank, self.env.world_size)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._hook("before_shard", step, folder / name)
            meta = {"step": str(step), "rank": str(rank)}
            entry = write_shard(
                folder / name, tensors, meta, before_rename=lambda: self._hook("before_rename", step, folder / name)
            )
            self._hook("after_shard", step, folder / name)
            whole = sorted(k for k in tensors if k not in pieces)
            return ShardResult(rank, name, entry, whole, pieces={k: box.to_json() for k, box in pieces.items()})
        except Exception as exc:  # reported to every rank at the commit, never raised here
            return ShardResult(rank, name, error=f"{type(exc).__name__}: {exc}")

    def _hook(self, stage: SaveStage, step: int, path: Path) -> None:
        if self.hooks is not None:
            self.hooks.on_save(stage, step, path)

    def _wait_beating(self, future: Future[ShardResult]) -> ShardResult:
        while True:
            try:
                return future.result(timeout=HEARTBEAT_EVERY_S)
            except TimeoutError:
                if self.heartbeat is not None:
                    self.heartbeat()

    def commit_pending(self) -> bool:
        """Collective: wait for this rank's shard, share results, rank 0 commits. True if committed."""
        assert self._pending is not None
        snap, folder, future = self._pending
        self._pending = None
        result = self._wait_beating(future)
        results = [ShardResult.from_json(r) for r in all_gather_json(result.to_json(), group=self.group)]
        failures = [r for r in results if r.error]
        ok = not failures
        if ok and should_manage_checkpoints(self.env):
            ok = self._write_manifest(snap, folder, results)
        elif failures:
            for r in failures:
                log.error(
                    "checkpoint_failed",
                    step=snap.step,
                    rank=r.rank,
                    error=r.error,
                    detail="previous checkpoint kept; retry at next interval",
                )
        committed = self._agree(ok)
        if committed:
            self.last_committed_step = snap.step
            log.info("checkpoint_committed", step=snap.step, path=str(folder))
        elif should_manage_checkpoints(self.env):
            self._remove_failed(snap.step, folder)
        return committed

    def _remove_failed(self, step: int, folder: Path) -> None:
        """Rank 0, after a verdict of "not committed": the folder's shards are dead weight (no
        manifest will ever name them), and on a full disk they hold the space the next save
        needs. Every rank's write has returned by now (the results were gathered). Only under
        our own lock, and only a folder without a manifest: another job that took the directory
        over may be writing the same step's folder, and a committed folder is never touched."""
        with self.lock.still_held() as held:
            if not held or (folder / MANIFEST).exists():
                return
            pointed = latest_target(self.cfg.root)  # a move of latest that failed after its rename
            if pointed is not None and pointed.resolve() == folder.resolve():
                log.error(
                    "checkpoint_cleanup_skipped",
                    step=step,
                    path=str(folder),
                    detail="latest points at the failed save: kept for the next start to repair",
                )
                return
            try:
                shutil.rmtree(folder)
            except FileNotFoundError:
                return
            except OSError as exc:
                log.error("checkpoint_cleanup_failed", step=step, path=str(folder), error=repr(exc))
                return
        log.warning("checkpoint_removed_failed", step=step, path=str(folder), detail="the files of a failed save")

    def _agree(self, ok: bool) -> bool:
        """Rank 0's verdict on the commit, shared (CPU tensor on the gloo group)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def _write_manifest(self, snap: Snapshot, folder: Path, results: list[ShardResult]) -> bool:
        # The guard's verdict is durable once given (quorum mode's line record: a confirmed or
        # pinned step stays so), so it is asked before the lock's short critical section.
        refused = self.commit_guard(snap.step) if self.commit_guard is not None else None
        if refused is not None:
            log.error("checkpoint_failed", step=snap.step, rank=self.env.rank, error=refused, detail="not committed")
            return False
        with self.lock.still_held() as held:  # no takeover between this check and the move of latest
            if not held:
                log.error(
                    "checkpoint_failed",
                    step=snap.step,
                    rank=self.env.rank,
                    error=f"the lock {self.lock.path} was taken over by another run or replica",
                    detail="not committed: this process no longer owns the checkpoint directory",
                )
                return False
            manifest = self._commit_manifest(snap, folder, results)
        if manifest is None:
            return False
        self._clean_up(snap.step, folder, manifest)
        return True

    def _clean_up(self, step: int, folder: Path, manifest: Manifest) -> None:
        """Rank 0, after a commit: remove shards of an earlier failed attempt at this step (not
        in the manifest, so never loaded) and old checkpoints. Best effort: the commit already
        happened, and an error raised here would skip the verdict's broadcast that every other
        rank waits in. Logged instead; retention runs again at the next commit."""
        try:
            for stale in folder.glob("shard-*"):
                if stale.name not in manifest.files:
                    stale.unlink(missing_ok=True)
            # The best folders are named in best.json before anything is deleted; if that fails,
            # nothing is purged this time (a best.json must never name a deleted folder).
            best = record_best(self.cfg.root, self.cfg.keep_best, self.cfg.best_metric)
            self.purger.purge(self.cfg.root, self.cfg.keep_last, protect={folder, *best})
        except Exception as exc:  # any failure, storage or not: never one rank's exception
            log.error(
                "checkpoint_cleanup_failed",
                step=step,
                path=str(folder),
                error=repr(exc),
                detail="the checkpoint is committed; clean-up is retried at the next commit",
            )

    def _commit_manifest(self, snap: Snapshot, folder: Path, results: list[ShardResult]) -> Manifest | None:
        """Write the manifest and move ``latest``; the manifest, or None (logged) on failure."""
        parent = ""
        if self.parent is not None:
            in_root = self.parent.parent.resolve() == self.cfg.root.resolve()
            parent = self.parent.name if in_root else str(self.parent.resolve())
        pos = snap.position
        manifest = Manifest(
            step=pos.step,
            epoch=pos.epoch,
            batch_in_epoch=pos.batch_in_epoch,
            world_size=self.env.world_size,
            files={r.file: r.entry for r in results if r.entry is not None},
            tensors={key: r.file for r in results for key in r.keys},
            fingerprint=self.fingerprint,
            payload=snap.payload,
            config=snap.config,
            versions=_versions(),
            run_id=self.env.run_id,
            created=time.time(),
            finished=pos.finished,
            timeline=self.timeline,
            parent=parent,
            sharded=_sharded_entries(snap, results),
        )
        try:
            check_sharded(manifest, folder / MANIFEST)  # a commit never promises what it lacks
            write_atomic(folder / MANIFEST, manifest.to_json().encode())
            self._hook("after_manifest", snap.step, folder / MANIFEST)
            point_latest(self.cfg.root, folder)
        except Exception as exc:  # storage, or a hook's: every rank waits for rank 0's verdict
            log.error(
                "checkpoint_failed",
                step=snap.step,
                rank=self.env.rank,
                error=repr(exc),
                detail="manifest or latest not written; previous checkpoint kept",
            )
            (folder / MANIFEST).unlink(missing_ok=True)
            return None
        return manifest

    # ------------------------------------------------------------------ load
    def resume(self) -> Loaded | None:
        """Collective: the checkpoint to continue from, or None to start fresh. Also settles
        this run's timeline (see the module docstring); nothing on disk changes unless every
        rank loaded the checkpoint."""
        choice: str | None = None
        error: str | None = None
        if should_manage_checkpoints(self.env):
            try:
                self._selection = choose_checkpoint(self.cfg, self.fingerprint)
                choice = None if self._selection.folder is None else str(self._selection.folder)
            except UsageError as exc:
                error = str(exc)
            except OSError as exc:  # listing the folder failed: every rank must hear of it, not hang
                error = f"{self.cfg.root} cannot be read: {exc}. Fix: check the storage and run again"
        error, choice = broadcast_json([error, choice], src=0, group=self.group)
        if error is not None:
            raise UsageError(error)
        if choice is None:
            self._agree_timeline()
            return None
        folder = Path(choice)
        if not _may_resume_from(self.cfg, folder):  # every rank checks what it is told to load
            raise RuntimeError(f"rank 0 chose {folder} to resume from: neither in {self.cfg.root} nor --resume's")
        try:
            loaded = load(folder)
            error = None
        except CheckpointInvalid as exc:
            error = f"rank {self.env.rank}: {exc}"
        errors: list[str | None] = all_gather_json(error, group=self.group)
        first = next((e for e in errors if e), None)
        if first:
            raise UsageError(
                f"checkpoint {folder} could not be loaded: {first}",
                f"check the storage, or {START_FRESH}",
            )
        self.parent = folder
        self.last_committed_step = loaded.manifest.step
        self._agree_timeline()
        return loaded

    def adopt_loaded(self, loaded: Loaded, timeline: str) -> None:
        """Continue from a checkpoint another replica of this job chose and settled (quorum
        mode: one settler, under the lock), on its ``timeline``. Nothing on disk changes."""
        self.parent = loaded.folder
        self.last_committed_step = loaded.manifest.step
        self.timeline = timeline

    def settle(self, selection: Selection, keep_newer: bool) -> str:
        """Quorum mode's one settler (a world of one holding the lock), once ``selection`` is
        loaded: what ``resume`` does on rank 0 after every rank loaded. ``keep_newer``: a
        committed checkpoint newer than the chosen one is never moved aside (it can only be
        another replica's of this job, committed while this one loaded); ``NewerCommitted``
        is raised instead, before anything but proven-corrupt folders moved, and the caller
        chooses again.
        Returns the timeline, which this checkpointer now continues."""
        self.timeline = self._settle(selection, keep_newer)
        if selection.folder is not None and selection.manifest is not None:
            self.parent = selection.folder
            self.last_committed_step = selection.manifest.step
        return self.timeline

    def _agree_timeline(self) -> None:
        """Collective: rank 0 settles the directory and the timeline; every rank takes it."""
        timeline = ""
        if should_manage_checkpoints(self.env):
            selection, self._selection = self._selection or Selection(None), None
            timeline = self._settle(selection)
        self.timeline = broadcast_json(timeline, src=0, group=self.group)

    def _settle(self, selection: Selection, keep_newer: bool = False) -> str:
        """Rank 0, after every rank loaded ``selection``: move aside what fallback found corrupt
        and any committed future newer than the loaded checkpoint; return this run's timeline.
        ``keep_newer``: raise ``NewerCommitted`` instead of moving a newer committed future aside
        (what fallback proved corrupt is still moved aside first)."""
        chosen, manifest = selection.folder, selection.manifest
        if chosen is None or manifest is None:
            return new_timeline()  # a fresh start: the directory holds no committed checkpoint
        for bad in selection.invalid:  # proven damage only (never a folder that could not be read)
            self._set_aside(bad, CORRUPT)
        root = self.cfg.root
        in_root = chosen.parent.resolve() == root.resolve()
        key = checkpoint_key(chosen) or (manifest.step, 1)
        # From another directory (--resume OTHER/step-N) every step >= N here is another future.
        newer = [f for f in step_folders(root) if committed(f) and (checkpoint_key(f) or key) > key]
        if not in_root:
            newer += [f for f in step_folders(root) if committed(f) and checkpoint_key(f) == key]
        if newer and keep_newer:
            raise NewerCommitted(f"{[f.name for f in newer]} committed while {chosen.name} was being loaded")
        timeline = manifest.timeline or new_timeline()  # a version-1 manifest has none
        if newer:
            timeline = new_timeline()
            log.warning(
                "checkpoint_timeline_forked",
                resumed=str(chosen),
                abandoned=[f.name for f in newer],
                timeline=timeline,
                previous=manifest.timeline,
                detail="newer checkpoints of the abandoned future are moved aside, never deleted",
            )
            for folder in newer:
                self._set_aside(folder, ABANDONED)
        try:
            repair_latest(root, chosen)
        except OSError as exc:
            log.error("checkpoint_latest_repair_failed", error=repr(exc))
        return timeline


def _may_resume_from(cfg: CheckpointConfig, folder: Path) -> bool:
    """A checkpoint this run may load: in its own folder, or in the one ``--resume PATH`` named."""
    allowed = [cfg.root] if cfg.resume in ("auto", "never") else [cfg.root, Path(cfg.resume)]
    return any(folder.resolve().is_relative_to(place.resolve()) for place in allowed)


def select_checkpoint(cfg: CheckpointConfig, fingerprint: dict[str, Any]) -> Path | None:
    """Which checkpoint a run continues from (None: start fresh); see ``choose_checkpoint``."""
    return choose_checkpoint(cfg, fingerprint).folder


def choose_checkpoint(cfg: CheckpointConfig, fingerprint: dict[str, Any]) -> Selection:
    """Which checkpoint a run continues from, and the newer committed ones found invalid on
    the way (``--resume auto``). Raises ``UsageError`` when checkpoints exist but none is valid,
    when one is incompatible, or when ``--resume never`` would overwrite existing ones.
    Changes nothing on disk."""
    mode = cfg.resume
    if mode == "never":
        done = [f for f in step_folders(cfg.root) if (f / MANIFEST).is_file()]
        if done:
            raise UsageError(
                f"--resume never, but {cfg.root} already holds checkpoints (newest: {done[0].name}) "
                "that a fresh run would overwrite",
                "point --checkpoint-dir (or --run-dir) at an empty folder or move the old checkpoints away; "
                "to continue them instead, leave --resume at auto",
            )
        return Selection(None)
    if mode != "auto":
        folder = Path(mode)
        target = latest_target(folder) or folder
        try:
            manifest = verify(target)
        except CheckpointUnreadable as exc:
            raise _unreadable(target, exc) from None
        except CheckpointInvalid as exc:
            raise UsageError(f"--resume {mode}: {exc}", "pass a valid checkpoint folder, or --resume auto") from None
        check_compatible(target, manifest, fingerprint)
        return Selection(target, manifest)
    root = cfg.root
    latest = latest_target(root)
    problems = []
    invalid: list[Path] = []
    if latest is not None and not latest.exists():
        problems.append(f"{root / 'latest'} points at {latest.name}, which does not exist")
        log.error("checkpoint_invalid", path=str(root / "latest"), error=problems[-1])
    # Newest first. `latest` normally names the first of these; after a crash between a
    # manifest and the `latest` move, a newer committed checkpoint exists and wins.
    try:
        done = [f for f in step_folders(root) if has_manifest(f)]
    except CheckpointUnreadable as exc:
        raise _unreadable(root, exc) from None
    for folder in done:
        try:
            manifest = verify(folder)
        except CheckpointTooNew as exc:
            # Falling back past it would silently lose its progress, and an older build would
            # later move it aside as corrupt: refuse the run instead.
            raise UsageError(str(exc)) from None
        except CheckpointUnreadable as exc:
            # Retried already. Falling back past it would settle an older timeline and move this
            # (possibly intact) checkpoint aside as an abandoned future: refuse instead.
            raise _unreadable(folder, exc) from None
        except CheckpointInvalid as exc:  # read fine and found damaged: moved aside once loaded
            problems.append(str(exc))
            invalid.append(folder)
            log.error("checkpoint_invalid", path=str(folder), error=str(exc))
            continue
        if latest is None or folder.resolve() != latest.resolve():
            log.warning("checkpoint_fallback", chosen=str(folder), latest=str(latest), skipped=problems)
        check_compatible(folder, manifest, fingerprint)
        return Selection(folder, manifest, tuple(invalid))
    if problems and (done or latest is not None):
        raise UsageError(
            f"{root} holds checkpoints but none is valid: {'; '.join(problems)}",
            f"repair or move them away, or {START_FRESH}",
        )
    return Selection(None)


def _unreadable(folder: Path, exc: CheckpointUnreadable) -> UsageError:
    """The refusal for a checkpoint the storage would not give back (``exc`` names the file)."""
    return UsageError(
        f"{exc}; the checkpoint may be intact, so this run neither falls back to an older one "
        "nor moves it aside, and nothing in the checkpoint directory was changed",
        f"check the storage (mount, server, permissions) and run again ({READ_RETRY_VAR} sets how long "
        f"reads are retried); if {folder} is damaged for good, move it out of the checkpoint directory "
        "or pass --resume with an older checkpoint folder",
    )


def check_compatible(folder: Path, manifest: Manifest, fingerprint: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model or data order, naming every difference.

    A checkpoint written before datasets had an identity (no ``data.*`` keys at all) is accepted
    with a warning: refusing it would strand every run upgraded mid-training.
    """
    recorded = manifest.fingerprint
    if any(key.startswith(DATA_KEY) for key in fingerprint) and not any(key.startswith(DATA_KEY) for key in recorded):
        log.warning(
            "checkpoint_without_dataset_identity",
            path=str(folder),
            detail="written before datasets were fingerprinted: a changed dataset cannot be detected",
        )
        fingerprint = {k: v for k, v in fingerprint.items() if not k.startswith(DATA_KEY)}
    # Keys of either side: a checkpoint of a plug-in task records its task.name, which a run of
    # the built-in task lacks (checkpoints older than a key lack it on both sides, by design).
    keys = [*fingerprint, *(k for k in recorded if k not in fingerprint and not k.startswith(DATA_KEY))]
    if "task.name" in fingerprint:  # flags a plug-in task ignores: older checkpoints recorded them
        keys = [k for k in keys if k in fingerprint or k not in (*TASK_IGNORES, "optimizer")]
    diffs = [
        f"{key}: checkpoint {recorded.get(key)!r}, this run {fingerprint.get(key)!r}"
        for key in keys
        if recorded.get(key) != fingerprint.get(key)
    ]
    if diffs:
        hint = f"run with the checkpoint's settings, or {START_FRESH}"
        if any(d.startswith(DATA_KEY) for d in diffs):
            hint = (
                "resume on the dataset the checkpoint was trained on (same files, sizes and labels; "
                f"its folder may move), or {START_FRESH}"
            )
        raise UsageError(f"checkpoint {folder} is incompatible with this run ({'; '.join(diffs)})", hint)


def _pieces_written(snap: Snapshot) -> dict[str, Box]:
    return {key: piece.box for key, piece in snap.sharded.items() if piece.writes}


def _sharded_entries(snap: Snapshot, results: list[ShardResult]) -> dict[str, ShardedEntry]:
    """Rank 0: the manifest's index of the sharded tensors, from every rank's written pieces
    (the global shape and dtype are rank 0's own: every rank holds the same tensors)."""
    entries = {}
    for key, mine in snap.sharded.items():
        pieces = [
            PieceEntry(r.file, box["offsets"], box["lengths"])
            for r in sorted(results, key=lambda r: r.rank)
            for k, box in r.pieces.items()
            if k == key
        ]
        entries[key] = ShardedEntry(list(mine.shape), DTYPE_NAMES[mine.tensor.dtype], pieces)
    return entries


def load(folder: Path) -> Loaded:
    """Read ``folder``'s whole tensors, every file verified; raises ``CheckpointInvalid``.
    Sharded tensors (format 4) stay on disk: ``Loaded.tensor`` reads the box a rank needs."""
    manifest = read_manifest(folder)
    check_sharded(manifest, folder / MANIFEST)
    tensors = read_shards(folder, manifest.files, skip=frozenset(manifest.sharded))
    missing = sorted(set(manifest.tensors) - set(tensors))
    if missing:
        raise CheckpointInvalid(f"{folder}: tensors listed in the manifest are missing: {missing[:3]}")
    return Loaded(folder, manifest, tensors)
