"""Fault injection for tests and chaos runs, driven by ``ELASTIC_TRAIN_FAULTS``. Off unless set.

Grammar: faults separated by ``,``; each is ``KIND:rank=R:step=S[:key=value...][:always]``.

* ``kill``: SIGKILL this process at the start of global step S (steps count from 1 across epochs).
* ``hang``: block forever at the start of step S (a stuck rank; its peers wait in a collective).
* ``raise``: raise ``InjectedFault`` at the start of step S.
* ``preempt``: send this process SIGUSR1 at the start of step S, as a scheduler's preemption
  notice would; the trainer stops at the next step boundary the ranks agree on.
* ``hold`` (``:until=NAME[:then=NAME2]``): block at the start of step S until the file NAME
  appears in the marker directory (a busy rank, released by another's ``release``); with
  ``then``, write NAME2 just before this process next asks for a quorum (quorum mode).
* ``release`` (``:file=NAME[:until=NAME2]``): write the file NAME at the start of step S; with
  ``until``, wait for NAME2 just before this process next asks for a quorum. A hold and a
  release order two replicas' quorum requests exactly, without guessing at timings.
* ``slow_link`` (``:bytes_per_s=N``): from step S on, this process enters quorum mode's
  gradient average late by gradient bytes / N seconds, as over a link of that speed: its peers
  wait in the collective that long, every step.
* ``kill_after_claim``: SIGKILL this process right after its claim of training step S was taken
  by the line record (quorum mode with ``--lighthouse-etcd``; it claims as one of the attempt's
  first participants): the record's head is then a step nobody applied, which the next quorum
  must void (``quorum.line``).
* ``kill_before_average``: SIGKILL this process in quorum mode's training step S after the
  attempt's first collective (the sums and positions) succeeded, right before its gradient
  average: its peers are then inside the one collective a survivor's work can be kept from
  (``salvaged`` in its log), deterministically rather than by the timing of an outside kill.
* ``load_error``: reading the checkpoint of step S fails with EIO in this process (quorum
  mode's start of a line: one replica's storage hiccup).
* ``kill_in_save`` (``:stage=before_shard|after_shard|after_manifest``) / ``enospc``: fired by
  the checkpoint writer's save hooks (``CheckpointFaults``, passed to ``Checkpointer(hooks=)``).
* ``slow_save`` (``:seconds=N``): the writer thread sleeps N seconds before this rank's shard of
  step S's save (a large shard on slow storage); the rank's main thread waits, beating, meanwhile.

A fault fires once per run, across restarts: before firing it leaves a marker file in the
marker directory (beside the run's persistent state), and a marked fault never fires again.
With ``:always`` it fires on every attempt, e.g. to exhaust torchrun's restart budget.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from elastic_train.errors import UsageError

ENV_VAR = "ELASTIC_TRAIN_FAULTS"
STEP_KINDS = ("kill", "hang", "raise", "preempt", "hold", "release")
HANDSHAKE_TIMEOUT_S = 300.0  # a hold or release waits this long for its file, then raises
HANDSHAKE_SETTLE_S = 0.2  # after a release's wait: the other process's next call is under way
SAVE_KINDS = ("kill_in_save", "enospc", "slow_save")
LOAD_KINDS = ("load_error",)
LINK_KINDS = ("slow_link",)
LINE_KINDS = ("kill_after_claim",)
AVERAGE_KINDS = ("kill_before_average",)
KINDS = STEP_KINDS + SAVE_KINDS + LOAD_KINDS + LINK_KINDS + LINE_KINDS + AVERAGE_KINDS
HINT = f"write e.g. {ENV_VAR}='kill:rank=1:step=7,raise:rank=0:step=3:always'"

log = structlog.get_logger(__name__)


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    always: bool = False
    params: Mapping[str, str] = field(default_factory=dict)

    @property
    def marker_name(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in sorted(self.params.items()))
        return f"fault-{self.kind}-rank{self.rank}-step{self.step}{extra}.fired"


def _parse_one(text: str) -> Fault:
    kind, *fields = text.strip().split(":")
    if kind not in KINDS:
        raise UsageError(f"{ENV_VAR}: unknown fault kind {kind!r} in {text!r} (known: {', '.join(KINDS)})", HINT)
    always = False
    values: dict[str, str] = {}
    for item in fields:
        if item == "always":
            always = True
            continue
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"{ENV_VAR}: expected key=value, got {item!r} in {text!r}", HINT)
        values[key] = value
    try:
        rank, step = int(values.pop("rank")), int(values.pop("step"))
    except KeyError as exc:
        raise UsageError(f"{ENV_VAR}: {text!r} lacks {exc.args[0]}=", HINT) from None
    except ValueError:
        raise UsageError(f"{ENV_VAR}: rank and step must be integers in {text!r}", HINT) from None
    if rank < 0 or step < 1:
        raise UsageError(f"{ENV_VAR}: need rank >= 0 and step >= 1 in {text!r}", HINT)
    if kind == "slow_save":
        _check_seconds(values.get("seconds"), text)
    if kind == "slow_link":
        try:
            if not float(values.get("bytes_per_s", "")) > 0:
                raise ValueError
        except ValueError:
            raise UsageError(f"{ENV_VAR}: slow_link needs bytes_per_s=<a positive number> in {text!r}", HINT) from None
    needs = {"hold": "until", "release": "file"}.get(kind)
    if needs is not None and not values.get(needs):
        raise UsageError(f"{ENV_VAR}: {kind} needs {needs}=<file name> in {text!r}", HINT)
    return Fault(kind, rank, step, always, values)


def _check_seconds(value: str | None, text: str) -> None:
    try:
        seconds = float(value) if value is not None else -1.0
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(f"{ENV_VAR}: slow_save needs seconds=<a positive number> in {text!r}", HINT)


def parse_faults(spec: str) -> list[Fault]:
    return [_parse_one(part) for part in spec.split(",") if part.strip()]


class FaultInjector:
    """This rank's faults. ``marker_dir`` must survive restarts (it sits beside checkpoints)."""

    def __init__(self, faults: list[Fault], rank: int, marker_dir: Path) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.marker_dir = marker_dir
        self._at_quorum: list[tuple[str, str]] = []  # ("write"|"wait", file) before the next quorum

    @classmethod
    def from_environ(cls, rank: int, marker_dir: Path) -> FaultInjector:
        return cls(parse_faults(os.environ.get(ENV_VAR, "")), rank, marker_dir)

    @property
    def active(self) -> bool:
        return bool(self.faults)

    def _claim(self, fault: Fault) -> bool:
        """True if ``fault`` should fire now; records that it fired (unless ``always``)."""
        if fault.always:
            return True
        marker = self.marker_dir / fault.marker_name
        if marker.exists():
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        # The marker must be durable before a kill: otherwise the fault fires again after restart.
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"{time.time()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def fires(self, kind: str, step: int, **params: str) -> bool:
        """For hooks elsewhere (checkpoint writer): does a ``kind`` fault fire at ``step``?"""
        return self.firing(kind, step, **params) is not None

    def firing(self, kind: str, step: int, **params: str) -> Fault | None:
        """``fires``, returning the fault that fires (its other parameters say how), or None."""
        for fault in self.faults:
            due = fault.kind == kind and fault.step == step
            if due and all(fault.params.get(k) == v for k, v in params.items()) and self._claim(fault):
                log.warning("fault_injected", kind=kind, step=step, **params)
                return fault
        return None

    def at_step(self, step: int) -> None:
        """Fire any kill/hang/raise/preempt fault due at the start of ``step``."""
        if not self.faults:
            return
        for kind in STEP_KINDS:
            if not self.fires(kind, step):
                continue
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                while True:
                    time.sleep(3600)
            elif kind == "preempt":
                os.kill(os.getpid(), signal.SIGUSR1)
            elif kind in ("hold", "release"):
                self._handshake(kind, step)
            else:
                raise InjectedFault(f"injected fault: raise at step {step}")

    def _handshake(self, kind: str, step: int) -> None:
        fault = next(f for f in self.faults if f.kind == kind and f.step == step)
        if kind == "release":
            self._touch(fault.params["file"])
            if "until" in fault.params:
                self._at_quorum.append(("wait", fault.params["until"]))
            return
        self._wait_for(fault.params["until"], f"injected hold at step {step}")
        if "then" in fault.params:
            self._at_quorum.append(("write", fault.params["then"]))

    def link_delay(self, nbytes: int, step: int) -> float:
        """Seconds a ``slow_link`` fault adds before sending ``nbytes`` at ``step`` (0: none).
        It is not claimed: a slow link stays slow, on every attempt and after restarts."""
        for fault in self.faults:
            if fault.kind == "slow_link" and step >= fault.step:
                return nbytes / float(fault.params["bytes_per_s"])
        return 0.0

    def before_quorum(self) -> None:
        """Quorum mode, just before this process asks for a quorum: what a ``hold`` or a
        ``release`` armed. A release's wait ends a moment after the file appears, so that the
        process that wrote it has asked first."""
        while self._at_quorum:
            action, name = self._at_quorum.pop(0)
            if action == "write":
                self._touch(name)
            else:
                self._wait_for(name, "injected release")
                time.sleep(HANDSHAKE_SETTLE_S)

    def _wait_for(self, name: str, what: str) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while not (self.marker_dir / name).exists():
            if time.monotonic() > deadline:
                raise InjectedFault(f"{what}: {name} never appeared in {self.marker_dir}")
            time.sleep(0.01)

    def _touch(self, name: str) -> None:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        (self.marker_dir / name).write_text(f"{time.time()}\n")


class CheckpointFaults:
    """The ``kill_in_save``, ``enospc`` and ``slow_save`` faults as the checkpoint writer's save
    hooks (``checkpoint.manager.SaveHooks``): a SIGKILL of this process at a stage of the save, a
    full disk just before a shard is renamed into place, or a shard that takes long to write."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    def on_save(self, stage: str, step: int, path: Path) -> None:
        if stage == "before_shard":
            slow = self.injector.firing("slow_save", step)
            if slow is not None:
                time.sleep(float(slow.params["seconds"]))  # the writer thread: a peer waits in the commit
        if stage == "before_rename":
            if self.injector.fires("enospc", step):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        elif self.injector.fires("kill_in_save", step, stage=stage):
            os.kill(os.getpid(), signal.SIGKILL)
