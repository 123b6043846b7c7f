"""Environment variables quorum mode's processes share (no imports: the agent stays light)."""

from __future__ import annotations

# The name or address this host's replicas advertise (store, Manager, state transfer) and its
# agent advertises for the Lighthouse; default: the host name (loopback for a one-node launch).
HOST_VAR = "ELASTIC_TRAIN_QUORUM_HOST"
# The address this host's listeners (the Lighthouse, each replica's store and state server) bind
# to; default: the address HOST_VAR's name resolves to here. "0.0.0.0" restores every interface.
BIND_VAR = "ELASTIC_TRAIN_QUORUM_BIND"
# The job's identity, part of every replica id: a replica refuses a quorum holding another
# job's replica. The agent sets it (its --run-id, else Slurm's job id, else a new one).
JOB_VAR = "ELASTIC_TRAIN_QUORUM_JOB"
# The job's secret: a healing replica's request and the state served to it are signed with it
# (HMAC-SHA256). The agent mints one per launch on one node; several nodes share one from the env.
SECRET_VAR = "ELASTIC_TRAIN_QUORUM_SECRET"
# The trainer flags (a JSON list), for the forkserver's preload of ``elastic_train.quorum.warm``.
WARM_ARGV_VAR = "ELASTIC_TRAIN_WARM_ARGV"
# etcd's members, where a worker claims each step in the line record (``quorum.line``); the
# agent sets it from the seat's members (--lighthouse-etcd).
LINE_VAR = "ELASTIC_TRAIN_LINE_ETCD"
# Replica groups the job was launched with (for the start-up line).
GROUPS_VAR = "ELASTIC_TRAIN_QUORUM_GROUPS"

# The OMP_NUM_THREADS the quorum launcher chose for its workers (a share of the node's cores),
# set only when the user did not set OMP_NUM_THREADS: the worker then treats it as a default
# (``run.configure_threads`` caps it on a GPU), not as the user's choice.
LAUNCHER_THREADS_VAR = "ELASTIC_TRAIN_LAUNCHER_THREADS"
