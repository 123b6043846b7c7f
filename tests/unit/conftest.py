"""Fixtures of the unit layer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-process gloo group on an in-memory store: the collectives a real run issues, with no
    subprocess (the checkpointer, the step boundary and the data opening need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
