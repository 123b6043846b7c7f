"""``--model torchvision:<name>``: resolved in torchvision's classification registry, sized for the
dataset, refused with the fix when it cannot train here; the built-in models untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision.models
from torch import nn

from elastic_train import models
from elastic_train.cli import check_inputs, parse_config
from elastic_train.config import TrainConfig
from elastic_train.errors import UsageError
from elastic_train.models import build_model, check_forward, registry_name


def usage_error(model: str, num_classes: int = 10, image_size: int = 32) -> str:
    with pytest.raises(UsageError) as info:
        build_model(model, num_classes, image_size)
    return str(info.value)


# ------------------------------------------------------------------------------------ the flag
@pytest.mark.parametrize("model", ["vit", "resnet18", "torchvision:mobilenet_v3_small", "torchvision:vit_b_16"])
def test_the_model_flag_takes_the_builtins_and_torchvision_names(model: str) -> None:
    assert parse_config(["--model", model]).model == model


@pytest.mark.parametrize("model", ["gpt2", "torchvision:", "torchvision:resnet-18", "torchvision:a b", "tv:resnet50"])
def test_a_model_flag_of_another_form_is_refused_listing_the_forms(model: str) -> None:
    with pytest.raises(UsageError) as parsed:
        parse_config(["--model", model])
    assert f"invalid choice: {model!r}" in str(parsed.value) and "torchvision:NAME" in str(parsed.value)
    with pytest.raises(UsageError) as built:
        TrainConfig(model=model)
    assert "vit, resnet18 or torchvision:NAME" in str(built.value) and "Fix:" in str(built.value)


# ------------------------------------------------------------------------------------ the registry
@pytest.mark.parametrize(
    ("name", "closest"),
    [("mobilenet_v3_smal", "torchvision:mobilenet_v3_small"), ("ResNet50", "torchvision:resnet50")],
)
def test_an_unknown_name_lists_the_closest_classifiers_and_how_to_list_all(name: str, closest: str) -> None:
    message = usage_error(f"torchvision:{name}")
    assert f"has no model named {name!r}" in message
    assert f"did you mean {closest}" in message
    assert "torchvision.models.list_models(module=torchvision.models)" in message


def test_a_name_like_nothing_in_the_registry_still_says_how_to_list_them() -> None:
    message = usage_error("torchvision:xyzzy")
    assert "did you mean" not in message and "list_models" in message


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("fasterrcnn_resnet50_fpn", "an object detection model"),
        ("deeplabv3_resnet50", "a semantic segmentation model"),
        ("r3d_18", "a video model"),
        ("raft_small", "an optical flow model"),
        ("quantized_resnet18", "a quantized, inference-only model"),
    ],
)
def test_registered_models_that_are_not_classifiers_are_refused_as_such(name: str, kind: str) -> None:
    assert name in torchvision.models.list_models()
    message = usage_error(f"torchvision:{name}")
    assert f"--model torchvision:{name} is {kind}; elastic-train trains image classifiers" in message
    assert "pick a classification model" in message


def test_an_unknown_name_is_refused_at_input_checking_before_any_process_group() -> None:
    with pytest.raises(UsageError, match="has no model named 'mobilenetv3'"):
        check_inputs(TrainConfig(model="torchvision:mobilenetv3"))
    check_inputs(TrainConfig(model="torchvision:mobilenet_v3_small"))  # a known name passes


def test_every_registry_classifier_is_accepted_by_the_flag() -> None:
    for name in torchvision.models.list_models(module=torchvision.models):
        assert registry_name(TrainConfig(model=f"torchvision:{name}").model) == name


# ------------------------------------------------------------------------------------ building
def train_step_outputs(model: nn.Module, image_size: int) -> torch.Tensor:
    """Logits of a training-mode forward of two images, after one backward of their sum."""
    model.train()
    out = model(torch.randn(2, 3, image_size, image_size))
    assert isinstance(out, torch.Tensor), f"training forward returned {type(out).__name__}"
    out.sum().backward()
    return out


@pytest.mark.parametrize(
    ("name", "image_size"),
    [
        ("mobilenet_v3_small", 32),
        ("squeezenet1_0", 32),
        ("shufflenet_v2_x0_5", 32),
        ("efficientnet_b0", 32),
        ("googlenet", 32),  # aux heads off
        ("inception_v3", 75),  # aux head off; its minimum size
    ],
)
def test_a_torchvision_model_trains_with_the_datasets_classes_and_every_parameter_gets_a_gradient(
    name: str, image_size: int
) -> None:
    model = build_model(f"torchvision:{name}", 7, image_size)
    out = train_step_outputs(model, image_size)
    assert out.shape == (2, 7)
    # DDP without an unused-parameter search needs every parameter in the loss.
    no_grad = [key for key, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f"parameters without a gradient: {no_grad[:5]}"


def test_a_vit_is_built_for_the_datasets_image_size() -> None:
    model = build_model("torchvision:vit_b_32", 10, 64)  # 2x2 patches
    assert model.image_size == 64
    assert train_step_outputs(model, 64).shape == (2, 10)


def test_weights_are_never_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = torchvision.models.get_model

    def spy(name: str, **kwargs: Any) -> nn.Module:
        calls.append(kwargs)
        model: nn.Module = real(name, **kwargs)
        return model

    monkeypatch.setattr(torchvision.models, "get_model", spy)
    build_model("torchvision:squeezenet1_1", 10, 32)
    assert calls and all("weights" in c and c["weights"] is None for c in calls)


# ------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize(
    ("name", "image_size", "minimum"), [("squeezenet1_1", 16, 17), ("densenet121", 16, 29), ("alexnet", 32, 63)]
)
def test_an_image_below_the_architectures_minimum_is_refused_naming_the_minimum(
    name: str, image_size: int, minimum: int
) -> None:
    message = usage_error(f"torchvision:{name}", image_size=image_size)
    assert f"needs images of at least {minimum}x{minimum}; the dataset's are {image_size}x{image_size}" in message
    assert f"Fix: pass --image-size {minimum} or more" in message
    build_model(f"torchvision:{name}", 10, minimum)  # and the minimum it names does work


def test_a_vit_whose_patches_do_not_divide_the_image_is_refused_with_sizes_that_do() -> None:
    message = usage_error("torchvision:vit_b_16", image_size=40)
    assert "cuts images into 16x16 patches, which 40x40 images do not divide into" in message
    assert "Fix: pass --image-size 48 or 32 (a multiple of 16" in message


def test_a_size_the_constructor_refuses_is_a_usage_error_with_the_documented_size() -> None:
    message = usage_error("torchvision:maxvit_t", image_size=32)
    assert "torchvision cannot build maxvit_t for 32x32 images: Input size (8, 8)" in message
    assert "Fix: pass --image-size 224" in message


# ------------------------------------------------------------------------------------ the trial forward
@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0"])  # BatchNorm, dropout, stochastic depth
def test_the_trial_forward_draws_no_random_numbers_and_changes_no_state(name: str) -> None:
    torch.manual_seed(3)
    reference = torchvision.models.get_model(name, weights=None, num_classes=10)
    rng_after_construction = torch.get_rng_state()
    torch.manual_seed(3)
    model = build_model(f"torchvision:{name}", 10, 32)
    assert torch.equal(torch.get_rng_state(), rng_after_construction)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "weights or BatchNorm statistics changed"
    assert all(m.training for m in model.modules()), "training mode not restored"


def test_the_trial_forward_gives_each_module_back_its_own_mode() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    model[1].eval()  # e.g. a frozen normalisation layer
    check_forward(model, "custom", 5, 8)
    assert [m.training for m in model] == [True, False, True, True, True] and model.training


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(x.mean(dim=(2, 3)))
        return logits, logits


def test_a_model_that_does_not_return_a_row_of_logits_is_refused() -> None:
    with pytest.raises(UsageError, match="returns tuple for one image, not a row of 5 class logits"):
        check_forward(_Pair(), "pair", 5, 8)
    with pytest.raises(UsageError, match=r"returns shape \(1, 5\) for one image, not a row of 6 class logits"):
        check_forward(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 5)), "linear", 6, 8)


# ------------------------------------------------------------------------------------ the built-ins
def test_the_builtin_models_do_not_take_the_trial_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    # Their random draws and initial weights are pinned (tests/process/test_seed_path_pinned.py).
    def refuse(*args: object) -> None:
        raise AssertionError("the trial forward ran for a built-in model")

    monkeypatch.setattr(models, "check_forward", refuse)
    torch.manual_seed(0)
    vit = build_model("vit", 10, 32)
    rng_after_vit = torch.get_rng_state()
    torch.manual_seed(0)
    assert torch.equal(models.vit(10, 32).state_dict()["heads.head.weight"], vit.state_dict()["heads.head.weight"])
    assert torch.equal(torch.get_rng_state(), rng_after_vit)
    assert isinstance(build_model("resnet18", 10, 32).conv1, nn.Conv2d)
