"""Process-group lifetime and the few collectives the trainer needs.

Every process, even a lone one, gets a process group, so the trainer has one code path: a
single process uses an in-memory store and a world of one. The group is always destroyed in
``finally`` (the seed's rule) so no rank lingers on a dead peer.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist
from tenacity import (
    RetryCallState,
    retry,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from elastic_train.distributed.env import DistEnv
from elastic_train.distributed.round import agree_round
from elastic_train.errors import UsageError

log = structlog.get_logger(__name__)

# Attempts to connect to the rendezvous store before giving up. Each attempt itself waits up to
# the store's own connect timeout; the waits between attempts are jittered so that hundreds of
# ranks do not hammer a store that just came back. Override: ELASTIC_TRAIN_INIT_ATTEMPTS.
DEFAULT_INIT_ATTEMPTS = 5


@dataclass(frozen=True)
class Placement:
    """The device this rank computes on and the matching collective backend."""

    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def choose_placement(requested: str, env: DistEnv) -> Placement:
    """Map ``--device`` to a device bound by LOCAL_RANK and a backend (nccl on CUDA, gloo on CPU)."""
    cuda_ok = torch.cuda.is_available()
    if requested == "cuda" and not cuda_ok:
        raise UsageError("--device cuda was requested but CUDA is not available", "use --device cpu or auto")
    if requested == "cpu" or (requested == "auto" and not cuda_ok):
        return Placement(torch.device("cpu"), "gloo")
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise UsageError(
            f"LOCAL_RANK={env.local_rank} but only {count} CUDA device(s) are visible",
            "launch at most one process per GPU (torchrun --nproc_per_node=<GPUs on the node>)",
        )
    return Placement(torch.device("cuda", env.local_rank), "nccl")


def _is_connection_error(exc: BaseException) -> bool:
    # Only store/socket connection failures are worth retrying: a wrong config fails every time.
    if isinstance(exc, (dist.DistNetworkError, dist.DistStoreError, ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, RuntimeError) and "connect" in str(exc).lower()


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("process_group_init_retry", attempt=state.attempt_number, error=repr(exc))


def init_attempts() -> int:
    return max(1, int(os.environ.get("ELASTIC_TRAIN_INIT_ATTEMPTS", DEFAULT_INIT_ATTEMPTS)))


def _connect_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:  # type: ignore[name-defined]
    """env:// (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set by torchrun): the store, rank, world."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))  # type: ignore[attr-defined]
    return store, int(rank), int(world_size)


def init_process_group(env: DistEnv, placement: Placement, timeout_s: float) -> None:
    """Join the process group.

    Only the connection to the store is retried (bounded, jittered waits): it is idempotent and
    rank-local. The round agreement and the group's creation are collective: a rank retrying
    them alone would wait for peers that have moved on, so a failure there ends the attempt and
    torchrun restarts the group. ``timeout_s`` bounds every later collective
    (``--collective-timeout``): a dead peer turns into an error after that long instead of the
    backend default of 30 minutes.
    """
    if placement.is_cuda:
        torch.cuda.set_device(placement.device)
    timeout = datetime.timedelta(seconds=timeout_s)
    device_id = placement.device if placement.is_cuda else None
    if env.launched:
        connect = retry(
            retry=retry_if_exception(_is_connection_error),
            stop=stop_after_attempt(init_attempts()),
            wait=wait_random_exponential(multiplier=0.5, max=10.0),
            before_sleep=_log_retry,
            reraise=True,
        )(_connect_store)
        store, rank, world_size = connect(timeout)
        # The group's keys go under a prefix this round's ranks agree on (distributed/round.py):
        # torchrun's default shared store keeps earlier rounds' keys.
        prefix = agree_round(store, rank, world_size, timeout_s)
        dist.init_process_group(
            placement.backend,
            store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
    else:
        dist.init_process_group(
            placement.backend,
            store=dist.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
    log.info("process_group_ready", backend=placement.backend, device=str(placement.device))


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(env: DistEnv, placement: Placement, timeout_s: float) -> Iterator[None]:
    """``init_process_group`` ... ``destroy_process_group()`` in ``finally``.

    On success every rank meets at a barrier first: no rank tears down its end of the group (or,
    in a plain launch, rank 0 the store) while a peer is still finishing its last collective.
    After an exception there is no barrier (the peer we would wait for may be dead) and an NCCL
    group is aborted first: destroying it would wait for collectives that can never finish.
    """
    clean = False
    try:
        init_process_group(env, placement, timeout_s)
        yield
        barrier(placement)
        clean = True
    finally:
        gc.collect()  # release DDP reducers and pending work objects that still reference the group
        if not clean:
            abort_process_group(placement)
        destroy_process_group()


def abort_process_group(placement: Placement) -> None:
    """Abort every NCCL communicator of this process (no-op for gloo, whose sockets just close)."""
    if placement.backend != "nccl" or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:  # best effort on the way out: the process is ending anyway
        log.warning("process_group_abort_failed", error=repr(exc))


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def broadcast_flag(flag: bool, device: torch.device, src: int = 0) -> bool:
    """Rank ``src`` decides; every rank returns the same answer."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.broadcast(t, src=src)
    return bool(t.item())


def broadcast_error(message: str | None, src: int = 0) -> str | None:
    """Share rank ``src``'s error message (or None) so every rank can fail the same way."""
    shared: str | None = broadcast_json(message, src=src)
    return shared


# Small values that ranks share (errors, a dataset's identity) travel as JSON (ASCII) in uint8
# tensors, never through torch's *_object collectives: those pickle, and unpickling what arrives
# from the network runs whatever the sender chose. The channel is still the job's own process
# group, which torch does not authenticate: a receiver checks what a value may name (e.g. the
# checkpointer's folders). A length beyond this bound is refused unread, on every rank (the
# sender too, so no rank goes on into the payload's collective alone); real values are KB to MB.
MAX_JSON_BYTES = 64 << 20


def _object_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current GPU under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encoded(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decoded(payload: torch.Tensor) -> Any:
    return json.loads(payload.cpu().numpy().tobytes().decode())


def _checked_lengths(sizes: torch.Tensor, senders: list[int]) -> list[int]:
    """The announced lengths (one device-to-host copy for all), each within ``MAX_JSON_BYTES``."""
    lengths: list[int] = sizes.cpu().tolist()
    for sender, length in zip(senders, lengths, strict=True):
        if not 0 <= length <= MAX_JSON_BYTES:
            raise RuntimeError(
                f"rank {sender} announced {length} bytes of JSON (at most {MAX_JSON_BYTES}): refused unread"
            )
    return lengths


def broadcast_json(value: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Rank ``src``'s JSON value (the others' ``value`` is ignored), on every rank of ``group``:
    its length, then its bytes. ``src`` is a global rank, as in ``dist.broadcast``. Collective;
    doubles as a barrier behind ``src``."""
    device = _object_device(group)
    payload = _encoded(value).to(device) if dist.get_rank() == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    (length,) = _checked_lengths(size, [src])
    if payload is None:
        payload = torch.empty(length, dtype=torch.uint8, device=device)
    if length:
        dist.broadcast(payload, src=src, group=group)
    return _decoded(payload)


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON value, in the group's rank order, on every rank of ``group``. Collective."""
    device = _object_device(group)
    mine = _encoded(value).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    lengths = _checked_lengths(torch.cat(sizes), list(range(world)))
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [_decoded(payload[:length]) for payload, length in zip(gathered, lengths, strict=True)]


def barrier(placement: Placement) -> None:
    if placement.is_cuda:
        dist.barrier(device_ids=[placement.device.index])
    else:
        dist.barrier()


class ControlPlane:
    """Small decisions every rank must agree on at a step boundary (stop? save now? all shards
    durable?), as a MAX all-reduce of a few small integers.

    The exchange runs on a gloo group of its own, as CPU tensors: it never waits for queued GPU
    work and never interleaves with DDP's gradient all-reduces. ``post`` starts it without
    waiting and ``collect`` (at the next boundary) returns its result, so the per-step agreement
    costs the training loop nothing while the step computes; decisions take effect one step
    later, at the same step on every rank. ``agree`` is the synchronous form. Collective: every
    rank must call these in the same order.
    """

    def __init__(self) -> None:
        group = dist.new_group(backend="gloo")
        self.group: dist.ProcessGroup | None = group if isinstance(group, dist.ProcessGroup) else None
        self._posted: tuple[dist.Work, torch.Tensor] | None = None

    def agree(self, values: Sequence[int]) -> list[int]:
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def post(self, values: Sequence[int]) -> None:
        assert self._posted is None, "collect() the previous agreement first"
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        self._posted = (work, t)

    def collect(self) -> list[int] | None:
        """The result of the last ``post`` (None if nothing is posted)."""
        if self._posted is None:
            return None
        work, t = self._posted
        self._posted = None
        work.wait()
        return [int(v) for v in t.tolist()]
