"""torchvision models sized for small images; the class count follows the dataset."""

from __future__ import annotations

from torch import nn

from elastic_train.errors import UsageError

# torchvision is imported inside the builders: it costs ~2 s at start-up, which a run that is
# rejected for bad flags should not pay.


def vit(num_classes: int, image_size: int) -> nn.Module:
    """A small ViT: 8x8 patches grid (patch = image_size // 8), 4 layers, width 128 (~0.55 M params)."""
    from torchvision.models import VisionTransformer

    patch = max(1, image_size // 8)
    if image_size % patch:
        raise UsageError(
            f"--image-size {image_size} is not divisible by the ViT patch size {patch}",
            "use an image size that is a multiple of 8, e.g. 32 or 64",
        )
    model: nn.Module = VisionTransformer(
        image_size=image_size,
        patch_size=patch,
        num_layers=4,
        num_heads=4,
        hidden_dim=128,
        mlp_dim=256,
        num_classes=num_classes,
    )
    return model


def small_resnet18(num_classes: int, image_size: int) -> nn.Module:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool, the usual CIFAR-style adaptation."""
    from torchvision.models import resnet18

    del image_size  # global average pooling makes it size-agnostic
    model: nn.Module = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # type: ignore[assignment]
    return model


def build_model(name: str, num_classes: int, image_size: int) -> nn.Module:
    if name == "vit":
        return vit(num_classes, image_size)
    if name == "resnet18":
        return small_resnet18(num_classes, image_size)
    raise UsageError(f"unknown --model {name!r}", "use vit or resnet18")
