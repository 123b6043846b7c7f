"""GroupWatch (issue 20) ends a frozen peer itself: torchrun would wait 30 s for it."""

from __future__ import annotations

import socket
import subprocess

import torch.distributed as dist

from elastic_train.quorum.group_watch import GroupWatch
from tests.unit.test_group_watch import Silence


def test_a_silent_peer_on_this_host_is_sigkilled_before_the_worker_leaves() -> None:
    """torchrun stops a failed group's workers with SIGTERM and waits a fixed 30 s before SIGKILL;
    a stopped process never acts on SIGTERM, so the watch kills it itself (same host only)."""
    store = dist.HashStore()
    frozen = subprocess.Popen(["sleep", "60"])  # stands in for the frozen worker 1
    try:
        store.set("elastic_train/alive/3/pid/1", f"{socket.gethostname()} {frozen.pid}")
        store.set("elastic_train/alive/3/1", "1")
        silent = Silence()
        watch = GroupWatch(store, 3, 0, 2, silence_s=0.3, on_silent=silent).start()
        try:
            assert silent.event.wait(3)
            assert frozen.wait(timeout=3) == -9
        finally:
            watch.stop()
    finally:
        frozen.kill()
        frozen.wait()
