"""``elastic_train.vit`` is torchvision's VisionTransformer, bit for bit: the same parameters in the
same order from the same seed, the same outputs and gradients, interchangeable state dicts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torchvision.models import VisionTransformer as TorchvisionViT

from elastic_train.models import build_model
from elastic_train.vit import VisionTransformer

SHAPES = [
    # image, patch, layers, heads, width, mlp, classes: the built-in model and odd ones
    (32, 4, 4, 4, 128, 256, 10),
    (16, 2, 2, 2, 32, 48, 3),
    (24, 8, 1, 1, 16, 16, 7),
]


def both(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    image, patch, layers, heads, width, mlp, classes = shape
    kwargs = dict(image_size=image, patch_size=patch, num_layers=layers, num_heads=heads, hidden_dim=width, mlp_dim=mlp)
    torch.manual_seed(seed)
    ours = VisionTransformer(**kwargs, num_classes=classes)
    torch.manual_seed(seed)
    theirs = TorchvisionViT(**kwargs, num_classes=classes)
    return ours, theirs


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("shape", SHAPES)
def test_initial_weights_names_and_order_equal_torchvision(shape: tuple[int, ...]) -> None:
    ours, theirs = both(shape)
    assert_same_tensors(dict(ours.named_parameters()), dict(theirs.named_parameters()))
    assert_same_tensors(ours.state_dict(), theirs.state_dict())
    # Each module's recorded version too (a load into either runs the same key migrations).
    assert ours.state_dict()._metadata == theirs.state_dict()._metadata  # type: ignore[attr-defined]
    # The generator is left where torchvision leaves it: later draws (data order, dropout) match.
    torch.manual_seed(0)
    VisionTransformer(*shape[:6], num_classes=shape[6])
    after_ours = torch.rand(8)
    torch.manual_seed(0)
    TorchvisionViT(*shape[:6], num_classes=shape[6])
    assert torch.equal(after_ours, torch.rand(8))


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_are_bitwise_equal_in_train_and_eval(shape: tuple[int, ...]) -> None:
    ours, theirs = both(shape, seed=3)
    # Non-zero heads, so the gradients reach every layer.
    for model in (ours, theirs):
        torch.manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    images = torch.randn(5, 3, shape[0], shape[0], generator=torch.Generator().manual_seed(1))
    for model in (ours, theirs):
        model.train()
        model(images).square().sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), name
    with torch.no_grad():
        ours.eval()
        theirs.eval()
        assert torch.equal(ours(images), theirs(images))  # eval takes MultiheadAttention's fast path


def test_state_dicts_load_across_the_two() -> None:
    ours, theirs = both(SHAPES[1], seed=1)
    _, other = both(SHAPES[1], seed=2)
    ours.load_state_dict(other.state_dict())
    assert_same_tensors(ours.state_dict(), other.state_dict())
    theirs.load_state_dict(ours.state_dict())


def test_a_wrong_image_size_is_an_error_naming_both_sizes() -> None:
    ours, _ = both(SHAPES[1])
    with pytest.raises(ValueError, match="expected 16x16 images, got 8x8"):
        ours(torch.zeros(1, 3, 8, 8))


def test_the_built_in_model_does_not_import_torchvision() -> None:
    # The point of the module: a worker that trains --model vit never pays for torchvision.
    probe = (
        "import sys; from elastic_train.models import build_model; build_model('vit', 10, 32); "
        "print('torchvision' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
    assert isinstance(build_model("vit", 10, 32), VisionTransformer)
