"""The Lighthouse's term, from the agent to its workers, so that quorum ids stay unique when the
Lighthouse moves (``--lighthouse-etcd``).

torchft numbers quorums from 1 in each Lighthouse, reconfigures a replica's process group only
when the quorum id changes, and keys the group's rendezvous in the store by that id. A new
Lighthouse (the seat moved) reuses the ids of the old one: a replica that was in the old
Lighthouse's quorum 2 and is put in the new one's quorum 2 keeps its old process group, while
its peers rendezvous afresh under the same keys, where the old group's entries still lie; the
step's collectives fail, and one replica restarts (measured: ~25 s and a worker restart when a
frozen or cut-off node came back). The agent writes the seat's term (etcd's index of the key,
larger for every new holder) to a file; each worker reads it when a quorum arrives and offsets
the quorum id by it, so every Lighthouse's ids are its own.

Every participant of a quorum reads its own agent's file; they agree because an agent's relay
carries a request only along the route (address and term) whose term the agent has written
(``quorum.forward``), and because an agent that deleted its own key while it was live does not
serve at its address again until every other agent's view of the old term has run out
(``Seat._delete_own``): without that, an agent still holding the old term relays to the new
process at the same address, its worker uses the old id, the quorum's process group forms under
two ids and fails, and torchft does not rebuild it while the id stays the same (measured under
load: a worker restart after a Lighthouse killed alone). What remains: a quorum answer that
passes the relay in the instant between the agent's writing a newer term and its retargeting
(two moves within one request) gives that one worker another id; the attempt fails and the
replica heals back in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TERM_FILE_VAR = "ELASTIC_TRAIN_LIGHTHOUSE_TERM_FILE"
SHIFT = 24  # a Lighthouse forms fewer than 16.7 million quorums; terms are etcd indices (< 2**39)


def write_term(path: Path, term: int) -> None:
    """Atomically: a worker never reads half a number."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(str(term))
    os.replace(temporary, path)


def read_term(path: Path) -> int:
    """0 when there is no term yet (no Lighthouse known)."""
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


class _Termed:
    """A quorum result whose id carries the term of the Lighthouse that formed it."""

    def __init__(self, quorum: Any, term: int) -> None:
        self._quorum = quorum
        self.quorum_id = (term << SHIFT) + int(quorum.quorum_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


class TermedClient:
    """torchft's ``ManagerClient`` whose quorums' ids are offset by the Lighthouse's term."""

    def __init__(self, client: Any, path: Path) -> None:
        self._client = client
        self._path = path

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        return _Termed(quorum, read_term(self._path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def follow_terms(manager: Any) -> None:
    """In a worker whose agent moves the Lighthouse (it set ``TERM_FILE_VAR``): offset every
    quorum id by the term. Without it, nothing changes."""
    path = os.environ.get(TERM_FILE_VAR)
    if path:
        manager._client = TermedClient(manager._client, Path(path))
