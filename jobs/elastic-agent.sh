#!/usr/bin/env bash
# One torchrun agent of an elastic job: run it once per node (srun does, in multinode.sbatch).
# Nodes may die, hang or join; training goes on at the size of the nodes that are left
# (between ET_NNODES's bounds) and resumes from the latest checkpoint after every change.
#
# Launch (two nodes, store on the batch host; see docs/fault-tolerance.md):
#   python -m elastic_train.rendezvous --port 29400 &        # on a host that is not a training node
#   ET_RDZV_ENDPOINT=batchhost:29400 ET_NNODES=1:2 jobs/elastic-agent.sh --epochs 100   # on each node
#
# Quorum fault tolerance (ET_FT=quorum; survivors keep training, see docs/slurm.md): this agent is
# python -m elastic_train.quorum.launch, and torchft's Lighthouse replaces the store. Node 0
# starts it; every other node is told where it is:
#   ET_FT=quorum ET_NODE_RANK=0 ET_NNODES=2 ET_LIGHTHOUSE_PORT=29510 jobs/elastic-agent.sh --epochs 100   # node0
#   ET_FT=quorum ET_NODE_RANK=1 ET_NNODES=2 ET_LIGHTHOUSE_NODE=node0 jobs/elastic-agent.sh --epochs 100  # others
#
# Knobs (environment; runtime ones in jobs/lib/common.sh):
#   ET_FT              restart (default): torchrun, the semantics above | quorum (needs torchft)
#   ET_PROCS_PER_REPLICA  ET_FT=quorum: workers per replica group (default 1; the node's GPU count
#                      makes each node one replica, DDP or FSDP2 inside by --parallel)
#   ET_RDZV_ENDPOINT   host:port of the rendezvous store (required, restart mode); with
#                      ET_RDZV_BACKEND=etcd, every etcd member's host:port, comma-separated
#   ET_RDZV_BACKEND    c10d (default): torch's TCPStore rendezvous | etcd: torch's etcd-v2 backend
#                      over an etcd cluster (python -m elastic_train.etcd_member), which survives
#                      the loss of a minority of its members; needs ET_RDZV_ID or $SLURM_JOB_ID
#   ET_ETCD_READ_TIMEOUT  ET_RDZV_BACKEND=etcd: seconds before a request to a silent member fails
#                      over to another (default 5)
#   ET_RDZV_ID         job id shared by all agents (default: $SLURM_JOB_ID, else "elastic-train"; with
#                      neither, the job's identity, the checkpoint lock's owner, is minted once in the
#                      rendezvous store, so two jobs on one --checkpoint-dir are told apart)
#   ET_NNODES          MIN:MAX nodes (default 1:2)
#   ET_NPROC           processes per node (default: $SLURM_GPUS_ON_NODE, or 1 without GPUs)
#   ET_MAX_RESTARTS    restarts per agent after worker failures (default 3)
#   ET_STORE_HOST      1: this agent hosts the store itself (no standalone store); default 0
#   ET_JOIN_TIMEOUT    seconds an agent waits for the minimum number of nodes (default 600)
#   ET_LOCAL_ADDR      this node's address for the rendezvous and the workers' store (torchrun
#                      --local-addr; default: torchrun resolves the hostname). Set it when the
#                      hostname resolves to another interface (several NICs, network namespaces);
#                      GLOO_SOCKET_IFNAME=<interface> does the same for the workers' gloo traffic
#                      (the environment reaches the workers unchanged)
#   ET_SHUTDOWN_TIMEOUT seconds between SIGTERM and SIGKILL for workers (default 60): the
#                      preemption checkpoint must be committed inside it
#   ET_LAUNCHER        torchrun (default) | warm: python -m elastic_train.launch, torchrun's agent
#                      with workers forked from a preloaded process (restarts skip ~3.5 s of imports)
#   ET_RUNTIME, ET_VENV, ET_MODULES, ET_CONTAINER, ET_PIP_ARGS  where python and torch come from, as
#                      in train.sbatch (a module or container runtime venv is built by the first
#                      agent or job that needs it, in the project dir, and reused by the others)
#   ET_LOG_DIR, ET_CHECKPOINT_DIR  as in train.sbatch (shared storage for multi-node jobs)
# Quorum mode only (ET_RDZV_ENDPOINT, ET_STORE_HOST, ET_JOIN_TIMEOUT, ET_LOCAL_ADDR, ET_SHUTDOWN_TIMEOUT
# and ET_LAUNCHER do not apply; ET_NNODES's MAX is the node count, any one replica trains on):
#   ET_NODE_RANK       this node's index, 0..nodes-1 (default: $SLURM_NODEID, else 0)
#   ET_LIGHTHOUSE_PORT the port node 0 starts the Lighthouse on (default 29510)
#   ET_LIGHTHOUSE_NODE the host of node 0, where the other nodes reach the Lighthouse (required on them)
#   ET_LIGHTHOUSE_ETCD etcd members host:port,... : no node owns the Lighthouse; the one holding its
#                      seat there runs it, another takes over when that node is lost (docs/fault-tolerance.md)
#   ET_LIGHTHOUSE_TTL  ET_LIGHTHOUSE_ETCD: seconds before another node takes a lost Lighthouse's seat (default 5)
#   ET_LIGHTHOUSE      http://host:port of a Lighthouse started elsewhere (e.g. a login node, so that
#                      losing node 0 is survivable): every node uses it and none starts one
# Arguments go to the trainer unchanged.
set -euo pipefail

ET_PROJECT_DIR=${ET_PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
ET_LOG_DIR=${ET_LOG_DIR:-$ET_PROJECT_DIR/logs}
ET_CHECKPOINT_DIR=${ET_CHECKPOINT_DIR:-$ET_PROJECT_DIR/checkpoints}
# shellcheck source=jobs/lib/common.sh
source "$ET_PROJECT_DIR/jobs/lib/common.sh"
et_catch_signals
cd "$ET_PROJECT_DIR"

gpus=$(et_gpus_on_node)
if [ "$gpus" -gt 0 ]; then nproc=${ET_NPROC:-$gpus}; else nproc=${ET_NPROC:-1}; fi
nnodes=${ET_NNODES:-1:2}

et_setup_runtime
et_setup_ft
et_setup_launcher
if [ "$ET_FT_MODE" = quorum ]; then
  [ "${ET_RDZV_BACKEND:-c10d}" = c10d ] ||
    et_die "ET_RDZV_BACKEND=${ET_RDZV_BACKEND} is a restart-mode setting: quorum mode has no rendezvous (its coordinator is the Lighthouse); unset it (ET_LIGHTHOUSE_ETCD puts the Lighthouse's seat in etcd) or use ET_FT=restart"
  node_rank=${ET_NODE_RANK:-${SLURM_NODEID:-0}}
  lighthouse_port=${ET_LIGHTHOUSE_PORT:-29510}
  if [ -n "${ET_LIGHTHOUSE_ETCD:-}" ]; then
    [ -z "${ET_LIGHTHOUSE:-}" ] || et_die "ET_LIGHTHOUSE and ET_LIGHTHOUSE_ETCD exclude each other: a given Lighthouse, or one whose seat moves"
    # Every node is a candidate: whichever holds the seat runs the Lighthouse, on ET_LIGHTHOUSE_PORT
    # or a free port (the seat's record carries the address).
    lighthouse=(--lighthouse-etcd "$ET_LIGHTHOUSE_ETCD" --lighthouse-ttl "${ET_LIGHTHOUSE_TTL:-5}"
      ${ET_LIGHTHOUSE_PORT:+--lighthouse-port "$ET_LIGHTHOUSE_PORT"})
    coordinator="the Lighthouse's seat in etcd ($ET_LIGHTHOUSE_ETCD)"
  elif [ -n "${ET_LIGHTHOUSE:-}" ]; then
    lighthouse=(--lighthouse "$ET_LIGHTHOUSE")
    coordinator="Lighthouse $ET_LIGHTHOUSE"
  elif [ "$node_rank" = 0 ]; then
    lighthouse=(--lighthouse-port "$lighthouse_port")  # started here, for the job's lifetime
    coordinator="starts the Lighthouse on port $lighthouse_port"
  else
    [ -n "${ET_LIGHTHOUSE_NODE:-}" ] ||
      et_die "node $node_rank of a quorum job needs ET_LIGHTHOUSE_NODE, the host of node 0 (which starts the Lighthouse), or ET_LIGHTHOUSE=http://host:port"
    lighthouse=(--lighthouse "http://$ET_LIGHTHOUSE_NODE:$lighthouse_port")
    coordinator="Lighthouse http://$ET_LIGHTHOUSE_NODE:$lighthouse_port"
  fi
  coordinator="node $node_rank of ${nnodes##*:}, $coordinator"
  # Replica groups are numbered node_rank * nproc + local, so --nnodes is the job's node count
  # (MAX): any number of survivors trains on, the Lighthouse's quorum has no larger minimum.
  et_quorum_shape "$nproc"
  launch=(python -m elastic_train.quorum.launch --nnodes "${nnodes##*:}" --node-rank "$node_rank"
    "${ET_QUORUM_SHAPE[@]}" --max-restarts "${ET_MAX_RESTARTS:-3}"
    --run-id "${ET_RDZV_ID:-${SLURM_JOB_ID:-elastic-train}}" "${lighthouse[@]}")
else
  endpoint=${ET_RDZV_ENDPOINT:?ET_RDZV_ENDPOINT=host:port of the rendezvous store is required}
  is_host=false
  [ "${ET_STORE_HOST:-0}" = 1 ] && is_host=true
  backend=c10d
  case ${ET_RDZV_BACKEND:-c10d} in
    c10d) ;;
    etcd)
      # torch's etcd-v2 backend connects to the one endpoint it is given and fails at start if
      # that member is down; connected, python-etcd learns every member and moves on from a dead
      # one by itself. So the agent starts with whichever member answers now.
      backend=etcd-v2
      [ -n "${ET_RDZV_ID:-}${SLURM_JOB_ID:-}" ] ||
        et_die "ET_RDZV_BACKEND=etcd needs ET_RDZV_ID (the job's name, the same on every node): an etcd rendezvous has no store to mint one in"
      endpoint=$("${ET_RUN[@]}" python -m elastic_train.etcd_member pick "$endpoint" --timeout "${ET_JOIN_TIMEOUT:-600}") ||
        et_die "no etcd member of ET_RDZV_ENDPOINT=$ET_RDZV_ENDPOINT answers (the reason is above)"
      ;;
    *) et_die "ET_RDZV_BACKEND=${ET_RDZV_BACKEND} is not c10d or etcd" ;;
  esac
  # Why each setting (measured on torch 2.14.1, see docs/fault-tolerance.md):
  # - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: every rendezvous round gets a fresh store for the
  #   workers, so restarted workers never read the previous round's addresses; with the shared
  #   store a restart sometimes failed outright, and a node re-join crashed both agents.
  # - is_host=false: the standalone store serves the rendezvous, so losing any node is survivable.
  # - last_call_timeout=5: after the minimum is met, wait 5 s (not 30) for stragglers.
  # - keep_alive_interval=1, keep_alive_max_attempt=3: a dead node is noticed in ~3 s, not 50.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  # The rendezvous store outlives every worker restart (the workers' own store is per round):
  # without a named job, rank 0 mints the job's identity there (elastic_train/distributed/identity.py).
  if [ -z "${ET_RDZV_ID:-}" ] && [ -z "${SLURM_JOB_ID:-}" ]; then
    export ELASTIC_TRAIN_JOB_STORE=$endpoint
  fi
  rdzv_conf="is_host=$is_host,join_timeout=${ET_JOIN_TIMEOUT:-600},last_call_timeout=5"
  rdzv_conf+=",keep_alive_interval=1,keep_alive_max_attempt=3"
  # etcd: python-etcd moves to another member only when a request fails at the socket, and a frozen
  # or cut-off member's requests fail only at this timeout (torch's default: 60 s).
  [ "$backend" = etcd-v2 ] && rdzv_conf+=",read_timeout=${ET_ETCD_READ_TIMEOUT:-5}"
  coordinator="nodes $nnodes, rendezvous $backend $endpoint"
  # shellcheck disable=SC2054  # the commas separate --signals-to-handle's list, one argument
  launch=("${ET_LAUNCH[@]}" --nnodes="$nnodes" --nproc-per-node="$nproc"
    --max-restarts="${ET_MAX_RESTARTS:-3}" --rdzv-backend="$backend" --rdzv-endpoint="$endpoint"
    --rdzv-id="${ET_RDZV_ID:-${SLURM_JOB_ID:-elastic-train}}" --rdzv-conf="$rdzv_conf"
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2
    --shutdown-timeout="${ET_SHUTDOWN_TIMEOUT:-60}" ${ET_LOCAL_ADDR:+"--local-addr=$ET_LOCAL_ADDR"})
fi
trap et_stop_gpu_monitor EXIT
et_start_gpu_monitor
et_log "agent on $(hostname): $nproc process(es), ft $ET_FT_MODE, $coordinator"
et_run_forwarding "${ET_RUN[@]}" "${launch[@]}" \
  -m elastic_train --log-dir "$ET_LOG_DIR" --checkpoint-dir "$ET_CHECKPOINT_DIR" "$@"
