"""Models: two built-ins sized for small images, and any torchvision classifier by name.

``--model vit`` and ``--model resnet18`` are the seed's models. Their construction is pinned (the
same random draws, the same initial weights: tests/process/test_seed_path_pinned.py), so nothing
below touches their path.

``--model torchvision:<name>`` builds ``torchvision.models.get_model(name, weights=None,
num_classes=...)``: random initial weights (nothing is ever downloaded), the dataset's class
count, and the dataset's image size where the architecture takes one (ViT's ``image_size``,
MaxViT's ``input_size``). The other classifiers pool globally and take any image above their
minimum size. Only torchvision's classification registry is accepted: detection, segmentation,
video, optical-flow and quantized models do not fit a loop that trains on class labels.

Sharp edges:

* DDP (``gradient_as_bucket_view=True``, no unused-parameter search) needs every parameter in
  the loss and a tensor of logits out of the forward: the auxiliary heads of ``googlenet`` and
  ``inception_v3`` are therefore turned off (without them they only return named tuples while
  training, and their parameters would get no gradient).
* A torchvision model gets one trial forward pass of a zero image, on the CPU, right after it is
  built (``check_forward``): an image too small for the architecture is a usage error naming
  the smallest size it takes, before any training step. The pass leaves no trace (see there).
* BatchNorm cannot train on one value per channel: a per-process batch of one sample fails in
  models whose feature map has shrunk to 1x1 (e.g. shufflenet on 32x32 images).
"""

from __future__ import annotations

import difflib
import functools
import math
from typing import Any

import torch
from torch import nn

from elastic_train.config import TORCHVISION_PREFIX
from elastic_train.errors import UsageError

# torchvision is imported inside the builders: it costs ~2 s at start-up, which a run that is
# rejected for bad flags should not pay.

LIST_COMMAND = 'python -c "import torchvision; print(*torchvision.models.list_models(module=torchvision.models))"'

# Builders (by the torchvision module that defines them) whose architecture is built for one input
# size: they get the dataset's.
_SIZE_ARGUMENT = {"vision_transformer": "image_size", "maxvit": "input_size"}
# Auxiliary classifier heads: off, for DDP and a forward that returns logits (module docstring).
_FIXED_ARGUMENTS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception": {"aux_logits": False, "init_weights": True},
}
# What the registry's other model families are, by their torchvision sub-package.
_NOT_CLASSIFIERS = {
    "detection": "an object detection model",
    "segmentation": "a semantic segmentation model",
    "video": "a video model",
    "optical_flow": "an optical flow model",
    "quantization": "a quantized, inference-only model",
}


def vit(num_classes: int, image_size: int) -> nn.Module:
    """A small ViT: 8x8 patches grid (patch = image_size // 8), 4 layers, width 128 (~0.55 M params).
    torchvision's architecture and initial weights, built without importing torchvision
    (``elastic_train.vit`` says why)."""
    from elastic_train.vit import VisionTransformer

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
    """The ``--model`` ``name`` with ``num_classes`` outputs for ``image_size`` square images."""
    if name == "vit":
        return vit(num_classes, image_size)
    if name == "resnet18":
        return small_resnet18(num_classes, image_size)
    if name.startswith(TORCHVISION_PREFIX):
        return torchvision_model(registry_name(name), num_classes, image_size)
    raise UsageError(f"unknown --model {name!r}", "use vit, resnet18 or torchvision:NAME")


# ---------------------------------------------------------------------------------------- registry
@functools.cache
def classifiers() -> tuple[str, ...]:
    """The names of torchvision's classification models (its registry's top-level package)."""
    import torchvision.models

    return tuple(torchvision.models.list_models(module=torchvision.models))


def registry_name(model: str) -> str:
    """The registry name in ``--model torchvision:<name>``, once known to be a classifier.

    An unknown name is a usage error that lists the closest classifiers; a registered model of
    another kind (detection, segmentation, ...) is refused as such.
    """
    import torchvision
    import torchvision.models

    name = model.removeprefix(TORCHVISION_PREFIX)
    if name in classifiers():
        return name
    close = difflib.get_close_matches(name.lower(), classifiers(), n=4, cutoff=0.5)
    closest = ", ".join(TORCHVISION_PREFIX + c for c in close)
    list_all = f"list all classification models with: {LIST_COMMAND}"
    if name in torchvision.models.list_models():
        family = torchvision.models.get_model_builder(name).__module__.split(".")[2]
        kind = _NOT_CLASSIFIERS.get(family, f"not a classification model (torchvision.models.{family})")
        raise UsageError(
            f"--model {model} is {kind}; elastic-train trains image classifiers",
            f"pick a classification model{f' (closest: {closest})' if close else ''}; {list_all}",
        )
    raise UsageError(
        f"--model {model}: torchvision {torchvision.__version__} has no model named {name!r}",
        f"{f'did you mean {closest}? ' if close else ''}{list_all}",
    )


def documented_min_size(name: str) -> int:
    """The smallest image side torchvision documents for ``name`` (its weights' ``min_size``).

    For convolutional models it is the architecture's true minimum (measured: alexnet 63,
    inception_v3 75, densenet 29, squeezenet1_1 17, ...). For ViT, Swin and MaxViT it is the size of
    the pretrained weights, not a limit of the architecture.
    """
    import torchvision.models

    weights = torchvision.models.get_model_weights(name)
    sizes: list[int] = [max(entry.meta.get("min_size", (1, 1))) for entry in weights]
    return min(sizes)


# ---------------------------------------------------------------------------------------- building
def torchvision_model(name: str, num_classes: int, image_size: int) -> nn.Module:
    """torchvision's classifier ``name`` with random weights, ``num_classes`` outputs, for
    ``image_size`` square images; checked by one trial forward pass (``check_forward``)."""
    import torchvision.models

    family = torchvision.models.get_model_builder(name).__module__.rsplit(".", 1)[-1]
    arguments = dict(_FIXED_ARGUMENTS.get(family, {}))
    size_argument = _SIZE_ARGUMENT.get(family)
    if size_argument == "image_size":
        _check_patches(name, image_size)
        arguments["image_size"] = image_size
    elif size_argument == "input_size":
        arguments["input_size"] = (image_size, image_size)
    try:
        model: nn.Module = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **arguments)
    except (ValueError, AssertionError) as exc:  # how torchvision refuses a size in a constructor
        size = documented_min_size(name)
        raise UsageError(
            f"torchvision cannot build {name} for {image_size}x{image_size} images: {_first_line(exc)}",
            f"pass --image-size {size} (the size torchvision documents for it)",
        ) from exc
    check_forward(model, name, num_classes, image_size)
    return model


def _check_patches(name: str, image_size: int) -> None:
    """torchvision's ViTs are named for their patch size (vit_b_16) and need images it divides."""
    patch = int(name.rsplit("_", 1)[-1])
    if image_size % patch:
        above = math.ceil(image_size / patch) * patch
        below = f" or {above - patch}" if above > patch else ""
        raise UsageError(
            f"torchvision:{name} cuts images into {patch}x{patch} patches, which {image_size}x{image_size} "
            "images do not divide into",
            f"pass --image-size {above}{below} (a multiple of {patch}; images are resized to it)",
        )


def check_forward(model: nn.Module, name: str, num_classes: int, image_size: int) -> None:
    """One zero image through ``model``: UsageError if it is too small for the architecture, or
    if the output is not one row of ``num_classes`` logits.

    Leaves no trace, so the first training step is the same as without it: eval mode updates no
    BatchNorm statistics and draws no random numbers (dropout and stochastic depth are off), no
    autograd graph is kept, ``fork_rng`` restores the CPU generator all the same, and every module
    gets back its own training flag. Costs one forward pass on the CPU (~0.01-0.5 s on 32x32).
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            out = model(torch.zeros(1, 3, image_size, image_size))
    except (RuntimeError, ValueError, AssertionError) as exc:  # e.g. "Output size is too small"
        raise _too_small(name, image_size, exc) from exc
    finally:
        for module, training in modes:
            module.training = training
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, num_classes):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise UsageError(
            f"torchvision:{name} returns {got} for one image, not a row of {num_classes} class logits",
            "pick a model whose forward returns the class logits as a tensor",
        )


def _too_small(name: str, image_size: int, exc: BaseException) -> UsageError:
    size = documented_min_size(name)
    if size > image_size:
        return UsageError(
            f"torchvision:{name} needs images of at least {size}x{size}; the dataset's are "
            f"{image_size}x{image_size} ({_first_line(exc)})",
            f"pass --image-size {size} or more (images are resized to it)",
        )
    return UsageError(
        f"torchvision:{name} failed a trial forward pass on one {image_size}x{image_size} image: {_first_line(exc)}",
        "pass a larger --image-size, e.g. 224 (the size torchvision's ImageNet models are built for)",
    )


def _first_line(exc: BaseException) -> str:
    """torchvision's own words, as one clause of our message."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
