"""One run per checkpoint directory: an exclusively created lock file with a heartbeat.

Rank 0 of a run holds ``<checkpoint-dir>/.lock`` (JSON: owner = the job id, host, pid, ttl).

* **Acquire.** The record is written and fsynced to a private file, then published with
  ``link(private, ".lock")``: link() fails with EEXIST when ``.lock`` exists, so of any number
  of racing starters exactly one wins, and no reader ever sees a half-written lock. Where hard
  links are refused (some FUSE and object-store mounts), ``open(".lock", O_CREAT | O_EXCL)`` is
  the fallback; a reader may then see it empty for an instant, and an unreadable lock counts as
  held (never as stale) until its heartbeat is older than the TTL.
* **Heartbeat.** A daemon thread of the holder touches the file every ``HEARTBEAT_S`` through
  its open descriptor (futimens; on NFS the server's clock sets the time). Staleness is the
  file's mtime, never its content, so a heartbeat is never read torn.
* **Stale.** A lock is stale once its mtime is older than the holder's TTL, or when its holder is
  a process of this host that no longer exists. The same job (same Slurm job id or torchrun run
  id) always takes its own lock back after a restart or requeue.
* **Takeover.** Whatever removes a ``.lock`` (a takeover, a release) first creates
  ``.lock.takeover`` exclusively, a mutex held for milliseconds: removals are serialised, while
  a publisher can only fill an empty slot. Under it the contender checks that ``.lock`` is
  still the very file it judged stale (inode and mtime: the holder did not beat meanwhile),
  renames it to a unique name and removes it; then it publishes its own as above. A mutex
  older than ``MUTEX_STALE_S`` (its holder froze or died within those milliseconds), or one
  whose holder is a process of this host (and PID namespace) that no longer exists, is cleared
  the same rename-and-check way; a holder removes it only while it still carries its own
  token. Acquiring waits longer than ``MUTEX_STALE_S``, so a mutex left by a lost node never
  turns into a refusal. Without the mutex, two contenders that both judged the old lock stale
  could each rename away what the other had just published.
* **Fencing.** The holder checks at every heartbeat that ``.lock`` is still its own (inode and hold id)
  (``lost``), and every commit checks it and moves ``latest`` with the mutex held
  (``still_held``), so no takeover falls in between: a run whose lock was taken over (it was
  silent for longer than its TTL, or, in quorum mode, another replica of the job saves now)
  logs an error and stops committing; ``was_lost`` then stays True (until it takes the lock
  again), and the restart-mode trainer stops at its next step boundary (``ExitCode.LOCK_LOST``).
* **Owner.** The job (``DistEnv.job_id``): every restart of one job has the same, any two jobs
  differ, also two plain torchrun jobs without ``--rdzv-id`` (``distributed/identity.py``).

NFS and cluster filesystems: link(), rename() and O_EXCL creation are atomic on the server for
NFSv3 and v4 (O_EXCL was not on NFSv2; link always was), and on Lustre, GPFS and CephFS.
flock/fcntl locks are not used: on many cluster filesystems they are disabled or local to one
client (Lustre without ``-o flock``, NFS without lockd), and the lock of a frozen holder would
never expire. NFS attribute caching (``actimeo``, up to 60 s by default) can show a reader an
older mtime, and host clocks must agree (NTP): the TTL's margin covers both.

TTL (``lock_ttl``): ``--hang-timeout + 180 s`` (900 s with the watchdog off), unless
``ELASTIC_TRAIN_LOCK_TTL`` (seconds) is set. Why: the heartbeat thread keeps beating while the
main thread waits in a collective, saves or evaluates; it stops only when the whole process
stops (SIGSTOP, a frozen node) or dies. A frozen holder's peers exit after ``--hang-timeout``
(their watchdog), the launcher restarts the group (up to its 30 s stop grace, then the
rendezvous), and the new rank 0, starting in about a minute on a cold node, takes its own job's
lock back; the last 60 s cover attribute caching and clock skew. So a job that is alive and
recovering keeps its directory, and one that is gone frees it after at most the TTL (at once on
the same host). The holder writes its TTL into the lock; other runs judge it by that.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from elastic_train.errors import UsageError

log = structlog.get_logger(__name__)

LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0
TTL_VAR = "ELASTIC_TRAIN_LOCK_TTL"
TTL_MARGIN_S = 180.0  # restart of a frozen holder's job after its watchdog fired, NFS caching, clocks
NO_WATCHDOG_TTL_S = 900.0  # --hang-timeout 0: nothing bounds a freeze; 15 minutes
MUTEX_NAME = ".lock.takeover"
MUTEX_STALE_S = 30.0  # the mutex is held for milliseconds; older means its contender died
# Contenders that keep taking turns give up after this. Longer than MUTEX_STALE_S: a mutex left
# by a holder on another host that froze or died in those milliseconds (a node lost mid-commit)
# is cleared before a starting replica or rank gives up on the directory (exit 2 would be final).
ACQUIRE_TIMEOUT_S = MUTEX_STALE_S + 10.0
# How long ``release`` waits for the heartbeat thread to stop. A beat is one futimens and one stat:
# milliseconds, unless the mount is wedged (a hard NFS mount whose server is gone blocks them
# for as long as it is gone). Past this bound the process must still be able to exit.
RELEASE_JOIN_S = 10.0
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS}
REFUSAL_FIX = (
    "use another --checkpoint-dir, stop that run, or, if it crashed on another host, wait "
    f"for its lock to expire ({TTL_VAR} overrides the TTL)"
)


def ttl_override() -> float | None:
    """``ELASTIC_TRAIN_LOCK_TTL`` in seconds, if set."""
    raw = os.environ.get(TTL_VAR, "").strip()
    if not raw:
        return None
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not ttl > 0:
        raise UsageError(f"{TTL_VAR}={raw!r} is not a positive number of seconds", f"unset {TTL_VAR}, or set e.g. 600")
    return ttl


def lock_ttl(hang_timeout: float) -> float:
    """Seconds without a heartbeat after which our lock is stale (see the module docstring)."""
    override = ttl_override()
    if override is not None:
        return override
    return hang_timeout + TTL_MARGIN_S if hang_timeout > 0 else NO_WATCHDOG_TTL_S


def _pid_namespace() -> str:
    """This process's PID namespace (its inode), or "" where /proc does not tell: processes of
    one host name in other namespaces (containers with the host's network and name) cannot be
    judged alive or dead from here."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """The lock as found: its record ({} if unreadable), identity and heartbeat age."""

    record: dict[str, Any]
    inode: int
    mtime_ns: int
    age: float


class CheckpointLock:
    def __init__(self, root: Path, owner: str, ttl_s: float) -> None:
        self.path = root / LOCK_NAME
        self.owner = owner
        self.ttl = ttl_s  # written into the lock: others judge our heartbeat by it
        self.host = socket.gethostname()
        self.pid_namespace = _pid_namespace()
        self._fd: int | None = None
        self._inode = -1  # the lock file's inode once taken (kept after a release: it was held)
        self._token = ""  # this hold's own id, written into the record (see ``_still_ours``)
        self._mutex: str | None = None  # what our takeover mutex says, while we hold it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost_logged = False
        self._missing_beats = 0  # beats that found no lock at all since ours was lost
        self._lost = threading.Event()  # set when this hold was found taken over or removed

    # ------------------------------------------------------------------ reading
    def _record(self, token: str) -> bytes:
        record = {
            "owner": self.owner,
            "hold": token,
            "host": self.host,
            "pidns": self.pid_namespace,
            "pid": os.getpid(),
            "ttl": self.ttl,
            "since": time.time(),
        }
        return json.dumps(record).encode()

    def _local(self, host: object, pid_namespace: object) -> bool:
        """Whether a process recorded as (host, PID namespace) is one this process can see. A
        record without a namespace (written before it was recorded) is judged by its host."""
        return host == self.host and pid_namespace in (None, self.pid_namespace)

    def inspect(self) -> Holder | None:
        """The current lock, or None if there is none."""
        try:
            st = os.stat(self.path)
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(text)
        except ValueError:
            record = {}  # being written (O_EXCL fallback) or damaged: judged by its age alone
        return Holder(record if isinstance(record, dict) else {}, st.st_ino, st.st_mtime_ns, time.time() - st.st_mtime)

    def blocks_us(self, held: Holder) -> str | None:
        """Why ``held`` forbids us to take the directory, or None (ours, stale, or dead)."""
        record = held.record
        if record.get("owner") == self.owner:
            return None
        ttl = ttl_override() or float(record.get("ttl") or self.ttl)
        if held.age > ttl:
            return None
        if self._local(record.get("host"), record.get("pidns")) and not _pid_alive(int(record.get("pid", -1))):
            return None
        who = f"run {record.get('owner')!r} (host {record.get('host')}, pid {record.get('pid')})" if record else "a run"
        return (
            f"checkpoint directory {self.path.parent} is in use by {who}, heartbeat {held.age:.0f}s ago "
            f"(stale after {ttl:.0f}s)"
        )

    def check_available(self) -> None:
        """Raise ``UsageError`` (naming the holder and the fix) if another job holds the
        directory now; take nothing. For quorum mode's worker start: the replica of this job
        that saves now keeps the lock (taking it would fence that replica's save in flight)."""
        held = self.inspect()
        reason = self.blocks_us(held) if held is not None else None
        if reason:
            raise UsageError(reason, REFUSAL_FIX)

    # ------------------------------------------------------------------ acquire
    def acquire(self) -> None:
        """Take the lock or raise ``UsageError`` naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
        while True:
            if self._publish():
                self._stop.clear()
                self._thread = threading.Thread(target=self._beat, name="ckpt-lock", daemon=True)
                self._thread.start()
                return
            held = self.inspect()
            if held is None:
                continue  # released between our attempt and our look: try again
            reason = self.blocks_us(held)
            if reason:
                raise UsageError(reason, REFUSAL_FIX)
            if self._take_over(held):
                if held.record.get("owner") != self.owner:
                    log.warning("checkpoint_lock_taken_over", previous=held.record, heartbeat_age_s=round(held.age, 1))
                continue
            if time.monotonic() > deadline:
                raise UsageError(
                    f"checkpoint directory {self.path.parent}: could not take its stale lock within "
                    f"{ACQUIRE_TIMEOUT_S:.0f}s (other runs are starting on it, or {MUTEX_NAME} cannot be created)",
                    "start one run per --checkpoint-dir",
                )
            time.sleep(0.01 + 0.05 * random.random())  # another contender holds the mutex: its turn

    def _publish(self) -> bool:
        """Create ``.lock`` exclusively with our record; False if it exists."""
        private = self.path.with_name(f"{LOCK_NAME}.{self.host}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        fd = os.open(private, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        token = uuid.uuid4().hex
        linked = False
        try:
            os.write(fd, self._record(token))
            os.fsync(fd)
            try:
                os.link(private, self.path)
                linked = True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
        finally:
            if not linked:
                os.close(fd)
            private.unlink(missing_ok=True)
        if not linked:
            return self._publish_exclusive(token)
        self._hold(fd, token)
        return True

    def _publish_exclusive(self, token: str) -> bool:
        """Fallback without hard links: O_CREAT | O_EXCL on ``.lock`` itself."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        os.write(fd, self._record(token))
        os.fsync(fd)
        self._hold(fd, token)
        return True

    def _hold(self, fd: int, token: str) -> None:
        self._fd, self._inode, self._lost_logged, self._missing_beats = fd, os.fstat(fd).st_ino, False, 0
        self._token = token
        self._lost.clear()

    def _still_ours(self) -> bool:
        """Whether ``.lock`` is the file this hold published: its inode and its record's hold id.

        The inode alone is not enough: tmpfs and ext4 hand a freed inode number to the next file
        at once, so after another replica of the job took the lock over (removing ours and
        linking its own), ``.lock`` can carry our old inode number. Judged by the inode alone,
        this replica then went on as the holder and, exiting, removed the new holder's lock,
        failing that replica's final commit (seen in a test run: exit 81, a restart)."""
        try:
            if os.stat(self.path).st_ino != self._inode:
                return False
            record = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):  # gone, or another's being written (O_EXCL fallback)
            return False
        return isinstance(record, dict) and record.get("hold") == self._token

    def _take_over(self, judged: Holder) -> bool:
        """Remove the lock we judged stale, unless it changed since we looked. True if removed."""
        if not self._lock_mutex():
            return False
        try:
            now = self.inspect()
            if now is None or (now.inode, now.mtime_ns) != (judged.inode, judged.mtime_ns):
                return False  # its holder beat, or it was replaced: judge again
            return _remove_if(self.path, judged.inode, judged.mtime_ns)
        finally:
            self._unlock_mutex()

    def _lock_mutex(self) -> bool:
        """Create ``.lock.takeover`` exclusively (clearing a stale one); False if it is held."""
        mutex = self.path.with_name(MUTEX_NAME)
        try:
            fd = os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(mutex)
                # A commit holds it too (``still_held``), so a holder killed mid-commit on this
                # host is common enough (a worker SIGKILL) to be cleared at once, not after 30 s.
                if time.time() - st.st_mtime > MUTEX_STALE_S or self._mutex_holder_died(mutex):
                    log.warning("checkpoint_lock_mutex_cleared", path=str(mutex))
                    _remove_if(mutex, st.st_ino, st.st_mtime_ns)
            return False
        # Who holds it (judged by ``_mutex_holder_died``) and a token of this hold (``_unlock_mutex``).
        record = f"{self.host} {self.pid_namespace or '-'} {os.getpid()} {uuid.uuid4().hex}\n"
        try:
            os.write(fd, record.encode())
        finally:
            os.close(fd)
        self._mutex = record
        return True

    def _wait_mutex(self, wait_s: float) -> bool:
        """Take the mutex, waiting up to ``wait_s`` for a contender's turn to end; False if not."""
        deadline = time.monotonic() + wait_s
        while not self._lock_mutex():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _mutex_holder_died(self, mutex: Path) -> bool:
        """True if the mutex names a process of this host that no longer exists."""
        try:
            host, namespace, pid = mutex.read_text().split()[:3]
            local = self._local(host, "" if namespace == "-" else namespace)
            return local and int(pid) != os.getpid() and not _pid_alive(int(pid))
        except (OSError, ValueError):
            return False  # being written, damaged or of an older build: judged by its age alone

    def _unlock_mutex(self) -> None:
        """Remove our mutex, and only ours: one cleared as stale (a holder silent for
        MUTEX_STALE_S, e.g. on a stalled filesystem) may be a contender's by now."""
        mine, self._mutex = self._mutex, None
        mutex = self.path.with_name(MUTEX_NAME)
        with contextlib.suppress(FileNotFoundError):
            # By its token, not its inode (a new file may reuse a freed one) or mtime (NFS).
            if mine is not None and mutex.read_text() == mine:
                mutex.unlink()

    def ensure_held(self) -> None:
        """Hold the lock now: keep it if it is still ours, else take it (again).

        For quorum mode, where the replica that saves changes with the membership: every
        replica of a job has the same owner, so the one saving now takes the lock from the one
        that saved before (``blocks_us``), which then ``lost`` it and, when it saves again,
        takes it back the same way. Raises ``UsageError`` when another job holds it.
        """
        if self._fd is not None and not self.lost():
            return
        self.release()
        self.acquire()

    # ------------------------------------------------------------------ holding
    @contextlib.contextmanager
    def still_held(self, wait_s: float = 2.0) -> Iterator[bool]:
        """Yield whether the lock is still ours, with the takeover mutex held for the block.

        A commit checks the lock and then moves ``latest``. In quorum mode another replica of the
        same job may take the lock over (``ensure_held``) and commit a newer step in between; the
        old holder would then point ``latest`` back at its older step. A takeover needs the mutex,
        so under it the answer cannot change before the block ends. Yields False when the mutex
        cannot be had within ``wait_s`` (a contender is taking the lock over right now).
        """
        if self._fd is None:  # never taken (a lock-less caller) is no fence; released or lost is
            yield self._inode == -1
            return
        mutex = self._wait_mutex(wait_s)
        try:
            lost = self.lost()
            if lost:
                self._lost.set()
            yield mutex and not lost
        finally:
            if mutex:
                self._unlock_mutex()

    @property
    def was_lost(self) -> bool:
        """True once a heartbeat or a commit found this hold taken over or removed (no file
        access: cheap enough for every step boundary); False again after a new ``acquire``."""
        return self._lost.is_set()

    def lost(self) -> bool:
        """True if we took the lock and ``.lock`` is no longer ours (taken over, or removed)."""
        if self._fd is None:
            return False
        return not self._still_ours()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.lost():
                    self._lost.set()
                    if not self._lost_logged:
                        self._lost_logged = self._log_lost()
                    continue
                fd = self._fd
                if fd is None:  # released while this beat was blocked in ``lost``
                    return
                os.utime(fd)
            except OSError as exc:
                log.error("checkpoint_lock_heartbeat_failed", error=repr(exc))

    def _log_lost(self) -> bool:
        """Who has the lock now. Another replica of this job (quorum mode: the one saving now)
        is a hand-over, part of normal work; only another job, or no lock at all, is an error.
        A takeover removes the old lock before it links its own: no lock is judged again at the
        next beats (False: not logged yet), and logged as lost only if it stays away."""
        holder = self.inspect()
        if holder is None and self._missing_beats < 2:
            self._missing_beats += 1
            return False
        record = holder.record if holder is not None else {}
        if record.get("owner") == self.owner:
            log.info(
                "checkpoint_lock_handed_over",
                path=str(self.path),
                to_host=record.get("host"),
                to_pid=record.get("pid"),
                detail="another replica of this job saves now",
            )
            return True
        log.error(
            "checkpoint_lock_lost",
            path=str(self.path),
            owner=record.get("owner"),
            detail="another run took the directory over (or the lock was removed); this run no longer commits "
            "checkpoints",
        )
        return True

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours.

        Never hangs on a wedged mount: when the heartbeat thread does not stop within
        ``RELEASE_JOIN_S`` (it is blocked in the filesystem), the lock is left in place and its
        descriptor open (closing it, like removing the lock, would block the same way). Logged;
        the lock goes stale after its TTL, and this job takes its own lock back at once."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(RELEASE_JOIN_S)
            if thread.is_alive():
                fd, self._fd = self._fd, None
                log.error(
                    "checkpoint_lock_heartbeat_stuck",
                    path=str(self.path),
                    waited_s=RELEASE_JOIN_S,
                    fd=fd,
                    detail="the storage does not answer; the lock is left in place and goes stale after its TTL",
                )
                return
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)
        mutex = self._wait_mutex(2.0)
        try:
            with contextlib.suppress(FileNotFoundError):
                if self._still_ours():  # else another run or replica holds it now: not ours to remove
                    st = os.stat(self.path)
                    _remove_if(self.path, st.st_ino, st.st_mtime_ns)
        finally:
            if mutex:
                self._unlock_mutex()


def _remove_if(path: Path, inode: int, mtime_ns: int) -> bool:
    """Remove ``path`` if it is still that file: rename it to a unique name, check, unlink (or
    link it back if it changed in between). True if removed."""
    aside = path.with_name(f"{path.name}.stale-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    st = os.stat(aside)
    if (st.st_ino, st.st_mtime_ns) != (inode, mtime_ns):
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True
