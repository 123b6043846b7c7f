"""The tests' port picker (``elastic_train.testing.processes.free_port``)."""

from __future__ import annotations

import random
import socket

import pytest

from elastic_train.testing import processes
from elastic_train.testing.processes import free_port


def test_a_free_port_lies_below_the_range_outgoing_connections_draw_from_and_can_be_bound() -> None:
    low, _ = processes._ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert processes._LOWEST_PORT <= port < low and port not in processes._DEFAULT_PORTS
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def draw_in_turn(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> None:
    """free_port's random draws return ``ports``, in turn."""
    draws = iter(ports)

    class Draw:
        @staticmethod
        def randrange(*_: int) -> int:
            return next(draws)

    monkeypatch.setattr(processes.secrets, "SystemRandom", Draw)


def test_a_port_held_by_a_listener_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = free_port()
    with socket.create_server(("127.0.0.1", taken)):
        other = free_port()  # not ``taken``: that one is held now
        monkeypatch.setattr(processes, "_handed_out", set())  # only the listener keeps ``taken`` out
        draw_in_turn(monkeypatch, [taken, taken, other])
        assert free_port() == other


def test_a_port_handed_out_before_is_never_given_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing holds a port between the draw and the child's bind: an etcd cluster's six ports,
    drawn in a row, once held one twice (two members failed to bind it)."""
    first, second = free_port(), free_port()
    monkeypatch.setattr(processes, "_handed_out", set())
    draw_in_turn(monkeypatch, [first, first, second])
    assert free_port() == first
    assert free_port() == second  # ``first`` came again and bound fine, but it was handed out


def test_the_draw_does_not_follow_the_seeded_global_random(monkeypatch: pytest.MonkeyPatch) -> None:
    """hypothesis seeds ``random`` the same in both test lanes: their draws would collide."""
    for name in ("randrange", "randint", "choice", "random"):
        monkeypatch.setattr(random, name, lambda *_: pytest.fail("free_port drew from the global random state"))
    random.seed(0)
    first = free_port()
    random.seed(0)
    assert {first, free_port()} <= set(range(processes._LOWEST_PORT, processes._ephemeral_range()[0]))
