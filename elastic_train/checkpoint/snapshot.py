"""A training loop's state at a step boundary, captured for a save and restored after a load.

The public front of the checkpointer: ``capture`` turns a model, its optimizer and the rest of
a loop's state into a ``Snapshot`` (tensors by stable flat keys, the JSON rest typed as a
``Payload``); ``Checkpointer.save`` writes it sharded; ``Checkpointer.resume`` loads it back and
``restore`` puts every piece in place. The built-in trainer uses exactly these two functions.

What a snapshot holds, by key family (``checkpoint.state``):

* ``model.*`` and ``optim.state.*``: replicated under DDP, each written once by one rank;
  sharded under FSDP2 (DTensors), each rank writing its own piece (``Snapshot.sharded``);
* ``extra.*``: the loop's own replicated tensors (e.g. an EMA copy of the weights);
* ``rank.<r>.*``: this rank's alone: RNG streams and the loop's per-rank tensors (partial
  metric sums). They are restored only at the same world size; at another size a loop reads
  every old rank's values (``Restored.old_ranks``) and decides (the trainer folds sums).

What a save writes is the state as of ``capture``. The loop's own tensors (``extra``,
``per_rank``) and module buffers are cloned there: the loop changes them in place at any time
(running sums at the next batch, buffers in the next forward pass). Parameters and optimizer
state are not copied twice: for an async save (``sync=False``) they must not change until
``Checkpointer.wait_staged`` returns (call it before the optimizer step; ``Checkpointer.guard``
holds every in-place change to them back until then).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from elastic_train.checkpoint.format import Payload, check_json
from elastic_train.checkpoint.reshard import is_dtensor
from elastic_train.checkpoint.shard_plan import Box
from elastic_train.checkpoint.state import (
    MODEL,
    OPTIM,
    capture_rng,
    flatten,
    load_state_dicts,
    rank_items,
    restore_rng,
    state_dicts,
    unflatten,
)

EXTRA = "extra."


def _plain(value: Any) -> Any:
    """Tuples as lists (the optimizer's ``betas``: ``state.unflatten`` restores them)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Position:
    """Where a run stands: what a resumed run continues from. Plain integers, world-size free."""

    step: int  # optimizer steps completed, counted across epochs
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # global batches of epoch ``epoch`` already trained on
    finished: bool = False  # nothing left to train

    @property
    def key(self) -> tuple[int, int, int, bool]:
        return self.step, self.epoch, self.batch_in_epoch, self.finished


@dataclass(frozen=True)
class LocalPiece:
    """This rank's piece of a sharded tensor (a DTensor's local part) and where it lies in the
    global tensor. ``writes``: False on a rank whose piece another rank already saves (a
    replicated mesh dimension's coordinates other than 0) or whose piece is empty."""

    tensor: torch.Tensor  # the local part itself, not a copy (see the module doc)
    box: Box
    shape: tuple[int, ...]  # the global shape
    writes: bool


def _split_sharded(tensors: dict[str, torch.Tensor]) -> dict[str, LocalPiece]:
    """Move the DTensors out of ``tensors``, as this rank's pieces."""
    keys = [key for key, value in tensors.items() if is_dtensor(value)]
    if not keys:
        return {}
    from elastic_train.checkpoint.dtensor_boxes import local_box, writes_piece

    pieces = {}
    for key in keys:
        value = tensors.pop(key)
        if any(p.is_partial() for p in value.placements):  # type: ignore[attr-defined]
            raise ValueError(f"capture(): {key} is a partial sum (placement Partial), not a state to save")
        box = local_box(value)
        local = value.to_local()  # type: ignore[attr-defined]
        pieces[key] = LocalPiece(local, box, tuple(value.shape), writes_piece(value) and not box.empty)
    return pieces


@dataclass
class Snapshot:
    """What one rank hands to ``Checkpointer.save`` at a step boundary (see the module doc)."""

    position: Position
    replicated: dict[str, torch.Tensor]
    per_rank: dict[str, torch.Tensor]
    payload: Payload
    config: dict[str, Any] = field(default_factory=dict)
    # Keys of ``replicated`` whose authoritative copy is rank 0's (module buffers: see
    # ``state.assign_shards``); rank 0 writes them whatever the balance.
    from_rank0: frozenset[str] = frozenset()
    # Sharded tensors (FSDP2's DTensors): this rank's piece of each, by key. Every rank writes
    # its own piece; the manifest records each piece's box (format 4).
    sharded: dict[str, LocalPiece] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.position.step


class _StateDict(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


def capture(
    position: Position,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    scheduler: _StateDict | None = None,
    scaler: torch.amp.GradScaler | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
    per_rank: Mapping[str, torch.Tensor] | None = None,
    app: Mapping[str, Any] | None = None,
    accounting: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Snapshot:
    """This rank's state at a step boundary, ready for ``Checkpointer.save``.

    ``model`` is the bare module (not the DDP wrapper); ``extra`` replicated tensors of the
    loop's own; ``per_rank`` this rank's own tensors; ``app`` the loop's own JSON state (checked
    here, on every rank: a value JSON cannot hold raises ``ValueError`` before any collective);
    RNG streams (torch, CUDA on ``device``, numpy, python) are always captured. What a resumed
    run must share with this one is the ``Checkpointer``'s fingerprint, written with every save.

    ``extra`` and ``per_rank`` tensors (and module buffers) are cloned here, on their own device:
    the save writes their values as of this call, whatever the loop does to them afterwards.
    The clones cost their size once more on that device while the snapshot is held (an async
    save holds it until its commit): small for metric sums, a model's worth for an EMA copy of
    the weights. Parameters and optimizer state are referenced, not cloned: see the module doc.
    """
    model_sd, optim_sd = state_dicts(model, optimizer)
    replicated, optim_meta = flatten(model_sd, optim_sd)
    # Buffers (BatchNorm statistics) change in the next forward pass, before an async save's
    # copy is guaranteed done: clone them now (they are small). Each rank's differ (its own batch
    # updated them); DDP re-broadcasts rank 0's at the next forward, so rank 0's are saved.
    buffers = frozenset(MODEL + name for name, _ in model.named_buffers()) & replicated.keys()
    for key in buffers:
        replicated[key] = replicated[key].clone()
    # The loop's own tensors are cloned as well, whatever their size: nothing but the loop
    # orders its in-place updates (running sums bumped before ``wait_staged``) against a save's
    # copy or against ``save`` itself, and a batch saved twice is counted twice after a resume.
    # A CUDA tensor is cloned on its device, queued on the current stream (no sync), before the
    # event that an async save's copy waits for.
    for name, value in (extra or {}).items():
        replicated[EXTRA + name] = value.detach().clone()
    sharded = _split_sharded(replicated)
    rank_state = capture_rng(device)  # fresh tensors already
    for name, value in (per_rank or {}).items():
        if name.startswith("rng."):
            raise ValueError(f"per-rank state {name!r}: the rng. prefix is reserved for the RNG streams")
        rank_state[name] = value.detach().clone()
    scaler_state = scaler.state_dict() if scaler is not None and scaler.is_enabled() else None
    # Deep copies, for the reason the tensors are cloned: an async save writes the manifest at its
    # commit, steps later, and a loop may append to the lists it passed (``app={"history": h}``).
    payload = Payload(
        optimizer=optim_meta,
        scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        scaler=scaler_state or None,
        accounting=copy.deepcopy(dict(accounting)) if accounting is not None else None,
        app=copy.deepcopy(dict(app or {})),
    )
    # Checked here, on every rank, before any collective: a value the manifest cannot give back
    # would otherwise fail rank 0's commit, or come back changed (a tuple as a list).
    for what, part in (*asdict(payload).items(), ("config", config)):
        try:
            check_json(_plain(part), what)
        except ValueError as exc:
            raise ValueError(f"capture(): {exc}; pass plain JSON values") from None
    return Snapshot(
        position=position,
        replicated=replicated,
        per_rank=rank_state,
        payload=payload,
        config=copy.deepcopy(dict(config or {})),
        from_rank0=buffers,
        sharded=sharded,
    )


@dataclass(frozen=True)
class Restored:
    """What ``restore`` put back, and what only the loop can place."""

    position: Position
    payload: Payload
    extra: dict[str, torch.Tensor]  # the ``extra`` tensors of ``capture``
    saved_world_size: int
    # Each old rank's ``per_rank`` tensors (RNG streams left out), by old rank.
    old_ranks: list[dict[str, torch.Tensor]]
    rng_restored: bool  # False at another world size: per-rank streams cannot be split or merged

    @property
    def same_world_size(self) -> bool:
        return self.rng_restored


class _Loaded(Protocol):
    @property
    def tensors(self) -> dict[str, torch.Tensor]: ...

    def saved_keys(self) -> list[str]: ...

    def tensor(self, key: str, like: torch.Tensor | None = None) -> torch.Tensor: ...

    @property
    def position(self) -> Position: ...

    @property
    def payload(self) -> Payload: ...

    @property
    def world_size(self) -> int: ...


def restore(
    loaded: _Loaded,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    scheduler: _StateDict | None = None,
    scaler: torch.amp.GradScaler | None = None,
    extra_like: Mapping[str, torch.Tensor] | None = None,
) -> Restored:
    """Put a loaded checkpoint back: model (strict), optimizer (by parameter name), scheduler,
    scaler and, at the same world size, this rank's RNG streams. Returns the rest.

    Each model and optimizer tensor is placed as ``model`` holds it (``reshard.placed``): whole
    for a plain module, this rank's box for an FSDP2 one, whichever way it was saved and at any
    world size. ``extra_like``: the loop's current extra tensors, so that sharded ones come back
    as this rank's pieces too (else every extra tensor comes back whole)."""
    payload = loaded.payload
    model_sd, optim_sd = unflatten(_placed_state(loaded, model), payload.optimizer)
    load_state_dicts(model, optimizer, model_sd, optim_sd)
    if scheduler is not None and payload.scheduler is not None:
        scheduler.load_state_dict(payload.scheduler)
    if scaler is not None and payload.scaler:
        scaler.load_state_dict(payload.scaler)
    same = loaded.world_size == world_size
    if same:
        restore_rng(rank_items(loaded.tensors, rank), device)
    old_ranks = [
        {k: v for k, v in rank_items(loaded.tensors, r).items() if not k.startswith("rng.")}
        for r in range(loaded.world_size)
    ]
    likes = extra_like or {}
    names = [key[len(EXTRA) :] for key in loaded.saved_keys() if key.startswith(EXTRA)]
    extra = {name: loaded.tensor(EXTRA + name, likes.get(name)) for name in names}
    return Restored(loaded.position, payload, extra, loaded.world_size, old_ranks, same)


def _placed_state(loaded: _Loaded, model: nn.Module) -> dict[str, torch.Tensor]:
    """The saved model and optimizer tensors, each placed like its counterpart in ``model``:
    a model key like the module's state, an optimizer key like its parameter (moments have the
    parameter's shape; a scalar such as Adam's ``step`` comes back whole)."""
    state = model.state_dict()
    params = dict(model.named_parameters())
    out = {}
    for key in loaded.saved_keys():
        like: torch.Tensor | None = None
        if key.startswith(MODEL):
            like = state.get(key[len(MODEL) :])
        elif key.startswith(OPTIM):
            like = params.get(key[len(OPTIM) :].rpartition(".")[0])
        else:
            continue
        out[key] = loaded.tensor(key, like)
    return out
