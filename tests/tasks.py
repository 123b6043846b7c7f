"""Small plug-in tasks the tests pass as ``--task tests.tasks:NAME`` (run from the repository root)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train import Task, TaskData


class _WithAnIdleBranch(nn.Module):
    """A classifier with a head the loss never uses: DDP cannot average its gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.idle = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _data() -> TaskData:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
    return TaskData(TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:]), description="idle-branch")


def idle_branch(cfg: Any) -> Task:
    return Task(name="idle-branch", data=_data, model=lambda _: _WithAnIdleBranch())


def idle_branch_declared(cfg: Any) -> Task:
    return Task(name="idle-branch", data=_data, model=lambda _: _WithAnIdleBranch(), find_unused_parameters=True)


def _regression_data() -> TaskData:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 4, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).squeeze(1)
    return TaskData(TensorDataset(x[:384], y[:384]), TensorDataset(x[384:], y[384:]), description="linear")


def regression(cfg: Any) -> Task:
    """A regression: no accuracy; early stop on val_loss going down to a target."""
    return Task(
        name="regression",
        data=_regression_data,
        model=lambda _: nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)),
        loss=nn.functional.mse_loss,
        correct=lambda outputs, targets: torch.zeros((), dtype=torch.float64),
        monitor="val_loss",
        mode="min",
        target=0.5,
        accuracy=False,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.05),
    )
