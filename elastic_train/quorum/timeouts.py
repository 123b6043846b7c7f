"""How long quorum mode waits, derived from the job instead of fixed for a test model.

Two kinds of bounds, and the rule that ties them to the step watchdog (``--hang-timeout``):

* **A phase's waits stay inside the watchdog's limit.** The watchdog beats before each quorum
  and before each attempt, never during a wait inside torchft (the main thread is in C++). So
  the quorum wait plus the heal that may follow it (one phase) must end before the watchdog
  fires, or a legitimately slow heal of a large model is killed as a hang. ``phase_bounds``
  splits 90% of the watchdog's limit between them and refuses, at start, a limit too short for
  both.
* **A collective waits as long as the job needs.** ``--peer-timeout`` is what a frozen peer
  costs the survivors at least; a flat all-reduce of every gradient takes longer on a large
  model or a slow link, and an attempt's first collective also waits for the slowest peer's
  forward and backward. A bound below either fails healthy attempts, and a failed gloo
  collective leaves the group broken until the quorum changes (a discard storm, then the
  worker gives up). ``WaitBound`` lets the first wait of each membership run to its ceiling
  (inside the watchdog's limit) and measures it, then waits ``--peer-timeout`` plus the slowest recent successful wait
  times a margin, doubled after a wait that ran into it, always capped by the ceiling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from elastic_train.errors import UsageError

PHASE_SHARE = 0.9  # of --hang-timeout: quorum wait + heal, with room for the beat's own jitter
MIN_QUORUM_S = 5.0  # below this a Lighthouse restart or a loaded host fails quorums at random
MIN_HEAL_S = 5.0
NO_WATCHDOG_S = 60.0  # each of the two when --hang-timeout is 0 (no watchdog)
MARGIN = 2.0  # times the slowest recent wait: room for a busier moment, little for a frozen peer (its cost)
RECENT = 20  # successful averages remembered


@dataclass(frozen=True)
class PhaseBounds:
    quorum_s: float  # Manager's quorum timeout: forming the quorum
    heal_s: float  # Manager's timeout: RPCs and the state transfer to or from a healing peer


def phase_bounds(hang_timeout: float) -> PhaseBounds:
    """The quorum wait and the heal of one ``begin_step``, inside the watchdog's limit."""
    if hang_timeout <= 0:
        return PhaseBounds(NO_WATCHDOG_S, NO_WATCHDOG_S)
    budget = PHASE_SHARE * hang_timeout
    if budget < MIN_QUORUM_S + MIN_HEAL_S:
        least = (MIN_QUORUM_S + MIN_HEAL_S) / PHASE_SHARE
        raise UsageError(
            f"--hang-timeout {hang_timeout:g} leaves {budget:.1f} s for a quorum wait plus a heal in quorum mode; "
            f"they need at least {MIN_QUORUM_S + MIN_HEAL_S:g} s",
            f"pass --hang-timeout {least:.0f} or more (or 0 to disable the watchdog)",
        )
    quorum = max(MIN_QUORUM_S, budget / 2)
    return PhaseBounds(quorum, budget - quorum)


@dataclass
class WaitBound:
    """How long a participant waits in one of an attempt's collectives for its peers: the first
    (it absorbs the peers' differences in compute time) or the gradient average (it moves the
    gradients)."""

    floor_s: float  # --peer-timeout
    ceiling_s: float  # inside the watchdog's limit
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    grown: int = 0  # waits that ran into the bound in a row since the last success

    def __post_init__(self) -> None:
        if self.ceiling_s < self.floor_s:
            raise UsageError(
                f"--peer-timeout {self.floor_s:g} is longer than the {self.ceiling_s:g} s the step watchdog "
                "leaves a collective",
                "lower --peer-timeout or raise --hang-timeout",
            )

    def seconds(self) -> float:
        """Until a wait was measured, the ceiling: the first attempt measures what the job needs
        (a peer lost during it costs the survivors that long, once)."""
        if not self.recent:
            return self.ceiling_s
        return min(self.ceiling_s, (self.floor_s + MARGIN * max(self.recent)) * float(2**self.grown))

    def new_membership(self) -> None:
        """The quorum changed: what this membership needs is measured afresh (waits at a world of
        one are local and say nothing about a peer's link)."""
        self.recent.clear()
        self.grown = 0

    def record(self, seconds: float) -> None:
        """A successful wait took ``seconds``."""
        self.recent.append(seconds)
        self.grown = 0

    def failed(self, seconds: float) -> None:
        """A wait failed after ``seconds``. One that ran into its bound may have been slow, not
        stuck (a link slower than assumed, a busier host): the next waits twice as long, until
        one succeeds and the measurements take over. A peer that died fails it at once and
        grows nothing."""
        if seconds >= 0.9 * self.seconds() and self.seconds() < self.ceiling_s:
            self.grown += 1
