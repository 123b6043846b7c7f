"""Shared by the impolite node-fault tests (tests/launch/test_impolite_nodes.py, a frozen node;
tests/netns/test_partitions.py, a network partition and its healing).

A killed process closes its sockets and its peers fail at once; these faults close nothing. The
survivor's gloo collective blocks until its step watchdog (``--hang-timeout``) ends the worker,
its agent re-rendezvouses without the silent node, and training resumes from the newest
checkpoint at the smaller size. Every test ends with each epoch's samples trained exactly once
(the per-epoch sample digests equal the sampler's plan, ``planned``) and one checkpoint lineage
(``assert_one_lineage``), and prints the time from the fault to the first step at the smaller
size (docs/fault-tolerance.md, "Failures").
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from elastic_train.data.synthetic import SYNTHETIC_TRAIN
from elastic_train.flags import parse_config
from elastic_train.testing.agents import Agent, all_events, assert_one_lineage, first_step_after, wait_for
from tests.helpers import epoch_metrics, flags, planned_samples

HANG_TIMEOUT = 15  # small, to keep the tests short; the default is chosen in docs/fault-tolerance.md
RUN = flags(
    batch_size=32,
    max_steps_per_epoch=24,
    max_val_samples=64,
    epochs=2,
    target_accuracy=1.0,
    patience=0,
    checkpoint_every=2,
    keep_last=1000,  # keep every checkpoint, so that all of them are verified at the end
    hang_timeout=HANG_TIMEOUT,
)
# Long enough after the shrink for the healed node to get through to the store again (TCP's
# retransmission backoff on its stale connection: up to ~25 s here) and rejoin before the end.
HEAL_EPOCHS = 5
HEAL_RUN = [*RUN, "--epochs", str(HEAL_EPOCHS)]
# Detection (hang timeout + one watchdog poll), the restart, the rendezvous without the silent
# node (3 s of missed keep-alives + 5 s last call), a worker's start-up and checkpoint load.
SHRINK_BOUND_S = HANG_TIMEOUT + 45


def planned(args: list[str]) -> list[tuple[int, int, str]]:
    """The reference: every epoch's (epoch, samples, digest) for the run of ``args`` as the sampler
    plans them. The samples of an epoch depend neither on the world size nor on training, so no
    uninterrupted run is needed to know them (the synthetic dataset only)."""
    cfg = parse_config(args)
    assert cfg.dataset == "synthetic", cfg.dataset
    return planned_samples(SYNTHETIC_TRAIN, cfg.batch_size, cfg.epochs, cfg.max_steps_per_epoch, cfg.seed)


def samples(base: Path) -> list[tuple[int, int, str]]:
    """(epoch, samples trained, digest of their indices) of every epoch of the run at ``base``."""
    return [(m["epoch"], m["samples_seen"], m["sample_digest"]) for m in epoch_metrics(base)]


def committed(base: Path, step: int) -> bool:
    return any(e["step"] >= step for e in all_events(base, "checkpoint_committed"))


def rank0_node_and_other(agents: list[Agent]) -> tuple[Agent, Agent]:
    """The node running rank 0 (it hosts the workers' store and writes the manifests), the other."""
    first, second = agents
    return (first, second) if 0 in first.worker_ranks() else (second, first)


def seconds_to_train_alone(base: Path, fault_at: float) -> float:
    """Seconds from the fault to the first finished step at world size 1 (waits for it)."""
    wait_for(lambda: first_step_after(base, fault_at, 1) is not None, SHRINK_BOUND_S + 30, "a step at world size 1")
    at = first_step_after(base, fault_at, 1)
    assert at is not None
    return at - fault_at


def exit_code(agent: Agent, timeout: float) -> int | None:
    """The agent's exit code once it ends, or None if it is still running after ``timeout``."""
    try:
        return agent.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def report(what: str, **values: object) -> None:
    """The measurement, for docs/fault-tolerance.md (shown with ``pytest -s`` or on failure)."""
    print(f"\nmeasured, {what}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


def outputs(*agents: Agent) -> str:
    return "\n".join(f"--- agent {a.name}\n{a.output[-3000:]}" for a in agents)


def assert_exactly_once_and_one_lineage(base: Path, args: list[str]) -> None:
    """Every epoch of the run of ``args`` (at ``base``) trained its planned samples exactly once,
    and its checkpoints form one lineage."""
    assert samples(base) == planned(args), "a sample was skipped or repeated across the fault"
    assert_one_lineage(base)
