"""GroupWatch (issue 20): a worker of a replica group leaves when a peer of its group goes silent.

With one group rank frozen, the group's rank 0 keeps heartbeating to the Lighthouse, which then
will not form a quorum from the other groups alone (a minority of the groups it sees healthy):
the live workers of the frozen group must leave themselves, within the silence bound.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from elastic_train.quorum.group_watch import GroupWatch


class Silence:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.event = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.event.set()


def test_live_peers_are_never_reported_and_a_frozen_one_is_within_its_bound() -> None:
    store = dist.HashStore()
    silent = [Silence() for _ in range(3)]
    watches = [
        GroupWatch(store, 0, r, 3, silence_s=0.5, on_silent=silent[r], kill_silent_peer=False).start() for r in range(3)
    ]
    try:
        time.sleep(1.5)  # three silence bounds of healthy beating
        assert not any(s.messages for s in silent), [s.messages for s in silent]
        # The margin each watcher saw: beats every 0.05 s, so a counter stood still about that long.
        margins = [w.longest_silence_s for w in watches]
        assert all(0 < m < 0.5 for m in margins), margins
        watches[2]._stop.set()  # worker 2 freezes: its counter stops, it does not say it left
        frozen_at = time.monotonic()
        assert silent[0].event.wait(3) and silent[1].event.wait(3)
        noticed = time.monotonic() - frozen_at
        assert 0.5 - 0.05 - 0.05 <= noticed < 3.0, noticed  # the last beat came up to one interval (0.05 s) before
        assert all("worker 2" in s.messages[0] and "silent" in s.messages[0] for s in silent[:2])
        # The silence that ended the watch is not a margin: the counter never moved again.
        assert all(w.longest_silence_s < 0.5 for w in watches[:2]), [w.longest_silence_s for w in watches]
    finally:
        for watch in watches:
            watch.stop()


def test_a_worker_that_left_on_purpose_or_has_not_started_yet_is_not_frozen_until_the_bound() -> None:
    store = dist.HashStore()
    early, late = Silence(), Silence()
    first = GroupWatch(store, 7, 0, 2, silence_s=0.6, on_silent=early, kill_silent_peer=False).start()
    time.sleep(0.3)  # the peer is still starting: counted from the watcher's own start
    second = GroupWatch(store, 7, 1, 2, silence_s=0.6, on_silent=late, kill_silent_peer=False).start()
    try:
        time.sleep(0.8)
        second.stop()  # finished first: "left", not frozen
        time.sleep(1.2)
        assert not early.messages and not late.messages, (early.messages, late.messages)
    finally:
        first.stop()
        second.stop()


def test_another_attempts_counters_do_not_count_and_a_store_that_fails_is_silence() -> None:
    store = dist.HashStore()
    # The previous attempt's peer left cleanly: a watch that read the wrong attempt's keys would
    # take worker 1 for gone-on-purpose and never report it.
    store.set("elastic_train/alive/0/1", "left")
    silent = Silence()
    watch = GroupWatch(store, 1, 0, 2, silence_s=0.4, on_silent=silent, kill_silent_peer=False).start()
    try:
        assert silent.event.wait(3) and "worker 1" in silent.messages[0]
    finally:
        watch.stop()

    class Broken:
        def set(self, key: str, value: str) -> None:
            raise TimeoutError("store timed out")

    failing = Silence()
    with pytest.raises(TimeoutError):
        GroupWatch(Broken(), 0, 0, 2, silence_s=0.4, on_silent=failing).start()  # the first beat is direct
    watch = GroupWatch(Broken(), 0, 0, 2, silence_s=0.4, on_silent=failing)
    watch._thread.start()  # the thread's beats fail: reported as silence, not raised into nothing
    assert failing.event.wait(3) and "cannot reach the group's store" in failing.messages[0]
    with pytest.raises(ValueError, match="positive"):
        GroupWatch(store, 0, 0, 2, silence_s=0)
