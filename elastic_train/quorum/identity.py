"""Which job a replica belongs to, and the address its listeners bind to.

Two jobs can reach one Lighthouse (a shared port, a copied command line); torchft would then put
their replicas in one quorum, average their gradients and heal one from the other's weights. So
every replica id carries the job's id (``<name>@<job>@<K>_<group>``; torchft reads the trailing
digits as the group, and appends ``:<uuid>`` per process), and a replica checks every quorum it
is given (``guard_quorum``): one that holds another job's replica is refused, by a
``ForeignReplicaError`` (exit 2) before any state moves. ``K``, the group's workers, is checked
there too: groups of different sizes would pair a worker with a peer that holds another shard
(FSDP2) or cut the global batch by a wrong count, so a quorum mixing sizes is refused
(``GroupSizeError``, exit 2). The job's secret (``SECRET_VAR``) signs
the state transfer (``elastic_train.quorum.transport``): a peer without it gets nothing.

Sharp edges: the guard sits between torchft's ``Manager`` and its Rust client (``_client``,
torchft 0.2.0), the one place where a quorum's member ids are seen before its heal starts.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from elastic_train.errors import UsageError
from elastic_train.quorum.names import BIND_VAR, HOST_VAR, JOB_VAR, SECRET_VAR

# Characters a job id keeps in a replica id: '@' separates it from the name, '_' from the group,
# ':' from torchft's per-process uuid; anything else becomes '-'.
_NOT_IN_JOB = re.compile(r"[^A-Za-z0-9.-]")
MIN_SECRET_CHARS = 16
# torchrun's default --rdzv-id: the same in every job, so no identity.
_NO_RUN_ID = "none"


def job_id(environ: Mapping[str, str]) -> str:
    """The job's id: ``JOB_VAR`` (the quorum agent sets it), else Slurm's job id, else torchrun's
    run id; "" when none is set. Characters a replica id cannot carry become '-'."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    raw = environ.get(JOB_VAR) or environ.get("SLURM_JOB_ID") or (run_id if run_id != _NO_RUN_ID else "")
    return _NOT_IN_JOB.sub("-", raw)


def member_id(name: str, job: str, group: int, group_size: int = 1) -> str:
    """The replica id torchft gets: ``<name>@<job>@<K>_<group>`` for a group of ``K`` workers
    (``<name>_<group>`` without a job)."""
    return f"{name}@{job}@{group_size}_{group}" if job else f"{name}_{group}"


def _fields(replica_id: str) -> list[str]:
    """``[name, job, K]`` of a replica id as torchft reports it (``...:<uuid>`` dropped)."""
    return replica_id.split(":", 1)[0].rpartition("_")[0].split("@")


def job_of(replica_id: str) -> str:
    """The job part of a replica id as torchft reports it (``<name>@<job>@<K>_<group>:<uuid>``)."""
    fields = _fields(replica_id)
    return fields[1] if len(fields) > 1 else ""


def group_size_of(replica_id: str) -> int | None:
    """The workers per group a replica id declares (``K``); None for an id without it."""
    fields = _fields(replica_id)
    return int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else None


def require_identity(job: str, secret: str, replica: str) -> None:
    """Refuse to join a quorum without a job id or a usable secret (``UsageError``, exit 2)."""
    if not job:
        raise UsageError(
            f"replica {replica} has no job id, so another job's replicas could join its quorum",
            f"launch with python -m elastic_train.quorum.launch (it sets one), or give every replica of "
            f"the job the same {JOB_VAR} (Slurm's SLURM_JOB_ID serves too)",
        )
    if len(secret) < MIN_SECRET_CHARS:
        raise UsageError(
            f"replica {replica}: {SECRET_VAR} is {'unset' if not secret else 'shorter than 16 characters'}; "
            "it signs the state a healing replica fetches",
            f"launch with python -m elastic_train.quorum.launch (it mints one), or give every replica of the job "
            f"the same random {SECRET_VAR}, e.g. "
            f"export {SECRET_VAR}=$(python -c 'import secrets; print(secrets.token_hex(16))')",
        )


def bind_address(advertised: str, environ: Mapping[str, str] = os.environ) -> str:
    """Where this host's quorum listeners bind: ``BIND_VAR``, else the address the advertised
    name resolves to here (IPv4 first). Not every interface: only the job's network reaches them.

    A name that resolves to loopback here (Debian maps the host name to 127.0.1.1) binds to
    loopback: set ``HOST_VAR`` to the address other hosts use.
    """
    override = environ.get(BIND_VAR)
    if override:
        return override
    try:
        infos = socket.getaddrinfo(advertised, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(
            f"the advertised host name {advertised!r} does not resolve on this host ({exc})",
            f"set {HOST_VAR} to this host's address (or {BIND_VAR} to the address to listen on)",
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def listen(address: str) -> socket.socket:
    """A listening TCP socket on ``address``, any free port: a store handed it (``TCPStore``'s
    ``master_listen_fd``) listens there only, where TCPStore itself would bind every interface."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(512)
    return listener


def resolves_to_loopback(host: str) -> bool:
    """True when ``host`` (a name or an address) means this host only: loopback, or a name
    whose every address here is loopback (``localhost``; Debian's 127.0.1.1 host name)."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(is_loopback(str(info[4][0])) for info in infos)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


class ForeignReplicaError(UsageError):
    """The Lighthouse put another job's replica in this replica's quorum."""


class GroupSizeError(UsageError):
    """The quorum holds replica groups with a different number of workers than this one's."""


class _GuardedClient:
    """torchft's ``ManagerClient`` with every quorum's member ids checked before it is used."""

    def __init__(self, client: Any, job: str, replica: str, lighthouse: str) -> None:
        self._client = client
        self._job = job
        self._replica = replica
        self._lighthouse = lighthouse
        self._group_size = group_size_of(replica)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        foreign = sorted(r for r in quorum.replica_ids if job_of(r) != self._job)
        if foreign:
            raise ForeignReplicaError(
                f"replica {self._replica} of job {self._job!r} was put in one quorum with "
                f"{', '.join(foreign)} (another job) by the Lighthouse at {self._lighthouse}; refusing to "
                "train with or heal from it",
                f"give each job its own Lighthouse (--lighthouse-port or --lighthouse), and every replica "
                f"of one job the same {JOB_VAR}",
            )
        declared = {r: group_size_of(r) for r in sorted(quorum.replica_ids)}
        other = {r: k for r, k in declared.items() if k != self._group_size}
        if other:
            sizes = ", ".join(
                f"{r} ({k} workers)" if k else f"{r} (no group size: another version)" for r, k in other.items()
            )
            raise GroupSizeError(
                f"replica {self._replica} is a group of {self._group_size} workers, but the quorum also holds "
                f"{sizes}; a worker averages with the worker of the same group rank in every other group, so "
                "every group must have the same size",
                "give every replica group the same number of workers (its torchrun's --nnodes x --nproc-per-node, "
                "fixed: not an elastic --nnodes range) and the same elastic-train",
            )
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def guard_quorum(manager: Any, job: str, replica: str, lighthouse: str) -> None:
    """Make ``manager`` refuse any quorum holding a replica of another job (see the module)."""
    manager._client = _GuardedClient(manager._client, job, replica, lighthouse)
