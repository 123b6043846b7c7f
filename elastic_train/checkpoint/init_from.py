"""``--init-from PATH``: start a run from given weights (the model only; a fresh optimizer).

PATH is a ``.safetensors`` file whose names are the model's own parameter and buffer names (what
``python -m elastic_train.ckpt export`` writes, or weights a user downloaded and converted), or
another run's checkpoint: a step folder, or a checkpoint directory (its ``latest``), verified as
a resume verifies it. The fit is strict: every tensor of the model must be there with its shape,
and nothing else; otherwise the run is refused naming the tensors (a classifier head of another
class count is a shape that does not fit: the message says which). It applies to a fresh start
only: a run that resumes its own checkpoint takes its weights from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from elastic_train.checkpoint.format import CheckpointInvalid, latest_target
from elastic_train.checkpoint.state import MODEL
from elastic_train.errors import UsageError

SHOWN = 5  # names listed per kind of misfit


def read_init_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights at ``path`` by model name. ``UsageError`` naming the problem when unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path.is_file():
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as exc:
            raise UsageError(
                f"--init-from {path} is not a readable safetensors file ({exc})",
                "pass a .safetensors file, a checkpoint folder or a checkpoint directory",
            ) from None
        return _strip_common_prefix(tensors)
    if path.is_dir():
        from elastic_train.checkpoint.manager import load

        folder = latest_target(path) or path
        try:
            loaded = load(folder)
        except (CheckpointInvalid, OSError) as exc:
            raise UsageError(
                f"--init-from {path}: {folder} is not a valid checkpoint ({exc})",
                "pass a step folder or a checkpoint directory with a `latest`, or a .safetensors file",
            ) from None
        return {k[len(MODEL) :]: v for k, v in loaded.whole(MODEL).items()}
    raise UsageError(f"--init-from {path} does not exist", "pass a .safetensors file or a checkpoint folder")


def _strip_common_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names saved from a wrapper (``module.`` of DDP, ``model.`` of our shards) as the bare model's."""
    for prefix in ("module.", MODEL):
        if tensors and all(k.startswith(prefix) for k in tensors):
            return {k[len(prefix) :]: v for k, v in tensors.items()}
    return tensors


def apply_init_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], source: Path) -> None:
    """Copy ``weights`` into ``model`` (in its dtypes, on its devices), or raise ``UsageError``
    listing every kind of misfit: tensors missing from the file, tensors the model lacks, shapes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [
        f"{k} (file {tuple(weights[k].shape)}, model {tuple(own[k].shape)})"
        for k in sorted(own)
        if k in weights and weights[k].shape != own[k].shape
    ]
    problems = [
        f"{what}: {', '.join(names[:SHOWN])}{f' and {len(names) - SHOWN} more' if len(names) > SHOWN else ''}"
        for what, names in (("missing from the file", missing), ("not in the model", unexpected), ("shapes", shapes))
        if names
    ]
    if problems:
        raise UsageError(
            f"--init-from {source} does not fit the model: " + "; ".join(problems),
            "pass weights of the same architecture and class count (e.g. `python -m elastic_train.ckpt export` "
            "of a run with the same --model), or convert the file's names to the model's",
        )
    with torch.no_grad():
        for name, value in own.items():
            value.copy_(weights[name].to(dtype=value.dtype))
