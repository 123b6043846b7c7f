"""Environment variables quorum mode's processes share (no imports: the agent stays light)."""

from __future__ import annotations

# The name or address this host's replicas advertise (store, Manager, state transfer) and its
# agent advertises for the Lighthouse; default: the host name.
HOST_VAR = "ELASTIC_TRAIN_QUORUM_HOST"
# The trainer flags (a JSON list), for the forkserver's preload of ``elastic_train.quorum.warm``.
WARM_ARGV_VAR = "ELASTIC_TRAIN_WARM_ARGV"
# Replica groups the job was launched with (for the start-up line).
GROUPS_VAR = "ELASTIC_TRAIN_QUORUM_GROUPS"
