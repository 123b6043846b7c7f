"""``--init-from``: weights from a safetensors file, strict fit, misfits named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from elastic_train.checkpoint.init_from import apply_init_weights, read_init_weights
from elastic_train.errors import UsageError


def net(classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, classes))


def test_weights_from_a_file_load_exactly_buffers_included_whatever_the_wrapper_prefix(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = net()
    source[1].running_mean.fill_(0.25)
    for prefix in ("", "module.", "model."):
        path = tmp_path / f"w{prefix}.safetensors"
        save_file({prefix + k: v.contiguous() for k, v in source.state_dict().items()}, path)
        torch.manual_seed(2)
        target = net()
        apply_init_weights(target, read_init_weights(path), path)
        for name, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[name], value), (prefix, name)


def test_weights_in_another_dtype_are_cast_to_the_models(tmp_path: Path) -> None:
    source = net()
    path = tmp_path / "half.safetensors"
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in source.state_dict().items()}, path)
    target = net()
    apply_init_weights(target, read_init_weights(path), path)
    assert target[0].weight.dtype == torch.float32
    assert torch.equal(target[0].weight, source[0].weight.to(torch.float16).to(torch.float32))


def test_a_misfit_is_refused_naming_every_kind(tmp_path: Path) -> None:
    weights = {k: v for k, v in net(classes=10).state_dict().items() if not k.startswith("0.")}
    weights["head.extra"] = torch.zeros(1)
    path = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, path)
    target = net(classes=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(UsageError) as info:
        apply_init_weights(target, read_init_weights(path), path)
    text = str(info.value)
    assert "missing from the file: 0.bias, 0.weight" in text
    assert "not in the model: head.extra" in text
    assert "3.weight (file (10, 8), model (3, 8))" in text and "Fix:" in text
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items()), "a refused file changed the model"


def test_an_unreadable_or_missing_source_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(UsageError, match="not a readable safetensors file"):
        read_init_weights(tmp_path / "junk.safetensors")
    with pytest.raises(UsageError, match="does not exist"):
        read_init_weights(tmp_path / "nothing-here")
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(UsageError, match="is not a valid checkpoint"):
        read_init_weights(tmp_path / "empty-dir")
