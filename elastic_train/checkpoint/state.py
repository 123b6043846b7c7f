"""Training state <-> flat ``{key: tensor}`` dicts and JSON, and who writes which tensor.

Keys are flat and stable:

* ``model.<fqn>``: model parameters and buffers (FQNs of the bare module, no ``module.``);
* ``optim.state.<fqn>.<name>``: optimizer state per parameter (e.g. ``exp_avg``, ``step``);
* ``rank.<r>.<name>``: state of rank ``r`` alone (RNG streams, partial-epoch metric sums).

Model and optimizer state are replicated under DDP; each such tensor is written once, by the rank
``assign_shards`` picks (greedy by bytes, so writes run in parallel and balance). Per-rank
tensors go into their own rank's shard. Non-tensor values (optimizer param groups, hyper-
parameters) go to the manifest as JSON: nothing is ever pickled.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

MODEL = "model."
OPTIM = "optim.state."
RANK = "rank."


def assign_shards(sizes: dict[str, int], world_size: int, pinned: Mapping[str, int] | None = None) -> dict[str, int]:
    """Map each key to a rank: ``pinned`` keys to their rank, then the others largest first,
    each to the least-loaded rank (ties: lowest rank).

    Deterministic for a given ``sizes``; without pins the byte loads of any two ranks differ by
    at most the largest tensor. Pins exist for state whose replicas differ between ranks at a
    step boundary although DDP treats them as replicated: module buffers (BatchNorm running
    statistics) are updated by each rank's own forward pass and re-broadcast from rank 0 at the
    next one, so rank 0's copy is the one the run continues with and the one to save.
    """
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for key, rank in (pinned or {}).items():
        if key in sizes:
            owner[key] = rank
            loads[rank] += sizes[key]
    for key in sorted((k for k in sizes if k not in owner), key=lambda k: (-sizes[k], k)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[key] = rank
        loads[rank] += sizes[key]
    return owner


def _param_fqns(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The FQN of each parameter in the optimizer's own numbering (param groups in order)."""
    names = {id(p): name for name, p in module.named_parameters()}
    try:
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    except KeyError:
        raise ValueError(
            "the optimizer holds a parameter that is not the module's (under FSDP2: a forward without "
            "backward left the parameters gathered; call reshard_all(model) before capture)"
        ) from None


def state_dicts(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state with the optimizer's parameters named by FQN, not by index.

    The same layout as ``torch.distributed.checkpoint.state_dict.get_state_dict`` for a module
    that is not sharded (DDP's replicas; a test holds the two equal), without importing it: that
    module costs ~0.6 s of every worker's start-up, i.e. of every restart.
    """
    fqns = _param_fqns(module, optimizer)
    raw = optimizer.state_dict()
    state = {fqns[index]: value for index, value in raw["state"].items()}
    groups = [{**group, "params": [fqns[i] for i in group["params"]]} for group in raw["param_groups"]]
    return module.state_dict(), {"state": state, "param_groups": groups}


def load_state_dicts(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """The inverse of ``state_dicts``: strict for the model, FQNs mapped back to indices."""
    module.load_state_dict(model_sd)
    index = {fqn: i for i, fqn in enumerate(_param_fqns(module, optimizer))}
    try:
        raw = {
            "state": {index[fqn]: value for fqn, value in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in optim_sd["param_groups"]],
        }
    except KeyError as exc:
        raise ValueError(f"optimizer state names a parameter this model does not have: {exc}") from None
    optimizer.load_state_dict(raw)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def flatten(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flat tensors and the JSON-able rest (param groups, non-tensor optimizer state)."""
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, dict[str, Any]] = {}
    for fqn, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model state {fqn!r} is not a tensor ({type(value).__name__})")
        tensors[MODEL + fqn] = value
    for fqn, per_param in optim_sd.get("state", {}).items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM}{fqn}.{name}"] = value
            else:
                extra.setdefault(fqn, {})[name] = _json_value(value)
    groups = [{k: _json_value(v) for k, v in group.items()} for group in optim_sd.get("param_groups", [])]
    return tensors, {"param_groups": groups, "optim_extra": extra}


def unflatten(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    model_sd = {k[len(MODEL) :]: v for k, v in tensors.items() if k.startswith(MODEL)}
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIM):
            fqn, _, name = key[len(OPTIM) :].rpartition(".")
            state.setdefault(fqn, {})[name] = value
    for fqn, values in meta.get("optim_extra", {}).items():
        state.setdefault(fqn, {}).update(values)
    groups = []
    for group in meta.get("param_groups", []):
        restored = dict(group)
        if isinstance(restored.get("betas"), list):
            restored["betas"] = tuple(restored["betas"])
        groups.append(restored)
    return model_sd, {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------- per-rank RNG
def capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """Every RNG stream of this process as tensors (torch CPU/CUDA, numpy, python)."""
    np_state: tuple[Any, ...] = np.random.get_state()  # type: ignore[assignment]
    py_version, py_internal, py_gauss = random.getstate()
    out = {
        "rng.torch": torch.get_rng_state(),
        "rng.numpy.keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "rng.numpy.meta": torch.tensor([np_state[2], np_state[3], np_state[4]], dtype=torch.float64),
        "rng.python.state": torch.tensor(py_internal, dtype=torch.int64),
        "rng.python.meta": torch.tensor(
            [py_version, 0.0 if py_gauss is None else 1.0, py_gauss or 0.0], dtype=torch.float64
        ),
    }
    if device.type == "cuda":
        out["rng.cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["rng.torch"])
    keys = state["rng.numpy.keys"].numpy().astype(np.uint32)
    pos, has_gauss, cached = state["rng.numpy.meta"].tolist()
    np.random.set_state(("MT19937", keys, int(pos), int(has_gauss), float(cached)))
    version, has_py_gauss, py_gauss = state["rng.python.meta"].tolist()
    internal = tuple(int(v) for v in state["rng.python.state"].tolist())
    random.setstate((int(version), internal, py_gauss if has_py_gauss else None))
    if device.type == "cuda" and "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"], device)


def rank_key(rank: int, name: str) -> str:
    return f"{RANK}{rank}.{name}"


def rank_items(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    prefix = f"{RANK}{rank}."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
