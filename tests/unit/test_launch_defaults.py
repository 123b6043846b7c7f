"""The warm launcher's one default that differs from torchrun's: a short last call for node ranges."""

from __future__ import annotations

import pytest

from elastic_train.launch import SHORT_LAST_CALL_S, with_short_last_call


@pytest.mark.parametrize(
    ("nnodes", "conf", "expected"),
    [
        ("1:2", "", f"last_call_timeout={SHORT_LAST_CALL_S}"),
        ("1:4", "is_host=true", f"is_host=true,last_call_timeout={SHORT_LAST_CALL_S}"),
        ("1:2", "last_call_timeout=30", "last_call_timeout=30"),  # the user's own value stands
        ("2", "", ""),  # a fixed node count has no last call
        ("2:2", "join_timeout=60", "join_timeout=60"),
    ],
)
def test_an_elastic_node_range_gets_a_short_last_call_unless_the_user_set_one(
    nnodes: str, conf: str, expected: str
) -> None:
    assert with_short_last_call(nnodes, conf) == expected
